"""Host time: how long building the graph of a layer call (or a decode step) takes.

MLX evaluates lazily, so the Python work of a call is pure host overhead; mlx-lm hides it
behind the GPU only while it is shorter than the GPU's work. This module measures it side
by side with stock `nn.QuantizedLinear` (2-bit, group 64), in one run, interleaved:

- per layer call: TernaryLinear on the Metal path, the kernel launch stubbed (off a Mac:
  `mx.fast.metal_kernel` replaced by a stub whose launch is one MLX op, a multi-output
  launch one op with several outputs, as a custom kernel is), on the reference path, and
  in training mode (the straight-through gradient's custom VJP), with and without int8
  activation quantization;
- per decode token of a 30-layer model: the same paths against stock q2 and q4.

Times are the best (and median) of many short rounds: the minimum is what the code costs,
the median what a busy machine adds.

Which stand-in is right (docs/KERNELS.md, "Host time"): the stub is a Python object, so a
stubbed call pays the stub's own frame and keyword handling on top of its one MLX op, which
a real launch (one C++ call) does not; the row "metal, launch as one MLX op" removes that:
the stubbed call's time minus the stub called alone plus one MLX op called directly. The
stock layer holds its scales and biases in the activation dtype, as `nn.quantize` leaves a
float16 model (float32 scales would add a promotion to every stock call and flatter every
ratio). On a Mac the real launch is timed too ("metal, real launch").
"""

import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Dict, List

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import format as fmt
from ..runtime import cpu, probe, tune
from ..runtime.layers import TernaryLinear

ROUNDS = 40
CALLS = 200
TARGETS = {False: 1.5, True: 2.5}  # ratio to nn.QuantizedLinear, without / with int8 activations


class _StubKernel:
    """A launch that costs one MLX op (several outputs: one op with several outputs)."""

    def __init__(self):
        self._bases = {}

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        if len(output_shapes) == 1:
            return [mx.zeros(output_shapes[0], output_dtypes[0])]
        key = tuple(output_shapes)
        split = self._bases.get(key)
        if split is None:
            widths = [s[-1] for s in output_shapes]
            base = mx.zeros((*output_shapes[0][:-1], sum(widths)))
            split = self._bases[key] = (base, [int(c) for c in np.cumsum(widths[:-1])])
        return mx.split(split[0], split[1], axis=-1)


@contextmanager
def stubbed_metal():
    """Within the block the Metal path runs with stubbed launches: Metal reported present,
    kernels built by the stub, no first-use checks (the stub's output is not real), no tuning."""
    stub = _StubKernel()
    saved = (
        mx.metal.is_available,
        mx.fast.metal_kernel,
        os.environ.get(tune.ENV_TUNE),
        cpu.available,
    )
    mx.metal.is_available = lambda: True
    mx.fast.metal_kernel = lambda **kw: stub
    cpu.available = lambda: False  # on a Mac the GPU is the default device
    os.environ[tune.ENV_TUNE] = "0"
    try:
        with probe.trusted():
            yield stub
    finally:
        mx.metal.is_available, mx.fast.metal_kernel = saved[0], saved[1]
        cpu.available = saved[3]
        if saved[2] is None:
            os.environ.pop(tune.ENV_TUNE, None)
        else:
            os.environ[tune.ENV_TUNE] = saved[2]


@dataclass
class HostRow:
    """Host microseconds per call of one path: best and median of the rounds."""

    name: str
    act: bool
    us_min: float
    us_median: float
    ratio: float = 0.0  # us_min / nn.QuantizedLinear's us_min


def _interleaved(fns: Dict[str, callable], rounds: int, calls: int) -> Dict[str, List[float]]:
    for fn in fns.values():
        for _ in range(20):
            fn()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[k].append((time.perf_counter() - t0) / calls * 1e6)
    return times


def _ternary(k: int, n: int, act: bool, backend: str, train: bool = False) -> TernaryLinear:
    rng = np.random.default_rng(0)
    t = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
    pt = fmt.PackedTernary.from_trits(t, np.ones((n, 1), np.float32), "fast", None)
    layer = TernaryLinear.from_packed(pt, activation_bits=8 if act else None, backend=backend)
    layer.train(train)
    return layer


def layer_overhead(
    k: int = 2560, n: int = 2560, dtype=mx.float16, rounds: int = ROUNDS, calls: int = CALLS
) -> List[HostRow]:
    """Host µs per call of each path for one k -> n layer, one token of `dtype`.

    Returns rows, nn.QuantizedLinear first; ratio is against its best time.
    """
    x = mx.zeros((1, 1, k), dtype=dtype)
    stock = nn.QuantizedLinear(k, n, False, group_size=64, bits=2)
    stock.set_dtype(dtype)  # scales and biases as a quantized float16 model holds them
    real = {}
    if mx.metal.is_available():  # a Mac: the real launch, planned and checked before the stub
        for act in (False, True):
            layer = real[("metal, real launch", act)] = _ternary(k, n, act, "metal")
            layer.eval()
            mx.eval(layer(x))
    native_paths = {}
    if cpu.available():  # planned before the stub, which hides the native backend
        for act in (False, True):
            layer = native_paths[("native CPU kernel", act)] = _ternary(k, n, act, "native")
            layer.eval()
            mx.eval(layer(x))
    with stubbed_metal() as stub:
        paths = {
            ("nn.QuantizedLinear 2-bit g64", False): stock,
            ("one MLX op (mx.zeros, called directly)", False): lambda x_: mx.zeros(
                (1, 1, n), dtype=dtype
            ),
            ("stub launch alone (one MLX op)", False): lambda x_: stub(
                inputs=[x_],
                template=[],
                grid=(1, 1, 1),
                threadgroup=(1, 1, 1),
                output_shapes=[(1, 1, n)],
                output_dtypes=[dtype],
            ),
        }
        for act in (False, True):
            paths[("metal, launch stubbed", act)] = _ternary(k, n, act, "metal")
            paths[("reference", act)] = _ternary(k, n, act, "reference")
            paths[("metal, training mode (custom VJP)", act)] = _ternary(k, n, act, "metal", True)
        for layer in paths.values():
            if isinstance(layer, TernaryLinear) and not layer.training:
                layer.eval()
        paths.update(native_paths)  # already in eval mode and planned
        fns = {key: (lambda f=f: f(x)) for key, f in paths.items()}
        times = _interleaved(fns, rounds, calls)
    if real:
        times.update(
            _interleaved({k_: (lambda f=f: f(x)) for k_, f in real.items()}, rounds, calls)
        )
    # The stub's own Python (its frame, its keywords; best against best) replaced by one
    # directly called op.
    stub_extra = min(times[("stub launch alone (one MLX op)", False)]) - min(
        times[("one MLX op (mx.zeros, called directly)", False)]
    )
    for act in (False, True):
        stubbed = times[("metal, launch stubbed", act)]
        times[("metal, launch as one MLX op", act)] = [t - stub_extra for t in stubbed]
    base = min(times[("nn.QuantizedLinear 2-bit g64", False)])
    return [
        HostRow(name, act, min(v), statistics.median(v), min(v) / base)
        for (name, act), v in times.items()
    ]


def _decode_model(layers: int, act: bool):
    """A Llama-shaped model with `layers` layers and small widths, ternary (fast, row scales)."""
    from mlx_lm.models import llama

    from ..runtime.layers import ternarize_model

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=256,
        num_hidden_layers=layers,
        intermediate_size=512,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=512,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    ternarize_model(model, packing="fast", scale="row", activation_bits=8 if act else None)
    mx.eval(model.parameters())
    return model


def _variant(base, name: str):
    """The model with its ternary layers as `name` ("metal", "native", "reference", "q2",
    "q4")."""
    import copy

    from ..runtime.layers import swap_modules, ternary_layers
    from .variants import make_layer

    model = copy.deepcopy(base)
    layers = dict(ternary_layers(base))
    if name in ("metal", "native", "reference"):
        for _, m in ternary_layers(model):
            m.backend = name
    else:
        swap_modules(model, lambda p, _m: make_layer(layers[p], name) if p in layers else None)
    mx.eval(model.parameters())
    model.eval()
    return model


def decode_overhead(
    layers: int = 30, act: bool = True, steps: int = 8, rounds: int = 15
) -> Dict[str, Dict[str, float]]:
    """Host ms to build one decode step's graph: {variant: {"ms_min", "ms_median"}}.

    The step runs mlx-lm's model call with a KV cache; its evaluation is not timed.
    """
    from mlx_lm.models.cache import make_prompt_cache

    base = _decode_model(layers, act)
    names = ("metal", "reference", "q2", "q4")
    native_models = {}
    if cpu.available():  # planned before the stub, which hides the native backend
        native_models["native"] = _variant(base, "native")
        mx.eval(
            native_models["native"](
                mx.array([[3]]), cache=make_prompt_cache(native_models["native"])
            )
        )
        names = ("native", *names)
    with stubbed_metal():
        models = {
            **native_models,
            **{name: _variant(base, name) for name in names if name not in native_models},
        }
        caches = {name: make_prompt_cache(m) for name, m in models.items()}
        tok = mx.array([[3]])
        for name, m in models.items():
            mx.eval(m(tok, cache=caches[name]))
        times = {name: [] for name in names}
        for _ in range(rounds):
            for name, m in models.items():
                for _ in range(steps):
                    t0 = time.perf_counter()
                    y = m(tok, cache=caches[name])
                    times[name].append((time.perf_counter() - t0) * 1e3)
                    mx.eval(y)
    return {
        name: {"ms_min": min(v), "ms_median": statistics.median(v)} for name, v in times.items()
    }


def report(k: int = 2560, n: int = 2560, layers: int = 30, rounds: int = ROUNDS) -> dict:
    """Both measurements and the targets, as one JSON-able dict."""
    rows = layer_overhead(k, n, rounds=rounds)
    decode = {
        ("act" if act else "no_act"): decode_overhead(layers, act, rounds=max(5, rounds // 3))
        for act in (False, True)
    }
    return {
        "rounds": rounds,
        "layer": {
            "in": k,
            "out": n,
            "dtype": "float16",
            "tokens": 1,
            "rows": [asdict(r) for r in rows],
        },
        "decode_step": {"layers": layers, "ms": decode},
        "targets": {"no_act": TARGETS[False], "act": TARGETS[True]},
        "mlx": mx.__version__,
    }


def lines(result: dict) -> List[str]:
    """The report as text lines (the CLI and the script print them)."""
    lay = result["layer"]
    out = [
        f"host us per call, {lay['in']} -> {lay['out']}, 1 token {lay['dtype']}, "
        f"best (median) of {result['rounds']} rounds; ratio = best / nn.QuantizedLinear's "
        "best",
        f"{'path':36} {'int8 x':>6} {'us':>14} {'ratio':>6} {'target':>7}",
    ]
    for r in lay["rows"]:
        stock = r["name"].startswith(("nn.", "stub", "one MLX op"))
        target = "" if stock else f"<= {result['targets']['act' if r['act'] else 'no_act']}"
        out.append(
            f"{r['name']:36} {('yes' if r['act'] else 'no'):>6} "
            f"{r['us_min']:6.2f} ({r['us_median']:5.2f}) {r['ratio']:6.2f} {target:>7}"
        )
    dec = result["decode_step"]
    out.append(f"host ms per decode token, {dec['layers']}-layer model (graph only), best (median)")
    for act, rows in dec["ms"].items():
        cells = "  ".join(
            f"{name} {v['ms_min']:.2f} ({v['ms_median']:.2f})" for name, v in rows.items()
        )
        out.append(f"  {'int8 x' if act == 'act' else 'float x'}: {cells}")
    return out
