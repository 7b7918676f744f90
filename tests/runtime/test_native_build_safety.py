"""The native build: no compiler outlives an interrupted or failed build, and a damaged
cached library is reported once and rebuilt."""

import ctypes
import os
import subprocess

import numpy as np
import pytest
from tiny import PYTHON, ROOT

from mlx_ternary.runtime.cpu import build
from mlx_ternary.runtime.cpu.build import NativeBuildError


def _sleeper():
    return subprocess.Popen([*PYTHON, "-c", "import time; time.sleep(60)"])


def test_a_failed_sibling_kills_the_compilers_still_running():
    failing = build.start_job([*PYTHON, "-c", "import sys; sys.exit('error: no')"])
    slow = _sleeper()
    with pytest.raises(NativeBuildError, match="compiling a failed"):
        build.run_jobs([(failing, "a"), (slow, "b")])
    assert slow.poll() is not None  # killed and reaped, not left running


def test_an_interrupted_build_kills_its_compilers(monkeypatch):
    slow = [_sleeper(), _sleeper()]

    def interrupted(proc, what):
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "_finish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build.run_jobs([(p, "x") for p in slow])
    assert all(p.poll() is not None for p in slow)


def test_run_waits_for_a_good_build():
    """Negative control: compilers that succeed are waited for, nothing raised."""
    ok = build.start_job([*PYTHON, "-c", "pass"])
    build.run_jobs([(ok, "ok")])
    assert ok.returncode == 0


DAMAGED = """
import shutil, sys, warnings
from pathlib import Path
from mlx_ternary.runtime.cpu import build
from mlx_ternary.runtime.cpu.build import NativeBuildError
good = Path(sys.argv[1])
cached = build.cache_dir() / good.name
cached.write_bytes(b"\\x7fELF" + b"garbage" * 100)  # a half-written library
rebuilt = []
build.compile_library = lambda path, *a, **k: (rebuilt.append(path), shutil.copy(good, path))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    module = build.load()
warned = [x for x in w if "cannot be loaded" in str(x.message)]
print(len(rebuilt), len(warned), module.isa(), sep="|")
"""


@pytest.mark.native
def test_a_damaged_cached_library_is_reported_once_and_rebuilt(tmp_path):
    """Run apart (an extension module loads once per process): a garbage library in the
    cache is reported once, rebuilt (the build faked by a copy of the good one), loaded."""
    mlx, nb = build.mlx_build(), build.nanobind()
    flags = build.ext_flags(mlx, nb)
    good = build.library_path(build.build_key(mlx, nb, build.compiler(), flags), mlx)
    assert good.is_file()  # the native marker: this checkout's library is built
    env = {**os.environ, "MLX_TERNARY_NATIVE_CACHE": str(tmp_path)}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    out = subprocess.run(
        [*PYTHON, "-c", DAMAGED, str(good)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rebuilt, warned, isa = out.stdout.splitlines()[-1].split("|")
    assert (rebuilt, warned) == ("1", "1") and isa


def test_the_cache_key_covers_every_source_under_csrc(tmp_path, monkeypatch):
    """A change to a header in a subfolder (kernels/, arch/, ops/) is a new library; a file
    that is not a source is not."""
    for rel in ("bindings.cpp", "kernels/layer.h", "arch/x86.h", "ops/primitive.h"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"// {rel}\n")
    monkeypatch.setattr(build, "CSRC", tmp_path)
    before = build.sources()
    (tmp_path / "notes.txt").write_text("not a source")
    assert build.sources() == before
    (tmp_path / "arch" / "x86.h").write_text("// changed\n")
    changed = build.sources()
    assert changed != before and b"arch/x86.h// changed" in changed


# The kernels' q8k epilogue (kernels/q8k.h: y + float(sumi) * (d * s), segment after segment)
# on arrays, as a probe library: compiled with the build's kernel flags it must round each
# product before the sum, as the reference twin and numpy do. FMA contraction (what the
# compiler does without -ffp-contract=off: GCC contracts by default in C++, on x86 with
# -march=native's FMA and on every arm64) rounds once.
EPILOGUE = """
extern "C" __attribute__((visibility("default"))) void epilogue(
    const int* sumi, const float* d, const float* s, float* y, int n, int k) {
  for (int i = 0; i < n; i++) y[i] = 0.f;
  for (int j = 0; j < k; j++)  // lanes = rows, as the tiles' epilogues
    for (int i = 0; i < n; i++) y[i] += (float)sumi[j * n + i] * (d[j * n + i] * s[i]);
}
"""


def _epilogue(tmp_path, flags, n=512, k=16):
    """The probe compiled with `flags` and run in this process (ctypes: no second process,
    so it runs under qemu-user too), and numpy's float32 result, one rounding per op."""
    src, lib = tmp_path / "epilogue.cpp", tmp_path / "epilogue.so"
    src.write_text(EPILOGUE)
    subprocess.run(
        [build.compiler(), *flags, "-shared", str(src), "-o", str(lib)], check=True, timeout=120
    )
    rng = np.random.default_rng(31)
    sumi = rng.integers(-60000, 60000, size=(k, n), dtype=np.int32)
    d = rng.uniform(1e-4, 1e-2, size=(k, n)).astype(np.float32)
    s = rng.uniform(0.5, 1.5, size=n).astype(np.float32)
    y = np.zeros(n, np.float32)
    fn = ctypes.CDLL(str(lib)).epilogue
    ptr = np.ctypeslib.as_ctypes
    fn(ptr(sumi), ptr(d), ptr(s), ptr(y), ctypes.c_int(n), ctypes.c_int(k))
    want = np.zeros(n, np.float32)
    for j in range(k):  # float32 arrays: every op rounds to float32
        want = want + sumi[j].astype(np.float32) * (d[j] * s)
    return y, want


@pytest.mark.native  # the kernels' compiler
def test_the_kernel_flags_round_each_product_as_numpy_does(tmp_path):
    """With build.kernel_flags() (the flags bindings.cpp is compiled with) the epilogue is
    numpy's bit for bit; dropping -ffp-contract=off from build.py fails here."""
    y, want = _epilogue(tmp_path, build.kernel_flags())
    assert y.tobytes() == want.tobytes(), (
        f"{(y != want).sum()} of {y.size} rows differ: the compiler contracted the epilogue "
        f"with build.kernel_flags() = {build.kernel_flags()} (-ffp-contract=off missing?)"
    )


@pytest.mark.native  # the kernels' compiler
def test_without_the_contraction_flag_the_epilogue_differs(tmp_path):
    """Negative control: the same flags with contraction allowed give other bits (fused
    multiply-adds), so the test above can fail."""
    flags = [f for f in build.kernel_flags() if not f.startswith("-ffp-contract")]
    y, want = _epilogue(tmp_path, [*flags, "-ffp-contract=fast"])
    assert (y != want).sum() > 0
    assert abs(y.astype(np.float64) - want).max() <= 1e-4 * abs(want).max()  # rounding only
