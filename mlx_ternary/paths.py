"""Where this package keeps what it builds and caches: one root, one folder per kind."""

import os
from pathlib import Path

# kind -> the environment variable that moves that folder elsewhere
CACHE_ENV = {
    "emulator": "MLX_TERNARY_EMULATOR_CACHE",  # compiled Metal-emulator kernels
    "native": "MLX_TERNARY_NATIVE_CACHE",  # the native CPU extension
    "tune": "MLX_TERNARY_TUNE_CACHE",  # self-tuning choices
    "gguf": "MLX_TERNARY_GGUF_CACHE",  # .gguf files converted to the native format
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
