"""Compile the emulator runtime and translated kernels with the system g++,
cached on disk by a hash of everything that goes into the build."""

import ctypes
import os
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

from .. import paths
from .errors import EmulatorError, MetalCompileError

CSRC = Path(__file__).parent / "csrc"

# Metal has no double and rounds float ops one at a time: unsuffixed literals
# are float and a*b+c is not fused unless the kernel calls fma.
_COMMON_FLAGS = [
    "-std=gnu++17",
    "-fPIC",
    "-shared",
    "-fwrapv",
    "-fno-strict-aliasing",
    "-ffp-contract=off",
    "-fno-omit-frame-pointer",
    "-fno-reorder-blocks",
    "-w",
]
_RUNTIME_FLAGS = _COMMON_FLAGS + ["-O2", "-pthread"]
# The runtime orders divergent SIMD collectives by code address (lowest
# first), which needs blocks laid out in source order: no block reordering,
# jump threading (it moves `if` bodies out of line) or tail merging (it makes
# two call sites one).
_KERNEL_FLAGS = _COMMON_FLAGS + [
    "-O1",
    "-fno-thread-jumps",
    "-fno-crossjumping",
    "-fno-tree-tail-merge",
    "-fsingle-precision-constant",
    "-fstack-clash-protection",  # big locals touch the guard page
    "-fno-exceptions",
    "-fno-rtti",
]

_lock = threading.Lock()
_runtime = None
_kernels: dict[str, ctypes.CDLL] = {}


def cache_dir() -> Path:
    """Where compiled libraries live (paths.CACHE_ENV["emulator"] moves it)."""
    return paths.cache_dir("emulator")


def compiler() -> str:
    return paths.compiler("MLX_TERNARY_EMULATOR_CXX", "g++")


def compiler_id(cxx: str) -> str:
    try:
        return paths.compiler_id(cxx)
    except OSError as e:
        raise EmulatorError(
            f"the Metal emulator needs a C++17 compiler; {e}. "
            "Install g++ or point MLX_TERNARY_EMULATOR_CXX at one."
        ) from e


def digest(*parts) -> str:
    return paths.digest(*parts, length=32)


@lru_cache(maxsize=1)
def _header_bytes() -> bytes:
    return b"".join((CSRC / name).read_bytes() for name in ("metal_compat.h", "emu_abi.h"))


def _compile(source_path: Path, out_path: Path, flags: list[str], what: str) -> None:
    cxx = compiler()
    with paths.locked(out_path.parent):
        if out_path.exists():  # another process built it while we waited
            return
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_path.parent)
        os.close(fd)
        cmd = [cxx, *flags, f"-I{CSRC}", f"-I{CSRC / 'include'}", str(source_path), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            raise MetalCompileError(f"{what} failed to compile:\n{_trim(proc.stderr)}")
        paths.publish(Path(tmp), out_path)


def _trim(stderr: str, limit: int = 60) -> str:
    lines = [l for l in stderr.splitlines() if "In instantiation of" not in l]
    errors = [i for i, l in enumerate(lines) if "error" in l]
    if errors:
        lines = lines[max(0, errors[0] - 2) :]
    return "\n".join(lines[:limit])


def runtime() -> ctypes.CDLL:
    """The runtime library, loaded RTLD_GLOBAL so kernels link against it."""
    global _runtime
    with _lock:
        if _runtime is not None:
            return _runtime
        flags = list(_RUNTIME_FLAGS)
        if os.environ.get("MLX_TERNARY_EMULATOR_UCONTEXT") == "1":
            flags.append(
                "-DEMU_USE_UCONTEXT"
            )  # the portable fiber switch, for testing it on x86-64
        src = (CSRC / "runtime.cpp").read_bytes()
        key = digest(src, _header_bytes(), flags, compiler_id(compiler()))
        path = cache_dir() / f"libmtlemu_rt-{key}.so"
        if not path.exists():
            _compile(CSRC / "runtime.cpp", path, flags, "the emulator runtime")
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        lib.emu_launch.restype = ctypes.c_int
        lib.emu_launch.argtypes = [
            ctypes.c_void_p,  # entry
            ctypes.c_char_p,  # kernel name
            ctypes.c_void_p,  # grid
            ctypes.c_void_p,  # threadgroup
            ctypes.c_int32,  # n_bufs
            ctypes.c_void_p,  # bufs
            ctypes.c_void_p,  # scalars
            ctypes.c_int32,  # n_workers
            ctypes.c_int32,  # schedule
            ctypes.c_uint64,  # stack size
            ctypes.c_void_p,  # read_out
            ctypes.c_void_p,  # written_out
            ctypes.c_void_p,  # counters
            ctypes.c_char_p,  # error
            ctypes.c_uint64,  # error_len
        ]
        _runtime = lib
        return lib


def load_kernel(cpp_source: str, label: str) -> tuple[ctypes.CDLL, Path]:
    """Compile (or find in the cache) and load one translated kernel.

    Returns the library and the path of its C++ source."""
    runtime()
    key = digest(cpp_source, _header_bytes(), _KERNEL_FLAGS, compiler_id(compiler()))
    src_path = cache_dir() / f"k-{key}.cpp"
    with _lock:
        lib = _kernels.get(key)
        if lib is not None:
            return lib, src_path
        path = cache_dir() / f"k-{key}.so"
        if not path.exists():
            src_path.parent.mkdir(parents=True, exist_ok=True)
            src_path.write_text(cpp_source)
            _compile(src_path, path, _KERNEL_FLAGS, f"kernel '{label}'")
        lib = ctypes.CDLL(str(path))
        _kernels[key] = lib
        return lib, src_path
