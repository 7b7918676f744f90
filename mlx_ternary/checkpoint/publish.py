"""Where a conversion lands: one destination check, then written beside and renamed into place."""

import errno
import os
import shutil
from pathlib import Path

from ..errors import TernaryError


def partial(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.partial-{os.getpid()}"


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def clear_stale(dst: Path) -> list:
    """Undo what a killed conversion to `dst` left (SIGKILL runs no cleanup).

    Its `.partial-PID` output is removed; a `.old-PID` (the previous destination moved
    aside by --force just before the rename) goes back into place when dst is missing,
    else is removed. Only entries of processes no longer alive are touched. Returns the
    paths it removed or restored.
    """
    done = []
    if not dst.parent.is_dir():
        return done
    for kind in ("partial", "old"):
        for p in sorted(dst.parent.glob(f".{dst.name}.{kind}-*")):
            if _alive(p.name.rpartition("-")[2]):
                continue
            if kind == "old" and not (dst.exists() or dst.is_symlink()):
                os.replace(p, dst)
            else:
                remove(p)
            done.append(p)
    return done


def disk_full(e: OSError, dst: Path) -> TernaryError:
    """The one error for a write that ran out of space (its partial output is removed)."""
    free = shutil.disk_usage(dst.parent).free if dst.parent.exists() else 0
    return TernaryError(
        f"{dst}: the disk is full ({free} bytes free in {dst.parent}; "
        f"{os.strerror(e.errno)}); nothing was written: free space or choose another "
        "destination"
    )


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


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
