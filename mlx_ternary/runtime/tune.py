"""Self-tuning: per layer shape and token count, the faster of our kernel and stock MLX.

The fast packing is bit for bit MLX's 2-bit affine layout, so stock `mx.quantized_matmul`
(the reference path) can run the same words. On Metal, the first call of a layer shape
class and token count times both in chains of dependent calls and keeps the faster, so
the product is never slower than stock 2-bit on any chip, whatever the kernels turn out
to do there. Choices are cached per chip and MLX version in
$XDG_CACHE_HOME/mlx_ternary/tune/ (~/.cache by default); MLX_TERNARY_TUNE=0 turns tuning
off (the kernel runs). A process spends at most TIME_BUDGET_S seconds tuning; after that
it runs the kernel for new shapes without caching them, so a later process tunes them.
"""

import json
import os
import re
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional

import mlx.core as mx

from ..format import ceil_div
from ..paths import cache_dir

ENV_TUNE = "MLX_TERNARY_TUNE"
TIME_BUDGET_S = 3.0  # per process, all shapes together
CHAIN_SECONDS = 0.02  # one timed chain aims at this long
CHAIN_MIN, CHAIN_MAX = 8, 64
TRIALS = 3
CANDIDATES = ("kernel", "stock")
FORMAT = 1

_state = {"spent": 0.0, "cache": None, "path": None}


def enabled() -> bool:
    return os.environ.get(ENV_TUNE, "1") not in ("0", "false", "off")


def cache_path() -> Path:
    """The tuning file of this chip and MLX version."""
    from .probe import chip

    name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{chip()}-mlx{mx.__version__}").strip("_")
    return cache_dir("tune") / f"{name}.json"


def _load(path: Path) -> Dict[str, str]:
    """The cached choices; a missing, unreadable or malformed file is ignored (rewritten)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        data = None
    ours = isinstance(data, dict) and data.get("format") == FORMAT  # else another version's
    choices = data.get("choices") if ours else None
    if not isinstance(data, dict) or ours and not isinstance(choices, dict):
        warnings.warn(  # once: the file is read once a process, then rewritten
            f"{path}: the tuning cache is damaged; its choices are measured again "
            "and the file rewritten",
            stacklevel=4,
        )
    if not isinstance(choices, dict):
        return {}
    return {k: v for k, v in choices.items() if isinstance(k, str) and v in CANDIDATES}


def _save(path: Path, choices: Dict[str, str]) -> None:
    """Write atomically (a temporary file renamed into place); failure only loses the cache."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tune-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(
                {"format": FORMAT, "mlx": mx.__version__, "choices": choices},
                f,
                indent=1,
                sort_keys=True,
            )
        os.replace(tmp, path)
    except OSError:
        pass


def _cache() -> Dict[str, str]:
    path = cache_path()
    if _state["cache"] is None or _state["path"] != path:
        _state["cache"], _state["path"] = _load(path), path
    return _state["cache"]


def reset() -> None:
    """Forget the in-memory cache and the time spent (tests; a new process starts so)."""
    _state.update(spent=0.0, cache=None, path=None)


def _glue(k: int) -> Callable[[mx.array], mx.array]:
    """Maps a layer output (..., N) back to an input (..., K): the chain's link."""

    def link(y):
        n = y.shape[-1]
        if n >= k:
            return y[..., :k]
        return mx.concatenate([y] * (ceil_div(k, n)), axis=-1)[..., :k]

    return link


def chain_seconds(
    steps: List[Callable], x: mx.array, length: int, trials: int = TRIALS, warm: bool = False
) -> List[float]:
    """Seconds per call of `length` dependent calls (step i % len(steps)), one evaluation
    per trial; the tuner and `bench --kernels` both time with it.

    The graph is built before the clock starts: only its evaluation is timed. `warm`
    evaluates one chain first, untimed.
    """

    def build():
        y = x
        for i in range(length):
            y = steps[i % len(steps)](y)
        return y

    if warm:
        mx.eval(build())
    times = []
    for _ in range(trials):
        y = build()
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(y)
        mx.synchronize()
        times.append((time.perf_counter() - t0) / length)
    return times


def time_candidate(name: str, fn: Callable, x: mx.array) -> float:
    """Seconds per call of `fn` (candidate `name`), chained; the default timer."""
    mx.eval(fn(x))  # compile, warm
    t0 = time.perf_counter()
    mx.eval(fn(x))
    one = max(time.perf_counter() - t0, 1e-6)
    length = int(min(CHAIN_MAX, max(CHAIN_MIN, CHAIN_SECONDS / one)))
    link = _glue(x.shape[-1])
    return min(chain_seconds([lambda y: link(fn(y))], x, length))


def choose(
    key: str,
    candidates: Dict[str, Callable],
    x: mx.array,
    timer: Optional[Callable[[str, Callable, mx.array], float]] = None,
) -> str:
    """ "kernel" or "stock" for `key`: cached, else timed now (within the budget).

    Args:
        key: the layer shape class and token count (see kernels.LayerPlan).
        candidates: {"kernel": fn, "stock": fn}, each x -> y.
        x: an example input.
        timer: (name, fn, x) -> seconds per call; default `time_candidate`.
    """
    if not enabled():
        return "kernel"
    cache = _cache()
    if key in cache:
        return cache[key]
    if _state["spent"] >= TIME_BUDGET_S:
        return "kernel"
    timer = timer or time_candidate
    t0 = time.perf_counter()
    times = {name: timer(name, fn, x) for name, fn in candidates.items()}
    _state["spent"] += time.perf_counter() - t0
    best = min(CANDIDATES, key=lambda name: times.get(name, float("inf")))
    cache[key] = best
    _save(_state["path"], cache)
    return best
