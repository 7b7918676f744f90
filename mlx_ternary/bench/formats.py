"""bench: one ternary model in several representations, measured side by side.

Every representation is built in memory from the same checkpoint and holds the same
weights exactly (stock MLX 2- and 4-bit codes are built by hand: q = t + 1, scale = s,
bias = -s), so the table compares storage and speed, not models:

    compact, fast  the native packings, as `load()` runs them on this device
    q2, q4         stock MLX affine quantization, group 64, nn.QuantizedLinear
    bf16, f32      the dequantized float weights, nn.Linear (bf16 runs in bfloat16)

Runs are interleaved (each repeat visits every format, in a rotated order) and timed
the way mlx-lm reports them: prefill = prompt tokens / time to the first token,
decode = further tokens / their time.
"""

import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .. import format as fmt
from ..checkpoint.load import get_classes, load_model, resolve_model_path
from ..errors import TernaryError
from ..runtime import dispatch
from ..runtime.cpu.layers import HalfEmbedding, adopt
from ..runtime.layers import TernaryLinear, swap_modules, ternary_layers
from . import ceiling, llamacpp

FORMATS = ("compact", "fast", "q2", "q4", "bf16", "f32")
DEFAULT_FORMATS = ("compact", "fast", "q2", "q4", "bf16")
Q_GROUP_SIZE = ceiling.Q_GROUP_SIZE
WARMUP_PROMPT = 1
WARMUP_GEN = 2


@dataclass
class Run:
    """One timed generation."""

    prefill_tps: float
    decode_tps: float
    peak_bytes: int


@dataclass
class FormatResult:
    """Everything measured for one representation."""

    name: str
    loads: bool
    reason: str = ""
    runs_as: str = ""
    dtype: str = ""
    weight_bytes: int = 0  # unique bytes of all parameters held
    linear_bytes: int = 0  # of those, the ternary layers' (shared arrays once)
    linear_weights: int = 0  # number of weights in the ternary layers
    read_bytes: int = 0  # weight bytes one decode step reads
    kv_bytes_per_token: int = 0
    state_bytes: int = 0
    runs: List[Run] = field(default_factory=list)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.linear_bytes / self.linear_weights if self.linear_weights else 0.0

    def stat(self, key: str) -> Dict[str, float]:
        """{"median", "min", "max"} of a Run field over the repeats."""
        v = [getattr(r, key) for r in self.runs]
        if not v:
            return {}
        return {"median": statistics.median(v), "min": min(v), "max": max(v)}


@dataclass
class BenchResult:
    model: str
    device: Dict[str, str]
    settings: Dict
    formats: List[FormatResult]
    bandwidth_gbs: Optional[float] = None
    bandwidth_source: str = ""
    apple: List[Dict] = field(default_factory=list)

    def ceiling_tps(self, r: FormatResult) -> Optional[float]:
        """This device's ceiling for `r` at the mean context of a decode step."""
        if not (self.bandwidth_gbs and r.loads and r.read_bytes):
            return None
        s = self.settings
        context = s["prompt_tokens"] + s["gen_tokens"] / 2
        b = ceiling.decode_bytes(r.read_bytes, r.kv_bytes_per_token, r.state_bytes, context)
        return ceiling.ceiling_tps(b, self.bandwidth_gbs)

    def to_dict(self) -> dict:
        out = {
            "model": self.model,
            "device": self.device,
            "settings": self.settings,
            "bandwidth_gbs": self.bandwidth_gbs,
            "bandwidth_source": self.bandwidth_source,
            "formats": [],
            "apple_ceiling": self.apple,
        }
        for r in self.formats:
            d = asdict(r)
            d["bits_per_weight"] = r.bits_per_weight
            d.update({k: r.stat(k) for k in ("prefill_tps", "decode_tps", "peak_bytes")})
            d["ceiling_tps"] = self.ceiling_tps(r)
            out["formats"].append(d)
        return out


# --------------------------------------------------------------------------- #
# Building the representations
# --------------------------------------------------------------------------- #


def runtime_packing(packing: str, backend: Optional[str] = None) -> str:
    """The packing `load()` holds in memory for a stored `packing` (fast off Metal)."""
    return "fast" if dispatch.resolve_backend(backend) == "reference" else packing


def _group_scales(
    scales: mx.array, out_features: int, in_features: int, group_size: Optional[int]
) -> mx.array:
    """Ternary scales of any granularity -> one per (row, group of Q_GROUP_SIZE)."""
    groups = in_features // Q_GROUP_SIZE
    if scales.shape[1] != 1:
        scales = mx.repeat(scales, group_size // Q_GROUP_SIZE, axis=1)[:, :groups]
    return mx.contiguous(mx.broadcast_to(scales, (out_features, groups)))


def _fast_to_q4(packed: mx.array) -> mx.array:
    """2-bit codes (N, K/16) uint32 -> the same codes in 4-bit fields (N, K/8) uint32.

    Each half word holds 8 codes; spreading 2-bit fields to 4-bit ones is three
    shift-or-mask steps (8 codes in 16 bits -> 8 codes in 32 bits).
    """

    def spread(x):
        x = (x | (x << 8)) & 0x00FF00FF
        x = (x | (x << 4)) & 0x0F0F0F0F
        return (x | (x << 2)) & 0x33333333

    lo, hi = spread(packed & 0xFFFF), spread(packed >> 16)
    return mx.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1).astype(mx.uint32)


def make_layer(layer: TernaryLinear, name: str, backend=None) -> nn.Module:
    """The `name` representation of a ternary layer, exact; shares arrays where it can."""
    n, k = layer.out_features, layer.in_features
    bias = layer.get("bias")
    fast = layer.packed if layer.packing == "fast" else None
    if name in ("compact", "fast"):
        packing = runtime_packing(name, backend)
        new = TernaryLinear(
            k,
            n,
            bias is not None,
            packing=packing,
            scale=layer.scale,
            group_size=layer.group_size,
            scale_dtype=layer.scales.dtype,
            activation_bits=layer.activation_bits,
            backend=backend,
        )
        new.packed = (
            layer.packed
            if packing == layer.packing
            else fmt.pack_mx(layer.trits(), packing, layer.group_size)
        )
        new.scales = layer.scales
    elif name in ("q2", "q4"):
        bits = ceiling.Q_BITS[name]
        new = nn.QuantizedLinear(k, n, bias is not None, group_size=Q_GROUP_SIZE, bits=bits)
        # The fast packing is bit for bit MLX's 2-bit layout (k % 64 == 0: no padding).
        codes = fast if fast is not None else fmt.pack_fast_mx(layer.trits())
        new.weight = codes if bits == 2 else _fast_to_q4(codes)
        new.scales = _group_scales(layer.scales, n, k, layer.group_size)
        new.biases = -new.scales
    else:
        dtype = mx.bfloat16 if name == "bf16" else mx.float32
        new = nn.Linear(k, n, bias is not None)
        new.weight = layer.dequantize(mx.float32).astype(dtype)
    if bias is not None:
        new.bias = bias if name != "bf16" else bias.astype(mx.bfloat16)
    return new


def check_format(name: str, layers) -> str:
    """Why `name` cannot represent these layers, or "" when it can."""
    if name in ("q2", "q4"):
        for path, m in layers:
            if m.in_features % Q_GROUP_SIZE:
                return (
                    f"{path}: in_features {m.in_features} is not a multiple of MLX's "
                    f"group size {Q_GROUP_SIZE}"
                )
    return ""


def available_bytes() -> Optional[int]:
    """Memory a new representation may still take: Metal's working set or MemAvailable."""
    if mx.default_device() == mx.gpu and mx.metal.is_available():
        info = mx.device_info()
        limit = info.get("max_recommended_working_set_size")
        return int(limit) - mx.get_active_memory() if limit else None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _unique_bytes(arrays) -> int:
    seen = {}
    for a in arrays:
        seen[id(a)] = a.nbytes
    return sum(seen.values())


def _layer_arrays(m: nn.Module, dtype) -> list:
    """The arrays a layer holds: parameters, plus the reference fast path's unit scale/bias
    arrays (the native and Metal kernels need none)."""
    arrays = [a for _, a in tree_flatten(m.parameters())]
    return arrays + (m.runtime_arrays(dtype) if isinstance(m, TernaryLinear) else [])


def _embedding_overcount(model: nn.Module, paths) -> int:
    """Bytes of untied embedding tables a decode step does not read (it reads one row)."""
    leaves = tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
    tied = not any(p.split(".")[-1] == "lm_head" for p, _ in leaves)
    if tied:
        return 0
    return sum(
        m.weight.nbytes - m.weight.nbytes // m.weight.shape[0]
        for _, m in leaves
        if isinstance(m, (nn.Embedding, HalfEmbedding))
    )


def build_variants(
    base: nn.Module,
    config: dict,
    model_path: Path,
    formats: List[str],
    backend=None,
    progress: Callable[[str], None] = lambda s: None,
):
    """{format: (model or None, FormatResult)} sharing the base's non-ternary arrays."""
    model_class, args_class = get_classes(config, model_path)
    layers = ternary_layers(base)
    if not layers:
        raise TernaryError(f"{model_path}: the model has no ternary layers to compare")
    paths = {p for p, _ in layers}
    rest = [(k, v) for k, v in tree_flatten(base.parameters()) if k.rsplit(".", 1)[0] not in paths]
    float_dtype = next(
        (v.dtype for _, v in rest if mx.issubdtype(v.dtype, mx.floating) and v.ndim == 1),
        mx.float32,
    )  # the norms' (tables may stay float16)
    out = {}
    for name in formats:
        res = FormatResult(name, loads=False)
        out[name] = (None, res)
        res.reason = check_format(name, layers)
        estimate = sum(ceiling.linear_bytes(_shape(m), name) for _, m in layers)
        free = available_bytes()
        if not res.reason and free is not None and estimate > free:
            res.reason = (
                f"needs about {estimate / 1e9:.1f} GB for its linear layers, "
                f"{free / 1e9:.1f} GB available"
            )
        if res.reason:
            continue
        progress(f"building {name}")
        dtype = mx.bfloat16 if name == "bf16" else float_dtype
        try:
            model, new = _assemble(
                model_class(args_class.from_dict(config)), layers, rest, name, dtype, backend
            )
        except (MemoryError, RuntimeError, ValueError) as e:  # e.g. an allocation refused
            res.reason = f"building it failed: {str(e).splitlines()[0]}"
            continue
        res.loads = True
        res.dtype = str(dtype).split(".")[-1]
        res.runs_as = _runs_as(name, new, backend)
        # The fast path's unit scale/bias arrays are load-time work: built here, counted.
        lin = [a for m in new.values() for a in _layer_arrays(m, dtype)]
        mx.eval(lin)
        res.linear_bytes = _unique_bytes(lin)
        res.linear_weights = sum(m.in_features * m.out_features for _, m in layers)
        res.weight_bytes = _unique_bytes([a for _, a in tree_flatten(model.parameters())] + lin)
        res.read_bytes = res.weight_bytes - _embedding_overcount(model, paths)
        out[name] = (model, res)
    return out


def _assemble(model: nn.Module, layers, rest, name: str, dtype, backend):
    """Swap `name` layers into a fresh (lazy) model and give it the shared float arrays."""
    new = {}
    for path, m in layers:
        new[path] = make_layer(m, name, backend)
        mx.eval(new[path].parameters())
    swap_modules(model, lambda p, _m: new.get(p))
    # As load() builds them: on the native backend, native attention and float16 tables.
    native = name in ("compact", "fast") and dispatch.resolve_backend(backend) == "native"
    keep = adopt(model, dict(rest)) if native else set()
    model.load_weights(
        [
            (
                k,
                v.astype(dtype)
                if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype and k not in keep
                else v,
            )
            for k, v in rest
        ],
        strict=False,
    )
    mx.eval(model.parameters())
    model.eval()
    return model, new


def _shape(m: TernaryLinear) -> ceiling.LinearShape:
    return ceiling.LinearShape(
        m.out_features, m.in_features, tuple(m.scales.shape), m.scales.dtype.size, m.group_size
    )


def _runs_as(name: str, new: Dict[str, nn.Module], backend) -> str:
    m = next(iter(new.values()))
    if isinstance(m, TernaryLinear):
        how = f"{m.packing} packing, {dispatch.resolve_backend(backend)} backend"
        return how + (", repacked at load" if m.packing != name else "")
    if isinstance(m, nn.QuantizedLinear):
        return f"mx.quantized_matmul {m.bits}-bit g{m.group_size}"
    return f"nn.Linear {m.weight.dtype}".replace("mlx.core.", "")


# --------------------------------------------------------------------------- #
# Measuring
# --------------------------------------------------------------------------- #


def _cache_footprint(cache) -> tuple:
    """(KV bytes per token, fixed recurrent-state bytes) of a filled mlx-lm cache."""
    from mlx_lm.models.cache import KVCache

    per_token, state = 0, 0
    for c in cache:
        if isinstance(c, KVCache):
            if c.keys is not None:
                for a in (c.keys, c.values):
                    per_token += a.shape[1] * a.shape[3] * a.dtype.size
        else:
            arrays = [a for a in tree_flatten(c.state) if isinstance(a, mx.array)]
            state += sum(a.nbytes for a in arrays)
    return per_token, state


def measure(model: nn.Module, prompt: mx.array, gen_tokens: int):
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
    kv, state = _cache_footprint(cache)
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

    Returns:
        A BenchResult; `.to_dict()` for JSON.
    """
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise TernaryError(
            f"unknown format(s) {', '.join(bad) or '(none)'}; choose from {', '.join(FORMATS)}"
        )
    if prompt_tokens < 1 or gen_tokens < 2 or repeats < 1:
        raise TernaryError("bench needs --prompt-tokens >= 1, --gen-tokens >= 2 and --repeats >= 1")
    node = llamacpp.find(llama_cpp)
    llama = _llama_row(gguf, llama_threads) if node else None
    model_path = resolve_model_path(model)
    progress(f"loading {model_path}")
    base, config = load_model(model_path, backend=backend)  # as load() holds it here
    variants = build_variants(base, config, model_path, list(formats), backend, progress)
    shapes, float_elements = _model_shapes(base)
    del base

    vocab = _vocab_size(config)
    rng = np.random.default_rng(seed)
    prompt = mx.array(rng.integers(0, vocab, prompt_tokens), dtype=mx.uint32)
    live = [f for f in formats if variants[f][0] is not None]
    for f in live:
        progress(f"warming up {f}")
        measure(variants[f][0], prompt[:WARMUP_PROMPT], WARMUP_GEN)
    order = live + ([LLAMA] if llama is not None and llama.loads else [])
    for r in range(repeats):
        k = r % max(len(order), 1)
        for f in order[k:] + order[:k]:
            progress(f"repeat {r + 1}/{repeats}: {f}")
            if f == LLAMA:  # a fresh node process: peak = its RSS
                out = llamacpp.run(
                    node,
                    Path(gguf),
                    threads=llama_threads or _threads(),
                    prompt_tokens=prompt_tokens,
                    gen_tokens=gen_tokens,
                    seed=seed,
                    vocab=vocab,
                )
                llama.runs += [
                    Run(x["prefill_tps"], x["decode_tps"], out["peak_rss"]) for x in out["runs"]
                ]
                continue
            model_, res = variants[f]
            run, kv, state = measure(model_, prompt, gen_tokens)
            run.peak_bytes += res.weight_bytes
            res.runs.append(run)
            res.kv_bytes_per_token, res.state_bytes = kv, state

    device = device_description(backend)
    source = "--bandwidth" if bandwidth_gbs else ""
    if not bandwidth_gbs and device["mlx_device"] == "gpu":
        bandwidth_gbs, source = ceiling.device_bandwidth(device["device"])
    elif not bandwidth_gbs:
        source = "unknown for a CPU; pass --bandwidth GB/S"
    context = context or prompt_tokens + gen_tokens
    settings = {
        "formats": list(formats),
        "prompt_tokens": prompt_tokens,
        "gen_tokens": gen_tokens,
        "repeats": repeats,
        "seed": seed,
        "ceiling_context": context,
    }
    results = [variants[f][1] for f in formats] + ([llama] if llama is not None else [])
    apple = []
    if live:  # KV elements per token and recurrent state from a measured run's cache
        r = variants[live[0]][1]
        size = mx.bfloat16.size if r.dtype == "bfloat16" else getattr(mx, r.dtype).size
        apple = ceiling.apple_table(
            shapes,
            list(formats),
            float_elements,
            r.kv_bytes_per_token // size,
            r.state_bytes // size,
            context,
        )
    return BenchResult(str(model), device, settings, results, bandwidth_gbs, source, apple)


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


def _vocab_size(config: dict) -> int:
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))


def _model_shapes(base: nn.Module):
    """(ternary layer shapes, float parameter elements a decode step reads) of `base`."""
    layers = ternary_layers(base)
    paths = {p for p, _ in layers}
    rest = [v for k, v in tree_flatten(base.parameters()) if k.rsplit(".", 1)[0] not in paths]
    unread = _embedding_overcount(base, paths) // _float_size(rest)
    return [_shape(m) for _, m in layers], sum(v.size for v in rest) - unread


def _float_size(arrays) -> int:
    return next((a.dtype.size for a in arrays if mx.issubdtype(a.dtype, mx.floating)), 4)


# --------------------------------------------------------------------------- #
# Presenting
# --------------------------------------------------------------------------- #


def _fmt_stat(s: Dict[str, float], scale: float = 1.0, digits: int = 2) -> str:
    if not s or math.isnan(s["median"]):
        return "-"
    m, lo, hi = (s[k] * scale for k in ("median", "min", "max"))
    return f"{m:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def table_rows(result: BenchResult) -> List[List[str]]:
    """The measured table, header first: one row per format."""
    rows = [
        [
            "format",
            "loads",
            "runs as",
            "bits/w",
            "weights MB",
            "peak MB",
            "prefill tok/s",
            "decode tok/s",
            "% of ceiling",
        ]
    ]
    for r in result.formats:
        if not r.loads:
            rows.append([r.name, "no: " + r.reason] + [""] * 7)
            continue
        ceil_ = result.ceiling_tps(r)
        dec = r.stat("decode_tps")
        frac = f"{100 * dec['median'] / ceil_:.0f}% of {ceil_:.1f}" if ceil_ and dec else "-"
        rows.append(
            [
                r.name,
                "yes",
                r.runs_as,
                f"{r.bits_per_weight:.2f}",
                f"{r.weight_bytes / 1e6:.1f}",
                _fmt_stat(r.stat("peak_bytes"), 1e-6, 1),
                _fmt_stat(r.stat("prefill_tps")),
                _fmt_stat(r.stat("decode_tps")),
                frac,
            ]
        )
    return rows


def apple_rows(result: BenchResult) -> List[List[str]]:
    """The computed Apple ceiling table, header first: decode tokens/s per chip."""
    if not result.apple:
        return []
    formats = list(result.apple[0]["tps"])
    rows = [["chip", "GB/s"] + formats]
    for row in result.apple:
        rows.append(
            [row["chip"], f"{row['bandwidth_gbs']:g}"] + [f"{row['tps'][f]:.1f}" for f in formats]
        )
    return rows


def render(rows: List[List[str]], markdown: bool = False) -> str:
    """Rows as an aligned plain-text table, or a Markdown table."""
    if not rows:
        return ""
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in rows]
        lines.insert(1, "|" + "|".join("---" for _ in rows[0]) + "|")
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def plot(result: BenchResult, path) -> None:
    """A PNG: tokens/s (prefill, decode; median with min-max) and memory per format."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TernaryError("--plot needs matplotlib: pip install 'mlx-ternary[bench]'") from None
    live = [r for r in result.formats if r.loads and r.runs]
    names = [r.name for r in live]
    x = np.arange(len(live))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, key in enumerate(("prefill_tps", "decode_tps")):
        st = [r.stat(key) for r in live]
        med = np.array([s["median"] for s in st])
        err = np.array([[s["median"] - s["min"] for s in st], [s["max"] - s["median"] for s in st]])
        ax1.bar(x + (i - 0.5) * 0.4, med, 0.4, yerr=err, capsize=3, label=key.split("_")[0])
    ax1.set_xticks(x, names)
    ax1.set_ylabel("tokens/s")
    ax1.legend()
    ax2.bar(x - 0.2, [r.weight_bytes / 1e6 for r in live], 0.4, label="weights")
    ax2.bar(x + 0.2, [r.stat("peak_bytes")["median"] / 1e6 for r in live], 0.4, label="peak")
    ax2.set_xticks(x, names)
    ax2.set_ylabel("MB")
    ax2.legend()
    fig.suptitle(
        f"{Path(result.model).name} on {result.device['device']} "
        f"(MLX {result.device['mlx']}, {result.device['mlx_device']})"
    )
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    plt.close(fig)
