"""Run `mx.fast.metal_kernel` sources on a CPU: a Metal emulator for tests.

    from mlx_ternary.emulator import metal_kernel
    kernel = metal_kernel(name, input_names, output_names, source)
    out = kernel(inputs=..., grid=..., threadgroup=..., output_shapes=..., output_dtypes=...)
    kernel.last_stats  # {buffer: {"read": bytes, "written": bytes}}

See docs/EMULATOR.md for what it supports and what it cannot see.
"""

from .errors import EmulatorError, KernelCrashError, KernelOutOfBoundsError, MetalCompileError
from .kernel import LaunchInfo, MetalKernel, metal_kernel, use_emulator

__all__ = [
    "EmulatorError",
    "KernelCrashError",
    "KernelOutOfBoundsError",
    "LaunchInfo",
    "MetalCompileError",
    "MetalKernel",
    "metal_kernel",
    "use_emulator",
]
