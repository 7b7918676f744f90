"""Where the Metal sources live (inside the installed package, or at the top of a checkout),
and each kernel's header and body as mx.fast.metal_kernel takes them."""

import re
from pathlib import Path
from typing import Tuple

from .geometry import prelude

_PACKAGE = Path(__file__).resolve().parents[2]  # mlx_ternary/
BODY_MARKER = "//// BODY ////"


def metal_dir() -> Path:
    """The directory holding the `.metal` kernel sources.

    A wheel ships them as mlx_ternary/metal/; a source checkout (or an editable
    install) keeps them in metal/ beside the package.
    """
    for candidate in (_PACKAGE / "metal", _PACKAGE.parent / "metal"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"Metal kernel sources not found beside {_PACKAGE}; reinstall mlx-ternary"
    )


def read_source(name: str) -> str:
    """The text of one kernel source file, e.g. read_source("gemv_fast.metal")."""
    path = metal_dir() / name
    if not path.exists():
        raise FileNotFoundError(f"{path}: Metal source missing; reinstall mlx-ternary")
    return path.read_text()


def split_source(text: str) -> Tuple[str, str]:
    """(header, body) of a kernel file; the body is what mx.fast.metal_kernel calls source.

    The two are separated by a line holding exactly BODY_MARKER.
    """
    parts = re.split(rf"^{re.escape(BODY_MARKER)}[ \t]*$", text, maxsplit=1, flags=re.M)
    if len(parts) != 2:
        raise ValueError(f"kernel source has no {BODY_MARKER!r} line separating header and body")
    return parts[0], parts[1]


COMMON = "common.metal"  # helpers every kernel may call; no kernel of its own


def kernel_source(name: str) -> Tuple[str, str]:
    """(header, body) of kernel `name` (metal/<name>.metal), the header after the generated
    geometry prelude (geometry.prelude: tile sizes and TERNARY_UNROLL as macros) and the
    shared helpers of metal/common.metal."""
    header, body = split_source(read_source(f"{name}.metal"))
    return prelude() + read_source(COMMON) + "\n" + header, body
