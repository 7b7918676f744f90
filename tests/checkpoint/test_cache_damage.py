"""A damaged GGUF cache entry (truncated, rewritten, manifest gone) is found at the next
use, reported once, and converted again: never a crash, never other numbers."""

import json
import os

import gguf_build as gb
import mlx.core as mx
import numpy as np
import pytest

import mlx_ternary
from mlx_ternary.checkpoint import gguf_cache

TOKENS = mx.array([[3, 17, 42, 5]])


def _truncate(entry):
    f = entry / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _rewrite(entry):  # same size, one byte of tensor data changed (a later mtime)
    f = entry / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0xFF
    f.write_bytes(bytes(raw))
    os.utime(f, ns=(f.stat().st_atime_ns, (entry / "manifest.json").stat().st_mtime_ns + 10**9))


def _no_manifest(entry):
    (entry / "manifest.json").unlink()


def _bad_manifest(entry):
    (entry / "manifest.json").write_text(json.dumps({"files": []}))


@pytest.fixture
def cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path, _, _ = gb.write(tmp_path / "m.gguf", "llama", output=None)
    model, _ = mlx_ternary.load(str(path))
    return path, gguf_cache.cache_dir(path), np.array(model(TOKENS))


@pytest.mark.parametrize("damage", [_truncate, _rewrite, _no_manifest, _bad_manifest])
def test_damaged_entry_is_reported_once_and_rebuilt(cached, damage):
    path, entry, logits = cached
    assert gguf_cache.entry_problem(entry) is None
    damage(entry)
    assert gguf_cache.entry_problem(entry) is not None
    messages = []
    assert gguf_cache.ternary_dir(path, notify=messages.append) == entry
    assert len([m for m in messages if "conversion is damaged" in m]) == 1
    assert str(entry) in messages[0]
    assert gguf_cache.entry_problem(entry) is None
    model, _ = mlx_ternary.load(str(path))
    np.testing.assert_array_equal(np.array(model(TOKENS)), logits)
    again = []
    gguf_cache.ternary_dir(path, notify=again.append)
    assert again == []  # whole again: reported once, not at every use


def test_an_untouched_entry_is_not_hashed_or_rebuilt(cached, monkeypatch):
    """Negative control: a whole entry is used as it is, without reading its shards."""
    path, entry, _ = cached
    from mlx_ternary.checkpoint.writers import ternary

    monkeypatch.setattr(ternary, "sha256_file", lambda f: pytest.fail(f"hashed {f}"))
    messages = []
    assert gguf_cache.ternary_dir(path, notify=messages.append) == entry and messages == []
