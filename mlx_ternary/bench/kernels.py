"""`mlx-ternary bench --kernels`: the project's kernels against stock MLX, timed to settle it.

On a Mac, for BitNet-2B and 27B layer shapes (and a wide one), M = 1 ... 512 tokens, int8
activations on and off, tensor/row/group scales and float16/bfloat16 activations:

- every variant's result is first checked against its reference twin (reference.py) on
  the same inputs; a variant that fails is reported, never timed;
- time per call comes from chains of >= 50 dependent calls inside one evaluation (each
  call consumes the previous output through a slice-and-scale glue, timed alone and
  subtracted), weights rotated over copies so no cache flatters them: no CPU-GPU round trip
  per call;
- a copy's bandwidth is measured in the same run, and decode is reported as a fraction of
  it (and of the chip's nominal bandwidth, ceiling.py); prefill (M > 16) in TFLOPS;
- beside them, stock `mx.quantized_matmul` 2-bit on the very same words (scale s, bias -s
  per group of 64: the user's alternative on this layout) and 4-bit g64, and the
  reference path (quantized_matmul plus MLX activation quantization).

Off a Mac `backend="emulate"` runs the same plan on small shapes through the CPU emulator:
a smoke test of this code (checks included), with no timing claims.
"""

import math
import platform
import statistics
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Callable, Dict, List, Optional

import mlx.core as mx
import numpy as np

from .. import format as fmt
from ..errors import TernaryError
from ..runtime import probe, reference
from ..runtime.metal import launch
from ..runtime.tune import chain_seconds
from . import ceiling

SHAPES = {  # name: (K in, N out)
    "2B qkv/o 2560->2560": (2560, 2560),
    "2B up 2560->6912": (2560, 6912),
    "2B down 6912->2560": (6912, 2560),
    "27B up 5120->17408": (5120, 17408),
    "27B down 17408->5120": (17408, 5120),
    "wide 4096->32768": (4096, 32768),
}
TOKENS = (1, 2, 4, 8, 16, 17, 64, 256, 512)  # 16 | 17: the GEMV -> GEMM boundary
SWEEP_TOKENS = (1, 64)  # scale modes and dtypes are swept at these token counts
SMOKE_SHAPES = {"smoke 256->96": (256, 96), "smoke 320->512": (320, 512)}
SMOKE_TOKENS = (1, 3, 16, 64)  # GEMVs of 1, 3 and 16 tokens (one launch each) and a GEMM
CHAIN = 50  # dependent calls per timed evaluation (>= 50)
BENCH_TRIALS = 5  # timed chains per variant: more than the tuner's, the bench reports a median
ROTATE_BYTES = 512 * 2**20  # weights cycled per chain: well past any GPU cache
COPY_BYTES = 256 * 2**20  # the bandwidth probe's buffer
STOCK_GROUP = 64
TOL = {mx.float16: 1e-2, mx.bfloat16: 6e-2, mx.float32: 1e-3}


@dataclass
class Row:
    """One variant at one (shape, tokens, activations, scale, dtype) point."""

    shape: str
    k: int
    n: int
    m: int
    act: bool
    scale: str
    dtype: str
    variant: str
    bytes: int  # weights + scales (+ biases) one call reads
    check: str = "ok"  # "ok" or why the result was wrong
    error: float = 0.0  # max |y - twin| / max |twin|
    us_median: Optional[float] = None
    us_min: Optional[float] = None
    gbs: Optional[float] = None
    of_measured: Optional[float] = None
    of_nominal: Optional[float] = None
    tflops: Optional[float] = None
    vs_stock_q2: Optional[float] = None  # stock 2-bit (same words) time / this time
    vs_stock_q4: Optional[float] = None  # stock 4-bit g64 time / this time


@lru_cache(maxsize=1)  # the points of one shape come in a row; packing 89 M trits is slow
def _layer(k: int, n: int, scale: str, dtype, seed: int = 0) -> dict:
    """Random trits in both packings, scales of `scale` kind, stock 2/4-bit arrays."""
    rng = np.random.default_rng(seed)
    t = rng.integers(-1, 2, size=(n, k)).astype(np.int8)
    g = 128 if scale == "group" else None
    s = rng.uniform(0.5, 1.5, size=fmt.scales_shape(scale, n, k, g)).astype(np.float32)
    pt_fast = fmt.PackedTernary.from_trits(t, s, "fast", g)
    pt_compact = fmt.PackedTernary.from_trits(t, s, "compact", g)
    scales = mx.array(s).astype(dtype)
    fast = mx.array(pt_fast.packed)
    groups = fast.shape[1] * fmt.CODES_PER_WORD // STOCK_GROUP
    wide = scales if g is None else mx.repeat(scales, g // STOCK_GROUP, axis=1)[:, :groups]
    qs = mx.contiguous(mx.broadcast_to(wide, (n, groups)))
    from .variants import fast_to_q4

    return {
        "t": t,
        "group": g,
        "scales": scales,
        "fast": fast,
        "compact": mx.array(pt_compact.packed),
        "q2": (fast, qs, -qs),
        "q4": (fast_to_q4(fast), qs, -qs),
    }


def _nbytes(arrays) -> int:
    return sum(a.nbytes for a in arrays)


def kernel_variants(
    layer: dict, k: int, n: int, m: int, act: bool, dtype, backend: str, decodes: bool
) -> Dict[str, tuple]:
    """{name: (make, arrays)}: make(w) -> (x -> y) for one copy w of the layer's arrays,
    with everything but x decided (so a timed chain only launches)."""
    out = {}
    g, bits = layer["group"], 8 if act else None
    shape = (m, k)
    for packing in ("fast", "compact"):
        choices = [None]
        if decodes and packing == "fast" and m <= launch.MAX_GEMV_TOKENS:
            choices = list(launch.FAST_DECODES)
        for decode in choices:

            def make(w, packing=packing, decode=decode):
                spec = launch.check_layer(
                    w[0],
                    w[1],
                    None,
                    packing=packing,
                    in_features=k,
                    group_size=g,
                    activation_bits=bits,
                )
                return launch.prepare(spec, w[0], w[1], None, dtype, shape, backend, decode=decode)[
                    0
                ]

            kind = launch.choose_kernel(m)
            label = f"{packing}/{decode or (kind if kind != 'gemv' else 'default')}"
            out[label] = (make, (layer[packing], layer["scales"]))

    def ref(w):
        return reference.prepare(
            w[0],
            w[1],
            None,
            packing="fast",
            in_features=k,
            group_size=g,
            activation_bits=bits,
            dtype=dtype,
        )

    out["reference (qmm + MLX act quant)" if act else "reference (qmm)"] = (
        ref,
        (layer["fast"], layer["scales"]),
    )
    if not act:
        for bits_ in (2, 4):

            def stock(w, bits_=bits_):
                return lambda x: mx.quantized_matmul(
                    x, *w, transpose=True, group_size=STOCK_GROUP, bits=bits_
                )

            name = "stock 2-bit g64 (same words)" if bits_ == 2 else "stock 4-bit g64"
            out[name] = (stock, layer[f"q{bits_}"])
    return out


def _copies(arrays, count: int) -> List[tuple]:
    """`count` separate copies of a tuple of arrays (the first is the original)."""
    out = [tuple(arrays)]
    for _ in range(count - 1):
        out.append(tuple(a + 0 for a in arrays))  # a new buffer each, same contents
    mx.eval(out)
    return out


def _glue(k: int, n: int) -> Callable[[mx.array], mx.array]:
    """(M, N) -> (M, K), values kept near 1: the link between chained calls."""
    scale = 1.0 / math.sqrt(k)
    reps = fmt.ceil_div(k, n)

    def link(y):
        if n < k:
            y = mx.concatenate([y] * reps, axis=-1)
        return y[..., :k] * scale

    return link


def copy_bandwidth(nbytes: int = COPY_BYTES, length: int = 10, trials: int = BENCH_TRIALS) -> float:
    """GB/s of a streaming read + write (x + 1 over nbytes of float16), chained."""
    x = mx.zeros((nbytes // 2,), dtype=mx.float16)
    mx.eval(x)
    t = min(chain_seconds([lambda y: y + 1], x, length, trials, warm=True))
    return 2 * nbytes / t / 1e9


def _check(fn, x, twin) -> tuple:
    y = fn(x)
    mx.eval(y, twin)
    got = np.array(y.astype(mx.float32)).astype(np.float64)
    want = np.array(twin.astype(mx.float32)).astype(np.float64)
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}", float("inf")
    if not np.isfinite(got).all():
        return "non-finite output", float("inf")
    err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))
    return ("ok" if err <= TOL[x.dtype] else f"error {err:.3g} > {TOL[x.dtype]:g}"), err


def measure_point(
    shape: str,
    k: int,
    n: int,
    m: int,
    act: bool,
    scale: str,
    dtype,
    backend: str,
    bandwidth: Optional[float],
    nominal: Optional[float],
    decodes: bool,
    chain: int,
    trials: int,
    rotate_bytes: int,
) -> List[Row]:
    """All variants at one point: checked, then (if correct) timed against the same glue."""
    layer = _layer(k, n, scale, dtype)
    rng = np.random.default_rng(1)
    x = mx.array(rng.normal(size=(m, k)).astype(np.float32)).astype(dtype)
    twin = reference.ternary_matmul(
        x,
        layer["fast"],
        layer["scales"],
        packing="fast",
        in_features=k,
        group_size=layer["group"],
        activation_bits=8 if act else None,
    )
    link = _glue(k, n)
    glue = []  # the links' own time, measured once at the first timed variant
    rows = []
    # Stock layers quantize no activations: with int8 x they are not run at all.
    for name, (make, arrays) in kernel_variants(
        layer, k, n, m, act, dtype, backend, decodes
    ).items():
        row = Row(shape, k, n, m, act, scale, str(dtype).split(".")[-1], name, _nbytes(arrays))
        try:
            row.check, row.error = _check(make(arrays), x, twin)
        except Exception as e:  # noqa: BLE001 - a kernel that fails is reported, not timed
            row.check = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        rows.append(row)
        if row.check != "ok":
            continue
        copies = max(1, min(16, rotate_bytes // max(row.bytes, 1)))
        steps = [lambda y, fn=make(w): link(fn(y)) for w in _copies(arrays, copies)]
        times = chain_seconds(steps, x, chain, trials, warm=True)
        if not glue:  # the links alone: a broadcast view in place of the layer
            only_links = [lambda y: link(mx.broadcast_to(y[..., :1], (m, n)))]
            glue.append(min(chain_seconds(only_links, x, chain, trials, warm=True)))
        _fill_times(row, [max(t - glue[0], 1e-9) for t in times], bandwidth, nominal)
    return rows


def _fill_times(
    row: Row, per_call: List[float], bandwidth: Optional[float], nominal: Optional[float]
) -> None:
    """A timed row's microseconds, GB/s, fractions of the bandwidths and (prefill) TFLOPS."""
    row.us_median, row.us_min = statistics.median(per_call) * 1e6, min(per_call) * 1e6
    sec = row.us_min / 1e6
    row.gbs = row.bytes / sec / 1e9
    if bandwidth:
        row.of_measured = row.gbs / bandwidth
    if nominal:
        row.of_nominal = row.gbs / nominal
    if row.m > launch.MAX_GEMV_TOKENS:
        row.tflops = 2 * row.m * row.n * row.k / sec / 1e12


def _against_stock(rows: List[Row]) -> None:
    """Fill vs_stock_q2 / vs_stock_q4: stock 2-bit's (4-bit's) time at the same point / each
    row's time. Stock layers quantize no activations, so int8 rows are compared with the
    float-x stock call at the same shape, M, scale and dtype (the user's alternative)."""
    for bits, field in (("stock 2-bit", "vs_stock_q2"), ("stock 4-bit", "vs_stock_q4")):
        stock = {
            (r.shape, r.m, r.scale, r.dtype): r.us_min
            for r in rows
            if r.variant.startswith(bits) and r.us_min
        }
        for r in rows:
            base = stock.get((r.shape, r.m, r.scale, r.dtype))
            if base and r.us_min:
                setattr(r, field, base / r.us_min)


def decode_summary(rows: List[dict]) -> List[dict]:
    """Decode (M <= 16) against stock, per shape, activations and variant: each M's time
    over the same variant's M = 1 time (flat in M when every weight is read once) and
    stock 2-bit's and 4-bit's time over it. Rows of dicts as `run` returns them."""
    out = []
    keys = {
        (r["shape"], r["act"], r["variant"])
        for r in rows
        if r["m"] <= launch.MAX_GEMV_TOKENS and r["scale"] == "row" and r["us_min"]
    }
    for shape, act, variant in sorted(keys):
        pts = {
            r["m"]: r
            for r in rows
            if (r["shape"], r["act"], r["variant"]) == (shape, act, variant)
            and r["scale"] == "row"
            and r["us_min"]
        }
        if 1 not in pts:
            continue
        for m in sorted(pts):
            if m > launch.MAX_GEMV_TOKENS:
                continue
            r = pts[m]
            out.append(
                {
                    "shape": shape,
                    "act": act,
                    "variant": variant,
                    "m": m,
                    "us_min": r["us_min"],
                    "vs_m1": r["us_min"] / pts[1]["us_min"],
                    "vs_stock_q2": r["vs_stock_q2"],
                    "vs_stock_q4": r["vs_stock_q4"],
                }
            )
    return out


def plan_points(backend: str, quick: bool = False):
    """[(shape name, K, N, M, act, scale, dtype, sweep decodes)] this run measures.

    The main grid: every shape x token count x int8 activations on/off, row scales, float16
    (float32 when emulated: MLX's CPU float16 matmuls are very slow). Then, on the first
    shape: tensor and group scales and bfloat16 at SWEEP_TOKENS, with both fast decodes
    at M = 1. `quick`: the first shape, fewer token counts.
    """
    emulate = backend == "emulate"
    shapes = SMOKE_SHAPES if emulate else SHAPES
    tokens = SMOKE_TOKENS if emulate else TOKENS
    sweep = (1,) if emulate else SWEEP_TOKENS
    if quick:
        shapes = dict(list(shapes.items())[:1])
        tokens, sweep = ((1, 16, 20), (1,)) if emulate else ((1, 8, 16, 64), SWEEP_TOKENS)
    main_dtype = mx.float32 if emulate else mx.float16
    points = []
    for name, (k, n) in shapes.items():
        for m in tokens:
            for act in (False, True):
                points.append((name, k, n, m, act, "row", main_dtype, False))
    name, (k, n) = next(iter(shapes.items()))
    for m in sweep:
        for act in (False, True):
            for scale in ("tensor", "group"):
                points.append((name, k, n, m, act, scale, main_dtype, m == 1))
            points.append((name, k, n, m, act, "row", mx.bfloat16, m == 1))
    return points


def context() -> dict:
    """Versions and device, which decide MLX's own kernel choices (qmv_fast/qmv_wide)."""
    info = {}
    try:
        info = {
            k: (v if isinstance(v, (int, float, str)) else str(v))
            for k, v in mx.device_info().items()
        }
    except (RuntimeError, ValueError):
        pass
    return {
        "mlx": mx.__version__,
        "device_info": info,
        "platform": platform.platform(),
        "macos": platform.mac_ver()[0],
        "chip": probe.chip(),
    }


def _check_backend(backend: str) -> None:
    if backend not in ("metal", "emulate"):
        raise TernaryError(f"bench --kernels runs backend 'metal' or 'emulate', not {backend!r}")
    if backend == "metal" and not mx.metal.is_available():
        raise TernaryError(
            "bench --kernels times the Metal kernels and needs a Mac with Metal; "
            "off a Mac, `--backend emulate` runs it as a smoke test (no timing)"
        )


def _nominal(emulate: bool, bandwidth_gbs: Optional[float]) -> tuple:
    """(nominal GB/s, where it came from): --bandwidth, else the chip's table entry."""
    if bandwidth_gbs:
        return bandwidth_gbs, "--bandwidth"
    if emulate:
        return None, ""
    return ceiling.device_bandwidth(context()["device_info"].get("device_name", ""))


def run(
    backend: str = "metal",
    quick: bool = False,
    bandwidth_gbs: Optional[float] = None,
    progress: Callable[[str], None] = lambda s: None,
) -> dict:
    """Measure the plan; returns a JSON-able dict (rows, bandwidths, context, settings).

    Raises:
        TernaryError: backend "metal" without Metal, or an unknown backend.
    """
    _check_backend(backend)
    emulate = backend == "emulate"
    chain, trials = (2, 1) if emulate else (CHAIN, BENCH_TRIALS)
    rotate = 0 if emulate else ROTATE_BYTES
    progress("measuring copy bandwidth")
    measured = copy_bandwidth(
        2**20 if emulate else COPY_BYTES, 2 if emulate else 10, 1 if emulate else BENCH_TRIALS
    )
    nominal, source = _nominal(emulate, bandwidth_gbs)
    rows = []
    points = plan_points(backend, quick)
    for i, (name, k, n, m, act, scale, dtype, decodes) in enumerate(points):
        progress(
            f"[{i + 1}/{len(points)}] {name} M={m} act={'int8' if act else 'off'} "
            f"{scale} {str(dtype).split('.')[-1]}"
        )
        rows += measure_point(
            name,
            k,
            n,
            m,
            act,
            scale,
            dtype,
            backend,
            measured,
            nominal,
            decodes,
            chain,
            trials,
            rotate,
        )
    _against_stock(rows)
    return {
        "backend": backend,
        "timing_claims": not emulate,
        "context": context(),
        "copy_bandwidth_gbs": measured,
        "nominal_bandwidth_gbs": nominal,
        "nominal_source": source,
        "chain": chain,
        "trials": trials,
        "rows": [asdict(r) for r in rows],
        "decode_vs_m": decode_summary([asdict(r) for r in rows]),
    }


def lines(result: dict) -> List[str]:
    """The result as a text table, then the verdicts (the CLI prints these)."""
    c = result["context"]
    out = [
        f"{c['chip']}, MLX {c['mlx']}, macOS {c['macos'] or '-'}; copy bandwidth "
        f"{result['copy_bandwidth_gbs']:.1f} GB/s measured, nominal "
        f"{result['nominal_bandwidth_gbs'] or '?'} ({result['nominal_source'] or 'unknown'})"
    ]
    if not result["timing_claims"]:
        out.append("EMULATED (CPU): results are checked, times are not GPU times")
    out.append(
        f"{'shape':22} {'M':>4} {'x':>5} {'scale':>6} {'dtype':>8} {'variant':34} "
        f"{'check':>6} {'us/call':>9} {'GB/s':>7} {'%meas':>6} {'TFLOPS':>7} {'q2/this':>7}"
    )
    for r in result["rows"]:

        def f(v, fmt_):
            return format(v, fmt_) if v is not None else "-"

        pct = f"{100 * r['of_measured']:.0f}%" if r["of_measured"] else "-"
        out.append(
            f"{r['shape'][:22]:22} {r['m']:4d} {'int8' if r['act'] else 'float':>5} "
            f"{r['scale']:>6} {r['dtype']:>8} {r['variant'][:34]:34} "
            f"{'ok' if r['check'] == 'ok' else 'FAIL':>6} {f(r['us_min'], '.1f'):>9} "
            f"{f(r['gbs'], '.1f'):>7} {pct:>6} {f(r['tflops'], '.2f'):>7} "
            f"{f(r['vs_stock_q2'], '.2f'):>7}"
        )
    out.append(
        "decode against stock (row scales): time at M / the same variant's at M = 1, "
        "stock 2-bit / this, stock 4-bit / this"
    )
    for d in result.get("decode_vs_m", []):

        def g(v):
            return f"{v:.2f}" if v is not None else "-"

        out.append(
            f"  {d['shape'][:22]:22} {'int8' if d['act'] else 'float':>5} {d['variant'][:34]:34} "
            f"M={d['m']:<3d} {d['us_min']:9.1f} us  x{g(d['vs_m1']):>5} of M=1  "
            f"q2/this {g(d['vs_stock_q2']):>5}  q4/this {g(d['vs_stock_q4']):>5}"
        )
    failed = [r for r in result["rows"] if r["check"] != "ok"]
    for r in failed:
        out.append(f"FAILED CHECK: {r['variant']} {r['shape']} M={r['m']}: {r['check']}")
    out.append(
        f"{len(result['rows']) - len(failed)} of {len(result['rows'])} results "
        "checked against the reference twin before timing"
    )
    return out
