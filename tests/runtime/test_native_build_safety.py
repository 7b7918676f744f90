"""The native build: no compiler outlives an interrupted or failed build, and a damaged
cached library is reported once and rebuilt."""

import os
import subprocess

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
