"""Where a conversion lands: one destination check, then written beside and renamed into place."""

import os
import shutil
from pathlib import Path

from ..errors import TernaryError


def partial(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.partial-{os.getpid()}"


def publish(tmp: Path, dst: Path, force: bool) -> None:
    """Rename the finished temporary output onto dst (an old one moved aside with force).

    `destination` refused an existing dst without force before anything was written."""
    old = None
    if force and (dst.exists() or dst.is_symlink()):
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        os.replace(dst, old)
    os.replace(tmp, dst)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def destination(mlx_path, to_gguf, force: bool) -> Path:
    """The one output of a conversion; an existing one is refused unless force."""
    if (mlx_path is None) == (to_gguf is None):
        raise TernaryError(
            "give exactly one destination: mlx_path (--mlx-path) or to_gguf (--to-gguf)"
        )
    dst = Path(to_gguf if to_gguf is not None else mlx_path).expanduser()
    if (dst.exists() or dst.is_symlink()) and not force:
        raise TernaryError(f"{dst}: already exists; pass --force (force=True) to replace it")
    return dst


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()
