"""Exceptions raised by the Metal emulator."""


class EmulatorError(RuntimeError):
    """A kernel could not be built or failed while it ran."""


class MetalCompileError(EmulatorError):
    """g++ rejected the translated kernel; the message quotes its errors with
    line numbers of the generated Metal source (print it with verbose=True)."""


class KernelOutOfBoundsError(EmulatorError, IndexError):
    """A thread read or wrote outside a buffer or threadgroup array."""


class KernelCrashError(EmulatorError):
    """A thread crashed: stack overflow, integer division by zero, or a bad
    raw pointer."""
