"""Where this package keeps what it builds and caches: one root, one folder per kind."""

import contextlib
import hashlib
import os
import subprocess
from functools import lru_cache
from pathlib import Path

# kind -> the environment variable that moves that folder elsewhere
CACHE_ENV = {
    "emulator": "MLX_TERNARY_EMULATOR_CACHE",  # compiled Metal-emulator kernels
    "native": "MLX_TERNARY_NATIVE_CACHE",  # the native CPU extension
    "tune": "MLX_TERNARY_TUNE_CACHE",  # self-tuning choices
    "gguf": "MLX_TERNARY_GGUF_CACHE",  # .gguf files converted to the ternary format
    # other formats converted to the ternary one for tensor-parallel loads (sliced per rank)
    "converted": "MLX_TERNARY_CONVERTED_CACHE",
}


def user_cache(*parts: str) -> Path:
    """$XDG_CACHE_HOME/mlx_ternary/<parts> (~/.cache by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser().joinpath("mlx_ternary", *parts)


def cache_dir(kind: str) -> Path:
    """The folder for one kind of cached thing: its variable in CACHE_ENV if set, else
    user_cache(kind)."""
    env = os.environ.get(CACHE_ENV[kind])
    return Path(env).expanduser() if env else user_cache(kind)


# --------------------------------------------------------------------------- #
# First-use C++ builds (the Metal emulator and the native CPU backend): the cache key, the
# compiler, one build at a time per cache folder, and an atomic move into the cache.
# --------------------------------------------------------------------------- #


def digest(*parts, length: int = 24) -> str:
    """A hex key of everything that goes into a build (bytes, or anything str() describes)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:length]


def compiler(env: str, default: str) -> str:
    """The C++ compiler: $<env>, else $CXX, else `default`."""
    return os.environ.get(env) or os.environ.get("CXX") or default


@lru_cache(maxsize=None)
def compiler_id(cxx: str) -> str:
    """The first line of `cxx --version` (part of a cache key).

    Raises:
        OSError: the compiler cannot be run; the message names the command.
    """
    try:
        out = subprocess.run(
            [cxx, "--version"], capture_output=True, text=True, check=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise OSError(f"running `{cxx} --version` failed ({type(e).__name__}: {e})") from None
    return out.stdout.splitlines()[0] if out.stdout else cxx


@contextlib.contextmanager
def locked(directory: Path):
    """One build at a time per cache folder (processes may start together)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as f:
        try:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX)
        except ImportError:  # not POSIX: no lock, builds still land atomically
            pass
        yield


def publish(built: Path, final: Path) -> Path:
    """Move a finished build into the cache in one step (readers never see half a file)."""
    os.replace(built, final)
    return final
