"""bench: one ternary model in several representations, measured side by side.

Every representation is built in memory from the same checkpoint and holds the same
weights exactly (stock MLX 2- and 4-bit codes are built by hand: q = t + 1, scale = s,
bias = -s), so the table compares storage and speed, not models (variants.py builds them,
report.py presents them). Runs are interleaved (each repeat visits every format, in a
rotated order) and timed the way mlx-lm reports them: prefill = prompt tokens / time to the
first token, decode = further tokens / their time.
"""

import os
import platform
import time
from functools import partial
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..checkpoint.load import load_model, resolve_model_path
from ..errors import TernaryError
from ..memory import kv_itemsize, kv_layout
from ..runtime import dispatch
from . import bandwidth, ceiling, llamacpp, peers
from .report import BenchResult, FormatResult, Run, apple_rows, plot, render, table_rows
from .variants import DEFAULT_FORMATS, FORMATS, build_variants, make_layer, model_shapes

__all__ = ["FORMATS", "DEFAULT_FORMATS", "run_bench", "time_generation", "render", "plot"]
__all__ += ["table_rows", "apple_rows", "build_variants", "make_layer", "BenchResult"]

WARMUP_PROMPT = 1
WARMUP_GEN = 2


def kv_footprint(model: nn.Module, tokens: int) -> tuple:
    """(KV bytes per token, fixed bytes) of the model's caches after `tokens` tokens, by
    memory's own probe (`memory.kv_layout`): a bounded (sliding) cache counts as fixed."""
    per_token, fixed = 0, 0
    for per, most, state in kv_layout(model):
        if most:
            fixed += int(per * min(tokens, most))
        else:
            per_token += int(per)
        fixed += state
    return per_token, fixed


def time_generation(model: nn.Module, prompt: mx.array, gen_tokens: int):
    """Prefill then decode greedily; returns (Run, KV bytes per token, state bytes)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.clear_cache()
    resident = mx.get_active_memory()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    prefill_s, n = 0.0, 0
    for n, _ in enumerate(
        generate_step(prompt, model, max_tokens=gen_tokens, prompt_cache=cache), 1
    ):
        if n == 1:
            prefill_s = time.perf_counter() - tic
            tic = time.perf_counter()
    decode_s = time.perf_counter() - tic
    extra = max(mx.get_peak_memory() - resident, 0)
    kv, state = kv_footprint(model, len(prompt) + n)
    decode = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    return Run(len(prompt) / prefill_s, decode, extra), kv, state


def device_description(backend=None) -> Dict[str, str]:
    info = mx.device_info()
    dev = mx.default_device()
    return {
        "device": str(info.get("device_name", platform.processor() or platform.machine())),
        "mlx_device": "gpu" if dev == mx.gpu else "cpu",
        "ternary_backend": dispatch.resolve_backend(backend),
        "platform": platform.platform(),
        "cpu_count": str(os.cpu_count()),
        "mlx": mx.__version__,
        "mlx_lm": _version("mlx_lm"),
    }


def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg.replace("_", "-"))
    except PackageNotFoundError:
        return "unknown"


def run_bench(
    model: str,
    formats=DEFAULT_FORMATS,
    prompt_tokens: int = 512,
    gen_tokens: int = 128,
    repeats: int = 3,
    context: Optional[int] = None,
    bandwidth_gbs: Optional[float] = None,
    seed: int = 0,
    backend=None,
    progress: Callable[[str], None] = lambda s: None,
    llama_cpp: Optional[str] = None,
    gguf: Optional[str] = None,
    llama_threads: Optional[int] = None,
    peer_benches: Sequence[Tuple[str, str, str]] = (),
    measure_bandwidth: bool = False,
) -> BenchResult:
    """Build each format of `model`, time interleaved generations, and compute ceilings.

    Args:
        model: a native or Hugging Face BitNet checkpoint directory (or hub id).
        formats: names from FORMATS.
        prompt_tokens: prompt length (random token ids, seeded).
        gen_tokens: tokens generated per run (at least 2: decode is timed after the first).
        repeats: timed runs per format, interleaved across formats.
        context: tokens of history for the Apple ceiling table (default prompt + gen).
        bandwidth_gbs: this device's memory bandwidth, when MLX cannot name it.
        seed: seed for the prompt.
        backend: force a ternary backend.
        progress: called with a short message before each step.
        llama_cpp: node_modules holding node-llama-cpp (default $MLX_TERNARY_LLAMA_CPP);
            when found, llama.cpp on `gguf` (the same weights) is one more row.
        gguf: the GGUF file llama.cpp runs.
        llama_threads: llama.cpp's threads (default: as many as the native kernels use).
        peer_benches: (label, llama-bench binary, GGUF): one more row each (peers.py).
        measure_bandwidth: measure the bandwidth (bandwidth.py) if not given nor Apple's.

    Returns:
        A BenchResult; `.to_dict()` for JSON.
    """
    _check_bench_args(formats, prompt_tokens, gen_tokens, repeats)
    llama = _llama_row(gguf, llama_threads) if (node := llamacpp.find(llama_cpp)) else None
    model_path = resolve_model_path(model)
    progress(f"loading {model_path}")
    base, config = load_model(model_path, backend=backend)  # as load() holds it here
    variants = build_variants(base, config, model_path, list(formats), backend, progress)
    shapes, float_elements = model_shapes(base)
    del base
    vocab = _vocab_size(config)
    prompt = mx.array(np.random.default_rng(seed).integers(0, vocab, prompt_tokens), mx.uint32)
    live = [f for f in formats if variants[f][0] is not None]
    _warm_up(variants, live, prompt, progress)
    run_llama = partial(_run_llama, node, gguf, llama, llama_threads, prompt_tokens, gen_tokens)
    runs = (llama_threads, prompt_tokens, gen_tokens, seed, vocab)
    external, peer_rows = _external(llama, run_llama, peer_benches, *runs)
    _timed_runs(variants, live + list(external), prompt, gen_tokens, repeats, external, progress)
    settings = dict(formats=list(formats), prompt_tokens=prompt_tokens, gen_tokens=gen_tokens)
    settings.update(repeats=repeats, seed=seed, ceiling_context=context or len(prompt) + gen_tokens)
    device = device_description(backend)
    bandwidth_gbs, source = _bandwidth(device, bandwidth_gbs, measure_bandwidth, llama_threads)
    results = [variants[f][1] for f in formats] + ([llama] if llama else []) + peer_rows
    apple = _apple(variants, live, shapes, float_elements, settings)
    return BenchResult(str(model), device, settings, results, bandwidth_gbs, source, apple)


def _warm_up(variants, live, prompt, progress) -> None:
    for f in live:
        progress(f"warming up {f}")
        time_generation(variants[f][0], prompt[:WARMUP_PROMPT], WARMUP_GEN)


def _check_bench_args(formats, prompt_tokens: int, gen_tokens: int, repeats: int) -> None:
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise TernaryError(
            f"unknown format(s) {', '.join(bad) or '(none)'}; choose from {', '.join(FORMATS)}"
        )
    if prompt_tokens < 1 or gen_tokens < 2 or repeats < 1:
        raise TernaryError("bench needs --prompt-tokens >= 1, --gen-tokens >= 2 and --repeats >= 1")


def _timed_runs(variants, order, prompt, gen_tokens, repeats, external, progress) -> None:
    """`repeats` rounds over the formats, each round starting one format further on;
    `external` {row: run()} are the other engines' rows (each run in its own process)."""
    for r in range(repeats):
        k = r % max(len(order), 1)
        for f in order[k:] + order[:k]:
            progress(f"repeat {r + 1}/{repeats}: {f}")
            if f in external:
                external[f]()
                continue
            model_, res = variants[f]
            run, kv, state = time_generation(model_, prompt, gen_tokens)
            run.peak_bytes += res.weight_bytes
            res.runs.append(run)
            res.kv_bytes_per_token, res.state_bytes = kv, state
            res.kv_itemsize = kv_itemsize(model_)


def _external(llama, run_llama, peer_benches, threads, prompt_tokens, gen_tokens, seed, vocab):
    """({row name: run()} for the other engines, the source-built peers' rows)."""
    external = {}
    if llama is not None and llama.loads:
        external[LLAMA] = partial(run_llama, seed, vocab)
    rows = [_peer_row(label, g, vocab, threads) for label, _, g in peer_benches]
    for row, (_, binary, g) in zip(rows, peer_benches):
        external[row.name] = partial(_run_peer, row, binary, g, threads, prompt_tokens, gen_tokens)
    return external, rows


def _run_llama(node, gguf, llama, threads, prompt_tokens, gen_tokens, seed, vocab) -> None:
    """One llama.cpp run in a fresh node process (its peak: the process's RSS)."""
    out = llamacpp.run(
        node,
        Path(gguf),
        threads=threads or _threads(),
        prompt_tokens=prompt_tokens,
        gen_tokens=gen_tokens,
        seed=seed,
        vocab=vocab,
    )
    llama.runs += [Run(x["prefill_tps"], x["decode_tps"], out["peak_rss"]) for x in out["runs"]]


def _bandwidth(device: Dict[str, str], given, measure: bool, threads) -> tuple:
    """(GB/s, where it comes from): --bandwidth, else the Apple chip's, else measured
    (--measure-bandwidth), else unknown."""
    if given:
        return given, "--bandwidth"
    if device["mlx_device"] == "gpu":
        return ceiling.device_bandwidth(device["device"])
    if measure:
        t = threads or _threads()
        got = bandwidth.measure((t,))
        return got["gbs"][t], f"measured: {got['method']}, {t} threads"
    return None, "unknown for a CPU; pass --bandwidth GB/S or --measure-bandwidth"


def _apple(variants, live, shapes, float_elements, settings) -> list:
    """The Apple ceiling table, with KV elements per token and recurrent state from a
    measured run's cache."""
    if not live:
        return []
    r = variants[live[0]][1]
    size = mx.bfloat16.size if r.dtype == "bfloat16" else getattr(mx, r.dtype).size
    return ceiling.apple_table(
        shapes,
        list(settings["formats"]),
        float_elements,
        r.kv_bytes_per_token // r.kv_itemsize,
        r.state_bytes // size,
        settings["ceiling_context"],
    )


LLAMA = "llama.cpp"


def _threads() -> int:
    from ..runtime import cpu

    return cpu.info().get("threads") or os.cpu_count() or 1


def _llama_row(gguf: Optional[str], threads: Optional[int]) -> FormatResult:
    """The llama.cpp row before it runs (or why it cannot)."""
    res = FormatResult(LLAMA, loads=False)
    if not gguf:
        res.reason = "pass --gguf FILE (the same weights as a llama.cpp GGUF)"
        return res
    total, tern_bytes, tern_weights = llamacpp.gguf_bytes(Path(gguf))
    res.loads, res.dtype = True, "float32"
    res.runs_as = (
        f"llama.cpp via node-llama-cpp, {threads or _threads()} threads (peak: process RSS)"
    )
    res.weight_bytes = res.read_bytes = total
    res.linear_bytes, res.linear_weights = tern_bytes, tern_weights
    return res


def _peer_row(label: str, gguf: str, vocab: int, threads: Optional[int]) -> FormatResult:
    """A source-built engine's row before it runs: bytes per token from its GGUF's tensors."""
    sizes = peers.tensor_sizes(Path(gguf))
    res = FormatResult(label, loads=True, dtype="float32")
    res.runs_as = f"llama-bench, {threads or _threads()} threads (peak: process RSS)"
    res.weight_bytes = sum(sizes.values())
    res.read_bytes = peers.decode_bytes(sizes, rows=vocab)
    return res


def _run_peer(row, binary, gguf, threads, prompt_tokens, gen_tokens) -> None:
    out = peers.llama_bench(
        Path(binary),
        Path(gguf),
        threads=threads or _threads(),
        prompt_tokens=prompt_tokens,
        gen_tokens=gen_tokens,
    )
    row.runs.append(Run(out["prefill_tps"], out["decode_tps"], out["peak_rss"]))


def _vocab_size(config: dict) -> int:
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))
