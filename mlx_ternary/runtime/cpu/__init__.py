"""The native CPU backend: the ternary linear layer as an MLX C++ primitive.

`ternary_matmul` has the signature of `reference.ternary_matmul` and computes the same thing
(exactly, with int8 activations and tensor/row scales) with SIMD kernels (AVX2, AVX-VNNI /
AVX-512 VNNI, NEON dot product) on all the cores; `dense_matmul` multiplies by a float16 /
bfloat16 / float32 table kept in its stored dtype (embeddings as output layer, lm_head).
Both are differentiable with respect to x (straight-through for the activation quantization).

The extension is compiled on first use and cached (build.py). Where that cannot happen -
no compiler, an MLX without headers, a nanobind ABI mismatch - `available()` is False, the
package runs the pure-MLX path, and one NativeBackendWarning says why.
"""

import threading
import warnings
from contextlib import contextmanager
from typing import Callable, Optional

import mlx.core as mx

from ...format import GGML_TABLES, Q8K, packing_code
from . import build


class NativeBackendWarning(UserWarning):
    """The native CPU kernel could not be built or loaded; the pure-MLX path runs instead."""


_lock = threading.Lock()
_state = {"tried": False, "module": None, "reason": None}


_scope = threading.local()


@contextmanager
def enabled():
    """Within the block (this thread), the mlx-lm functions routed to native kernels for a
    model (attention.py, activation.py) use them: a routed model runs its calls in here."""
    _scope.depth = getattr(_scope, "depth", 0) + 1
    try:
        yield
    finally:
        _scope.depth -= 1


def active() -> bool:
    """Whether this thread is inside an `enabled()` block (a routed model's call)."""
    return getattr(_scope, "depth", 0) > 0


def _module(progress: Optional[Callable[[str], None]] = None):
    if not _state["tried"]:
        with _lock:
            if not _state["tried"]:
                try:
                    _state["module"] = build.load(progress or (lambda s: None))
                except (build.NativeBuildError, OSError, ImportError) as e:
                    _state["reason"] = str(e)
                    warnings.warn(
                        f"mlx-ternary: the native CPU kernel is unavailable: {e}. "
                        "Running the pure-MLX path instead.",
                        NativeBackendWarning,
                        stacklevel=3,
                    )
                _state["tried"] = True
    return _state["module"]


def available(progress: Optional[Callable[[str], None]] = None) -> bool:
    """Whether the native kernel can run here (builds it on the first call).

    Args:
        progress: called with a short message before each compile step (only on a build).
    """
    return _module(progress) is not None


def unavailable_reason() -> Optional[str]:
    """Why `available()` is False (None when it is True or was not asked yet)."""
    return _state["reason"]


def info() -> dict:
    """ISA of the kernels, threads, and the library's MLX version (empty if unavailable)."""
    m = _module()
    if m is None:
        return {}
    return {"isa": m.isa(), "threads": m.num_threads(), "mlx": m.built_for_mlx()}


def set_num_threads(n: int) -> None:
    """Threads the kernels use; n < 1 restores the default (all cores this process may use,
    or $MLX_TERNARY_NUM_THREADS)."""
    require().set_num_threads(int(n))


def require():
    m = _module()
    if m is None:
        from ...errors import TernaryError

        raise TernaryError(f"the native CPU backend is unavailable here: {_state['reason']}")
    return m


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
) -> mx.array:
    """y = act_quant(x) @ (s * t).T + bias, on the CPU; see reference.ternary_matmul.

    activation_bits: 8 (BitNet per token), None (float) or format.Q8K (llama.cpp's blocks,
    where `q8k_supported`).

    Raises:
        TernaryError: the native backend is unavailable.
        ValueError: shapes or dtypes that do not describe one packed layer.
    """
    m = require()
    return m.ternary_matmul(
        x,
        packed,
        scales,
        bias,
        packing_code(packing),
        in_features,
        _group(scales, group_size),
        m.ACT_Q8K if activation_bits == Q8K else activation_bits or 0,
    )


def _group(scales: mx.array, group_size: Optional[int]) -> int:
    return group_size or 0 if scales.shape[1] > 1 else 0


def q8k_supported(scales: mx.array, *, packing: str, in_features: int, group_size=None) -> bool:
    """Whether the kernel runs q8k activations for this layer: every packed step must lie
    inside one 256-column block (not so for compact rows over 320 columns with one scale, or
    fast packing with groups of 64); elsewhere the reference twin (runtime/q8k.py) runs."""
    m = _module()
    return m is not None and m.q8k_supported(
        packing_code(packing), in_features, _group(scales, group_size)
    )


def dense_matmul(x: mx.array, w: mx.array) -> mx.array:
    """x @ w.T in float32 for w (N, K) float16, bfloat16 or float32 as stored."""
    return require().dense_matmul(x, w)


def ggml_dequantize(blocks: mx.array, type_name: str, in_features: int) -> mx.array:
    """(..., row_bytes) uint8 llama.cpp blocks (format.GGML_TABLES) -> (..., K) float32,
    exactly as ggml dequantizes them (runtime/ggml.py `dequantize` is the twin)."""
    return require().ggml_dequantize(blocks, GGML_TABLES[type_name].code, in_features)


def ggml_matmul(
    x: mx.array, blocks: mx.array, type_name: str, in_features: int, *, llama: bool
) -> mx.array:
    """x @ W.T in float32 for W (N, row_bytes) llama.cpp blocks kept as stored; `llama`:
    ggml's numerics (activations quantized per token, its integer dot products), else float
    (runtime/ggml.py `matmul` is the twin of both)."""
    return require().ggml_matmul(x, blocks, GGML_TABLES[type_name].code, in_features, llama)


def ternary_weight(
    packed: mx.array,
    scales: mx.array,
    *,
    packing: str,
    in_features: int,
    group_size: Optional[int] = None,
) -> mx.array:
    """The (N, K) float32 weight s * t (what the backward pass multiplies by)."""
    return require().ternary_weight(
        packed, scales, packing_code(packing), in_features, group_size or 0
    )


def swiglu(g: mx.array, x: mx.array) -> mx.array:
    """silu(g) * x for float32 arrays of one shape (a vectorized exp, within 2 ulp of float64;
    no gradient: activation.py gives it mlx-lm's)."""
    return require().swiglu(g, x)
