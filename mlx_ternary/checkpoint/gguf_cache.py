"""A .gguf file where a model directory is expected: converted once, then reused.

`load()`, `generate`, `serve`, `plan` and `perplexity` take a GGUF path; the first time,
it is converted to the ternary format into the cache, and later loads read that copy.
Tensor-parallel loads (parallel.sharded_load) do the same with every other non-ternary-format
checkpoint directory (Hugging Face BitNet, MLX affine packs, TriLM floats), so that each
rank reads only its slices of the ternary-format copy.

Where: $XDG_CACHE_HOME/mlx_ternary/gguf (default ~/.cache/mlx_ternary/gguf; directories:
.../converted), one directory per file version, `<name>-<path hash>-<content key>`. The
content key hashes the conversion's version, the file's (each file's, for a directory)
size, modification time and its first and last MiB, so an upgrade that converts
differently, a replaced or re-exported file gets a new key and is converted again; the
older conversions of the same path are then removed. One process converts at a time (a
lock on the cache folder): the others wait, then read its copy. Conversion writes beside the destination and renames into
place (convert's rule), so a directory in the cache is always complete; one damaged
afterwards (a file truncated or rewritten, its manifest gone) is found at the next use,
reported once and converted again.
"""

import fcntl
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Callable, Optional

from ..errors import TernaryError
from ..paths import cache_dir as kind_dir

SAMPLE = 1 << 20  # bytes hashed at each end of the file
# Bumped when a conversion's meaning changes, so older cached copies are converted again:
# 2 = llama.cpp's files record `activations: q8k`; 3 = Q8_0 / k-quant tables kept as blocks.
CONVERSION = 3


def cache_root(directory: bool = False) -> Path:
    """Where GGUF files' (or, with `directory`, checkpoint directories') copies live."""
    return kind_dir("converted" if directory else "gguf")


def _path_key(path: Path) -> str:
    return hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:10]


def _hash_file(h, path: Path) -> None:
    st = path.stat()
    h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(SAMPLE))
        if st.st_size > SAMPLE:
            f.seek(max(SAMPLE, st.st_size - SAMPLE))
            h.update(f.read(SAMPLE))


def _content_key(path: Path) -> str:
    h = hashlib.sha256(f"{CONVERSION}".encode())
    for f in sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]:
        _hash_file(h, f)
    return h.hexdigest()[:16]


def cache_dir(path: Path) -> Path:
    """Where the conversion of this version of `path` (a file or directory) lives."""
    path = Path(path).expanduser()
    name = path.resolve().name if path.is_dir() else path.stem
    return cache_root(path.is_dir()) / f"{name}-{_path_key(path)}-{_content_key(path)}"


def entry_problem(out: Path) -> Optional[str]:
    """What is wrong with a cache entry, or None when it is whole.

    Each file is held to the size its manifest records; a file changed after the
    manifest was written (a later mtime) is hashed against the manifest's sha256, so a
    rewritten or half-written entry is found without hashing an untouched one each time.
    """
    from .writers.ternary import MANIFEST_FILE, sha256_file

    mf = out / MANIFEST_FILE
    try:
        files = json.loads(mf.read_text())["files"]
        written = mf.stat().st_mtime_ns
        for name, meta in files.items():
            f = out / name
            st = f.stat()
            if st.st_size != meta["size"]:
                return f"{name}: {st.st_size} bytes, the manifest says {meta['size']}"
            if st.st_mtime_ns > written and sha256_file(f) != meta["sha256"]:
                return f"{name}: its sha256 differs from the manifest"
    except FileNotFoundError as e:
        return f"{Path(e.filename).name} is missing"
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST_FILE} is not readable"
    return None


def ternary_dir(
    path: Path,
    notify: Optional[Callable[[str], None]] = None,
    progress: Optional[Callable[[str, int, int], None]] = None,
) -> Path:
    """The ternary-format directory for a GGUF file (or a checkpoint directory in another
    format), converting it on first use.

    Args:
        notify: called with one line when a conversion starts (the CLI prints it).
        progress: convert's (tensor name, done, total) callback.
    """
    path = Path(path).expanduser()
    out = cache_dir(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # One conversion at a time in the cache folder (a lock on the folder itself): the
    # ranks of an mlx.launch group on one host, or two commands started together, wait
    # for the first, then read its copy.
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return _converted(path, out, notify, progress)
    finally:
        os.close(fd)  # releases the lock


def _converted(path: Path, out: Path, notify, progress) -> Path:
    """`out`, the conversion of `path`, converted now unless a whole copy is there."""
    from .convert import convert

    if (out / "config.json").is_file():
        problem = entry_problem(out)
        if problem is None:
            return out
        message = f"{out}: the cached conversion is damaged ({problem}); converting {path} again"
        notify(message) if notify else warnings.warn(message, stacklevel=2)
        shutil.rmtree(out, ignore_errors=True)
    if notify:
        notify(
            f"{path}: converting the {'GGUF file' if path.is_file() else 'checkpoint'} to "
            f"mlx-ternary's format once, into {out} "
            "(later runs load it from there)"
        )
    try:
        # a directory packed as load() packs its ternary layers (open_source's default)
        packing = "compact" if path.is_dir() else None
        convert(str(path), out, packing=packing, progress=progress)
    except TernaryError:
        if not (out / "config.json").is_file():  # else another process just finished it
            raise
    prefix = out.name.rsplit("-", 1)[0] + "-"
    for old in out.parent.glob(prefix + "*"):
        if old != out and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return out
