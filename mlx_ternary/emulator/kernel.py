"""metal_kernel: a drop-in for mx.fast.metal_kernel that runs on the CPU.

The body is wrapped exactly as MLX wraps it (signature.py), translated to C++
(translate.py), compiled with g++ (build.py) and run by the fiber runtime in
csrc/runtime.cpp. Calls are eager: the outputs are computed when the kernel
is called, not when they are evaluated.
"""

import ctypes
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from . import build, signature
from .errors import EmulatorError, KernelCrashError, KernelOutOfBoundsError
from .translate import translate

_MAX_THREADS_PER_THREADGROUP = 1024

# The numpy view of each dtype's bytes (bfloat16 as its bits).
_NUMPY_TYPES = {
    mx.bool_: np.bool_,
    mx.uint8: np.uint8,
    mx.uint16: np.uint16,
    mx.uint32: np.uint32,
    mx.uint64: np.uint64,
    mx.int8: np.int8,
    mx.int16: np.int16,
    mx.int32: np.int32,
    mx.int64: np.int64,
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,
    mx.float32: np.float32,
}

# emu_attrs fields for attributes whose value is not a field of that name.
_ATTRIBUTE_EXPRESSIONS = {
    "grid_size": "metal::uint3(a->threads_per_grid[0], a->threads_per_grid[1], a->threads_per_grid[2])",
    "grid_origin": "metal::uint3(0u, 0u, 0u)",
    "thread_execution_width": "32u",
    "threads_per_simdgroup": "32u",
}

_SCHEDULES = {"forward": 0, "reverse": 1}
_STRICT_SIMD = 2
_COUNTER_NAMES = (
    "threadgroups",
    "threads",
    "simd_ops",
    "divergent_simd_ops",
    "barriers",
    "switches",
)
_BUF_DEVICE, _BUF_CONSTANT = 0, 1
_BUF_ALIGN = 64  # bytes: where the emulator puts a buffer that is not aligned already


class _Buf(ctypes.Structure):
    """emu_buf in csrc/emu_abi.h."""

    _fields_ = [
        ("base", ctypes.c_void_p),
        ("lo", ctypes.c_void_p),
        ("hi", ctypes.c_void_p),
        ("read", ctypes.c_uint64),
        ("written", ctypes.c_uint64),
        ("name", ctypes.c_char_p),
        ("kind", ctypes.c_int32),
        ("elem_size", ctypes.c_int32),
    ]


@dataclass
class LaunchInfo:
    """What the last launch did, beside the byte counters in last_stats.

    simd_ops counts SIMD-group collectives (one per simdgroup and call);
    divergent_simd_ops those that ran while other live lanes of the
    simdgroup waited elsewhere (another branch or a barrier): the emulator
    then runs the lanes that are behind in the program first. switches
    counts fiber context switches. cpp_path is the translated kernel.
    """

    kernel_name: str
    grid: tuple
    threadgroup: tuple
    seconds: float
    cpp_path: str
    threadgroups: int = 0
    threads: int = 0
    simd_ops: int = 0
    divergent_simd_ops: int = 0
    barriers: int = 0
    switches: int = 0


def _to_array(x) -> mx.array:
    if isinstance(x, mx.array):
        return x
    if isinstance(x, (bool, int, float, np.ndarray, np.generic)):
        return mx.array(x)
    raise ValueError(f"[metal_kernel] Inputs must be arrays or scalars, got {type(x).__name__}.")


def _num_workers() -> int:
    env = os.environ.get("MLX_TERNARY_EMULATOR_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(os.cpu_count() or 1, 8))


@lru_cache(maxsize=1)
def _utils_cpp() -> str:
    return translate((build.CSRC / "mlx_utils.metal").read_text())


def _raw_view(arr: mx.array) -> np.ndarray:
    """A numpy view of the array's memory, strides included, without a copy."""
    if arr.dtype == mx.bfloat16:
        arr = arr.view(mx.uint16)
    elif arr.dtype not in _NUMPY_TYPES:
        raise ValueError(f"[metal_kernel] The emulator does not support input dtype {arr.dtype}.")
    mx.eval(arr)
    return np.asarray(memoryview(arr))


def _aligned_raw(nbytes: int) -> tuple:
    """(owner, start) of nbytes of host memory aligned like a Metal buffer."""
    raw = np.empty(nbytes + _BUF_ALIGN, np.uint8)
    start = (-raw.__array_interface__["data"][0]) % _BUF_ALIGN
    return raw, start


def _aligned_copy(view: np.ndarray) -> np.ndarray:
    """A copy of a contiguous array at an aligned address: Metal buffers start aligned, and
    a kernel's 16-byte vector loads (float4) compile to aligned host moves."""
    raw, start = _aligned_raw(view.nbytes)
    out = raw[start : start + view.nbytes].view(view.dtype).reshape(view.shape)
    out[...] = view
    return out


def _fill_value(value: float, dtype):
    if dtype == mx.bfloat16:
        return np.array(mx.array(value, mx.bfloat16).view(mx.uint16))
    return np.array(value).astype(_NUMPY_TYPES[dtype])


class _Binding:
    """The buffers and scalars of one launch, in kernel argument order, and
    the C++ expression that passes each to the kernel function."""

    def __init__(self):
        self.keep = []  # numpy arrays that must outlive the launch
        self.bufs, self.names, self.scalars, self.args = [], [], [], []

    def buffer(self, view: np.ndarray, name: str, kind: int, ctype: str) -> None:
        if view.size:
            base = view.__array_interface__["data"][0]
            ends = [st * (n - 1) for st, n in zip(view.strides, view.shape)]
            lo = base + sum(min(0, e) for e in ends)
            hi = base + sum(max(0, e) for e in ends) + view.itemsize
        else:
            placeholder = np.empty(16, np.uint8)
            self.keep.append(placeholder)
            base = lo = hi = placeholder.__array_interface__["data"][0]
        self.keep.append(view)
        ptr = "constant_ptr" if kind == _BUF_CONSTANT else "device_ptr"
        self.args.append(f"emu::{ptr}<{ctype}>(&b[{len(self.bufs)}])")
        self.names.append(name)
        self.bufs.append(_Buf(base, lo, hi, 0, 0, name.encode(), kind, view.itemsize))

    def scalar(self, value: np.ndarray, ctype: str) -> None:
        self.keep.append(value)
        self.args.append(f"*static_cast<const {ctype}*>(s[{len(self.scalars)}])")
        self.scalars.append(value.__array_interface__["data"][0])


class MetalKernel:
    """A kernel that is called like the result of mx.fast.metal_kernel.

    After each call, ``last_stats`` maps every buffer the kernel could reach
    (inputs, outputs, and the ``<input>_shape``/``_strides`` arrays it uses)
    to ``{"read": bytes, "written": bytes}``, counted at each access, and
    ``last_launch`` holds a LaunchInfo.

    ``schedule`` ("forward" or "reverse") sets the order in which threads of a
    threadgroup run between barriers; a result that changes with it has a
    race. With ``strict_simd`` a SIMD-group function reached by only some of
    the live lanes of a simdgroup (divergent control flow) raises instead of
    running those lanes on their own.
    """

    def __init__(
        self,
        name,
        input_names,
        output_names,
        source,
        header="",
        ensure_row_contiguous=True,
        atomic_outputs=False,
        compile_options=None,
    ):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self.compile_options = compile_options
        self.schedule = os.environ.get("MLX_TERNARY_EMULATOR_SCHEDULE", "forward")
        self.strict_simd = os.environ.get("MLX_TERNARY_EMULATOR_STRICT_SIMD", "0") == "1"
        self.last_stats: dict[str, dict[str, int]] = {}
        self.last_launch: LaunchInfo | None = None
        self._built: dict[str, tuple] = {}  # kernel name -> (library, C++ path)

    def _signature(self, kernel_name, inputs, output_dtypes, template) -> str:
        return signature.write_signature(
            kernel_name,
            self.header,
            self.source,
            self.input_names,
            inputs,
            self.output_names,
            output_dtypes,
            template,
            self.atomic_outputs,
        )

    def metal_source(self, inputs, output_dtypes, template=None) -> str:
        """The Metal source MLX generates for these inputs, as verbose=True prints it."""
        inputs = [_to_array(x) for x in inputs]
        name = signature.kernel_name(self.name, inputs, output_dtypes, template)
        src = self._signature(name, inputs, output_dtypes, template)
        return src + (signature.instantiation(name, template) if template else "")

    def _cpp(self, kernel_name, inputs, output_dtypes, template, binding: _Binding) -> str:
        """The translated kernel and an extern "C" entry that calls it."""
        args = list(binding.args)
        for attr, t in signature.attributes_used(self.source):
            if attr in _ATTRIBUTE_EXPRESSIONS:
                args.append(_ATTRIBUTE_EXPRESSIONS[attr])
            elif t == "uint3":
                args.append(f"metal::uint3(a->{attr}[0], a->{attr}[1], a->{attr}[2])")
            else:
                args.append(f"a->{attr}")
        call = kernel_name + (signature.write_template(template) if template else "")
        metal = self._signature(kernel_name, inputs, output_dtypes, template)
        return (
            '#include "metal_compat.h"\n'
            '#line 1 "mlx_utils.metal"\n'
            f"{_utils_cpp()}\n"
            f'#line 1 "{kernel_name}.metal"\n'
            f"{translate(metal)}\n"
            '#line 1 "emulator_entry.cpp"\n'
            'extern "C" void emu_kernel_entry(emu_buf* b, const void* const* s, const emu_attrs* a) {\n'
            "  (void)b; (void)s; (void)a;\n"
            f"  {call}(\n      " + ",\n      ".join(args) + ");\n}\n"
        )

    def _check_call(self, inputs, output_shapes, output_dtypes, grid, threadgroup, template):
        for actual, expected, what in (
            (len(inputs), len(self.input_names), "inputs"),
            (len(output_shapes), len(self.output_names), "output_shapes"),
            (len(output_dtypes), len(self.output_names), "output_dtypes"),
        ):
            if actual != expected:
                raise ValueError(
                    f"[metal_kernel] Expected `{what}` to have size {expected} but got size {actual}."
                )
        if len(grid) != 3 or len(threadgroup) != 3:
            raise ValueError("[metal_kernel] grid and threadgroup must be 3-tuples.")
        if any(g < 0 for g in grid) or any(t <= 0 for t in threadgroup):
            raise ValueError(
                f"[metal_kernel] grid {grid} must be >= 0 and threadgroup {threadgroup} > 0."
            )
        tg_size = threadgroup[0] * threadgroup[1] * threadgroup[2]
        if tg_size > _MAX_THREADS_PER_THREADGROUP:
            raise ValueError(
                f"Thread group size ({tg_size}) is greater than  the maximum allowed threads "
                f"per threadgroup ({_MAX_THREADS_PER_THREADGROUP})."
            )
        for _, arg in template:
            if not isinstance(arg, (bool, int, mx.Dtype)):
                raise ValueError(
                    "[metal_kernel] Invalid template argument. Must be `mlx.core.Dtype`, `int` or `bool`."
                )
        for dtype in output_dtypes:
            if dtype not in _NUMPY_TYPES:
                raise ValueError(
                    f"[metal_kernel] The emulator does not support output dtype {dtype}."
                )
        if self.schedule not in _SCHEDULES:
            raise ValueError(
                f"schedule must be one of {sorted(_SCHEDULES)}, got {self.schedule!r}."
            )

    def _bind_inputs(self, binding: _Binding, inputs) -> None:
        infos = signature.shape_infos(self.input_names, self.source)
        for name, arr, (has_shape, has_strides, has_ndim) in zip(self.input_names, inputs, infos):
            ctype = signature.type_string(arr.dtype)
            view = _raw_view(arr)
            if arr.ndim == 0:
                binding.scalar(np.ascontiguousarray(view), ctype)
                continue
            if self.ensure_row_contiguous and not view.flags.c_contiguous:
                view = np.ascontiguousarray(view)
            if view.flags.c_contiguous and view.__array_interface__["data"][0] % _BUF_ALIGN:
                view = _aligned_copy(view)
            kind = _BUF_CONSTANT if arr.size < signature.MAX_CONSTANT_ARRAY_SIZE else _BUF_DEVICE
            binding.buffer(view, name, kind, "const " + ctype)
            if has_shape:
                binding.buffer(
                    np.array(arr.shape, np.int32), name + "_shape", _BUF_CONSTANT, "const int"
                )
            if has_strides:
                strides = [s // view.itemsize for s in view.strides]
                binding.buffer(
                    np.array(strides, np.int64), name + "_strides", _BUF_CONSTANT, "const int64_t"
                )
            if has_ndim:
                binding.scalar(np.array(arr.ndim, np.int32), "int")

    def _bind_outputs(
        self, binding: _Binding, output_shapes, output_dtypes, init_value
    ) -> list[np.ndarray]:
        views = []
        for name, shape, dtype in zip(self.output_names, output_shapes, output_dtypes):
            np_type = _NUMPY_TYPES[dtype]
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_type).itemsize
            raw, start = _aligned_raw(nbytes)
            view = raw[start : start + nbytes].view(np_type)
            if init_value is not None:
                view[...] = _fill_value(init_value, dtype)
            elif os.environ.get("MLX_TERNARY_EMULATOR_POISON", "1") != "0":
                # Metal leaves outputs uninitialized; 0xFF bytes (NaN, -1)
                # make a missed write visible.
                view.view(np.uint8)[...] = 0xFF
            else:
                view[...] = 0
            binding.keep.append(raw)
            ctype = signature.type_string(dtype)
            if self.atomic_outputs:
                ctype = f"metal::atomic<{ctype}>"
            binding.buffer(view, name, _BUF_DEVICE, ctype)
            views.append(view)
        return views

    def __call__(
        self,
        *,
        inputs,
        output_shapes,
        output_dtypes,
        grid,
        threadgroup,
        template=None,
        init_value=None,
        verbose=False,
        stream=None,
    ) -> list[mx.array]:
        """Run the kernel; the keywords are those of mx.fast.metal_kernel kernels.

        Raises:
            ValueError: the call is invalid (as MLX would say).
            MetalCompileError: g++ rejected the translated source.
            KernelOutOfBoundsError: a thread accessed outside a buffer.
            KernelCrashError: a thread crashed (stack overflow, division by zero).
            EmulatorError: another failure inside the kernel.
        """
        grid = tuple(int(g) for g in grid)
        threadgroup = tuple(int(t) for t in threadgroup)
        template = list(template or [])
        output_dtypes = list(output_dtypes)
        output_shapes = [tuple(int(d) for d in s) for s in output_shapes]
        self._check_call(inputs, output_shapes, output_dtypes, grid, threadgroup, template)
        inputs = [_to_array(x) for x in inputs]
        kernel_name = signature.kernel_name(self.name, inputs, output_dtypes, template)
        if verbose:
            print(
                f"Generated source code for `{self.name}`:\n```\n"
                f"{self.metal_source(inputs, output_dtypes, template)}\n```"
            )

        binding = _Binding()
        self._bind_inputs(binding, inputs)
        out_views = self._bind_outputs(binding, output_shapes, output_dtypes, init_value)
        # The name encodes everything the C++ depends on: template arguments,
        # dtypes, and how each input is passed.
        if kernel_name not in self._built:
            cpp = self._cpp(kernel_name, inputs, output_dtypes, template, binding)
            self._built[kernel_name] = build.load_kernel(cpp, self.name)
        lib, cpp_path = self._built[kernel_name]
        self._launch(lib, binding, kernel_name, grid, threadgroup, cpp_path)

        outputs = []
        for view, shape, dtype in zip(out_views, output_shapes, output_dtypes):
            out = mx.array(view.reshape(shape))
            outputs.append(out.view(mx.bfloat16) if dtype == mx.bfloat16 else out)
        return outputs

    def _launch(self, lib, binding: _Binding, kernel_name, grid, threadgroup, cpp_path) -> None:
        n = len(binding.bufs)
        bufs = (_Buf * max(n, 1))(*binding.bufs)
        scalars = (ctypes.c_void_p * max(len(binding.scalars), 1))(*binding.scalars)
        grid_arr = (ctypes.c_uint32 * 3)(*grid)
        tg_arr = (ctypes.c_uint32 * 3)(*threadgroup)
        read = (ctypes.c_uint64 * max(n, 1))()
        written = (ctypes.c_uint64 * max(n, 1))()
        counters = (ctypes.c_uint64 * len(_COUNTER_NAMES))()
        error = ctypes.create_string_buffer(4096)
        stack = int(os.environ.get("MLX_TERNARY_EMULATOR_STACK", 256 * 1024))
        mode = _SCHEDULES[self.schedule] | (_STRICT_SIMD if self.strict_simd else 0)

        t0 = time.perf_counter()
        rc = build.runtime().emu_launch(
            ctypes.cast(lib.emu_kernel_entry, ctypes.c_void_p),
            self.name.encode(),
            ctypes.addressof(grid_arr),
            ctypes.addressof(tg_arr),
            n,
            ctypes.addressof(bufs),
            ctypes.addressof(scalars),
            _num_workers(),
            mode,
            stack,
            ctypes.addressof(read),
            ctypes.addressof(written),
            ctypes.addressof(counters),
            error,
            len(error),
        )
        seconds = time.perf_counter() - t0

        self.last_stats = {}
        for i, name in enumerate(binding.names):
            self.last_stats[name] = {"read": read[i], "written": written[i]}
        self.last_launch = LaunchInfo(
            kernel_name,
            grid,
            threadgroup,
            seconds,
            str(cpp_path),
            **{k: counters[i] for i, k in enumerate(_COUNTER_NAMES)},
        )
        if rc != 0:
            message = error.value.decode(errors="replace")
            raise {1: KernelOutOfBoundsError, 2: KernelCrashError}.get(rc, EmulatorError)(message)


def metal_kernel(
    name: str,
    input_names,
    output_names,
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    atomic_outputs: bool = False,
    compile_options=None,
) -> MetalKernel:
    """Build a kernel like ``mx.fast.metal_kernel`` that runs in the emulator.

    Args:
        name: Kernel name, as for mx.fast.metal_kernel.
        input_names: Parameter names of the inputs.
        output_names: Parameter names of the outputs.
        source: The kernel body in Metal.
        header: Metal source put before the kernel (helpers, includes).
        ensure_row_contiguous: Copy non-contiguous inputs first, as MLX does.
        atomic_outputs: Declare outputs as ``device atomic<T>*``.
        compile_options: Accepted for compatibility; the emulator always
            computes math in IEEE float.

    Returns:
        A MetalKernel, called with the keywords of an mx.fast.metal_kernel
        kernel: inputs, output_shapes, output_dtypes, grid, threadgroup,
        template, init_value, verbose, stream. Nothing is compiled before
        the first call.

    Raises:
        ValueError: output_names is empty.
    """
    return MetalKernel(
        name,
        input_names,
        output_names,
        source,
        header,
        ensure_row_contiguous,
        atomic_outputs,
        compile_options,
    )


@contextmanager
def use_emulator():
    """Within the block, ``mx.fast.metal_kernel`` builds emulated kernels:
    for code that creates its kernels at import time or inside a factory."""
    real = mx.fast.metal_kernel
    mx.fast.metal_kernel = metal_kernel
    try:
        yield
    finally:
        mx.fast.metal_kernel = real
