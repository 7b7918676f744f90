"""Compile the native extension on first use, cached by everything that goes into it.

An MLX extension is C++ compiled against MLX's headers and linked to its libmlx: it must be
built against the very MLX it runs with. Compiling on first use (the emulator's precedent)
gets that for free - the cache key holds the MLX version and its library's size and mtime,
so upgrading MLX builds a new extension instead of loading a stale one - and keeps
`pip install` free of compilers: without one the package installs and runs the pure-MLX
path. The build needs only a C++20 compiler: nanobind (a dependency) ships its sources, MLX
its headers. Loading checks the nanobind ABI, the MLX version the library was built for,
and runs the kernels' self-check before anything is served.
"""

import importlib.util
import platform
import re
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import List

from ... import paths
from ...paths import digest, locked, publish

CSRC = Path(__file__).parent / "csrc"
BINDINGS = "bindings.cpp"  # the one translation unit: it includes ops/, kernels/ and arch/
MODULE = "_mlx_ternary_native"
ENV_CXX = "MLX_TERNARY_NATIVE_CXX"

_COMMON = [
    "-std=c++20",
    "-O3",
    "-fPIC",
    "-fvisibility=hidden",
    "-fno-strict-aliasing",
    "-DNDEBUG",
    "-DNB_COMPACT_ASSERTIONS",
]
# -ffp-contract=off: the epilogue must round like the reference twin's separate float32 ops.
_EXT = ["-ffp-contract=off", "-DNB_DOMAIN=mlx", "-w"]


class NativeBuildError(RuntimeError):
    """The extension cannot be built or loaded here; the message says why and what to do."""


def cache_dir() -> Path:
    """Where the built extension lives (paths.CACHE_ENV["native"] moves it)."""
    return paths.cache_dir("native")


def compiler() -> str:
    return paths.compiler(ENV_CXX, "c++")


def compiler_id(cxx: str) -> str:
    try:
        return paths.compiler_id(cxx)
    except OSError as e:
        raise NativeBuildError(
            f"the native CPU kernel needs a C++20 compiler and {e}; install g++ or "
            f"clang++, or point ${ENV_CXX} at one"
        ) from None


def arch_flags() -> List[str]:
    """Flags for this machine's CPU: the library is built here, for here."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return ["-march=native"]
    if machine in ("arm64", "aarch64"):
        # Apple clang has no -mcpu=native on every version; every Apple M core has dotprod.
        return ["-march=armv8.2-a+dotprod+fp16"] if sys.platform == "darwin" else ["-mcpu=native"]
    return []


@lru_cache(maxsize=1)
def cpu_fingerprint() -> str:
    """The CPU features -march=native compiles for (a cache shared by several machines must
    not hand one machine's library to another)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


@dataclass(frozen=True)
class MlxBuild:
    """What of the installed MLX the extension compiles and links against."""

    version: str
    include: Path
    libdir: Path
    library: Path
    core: Path  # the mlx.core Python extension (its nanobind ABI must match ours)
    stable_abi: bool  # mlx.core is a limited-API (abi3) module


def mlx_build() -> MlxBuild:
    import mlx.core as mx

    core = Path(mx.__file__)
    root = core.parent
    lib = root / "lib" / ("libmlx.dylib" if sys.platform == "darwin" else "libmlx.so")
    include = root / "include"
    if not (include / "mlx" / "mlx.h").exists() or not lib.exists():
        raise NativeBuildError(
            f"the installed mlx ({root}) ships no C++ headers or libmlx; "
            "the native CPU kernel needs the mlx wheel's include/ and lib/"
        )
    return MlxBuild(mx.__version__, include, lib.parent, lib, core, ".abi3." in core.name)


@dataclass(frozen=True)
class Nanobind:
    version: str
    include: Path
    src: Path
    robin_map: Path
    abi_tag: str  # "_a<backend ABI>_v<internals version>" of its internals key


def nanobind() -> Nanobind:
    try:
        import nanobind as nb
    except ImportError:
        raise NativeBuildError(
            "nanobind is not installed; reinstall mlx-ternary (it depends on nanobind>=3)"
        ) from None
    include, src = Path(nb.include_dir()), Path(nb.source_dir())
    backend = (include / "nanobind" / "nb_backend.h").read_text()
    internals = (src / "nb_internals.h").read_text()
    major = re.search(r"#define NB_BACKEND_ABI_MAJOR (\d+)", backend)
    version = re.search(r"#\s*define NB_INTERNALS_VERSION (\d+)", internals)
    if not (major and version):
        raise NativeBuildError(
            f"nanobind {nb.__version__} is not a 3.x release this build "
            "understands; install nanobind>=3,<4"
        )
    return Nanobind(
        nb.__version__,
        include,
        src,
        src.parent / "ext" / "robin_map" / "include",
        f"_a{major.group(1)}_v{version.group(1)}",
    )


def check_nanobind_abi(mlx: MlxBuild, nb: Nanobind) -> None:
    """Our module shares mlx.array's type only if both use the same nanobind internals."""
    tag = (nb.abi_tag + ("_stable" if mlx.stable_abi else "")).encode()
    if tag not in mlx.core.read_bytes():
        raise NativeBuildError(
            f"mlx {mlx.version} was built with a nanobind whose ABI differs from the installed "
            f"nanobind {nb.version} (no {tag.decode()!r} in {mlx.core.name}); the native "
            "kernel needs an mlx built with nanobind 3: upgrade mlx to 0.32.3 or later"
        )


def sources() -> bytes:
    """Every header and source under csrc/ (ops/, kernels/, arch/ ...), with its path."""
    return b"".join(
        p.relative_to(CSRC).as_posix().encode() + p.read_bytes()
        for p in sorted(CSRC.rglob("*"))
        if p.suffix in (".h", ".cpp")
    )


def python_flags(mlx: MlxBuild) -> List[str]:
    flags = [f"-I{sysconfig.get_paths()['include']}"]
    if mlx.stable_abi:
        flags.append("-DPy_LIMITED_API=0x030C0000")
    return flags


def suffix(mlx: MlxBuild) -> str:
    return ".abi3.so" if mlx.stable_abi else sysconfig.get_config_var("EXT_SUFFIX")


def link_flags(mlx: MlxBuild) -> List[str]:
    flags = [f"-L{mlx.libdir}", "-lmlx", f"-Wl,-rpath,{mlx.libdir}"]
    if sys.platform == "darwin":
        flags.append("-Wl,-undefined,dynamic_lookup")
    return flags


def build_key(mlx: MlxBuild, nb: Nanobind, cxx: str, flags: List[str]) -> str:
    """Sources, flags, compiler command, the CPU, the MLX (version, libmlx size and mtime),
    nanobind and Python: a change of any of them is a new library. The compiler's own version
    is not in it, so a cached library still loads where the compiler has since been removed."""
    lib = mlx.library.stat()
    return digest(
        sources(),
        flags,
        cxx,
        cpu_fingerprint(),
        mlx.version,
        lib.st_size,
        lib.st_mtime_ns,
        nb.version,
        suffix(mlx),
        sys.version,
    )


def library_path(key: str, mlx: MlxBuild) -> Path:
    return cache_dir() / f"{MODULE}-{key}{suffix(mlx)}"


def start_job(cmd: List[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, what: str) -> None:
    _, err = proc.communicate()
    if proc.returncode != 0:
        lines = [l for l in err.splitlines() if "error" in l.lower()] or err.splitlines()
        raise NativeBuildError(
            f"compiling {what} failed ({proc.args[0]}): " + " | ".join(lines[:6])
        )


def run_jobs(jobs) -> None:
    """Wait for the compiler processes; on any error or interruption (Ctrl-C, a failed
    sibling) the ones still running are killed and reaped: no compiler outlives a build."""
    try:
        for proc, what in jobs:
            _finish(proc, what)
    finally:
        for proc, _ in jobs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def compile_library(
    path: Path, mlx: MlxBuild, nb: Nanobind, cxx: str, flags: List[str], progress=lambda s: None
) -> None:
    """nanobind's runtime (cached apart: it does not change with our sources) and our
    kernels compile side by side, then link."""
    compiler_id(cxx)  # a clear error when there is no compiler
    nb_flags = (
        _COMMON
        + arch_flags()
        + python_flags(mlx)
        + [f"-I{nb.include}", f"-I{nb.robin_map}", "-DNB_BUILD"]
    )
    nb_obj = cache_dir() / f"nanobind-{digest(nb.version, cxx, nb_flags, cpu_fingerprint())}.o"
    progress(f"compiling the native CPU kernel for mlx {mlx.version} (once, about half a minute)")
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        jobs = []
        if not nb_obj.exists():
            nb_tmp = Path(tmp) / "nanobind.o"
            jobs.append(
                (
                    start_job(
                        [cxx, *nb_flags, "-c", str(nb.src / "nb_combined.cpp"), "-o", str(nb_tmp)]
                    ),
                    f"nanobind {nb.version}",
                )
            )
        ext_obj = Path(tmp) / "bindings.o"
        jobs.append(
            (
                start_job([cxx, *flags, "-c", str(CSRC / BINDINGS), "-o", str(ext_obj)]),
                "the native CPU kernel",
            )
        )
        run_jobs(jobs)
        if not nb_obj.exists():
            publish(nb_tmp, nb_obj)
        lib = Path(tmp) / path.name
        link = [cxx, "-shared", str(ext_obj), str(nb_obj), "-o", str(lib), *link_flags(mlx)]
        run_jobs([(start_job(link), "the native CPU kernel (link)")])
        publish(lib, path)


def kernel_flags() -> List[str]:
    """The flags that decide the kernels' arithmetic: language, optimization, contraction, CPU."""
    return _COMMON + _EXT + arch_flags()


def ext_flags(mlx: MlxBuild, nb: Nanobind) -> List[str]:
    return (
        kernel_flags()
        + python_flags(mlx)
        + [
            f"-I{nb.include}",
            f"-I{mlx.include}",
            f"-I{CSRC}",
            f'-DMLXT_MLX_VERSION="{mlx.version}"',
        ]
    )


def import_library(path: Path):
    spec = importlib.util.spec_from_file_location(MODULE, str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def verify(module, mlx_version: str) -> None:
    """Refuse a library built for another MLX, one whose nanobind does not share mlx.array,
    and SIMD kernels that disagree with the portable ones."""
    built, linked = module.built_for_mlx(), module.linked_mlx()
    if built != mlx_version or linked != mlx_version:
        raise NativeBuildError(
            f"the native library was built for mlx {built} and links mlx "
            f"{linked}, but mlx {mlx_version} is running; delete "
            f"{cache_dir()} to rebuild it"
        )
    import mlx.core as mx

    try:
        y = module.dense_matmul(mx.ones((1, 8)), mx.ones((2, 8), dtype=mx.float16))
        mx.eval(y)
    except TypeError as e:
        raise NativeBuildError(
            "the native library does not accept mlx arrays (a nanobind "
            f"mismatch with mlx.core: {str(e).splitlines()[0]})"
        ) from None
    if y.tolist() != [[8.0, 8.0]]:
        raise NativeBuildError(f"the native library's smoke test returned {y.tolist()}")
    problem = module.selfcheck()
    if problem:
        raise NativeBuildError(
            f"the native kernels ({module.isa()}) failed their self-check: {problem}"
        )


def load(progress=lambda s: None):
    """The verified extension module, compiling it first if the cache has none.

    Raises:
        NativeBuildError: no compiler, no headers, an ABI mismatch, a failed build or check.
    """
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        raise NativeBuildError("free-threaded Python is not supported by the native kernel")
    mlx, nb = mlx_build(), nanobind()
    check_nanobind_abi(mlx, nb)
    cxx = compiler()
    flags = ext_flags(mlx, nb)
    path = library_path(build_key(mlx, nb, cxx, flags), mlx)
    cached = path.exists()
    if not cached:
        with locked(cache_dir()):
            if not path.exists():
                compile_library(path, mlx, nb, cxx, flags, progress)
    try:
        module = import_library(path)
    except (ImportError, OSError) as e:  # a damaged cached library (truncated, overwritten)
        if not cached:  # just built: a rebuild would fail the same way
            raise
        warnings.warn(
            f"{path}: the cached native kernel cannot be loaded ({e}); compiling it again",
            stacklevel=2,
        )
        with locked(cache_dir()):
            path.unlink(missing_ok=True)
            compile_library(path, mlx, nb, cxx, flags, progress)
        module = import_library(path)
    verify(module, mlx.version)
    return module
