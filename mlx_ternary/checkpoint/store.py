"""What is on this machine: models downloaded (huggingface_hub's cache) and converted
(gguf_cache.py's folders), with sizes and what each is; removing one, pruning the cache.

Nothing here downloads. Downloads live in HF_HUB_CACHE (~/.cache/huggingface/hub, HF_HOME
moves it); conversions in gguf_cache.cache_root() (MLX_TERNARY_GGUF_CACHE and
MLX_TERNARY_CONVERTED_CACHE move them).
"""

import fcntl
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import List

from ..errors import TernaryError
from .gguf_cache import cache_root
from .readers import READERS, gguf, hf_bitnet, mlx_affine, ternary, trilm
from .readers.arch import read_config

FORMATS = {
    ternary: "mlx-ternary ternary format",
    hf_bitnet: "Hugging Face BitNet",
    mlx_affine: "MLX affine pack",
    gguf: "GGUF",
    trilm: "float checkpoint",
}


@dataclass
class StoredModel:
    """One entry: a downloaded repo or a converted copy."""

    id: str  # repo id, or the converted folder's name
    where: str  # "downloaded" or "converted"
    size: int  # bytes on disk
    what: str  # model type and format, as far as they can be read
    path: Path


def describe(path: Path) -> str:
    """`model_type, format` of a checkpoint directory, or the GGUF files a folder holds."""
    ggufs = sorted(p.name for p in path.glob("*.gguf")) if path.is_dir() else [path.name]
    if ggufs and not (path / "config.json").is_file():
        return "GGUF: " + ", ".join(ggufs)
    try:
        config = read_config(path)
    except TernaryError:
        return "no config.json"
    kind = next((FORMATS[r] for r in READERS if r.detect(path)), "unknown format")
    return f"{config.get('model_type', '?')}, {kind}"


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def downloaded() -> List[StoredModel]:
    """The model repos in huggingface_hub's cache (each with its newest snapshot)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir()
    except CacheNotFound:
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda r: r.last_modified)
        out.append(
            StoredModel(
                repo.repo_id,
                "downloaded",
                repo.size_on_disk,
                describe(Path(newest.snapshot_path)),
                Path(repo.repo_path),
            )
        )
    return out


def _cache_roots() -> List[Path]:
    return [cache_root(), cache_root(directory=True)]


def converted() -> List[StoredModel]:
    """The copies gguf_cache.py converted (GGUF files and other checkpoint formats)."""
    out = []
    for root in _cache_roots():
        if not root.is_dir():
            continue
        for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            out.append(StoredModel(d.name, "converted", _dir_size(d), describe(d), d))
    return out


def locations() -> List[Path]:
    """Where downloads and conversions live: the Hugging Face hub cache, then the
    conversion caches."""
    from huggingface_hub import constants

    return [Path(constants.HF_HUB_CACHE), *_cache_roots()]


def stored() -> List[StoredModel]:
    return downloaded() + converted()


@contextmanager
def _locked(folder: Path):
    """gguf_cache.ternary_dir's lock on a cache folder: no conversion runs meanwhile."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def remove(model_id: str) -> StoredModel:
    """Remove one downloaded repo (every revision) or one converted copy, by its id.

    Raises:
        TernaryError: no entry has that id (the message lists what `models` shows).
    """
    for entry in converted():
        if entry.id == model_id:
            with _locked(entry.path.parent):
                shutil.rmtree(entry.path)
            return entry
    for entry in downloaded():
        if entry.id == model_id:
            from huggingface_hub import scan_cache_dir

            info = scan_cache_dir()
            repo = next(r for r in info.repos if r.repo_id == model_id and r.repo_type == "model")
            info.delete_revisions(*(r.commit_hash for r in repo.revisions)).execute()
            shutil.rmtree(entry.path, ignore_errors=True)  # refs and what revisions left
            return entry
    raise TernaryError(
        f"{model_id}: no downloaded or converted model has this id; `mlx-ternary models` lists them"
    )


def prune() -> List[StoredModel]:
    """Remove every converted copy (they are made again from their source on next use)."""
    gone = converted()
    for root in _cache_roots():
        if root.is_dir():
            with _locked(root):
                for entry in gone:
                    if entry.path.parent == root:
                        shutil.rmtree(entry.path, ignore_errors=True)
    return gone
