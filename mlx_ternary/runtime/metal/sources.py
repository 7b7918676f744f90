"""Where the Metal sources live: inside the installed package, or at the top of a checkout."""

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[2]  # mlx_ternary/


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
