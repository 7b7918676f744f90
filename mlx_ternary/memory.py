"""The memory plan: weights + KV cache + activations + overhead, against what the machine has.

`plan()` reads a (possibly lazily) loaded mlx-lm model: parameter sizes come from array
shapes and dtypes, the KV cache size per token from a lazy one-token probe of mlx-lm's own
cache objects, and the activation peak of one prefill chunk from the model's dimensions.
Nothing is evaluated, so the plan runs before the float weights are read from disk.
`measure()` runs a real prefill + decode and reads MLX's peak-memory counter: the check
that the plan is honest (docs/SERVE.md gives the figures).
"""

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .format import KV_GROUP_SIZE, ceil_div
from .runtime.cpu import activation as native_swiglu
from .runtime.cpu import attention as native_attention
from .runtime.cpu import block as native_block
from .runtime.cpu.tables import GGMLEmbedding, GGMLLinear, HalfEmbedding, HalfLinear
from .runtime.layers import TernaryLinear, ternary_layers

GiB = 1024**3
# Python, MLX, tokenizers and the HTTP stack: resident memory outside MLX's allocator
# (measured: 0.35 GiB peak RSS serving the tiny model on Linux; docs/SERVE.md).
FRAMEWORK_OVERHEAD = 512 * 1024**2
KV_STEP = 256  # mlx-lm's KV caches grow in steps of 256 tokens
ACTIVATION_MARGIN = 1.1  # allocator rounding and small temporaries the count leaves out
# MLX's CPU RoPE holds temporaries of 2.4x its input beside its output (measured: a peak of
# 444 KB for a (1, 4, 512, 16) float32 query, 131 KB in and out).
ROPE_TEMPORARIES = 2.4
# With the fused native blocks (runtime/cpu/block.py) a layer is ~5 MLX tasks instead of ~25,
# and MLX keeps up to 10 in flight: mlx-lm's pipelined decoding schedules the next step's
# cache updates while up to ~2-4 layers of this step still read the caches, so those updates
# copy the buffers instead of writing in place (measured: serving the 2-layer test model,
# ~0.5 MB = one layer's cache more at the peak than mlx-lm's blocks).
FUSED_LAYERS_IN_FLIGHT = 4
# The command-line options that change each part of the plan (named in the advice).
PLAN_FLAGS = {
    "context": "--max-context",
    "kv_bits": "--kv-bits",
    "batch": "--batch",
    "prefill": "--prefill-step-size",
    "prompt_cache": "--prompt-cache-bytes",
}
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1024**2,
    "mib": 1024**2,
    "g": GiB,
    "gb": GiB,
    "gib": GiB,
}


@dataclass
class MemoryPlan:
    """Bytes each part of a run needs, and whether the total fits under `limit`."""

    weights: Dict[str, int]  # {"ternary", "float", "embeddings"}
    kv_cache: int
    activations: int
    overhead: int
    available: int
    available_source: str
    limit: int
    max_context: int
    batch: int
    prefill_step_size: int
    kv_bits: Optional[int] = None
    prompt_cache: int = 0  # bytes of KV kept across requests (serve)
    batching: int = 0  # what continuous batching holds beyond those (`batching_bytes`)
    notes: List[str] = field(default_factory=list)
    flags: Dict[str, str] = field(default_factory=lambda: dict(PLAN_FLAGS))

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def total(self) -> int:
        return (
            self.weights_total
            + self.kv_cache
            + self.prompt_cache
            + self.batching
            + self.activations
            + self.overhead
        )

    @property
    def fits(self) -> bool:
        return self.total <= self.limit

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(weights_total=self.weights_total, total=self.total, fits=self.fits)
        return d

    def lines(self) -> List[str]:
        """The plan as aligned text lines, one part per line."""
        kv = f"KV cache ({self.batch} x {self.max_context} tokens"
        kv += f", {self.kv_bits}-bit)" if self.kv_bits else ")"
        rows = [
            ("weights, ternary", self.weights["ternary"]),
            ("weights, float", self.weights["float"]),
            ("weights, embeddings", self.weights["embeddings"]),
            (kv, self.kv_cache),
            *(
                [("prompt cache (kept across requests)", self.prompt_cache)]
                if self.prompt_cache
                else []
            ),
            *(
                [("continuous batching (KV slack, cache insert)", self.batching)]
                if self.batching
                else []
            ),
            (f"activations (prefill chunk {self.prefill_step_size})", self.activations),
            ("framework overhead", self.overhead),
            ("total", self.total),
            (f"memory limit ({self.available_source})", self.limit),
        ]
        width = max(len(name) for name, _ in rows)
        return [f"{name:<{width}}  {fmt_bytes(n):>10}" for name, n in rows] + self.notes

    def advice(self) -> List[str]:
        """What to change so the plan fits, largest saving first, in `flags`' names."""
        out, flag = [], self.flags.get
        if self.kv_cache > 0 and flag("context"):
            out.append(
                f"lower {flag('context')} (the KV cache for {self.max_context} tokens "
                f"is {fmt_bytes(self.kv_cache)} and shrinks in proportion)"
            )
        if self.kv_cache > 0 and not self.kv_bits and flag("kv_bits"):
            out.append(f"quantize the KV cache with {flag('kv_bits')} 8 (about half the KV memory)")
        if self.prompt_cache > 0 and flag("prompt_cache"):
            out.append(
                f"a smaller {flag('prompt_cache')} (now "
                f"{fmt_bytes(self.prompt_cache)}; 0 turns the prompt cache off)"
            )
        if self.batch > 1 and flag("batch"):
            out.append(
                f"lower {flag('batch')} (now {self.batch}; each sequence holds "
                f"{fmt_bytes(self.kv_cache // self.batch)} of KV cache)"
            )
        if self.prefill_step_size > 128 and flag("prefill"):
            out.append(
                f"a smaller {flag('prefill')} (now {self.prefill_step_size}; the "
                f"activation peak is {fmt_bytes(self.activations)})"
            )
        return out or ["a smaller model or a machine with more memory"]

    def refusal(self) -> str:
        """One message with the numbers and the advice, for a plan that does not fit."""
        parts = [f"weights {fmt_bytes(self.weights_total)}", f"KV cache {fmt_bytes(self.kv_cache)}"]
        if self.prompt_cache:
            parts.append(f"prompt cache {fmt_bytes(self.prompt_cache)}")
        if self.batching:
            parts.append(f"continuous batching {fmt_bytes(self.batching)}")
        parts += [
            f"activations {fmt_bytes(self.activations)}",
            f"overhead {fmt_bytes(self.overhead)}",
        ]
        return (
            f"the memory plan does not fit: {' + '.join(parts)} = {fmt_bytes(self.total)}"
            f", over the limit of {fmt_bytes(self.limit)} ({self.available_source}); "
            f"try: {'; '.join(self.advice())}"
        )


def parse_bytes(text: str) -> int:
    """'512MB', '2GiB', '0', '1048576' -> bytes (K/M/G are powers of 1024)."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and _UNITS.get(m.group(2).lower())
    if not unit:
        raise ValueError(f"{text!r} is not a size: write bytes or a number with KB, MB or GB")
    return int(float(m.group(1)) * unit)


def fmt_bytes(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= 1024**2:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def available_memory(free: bool = False) -> tuple:
    """(bytes, where the number comes from): Metal's working set, else system RAM.

    free: what a new allocation may still take: on Metal the working set less the memory
    MLX holds now (the bench builds one representation after another); RAM's MemAvailable
    already is."""
    if mx.metal.is_available():
        info = mx.device_info()
        size = info.get("max_recommended_working_set_size") or info.get("memory_size")
        if size:
            held = mx.get_active_memory() if free else 0
            return int(size) - held, "Metal recommended working set"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "system RAM available"
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "system RAM"


def _is_embedding(path: str, module: nn.Module) -> bool:
    return (
        isinstance(module, (nn.Embedding, nn.QuantizedEmbedding))
        or path.split(".")[-1] == "lm_head"
    )


def weight_bytes(model: nn.Module) -> Dict[str, int]:
    """Parameter bytes by kind: ternary layers (with their runtime affine tables), float
    layers, and the input/output embeddings. Lazy arrays are sized without evaluating."""
    sizes = {"ternary": 0, "float": 0, "embeddings": 0}
    dtype = activation_dtype(model)
    seen = set()
    for _, layer in ternary_layers(model):
        for a in layer.runtime_arrays(dtype):  # the reference fast path's tables, shared
            if id(a) not in seen:
                seen.add(id(a))
                sizes["ternary"] += a.nbytes
    for path, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        kind = (
            "ternary"
            if isinstance(m, TernaryLinear)
            else "embeddings"
            if _is_embedding(path, m)
            else "float"
        )
        sizes[kind] += sum(a.nbytes for _, a in tree_flatten(m.parameters()))
    return sizes


def activation_dtype(model: nn.Module):
    """The float dtype activations (and the KV cache) run in: the embedding's (float32
    where the native backend keeps a float16 table or llama.cpp's blocks and widens what it
    looks up)."""
    for _, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        if isinstance(m, (HalfEmbedding, HalfLinear, GGMLEmbedding, GGMLLinear)):
            return mx.float32
        for _, a in tree_flatten(m.parameters()):
            if mx.issubdtype(a.dtype, mx.floating) and a.ndim == 2:
                return a.dtype
    return mx.float32


def materialize(model: nn.Module, dtype=None) -> None:
    """Evaluate the model's weights and its ternary layers' runtime arrays on this thread
    (for activations of `dtype`, default the model's), so a thread that runs the model
    later finds no lazy graph built on this thread's stream."""
    mx.eval(model.parameters())
    dtype = dtype or activation_dtype(model)
    mx.eval([a for _, layer in ternary_layers(model) for a in layer.runtime_arrays(dtype)])


def kv_itemsize(model: nn.Module) -> int:
    """Bytes of one cached key element (float16 where the fused CPU block keeps the cache,
    else the model's activations), from the same lazy one-token probe as `kv_layout`; the
    activations' size for a model without a KV cache."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.zeros((1, 1), dtype=mx.int32), cache=cache)  # builds the graph, evaluates nothing
    keys = [c.keys for c in cache if getattr(c, "keys", None) is not None]
    return keys[0].itemsize if keys else activation_dtype(model).size


def kv_layout(
    model: nn.Module,
    kv_bits: Optional[int] = None,
    kv_group_size: int = KV_GROUP_SIZE,
    max_kv_size: Optional[int] = None,
) -> List[Tuple[float, Optional[int], int]]:
    """Per cache of the model: (KV bytes per token, most tokens it holds or None, bytes of
    fixed state), from a lazy one-token probe of the model's own caches, so any attention
    layout (GQA, sliding windows, state caches) is measured, not assumed."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    model(mx.zeros((1, 1), dtype=mx.int32), cache=cache)  # builds the graph, evaluates nothing
    out = []
    for c in cache:
        if getattr(c, "keys", None) is None:
            state = sum(a.nbytes for _, a in tree_flatten(c.state) if isinstance(a, mx.array))
            out.append((0.0, None, state))
            continue
        per_token = 0.0
        for a in (c.keys, c.values):
            # quantized caches keep mlx-lm's block: scales in the activations' dtype
            scale = activation_dtype(model).size
            per_elem = (kv_bits / 8 + 2 * scale / kv_group_size) if kv_bits else a.itemsize
            per_token += a.shape[1] * a.shape[3] * per_elem
        out.append((per_token, getattr(c, "max_size", None) or None, 0))
    return out


def kv_bytes(
    model: nn.Module,
    max_context: int,
    batch: int = 1,
    kv_bits: Optional[int] = None,
    kv_group_size: int = KV_GROUP_SIZE,
    max_kv_size: Optional[int] = None,
) -> int:
    """KV cache bytes for `batch` sequences of `max_context` tokens (see `kv_layout`)."""
    tokens = ceil_div(max_context, KV_STEP) * KV_STEP
    total = 0
    for per_token, most, state in kv_layout(model, kv_bits, kv_group_size, max_kv_size):
        total += int(per_token * (min(tokens, most) if most else tokens)) + state
    return total * batch


def batching_bytes(
    model: nn.Module,
    max_context: int,
    batch: int = 1,
    kv_bits: Optional[int] = None,
    kv_group_size: int = KV_GROUP_SIZE,
    max_kv_size: Optional[int] = None,
    prompt_cache: int = 0,
) -> int:
    """Bytes the batched server holds beyond `kv_bytes` and the prompt cache's bound: 0 for
    one sequence without a prompt cache (where the caches grow from empty in whole steps).

    KV step slack: mlx-lm's BatchKVCache sizes a batch's buffers at the longest sequence's
    length, not at a multiple of KV_STEP, when it merges a reused prompt-cache prefix into a
    batch or shifts the batch left as a finished sequence leaves; a buffer that is full then
    grows by whole KV_STEPs from there. So every sequence of the batch may hold up to
    max_context + KV_STEP - 1 positions, not max_context rounded up to KV_STEP (measured:
    serving the 2-layer test model with max context 256, buffers of 292 positions).

    Prompt-cache insert: a finished sequence's entry is copied (and evaluated) before the
    least recently used entries are evicted, so the store holds its bound plus one sequence's
    KV cache for a moment.
    """
    if batch <= 1 and prompt_cache <= 0:
        return 0
    layout = kv_layout(model, kv_bits, kv_group_size, max_kv_size)
    planned = ceil_div(max_context, KV_STEP) * KV_STEP
    cap = lambda n, most: min(n, most) if most else n  # noqa: E731
    slack = sum(
        pt * (cap(max_context + KV_STEP - 1, most) - cap(planned, most)) for pt, most, _ in layout
    )
    total = batch * max(0, int(slack))
    if prompt_cache > 0:
        one = sum(int(pt * cap(max_context, most)) + state for pt, most, state in layout)
        total += min(one, prompt_cache)
    return total


def native_kernels(model: nn.Module) -> Tuple[bool, bool]:
    """(attention, SwiGLU): whether `model`'s calls of each run the native CPU kernel here -
    the dispatchers' own conditions: routed by the native backend, the CPU, float32."""
    here = mx.default_device() == mx.cpu and activation_dtype(model) == mx.float32
    return here and native_attention.routed(model), here and native_swiglu.routed(model)


def fused_blocks(model: nn.Module) -> bool:
    """Whether `model`'s decoder blocks run the fused native block here (routed, the setting
    on, the CPU, float32; runtime/cpu/block.py's own conditions decide each call)."""
    here = mx.default_device() == mx.cpu and activation_dtype(model) == mx.float32
    return here and native_block.routed(model) and native_block.is_enabled()


def _dims(model: nn.Module) -> dict:
    args = getattr(model, "args", None)
    get = lambda name, default=0: getattr(args, name, None) or default  # noqa: E731
    h = get("hidden_size")
    heads = get("num_attention_heads", 1)
    kv_heads = get("num_key_value_heads", heads)
    hd = get("head_dim", h // heads if heads else 0)
    inter = get("intermediate_size", 4 * h)
    return dict(h=h, heads=heads, hd=hd, kv=kv_heads * hd, inter=inter, vocab=get("vocab_size"))


def _native_layer(d: dict) -> int:
    """Floats per token of one decoder layer's tensors when attention and SwiGLU run natively.

    MLX's CPU evaluation runs ahead of its worker (each queued task holds its inputs and
    output), so a layer's tensors are live together, not only its widest moment's (measured:
    2.2 MB for a 512-token layer of the test model, its attention block alone 0.95 MB).
    Attention: norm, q/k/v, RoPE's outputs and its temporaries (ROPE_TEMPORARIES), the
    kernel's output (it reads q/k/v in place; scores are per-thread scratch, outside MLX),
    its transposed copy, o_proj, residual. MLP: norm, gate, up, SwiGLU's
    output (one tensor), down, residual. Plus the residual stream entering the layer.
    """
    h, q, kv, inter = d["h"], d["heads"] * d["hd"], d["kv"], d["inter"]
    rope = (q + kv) + int(ROPE_TEMPORARIES * (q + kv))
    attention = h + (q + 2 * kv) + rope + 2 * q + 2 * h
    return h + attention + 3 * h + 3 * inter


def _kv_growth(model: nn.Module, batch: int, max_context: int) -> int:
    """Bytes a cache holds twice while it grows: mlx-lm concatenates the old keys/values with
    a new step, so one layer's old buffers and the new ones are live together; with fused
    blocks, FUSED_LAYERS_IN_FLIGHT layers' (their pipelined updates copy)."""
    tokens = ceil_div(max_context, KV_STEP) * KV_STEP
    sizes = [pt * (min(tokens, most) if most else tokens) for pt, most, _ in kv_layout(model)]
    layers = FUSED_LAYERS_IN_FLIGHT if fused_blocks(model) else 1
    return int(batch * sum(sorted(sizes, reverse=True)[:layers]))


def activation_bytes(model: nn.Module, batch: int, prefill_step: int, max_context: int) -> int:
    """Peak transient bytes of one prefill chunk of `batch` x `prefill_step` tokens attending
    to up to `max_context` keys, or of one batched decode step (logits), whichever is larger,
    plus a KV cache's growth (`_kv_growth`).

    Where attention and SwiGLU run the native kernels (`native_kernels`): one layer's tensors
    (`_native_layer`) and the batch's bool mask. Elsewhere the widest moment of a layer:
    attention (hidden states, q/k/v, the score matrix and its softmax, as MLX's unfused
    attention builds them off Metal) or the MLP (gate, up, product).
    """
    d = _dims(model)
    h, heads, hd = d["h"], d["heads"], d["hd"]
    f = activation_dtype(model).size
    step = min(prefill_step, max_context)
    t = batch * step
    decode = 3 * batch * d["vocab"] * f
    if all(native_kernels(model)):
        layers = [t * _native_layer(d) * f + t * max_context]  # the bool mask: a byte each
    else:
        attn = t * (3 * h + 2 * heads * hd + 2 * d["kv"]) * f
        # Scores and their softmax, plus keys/values broadcast over the query heads.
        attn += 2 * batch * heads * max_context * (step + hd) * f
        layers = [attn, t * (3 * h + 3 * d["inter"]) * f]  # the MLP: gate, up, product
    peak = ACTIVATION_MARGIN * max(*layers, decode)
    return int(peak) + _kv_growth(model, batch, max_context)


def plan(
    model: nn.Module,
    max_context: int,
    batch: int = 1,
    prefill_step_size: int = 512,
    kv_bits: Optional[int] = None,
    memory_limit: Optional[float] = None,
    max_kv_size: Optional[int] = None,
    flags: Optional[Dict[str, str]] = None,
    prompt_cache: int = 0,
) -> MemoryPlan:
    """The memory plan for serving `batch` sequences of up to `max_context` tokens.

    Args:
        model: an mlx-lm model (lazily loaded is enough: nothing is evaluated).
        max_context: prompt + generated tokens per sequence.
        batch: sequences decoded together.
        prefill_step_size: prompt tokens processed per chunk.
        kv_bits: KV cache quantization bits, or None for the float cache.
        memory_limit: limit in GiB (default: the memory available).
        max_kv_size: a rotating KV cache of this many tokens.
        flags: the options that change each part, for the advice (default: `plan`'s).
        prompt_cache: bytes of prompt KV caches kept across requests (serve's LRU bound).

    Returns:
        A MemoryPlan; `.fits` says whether it fits, `.refusal()` says what to change.
    """
    available, source = available_memory()
    limit = int(memory_limit * GiB) if memory_limit else available
    if memory_limit:
        source = f"--memory-limit; {fmt_bytes(available)} {source}"
    return MemoryPlan(
        weights=weight_bytes(model),
        kv_cache=kv_bytes(model, max_context, batch, kv_bits, max_kv_size=max_kv_size),
        activations=activation_bytes(model, batch, prefill_step_size, max_context),
        overhead=FRAMEWORK_OVERHEAD,
        available=available,
        available_source=source,
        limit=limit,
        max_context=max_context,
        batch=batch,
        prefill_step_size=prefill_step_size,
        kv_bits=kv_bits,
        prompt_cache=prompt_cache,
        batching=batching_bytes(
            model, max_context, batch, kv_bits, max_kv_size=max_kv_size, prompt_cache=prompt_cache
        ),
        flags=dict(PLAN_FLAGS if flags is None else flags),
    )


def measure(
    model: nn.Module,
    prompt_tokens: int,
    batch: int = 1,
    prefill_step_size: int = 512,
    decode_tokens: int = 4,
    vocab: Optional[int] = None,
    seed: int = 0,
) -> dict:
    """Run a batched prefill of `prompt_tokens` plus `decode_tokens` greedy steps through
    mlx-lm's BatchGenerator and read MLX's peak-memory counter.

    Returns:
        {"peak": bytes at the peak, "baseline": bytes before (the weights), "seconds": ...}.
    """
    from mlx_lm.generate import BatchGenerator

    vocab = vocab or getattr(model.args, "vocab_size", 2)
    materialize(model)  # the runtime tables are built on the first call: resident first
    mx.clear_cache()
    baseline = mx.get_active_memory()
    mx.reset_peak_memory()
    key = mx.random.key(seed)
    prompts = mx.random.randint(2, vocab, (batch, prompt_tokens), key=key).tolist()
    gen = BatchGenerator(
        model,
        completion_batch_size=batch,
        prefill_batch_size=batch,
        prefill_step_size=prefill_step_size,
    )
    tic = time.perf_counter()
    uids = gen.insert(prompts, max_tokens=[decode_tokens] * batch)
    done = set()
    while len(done) < len(uids):
        for r in gen.next_generated():
            if r.finish_reason is not None:
                done.add(r.uid)
    seconds = time.perf_counter() - tic
    peak = mx.get_peak_memory()
    del gen
    mx.clear_cache()
    return {"peak": peak, "baseline": baseline, "seconds": seconds}
