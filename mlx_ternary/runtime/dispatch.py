"""Dispatch for the ternary matmul: per-layer launch plans over the backends.

Backend choice, first match wins: the `backend` keyword; MLX_TERNARY_EMULATE_METAL=1;
MLX_TERNARY_BACKEND=metal|emulate|native|reference; the native CPU kernel where the default
device is the CPU and it builds; Metal where `mx.metal.is_available()`; the reference twin
elsewhere (CUDA, or a CPU without a compiler).

"metal" launches the project's kernels (metal/*.metal) through mx.fast.metal_kernel,
"emulate" launches the same sources through the CPU emulator (mlx_ternary.emulator),
"native" runs the C++ CPU primitive (mlx_ternary.runtime.cpu), and "reference" runs the pure-MLX
twins (reference.py). Importing this module never needs Metal or a compiler.

A LayerPlan holds what one layer's calls need, decided once: the backend, the validated
layer, and per (activation dtype, token count) the prepared launches (launch.prepare),
the first-use check (probe.py), the tuned choice against stock MLX (tune.py) and, in
training mode, the straight-through gradient. A call is a dictionary lookup and a launch.
"""

import os
from functools import partial
from typing import Callable, Optional

import mlx.core as mx

from ..errors import TernaryError
from ..format import CODES_PER_WORD, Q8K, check_packing
from . import cpu, reference
from .metal.spec import FLOAT_DTYPES, check_layer

BACKENDS = ("metal", "emulate", "native", "reference")
ENV_BACKEND = "MLX_TERNARY_BACKEND"
ENV_EMULATE = "MLX_TERNARY_EMULATE_METAL"
# The packing `convert` writes by default. The cost model in docs/KERNELS.md predicts the
# 2-bit layout's exponent-OR decode (~2.4 ALU slots per weight) near bandwidth on every
# Apple GPU, while base-3 is ALU-bound; `mlx-ternary bench --kernels` settles it on a Mac.
DEFAULT_PACKING = "fast"
MAX_PLANNED_CALLS = 64  # (shape, dtype) entries a plan keeps; prefill lengths vary


def resolve_backend(backend: Optional[str] = None) -> str:
    """The backend a call will use, after keyword, environment and hardware."""
    if backend is None:
        if os.environ.get(ENV_EMULATE, "") not in ("", "0"):
            backend = "emulate"
        else:
            backend = os.environ.get(ENV_BACKEND) or None
    if backend is None:
        if mx.default_device() == mx.cpu and cpu.available():
            return "native"
        return "metal" if mx.metal.is_available() else "reference"
    if backend not in BACKENDS:
        raise TernaryError(
            f"unknown ternary backend {backend!r} (from the keyword or ${ENV_BACKEND}); "
            f"expected one of {', '.join(BACKENDS)}"
        )
    if backend == "metal" and not mx.metal.is_available():
        raise TernaryError(
            "the Metal backend was requested but Metal is not available on this machine; "
            f"unset ${ENV_BACKEND} or use backend='reference' (or 'emulate' to run the "
            "Metal sources on the CPU)"
        )
    if backend == "native" and not cpu.available():
        raise TernaryError(
            f"the native CPU backend was requested but is unavailable: "
            f"{cpu.unavailable_reason()}; unset ${ENV_BACKEND} or use "
            "backend='reference'"
        )
    return backend


def host_matmul(backend: str) -> Callable:
    """The matmul of a backend that runs no Metal kernel: the one place it is chosen.

    Returns a function with the signature of reference.ternary_matmul (x, packed, scales,
    bias, *, packing, in_features, group_size, activation_bits).
    """
    if backend == "native":  # a C++ primitive with its own straight-through VJP
        return cpu.ternary_matmul
    if backend == "reference":
        return reference.ternary_matmul
    raise TernaryError(f"backend {backend!r} has no host matmul; expected 'native' or 'reference'")


def with_input_gradient(run: Callable, grad_x: Callable) -> Callable:
    """`run` (x -> y) with the VJP y -> grad_x(cotangent): Metal kernel outputs have none."""
    fn = mx.custom_function(run)

    @fn.vjp
    def _vjp(primals, cotangent, outputs):
        return grad_x(cotangent)

    return fn


class LayerPlan:
    """Everything the calls of one ternary layer need, decided when its arrays are set.

    A plan belongs to one (packed, scales, bias) triple; TernaryLinear makes a new one when
    any of them is replaced (mlx-lm's load_weights/update) or a setting changes.
    """

    def __init__(
        self,
        packed: mx.array,
        scales: mx.array,
        bias: Optional[mx.array],
        *,
        packing: str,
        in_features: int,
        group_size: Optional[int],
        activation_bits: Optional[int],
        backend: Optional[str] = None,
    ):
        self.packed, self.scales, self.bias = packed, scales, bias
        self.packing = check_packing(packing)
        self.k, self.n = in_features, packed.shape[0]
        self.group_size, self.activation_bits = group_size, activation_bits
        self.backend = resolve_backend(backend)
        self.calls = {}  # (x shape, dtype) -> x -> y, inference
        self.train_calls = {}  # the same, differentiable w.r.t. x
        self._affine = {}  # dtype -> reference.qmm_affine(...)
        self.spec = None
        # q8k has no Metal kernel: those layers run the reference twin there (portable_call)
        if self.backend in ("metal", "emulate") and activation_bits != Q8K:
            self.spec = check_layer(
                packed,
                scales,
                bias,
                packing=packing,
                in_features=in_features,
                group_size=group_size,
                activation_bits=activation_bits,
            )

    def __deepcopy__(self, memo):
        # A copied layer gets copied arrays, so it plans again (kernels, dtypes and
        # prepared launches are not copyable anyway).
        return None

    def affine(self, dtype):
        """MLX affine (scales, biases, group) for the fast packing's reference path."""
        affine = self._affine.get(dtype)
        if affine is None:
            kp = self.packed.shape[1] * CODES_PER_WORD
            affine = reference.qmm_affine(self.scales, self.n, kp, self.group_size, dtype)
            if reference.materialize(*affine[:2]):  # never keep arrays of a trace
                self._affine[dtype] = affine
        return affine

    def __call__(self, x: mx.array, training: bool = False) -> mx.array:
        fn = (self.train_calls if training else self.calls).get((x.shape, x.dtype))
        if fn is None:
            fn = self.plan_call(x, training)
        return fn(x)

    # ---- planning (once per x shape and dtype) ----------------------------------------

    def portable_call(self, dtype) -> Callable:
        """x -> y on the host backend (the reference twin on Metal, and for q8k layers the
        native kernel cannot run): exact on every device."""
        backend = self.backend if self.backend not in ("metal", "emulate") else "reference"
        if backend == "native" and self.activation_bits == Q8K and not self.native_q8k():
            backend = "reference"
        args = dict(
            packing=self.packing,
            in_features=self.k,
            group_size=self.group_size,
            activation_bits=self.activation_bits,
        )
        if backend == "reference" and dtype in FLOAT_DTYPES:
            affine = self.affine(dtype) if self.packing == "fast" else None
            return reference.prepare(
                self.packed, self.scales, self.bias, **args, dtype=dtype, affine=affine
            )
        fn, packed, scales, bias = host_matmul(backend), self.packed, self.scales, self.bias
        return lambda x: fn(x, packed, scales, bias, **args)

    def native_q8k(self) -> bool:
        return cpu.q8k_supported(
            self.scales, packing=self.packing, in_features=self.k, group_size=self.group_size
        )

    def grad_x(self, g: mx.array) -> mx.array:
        """g @ W: the input gradient (the straight-through estimator's, with int8 x too)."""
        affine = self.affine(g.dtype) if self.packing == "fast" else None
        return reference.input_grad(
            g,
            self.packed,
            self.scales,
            packing=self.packing,
            in_features=self.k,
            group_size=self.group_size,
            affine=affine,
        )

    def tune_key(self, dtype, m: int) -> str:
        from .metal.launch import MAX_GEMV_TOKENS

        spec = self.spec
        return (
            f"{spec.packing}/{spec.n}x{spec.k}/scale{spec.mode}/g{spec.group_size or 0}/"
            f"act{int(spec.act)}/bias{int(spec.has_bias)}/{str(dtype).split('.')[-1]}/"
            f"m{m if m <= MAX_GEMV_TOKENS else 'gemm'}"
        )

    def _kernel_call(self, dtype, shape: tuple) -> Optional[Callable]:
        """The prepared kernel launches, or None where the reference path must run."""
        from . import probe, tune  # Metal and emulated plans only: CPU runs import neither
        from .metal import launch

        spec = self.spec
        if spec is None or not spec.fits_kernels or dtype not in FLOAT_DTYPES:
            return None
        try:
            run, variant = launch.prepare(
                spec, self.packed, self.scales, self.bias, dtype, shape, self.backend
            )
        except Exception as e:  # noqa: BLE001 - an unchecked kernel that cannot be built
            if self.backend != "metal":
                raise
            probe.construction_failed(spec, e)
            return None
        if self.backend != "metal":
            return run
        m = _tokens(shape)
        if not probe.check(spec, dtype, m, self.backend, variant):
            return None
        if spec.packing == "fast" and tune.enabled():
            x = mx.random.normal(shape, key=mx.random.key(m)).astype(dtype)
            choice = tune.choose(
                self.tune_key(dtype, m), {"kernel": run, "stock": self.portable_call(dtype)}, x
            )
            if choice == "stock":
                return None
        return run

    def plan_call(self, x: mx.array, training: bool) -> Callable:
        """Decide the calls of x's shape and dtype (first call of each), and remember them."""
        shape, dtype = tuple(x.shape), x.dtype
        if not shape or shape[-1] != self.k:
            raise ValueError(f"x must end in in_features = {self.k} columns, got shape {shape}")
        if x.size == 0:
            fn = partial(_empty, n=self.n)
        elif not reference.materialize(self.packed, self.scales, self.bias):
            # The layer's own arrays are being traced (mlx-lm compiles its training step with
            # the parameters as inputs): what is derived from them now belongs to this trace.
            # Run the host path, which autodiff and compile see through, and keep nothing.
            return self.portable_call(dtype)
        else:
            run = self._kernel_call(dtype, shape)
            if run is None:
                fn = self.portable_call(dtype)
            elif training or self.backend == "emulate":
                # Emulated outputs are computed eagerly and carry no graph back to x.
                fn = with_input_gradient(run, self.grad_x)
            else:
                fn = run
        calls = self.train_calls if training else self.calls
        if len(calls) >= MAX_PLANNED_CALLS:
            calls.clear()
        calls[(shape, dtype)] = fn
        return fn


def _tokens(shape: tuple) -> int:
    m = 1
    for d in shape[:-1]:
        m *= d
    return m


def _empty(x: mx.array, n: int) -> mx.array:
    return mx.zeros((*x.shape[:-1], n), dtype=x.dtype)


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
    backend: Optional[str] = None,
) -> mx.array:
    """y = act_quant(x) @ (s * t).T + bias for a packed ternary weight, one call.

    Plans and runs once; TernaryLinear keeps its plan between calls instead.

    Args:
        x: activations (..., in_features).
        packed: the packed trits in `packing` (see format.py).
        scales: (1, 1), (N, 1) or (N, ceil(K / group_size)).
        bias: optional (N,).
        packing: "compact" or "fast".
        in_features: K.
        group_size: the scale group along K, for group scales.
        activation_bits: 8 for BitNet int8 per-token activations, format.Q8K for
            llama.cpp's int8 blocks (runtime/q8k.py), else None.
        backend: force "metal", "emulate", "native" or "reference".

    Returns:
        (..., out_features) in x's dtype.

    Raises:
        TernaryError: an unknown or unavailable backend.
        ValueError: (Metal kernels) shapes or dtypes that break a kernel's rule.
    """
    plan = LayerPlan(
        packed,
        scales,
        bias,
        packing=packing,
        in_features=in_features,
        group_size=group_size,
        activation_bits=activation_bits,
        backend=backend,
    )
    return plan(x)
