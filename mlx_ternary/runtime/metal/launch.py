"""Launches of the Metal kernels in metal/*.metal (real GPU or CPU emulator), prepared once.

`check_layer` (spec.py) validates a layer's arrays once (ValueError naming the rule) and
returns a LayerSpec; `prepare` turns a spec, an activation dtype and a token count into a `run(x)`
that only launches: kernel objects, template arguments, grids, the params array and the
dummy inputs are all decided before the first call. Kernels are built through
`mx.fast.metal_kernel` ("metal") or `mlx_ternary.emulator.metal_kernel` ("emulate"); each
.metal file is split at its "//// BODY ////" line into `header` and kernel `source`.

Kernels (docs/KERNELS.md has the thread mappings, costs and measured bytes):
    gemv_fast      decode, fast packing, up to MAX_GEMV_TOKENS tokens in one launch (int8
                   activations quantized inside); "offset" | "exact"
    gemv_compact   decode, compact packing, the same; "fraction"
    prepass        prefill with int8 activations: per-token scale and quantized x
    gemm           prefill, either packing, any M; weights decoded once per 64 tokens
"""

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx

from ...format import TRITS_PER_BYTE, packing_code
from .geometry import (
    GEMM_ROWS,
    GEMM_THREADS,
    GEMM_TOKENS,
    GEMV_TG_ROWS,
    MAX_GEMV_TOKENS,
    PREPASS_THREADS,
    SIMD_WIDTH,
    compact_layout,
    gemv_layout,
    gemv_token_tile,
)
from .sources import kernel_source, split_source  # noqa: F401 - split_source: the launcher's API
from .spec import FLOAT_DTYPES, MIN_DEVICE_ELEMENTS, LayerSpec, ceil_div, check_layer, check_x  # noqa: F401 - check_layer, check_x: part of the launcher's API

FAST_DECODES = ("offset", "exact")
COMPACT_DECODES = ("fraction",)
KERNEL_CHOICES = ("gemv", "gemm", "gemm_fma")
# "offset" adds ~1e-4 relative error with float activations (measured through the emulator,
# docs/KERNELS.md): below float16/bfloat16 output rounding, so it is the default there;
# float32 gets "exact". With int8 activations both are exact.
DEFAULT_FAST_DECODE = {mx.float16: "offset", mx.bfloat16: "offset", mx.float32: "exact"}

_GEMV_INPUTS = ["x", "wq", "scales", "bias", "params"]
DIRECT_INPUTS = _GEMV_INPUTS[1:]  # the inputs after x of a launch with `run.direct`
KERNELS = {  # name: (input names, output names)
    "prepass": (["x", "params"], ["xq", "aux"]),
    "gemv_fast": (_GEMV_INPUTS, ["y"]),
    "gemv_compact": (_GEMV_INPUTS, ["y"]),
    "gemm": (["x", "aux", "wq", "scales", "bias", "params"], ["y"]),
}
_KERNELS: Dict[Tuple[str, str, object], object] = {}
_DUMMY: Dict[str, mx.array] = {}


def kernel_factory(backend: str):
    """The function that builds kernels for `backend`: mx.fast.metal_kernel or the emulator's."""
    if backend == "metal":
        return mx.fast.metal_kernel
    if backend == "emulate":
        from ...emulator import metal_kernel

        return metal_kernel
    raise ValueError(f"metal_ops runs backend 'metal' or 'emulate', not {backend!r}")


def get_kernel(name: str, backend: str):
    """The built kernel `name` (file metal/<name>.metal) for `backend`, built on first use.

    Cached per factory, so a replaced mx.fast.metal_kernel (a test's fake, a benchmark's
    stub) builds its own kernels.
    """
    factory = kernel_factory(backend)
    key = (backend, name, factory)
    if key not in _KERNELS:
        header, body = kernel_source(name)
        inputs, outputs = KERNELS[name]
        _KERNELS[key] = factory(
            name=f"ternary_{name}",
            input_names=inputs,
            output_names=outputs,
            source=body,
            header=header,
            ensure_row_contiguous=True,
        )
    return _KERNELS[key]


def _dummy(name: str) -> mx.array:
    """A 1-element float32 stand-in for an input a variant does not read (bias, aux)."""
    if name not in _DUMMY:
        _DUMMY[name] = mx.zeros((1,), dtype=mx.float32)
        mx.eval(_DUMMY[name])  # kept across calls and threads: never a lazy graph
    return _DUMMY[name]


def _blocks(spec: LayerSpec) -> Tuple[int, int, int]:
    """(B columns per compact block, BPB bytes per block, NB blocks per row)."""
    b = spec.group_size or spec.k
    return b, ceil_div(b, TRITS_PER_BYTE), ceil_div(spec.k, b)


def _params(values) -> mx.array:
    return mx.array(values, dtype=mx.int32)


@dataclass(frozen=True)
class Launch:
    """One kernel launch with everything but its first input decided."""

    name: str
    kernel: object
    rest: tuple  # the inputs after x (None: supplied per call)
    template: list
    grid: tuple
    threadgroup: tuple
    out_dtypes: list
    sizes: tuple  # element counts of all inputs (x first), for the variant

    def __call__(self, x: mx.array, out_shapes: list) -> list:
        return self.kernel(
            inputs=[x, *self.rest],
            template=self.template,
            grid=self.grid,
            threadgroup=self.threadgroup,
            output_shapes=out_shapes,
            output_dtypes=self.out_dtypes,
        )

    @property
    def variant(self) -> tuple:
        """What decides the compiled pipeline: kernel, templates, constant-bound inputs."""
        small = tuple(s < MIN_DEVICE_ELEMENTS for s in self.sizes)
        return (self.name, tuple((k, str(v)) for k, v in self.template), small)


def _launch(name, backend, rest, template, grid, threadgroup, out_dtypes, sizes) -> Launch:
    return Launch(
        name, get_kernel(name, backend), rest, template, grid, threadgroup, out_dtypes, sizes
    )


def prepass_launch(spec: LayerSpec, dtype, m: int, backend: str) -> Launch:
    params = _params([spec.k])
    return _launch(
        "prepass",
        backend,
        (params,),
        [("T", dtype)],
        (PREPASS_THREADS, m, 1),
        (PREPASS_THREADS, 1, 1),
        [mx.float16, mx.float32],
        (m * spec.k, params.size),
    )


def _gemm_inputs(spec, packed, scales, bias, m, params):
    """(inputs after x, element counts of all inputs) of a GEMM launch."""
    aux = None if spec.act else _dummy("aux")
    bias = bias if bias is not None else _dummy("bias")
    sizes = (m * spec.k, m if spec.act else 1, packed.size, scales.size, bias.size, params.size)
    return (aux, packed, scales, bias, params), sizes


def _gemv(spec, packed, scales, bias, dtype, m, decode, backend) -> Launch:
    """The one launch of an m-token decode call (m <= MAX_GEMV_TOKENS), int8 included."""
    tm = gemv_token_tile(m)
    # Staged values: half where exact, else float32. fast stages x (exact in half for half x
    # and for int8 values); compact stages coefficients 1.5 y_k - 0.5 y_(k-1) (exact in half
    # only for int8 values).
    exact_half = spec.act or (spec.packing == "fast" and dtype == mx.float16)
    xs = mx.float16 if exact_half else mx.float32
    tmpl = [
        ("T", dtype),
        ("XT", dtype),
        ("XS", xs),
        ("ST", spec.scale_dtype),
        ("BT", spec.bias_dtype),
        ("TM", tm),
    ]
    tail = [
        ("SMODE", spec.mode),
        ("G", spec.group_size or 0),
        ("ACTQ", spec.act),
        ("HAS_BIAS", spec.has_bias),
    ]
    if spec.packing == "fast":
        rl, nsg = gemv_layout(tm)
        tmpl += [("RL", rl), ("NSG", nsg), *tail, ("DECODE", FAST_DECODES.index(decode))]
        params = _params([m, spec.n, spec.k, spec.row_width, spec.scale_cols])
        name = "gemv_fast"
    else:
        _, bpb, nb = _blocks(spec)
        wl, nsg = compact_layout(nb * bpb)
        tmpl += [("WL", wl), ("NSG", nsg), *tail]
        params = _params([m, spec.n, spec.k, spec.row_width, spec.scale_cols, nb * bpb])
        name = "gemv_compact"
    bias = bias if bias is not None else _dummy("bias")
    sizes = (m * spec.k, packed.size, scales.size, bias.size, params.size)
    threads = nsg * SIMD_WIDTH
    return _launch(
        name,
        backend,
        (packed, scales, bias, params),
        tmpl,
        (threads, ceil_div(spec.n, GEMV_TG_ROWS), 1),
        (threads, 1, 1),
        [dtype],
        sizes,
    )


def gemm_launch(spec, packed, scales, bias, xt, dtype, m, mma, backend) -> Launch:
    b, bpb, nb = _blocks(spec)
    exact_half = (xt == mx.float16) and (spec.mode != 2 or spec.scale_dtype == mx.float16)
    tmpl = [
        ("T", dtype),
        ("ST", spec.scale_dtype),
        ("BT", spec.bias_dtype),
        ("TT", mx.float16 if exact_half else mx.float32),
        ("PACKING", packing_code(spec.packing)),
        ("SMODE", spec.mode),
        ("G", spec.group_size or 0),
        ("ACTQ", spec.act),
        ("HAS_BIAS", spec.has_bias),
        ("MMA", mma),
    ]
    params = [m, spec.n, spec.k, spec.row_width, spec.scale_cols, b, bpb, nb, 1]
    rest, sizes = _gemm_inputs(spec, packed, scales, bias, m, _params(params))
    return _launch(
        "gemm",
        backend,
        rest,
        tmpl,
        (GEMM_THREADS, ceil_div(spec.n, GEMM_ROWS), ceil_div(m, GEMM_TOKENS)),
        (GEMM_THREADS, 1, 1),
        [dtype],
        sizes,
    )


def choose_kernel(m: int, kernel: Optional[str] = None) -> str:
    """The kernel an m-token call runs: GEMV up to MAX_GEMV_TOKENS, else the MMA GEMM."""
    if kernel is None:
        return "gemv" if m <= MAX_GEMV_TOKENS else "gemm"
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"kernel must be one of {KERNEL_CHOICES} or None, got {kernel!r}")
    if kernel == "gemv" and m > MAX_GEMV_TOKENS:
        raise ValueError(f"the GEMV kernels take at most {MAX_GEMV_TOKENS} tokens, got {m}")
    return kernel


def _decode(spec: LayerSpec, dtype, decode: Optional[str]) -> str:
    if spec.packing == "fast":
        decode = decode or DEFAULT_FAST_DECODE[dtype]
        allowed = FAST_DECODES
    else:
        decode = decode or COMPACT_DECODES[0]
        allowed = COMPACT_DECODES
    if decode not in allowed:
        raise ValueError(f"{spec.packing} decode must be one of {allowed}, got {decode!r}")
    return decode


def prepare(
    spec: LayerSpec,
    packed: mx.array,
    scales: mx.array,
    bias: Optional[mx.array],
    dtype,
    shape: tuple,
    backend: str,
    decode: Optional[str] = None,
    kernel: Optional[str] = None,
) -> Tuple[Callable[[mx.array], mx.array], tuple]:
    """The launches of a call with x of `shape` (..., K) and `dtype`, decided now.

    Returns:
        (run, variant): run(x) launches and returns y (..., N); variant identifies the
        compiled pipelines (for first-use checks).

    Raises:
        ValueError: an unknown dtype, decode or kernel, or more tokens than a forced GEMV
            takes.
    """
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {dtype}")
    m = 1
    for d in shape[:-1]:
        m *= d
    kind = choose_kernel(m, kernel)
    decode = _decode(spec, dtype, decode)
    out_shape = (*shape[:-1], spec.n)
    if kind == "gemv":
        main = _gemv(spec, packed, scales, bias, dtype, m, decode, backend)
        return _run_one(main, out_shape), (main.variant,)
    xt = mx.float16 if spec.act else dtype
    main = gemm_launch(spec, packed, scales, bias, xt, dtype, m, kind == "gemm", backend)
    if not spec.act:
        return _run_one(main, out_shape), (main.variant,)
    pre = prepass_launch(spec, dtype, m, backend)
    return _run_int8(pre, main, out_shape, (m, spec.k), (m, 1)), (pre.variant, main.variant)


def _run_one(main: Launch, out_shape: tuple) -> Callable[[mx.array], mx.array]:
    """run(x) of a one-launch call (a GEMV, or a GEMM without int8 activations)."""
    # Everything the closure touches is a local: no attribute lookups per call.
    kern, tmpl, grid, tg, odt = (
        main.kernel,
        main.template,
        main.grid,
        main.threadgroup,
        main.out_dtypes,
    )
    rest = list(main.rest)
    out_shapes = [out_shape]

    def run(x):
        return kern(
            inputs=[x, *rest],
            template=tmpl,
            grid=grid,
            threadgroup=tg,
            output_shapes=out_shapes,
            output_dtypes=odt,
        )[0]

    if len(rest) == len(DIRECT_INPUTS):  # a GEMV (decode): x and these four
        # The launch's pieces, for a caller that launches without this closure's frame
        # (TernaryLinear's repeated call): y = kern(inputs=[x, *rest], ...)[0], as run does.
        run.direct = (kern, *rest, tmpl, grid, tg, out_shapes, odt)
    return run


def _run_int8(
    pre: Launch, main: Launch, out_shape: tuple, xq_shape: tuple, aux_shape: tuple
) -> Callable[[mx.array], mx.array]:
    """run(x) of an int8-activation prefill call: the pre-pass, then the GEMM."""
    kern, tmpl, grid, tg, odt = (
        main.kernel,
        main.template,
        main.grid,
        main.threadgroup,
        main.out_dtypes,
    )
    pkern, (pparams,), ptmpl, pgrid, ptg, pdt = (
        pre.kernel,
        pre.rest,
        pre.template,
        pre.grid,
        pre.threadgroup,
        pre.out_dtypes,
    )
    pshapes = [xq_shape, aux_shape]
    out_shapes = [out_shape]
    _, w, s, b, params = main.rest

    def run_act(x):
        xq, xaux = pkern(
            inputs=[x, pparams],
            template=ptmpl,
            grid=pgrid,
            threadgroup=ptg,
            output_shapes=pshapes,
            output_dtypes=pdt,
        )
        return kern(
            inputs=[xq, xaux, w, s, b, params],
            template=tmpl,
            grid=grid,
            threadgroup=tg,
            output_shapes=out_shapes,
            output_dtypes=odt,
        )[0]

    return run_act


def ternary_matmul(
    x: mx.array,
    packed: mx.array,
    scales: mx.array,
    bias: Optional[mx.array] = None,
    *,
    packing: str,
    in_features: int,
    group_size: Optional[int] = None,
    activation_bits: Optional[int] = None,
    backend: str = "metal",
    decode: Optional[str] = None,
    kernel: Optional[str] = None,
) -> mx.array:
    """y = act_quant(x) @ (s * t).T + bias through the project's Metal kernels, one call.

    Validates and prepares on every call; TernaryLinear prepares once per layer instead
    (kernels.LayerPlan).

    Args:
        x: (..., K) float16, bfloat16 or float32 activations.
        packed: (N, Kp/16) uint32 (fast) or (N, row_bytes) uint8 (compact), format.py.
        scales: (1, 1), (N, 1) or (N, ceil(K / group_size)), any float dtype.
        bias: optional (N,) float.
        packing: "fast" or "compact".
        in_features: K.
        group_size: scale group (and compact block) size, 64/128/256, or None.
        activation_bits: 8 for BitNet int8 per-token activations (pre-pass), else None.
        backend: "metal" (mx.fast.metal_kernel) or "emulate" (the CPU emulator).
        decode: GEMV decode ("offset"/"exact" for fast, "fraction" for compact).
        kernel: force "gemv", "gemm" (simdgroup-matrix tiles) or "gemm_fma" (FMA tiles);
            default: GEMV up to MAX_GEMV_TOKENS tokens, else "gemm".

    Returns:
        (..., N) in x's dtype.

    Raises:
        ValueError: shapes or dtypes that break a rule (the message names it).
    """
    spec = check_layer(
        packed,
        scales,
        bias,
        packing=packing,
        in_features=in_features,
        group_size=group_size,
        activation_bits=activation_bits,
    )
    check_x(x, spec)
    if x.size == 0:
        return mx.zeros((*x.shape[:-1], spec.n), dtype=x.dtype)
    run, _ = prepare(spec, packed, scales, bias, x.dtype, tuple(x.shape), backend, decode, kernel)
    return run(x)
