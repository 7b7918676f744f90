"""Shared test set-up: the device tiers, skipped the way MLX's own tests skip what a machine
cannot run, with the reason in the report.

- ``@pytest.mark.metal``: needs a real Apple GPU (Metal kernels otherwise run through the
  CPU emulator in the ordinary tests);
- ``@pytest.mark.cuda``: needs MLX's CUDA backend;
- ``@pytest.mark.native``: needs the native CPU extension, built on first use with the
  system C++ compiler.

Helpers shared between test files live in tiny.py (models, checkpoints, paths) and
gguf_build.py (GGUF files); this directory is on sys.path through this file.
"""

import mlx.core as mx
import pytest

TIERS = {
    "metal": "needs a real Apple GPU (Metal)",
    "cuda": "needs MLX's CUDA backend",
    "native": "needs the native CPU extension",
}


def pytest_configure(config):
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


def _missing(tier: str):
    """Why this machine cannot run `tier`, or None when it can."""
    if tier == "metal":
        return None if mx.metal.is_available() else "Metal is not available"
    if tier == "cuda":
        return None if mx.cuda.is_available() else "CUDA is not available"
    from mlx_ternary.runtime import cpu

    return None if cpu.available() else f"native kernel unavailable: {cpu.unavailable_reason()}"


def pytest_collection_modifyitems(config, items):
    reasons = {}
    for item in items:
        for tier in TIERS:
            # The marker, not `tier in item.keywords`: keywords hold directory names too, so a
            # checkout in a directory named "metal" would skip every test under it.
            if item.get_closest_marker(tier):
                if tier not in reasons:
                    reasons[tier] = _missing(tier)
                if reasons[tier]:
                    item.add_marker(pytest.mark.skip(reason=f"{TIERS[tier]}: {reasons[tier]}"))
