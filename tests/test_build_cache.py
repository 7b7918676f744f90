"""The first-use C++ build mechanics in paths.py, shared by the Metal emulator's and the
native CPU backend's pipelines (emulator/build.py, runtime/cpu/build.py)."""

import hashlib

import pytest

from mlx_ternary import paths
from mlx_ternary.emulator import build as emu_build
from mlx_ternary.emulator.errors import EmulatorError
from mlx_ternary.runtime.cpu import build as cpu_build


def test_digest_is_sha256_of_the_parts_with_separators():
    want = hashlib.sha256(b"a\0" + b"b\0").hexdigest()
    assert paths.digest("a", b"b") == want[:24]
    assert paths.digest("a", b"b", length=32) == want[:32]
    assert paths.digest("ab") != paths.digest("a", "b")  # the separator counts
    assert emu_build.digest("a", b"b") == want[:32]  # the emulator keeps its 32-hex keys


@pytest.mark.parametrize(
    "module, env, default",
    [(emu_build, "MLX_TERNARY_EMULATOR_CXX", "g++"), (cpu_build, "MLX_TERNARY_NATIVE_CXX", "c++")],
)
def test_both_pipelines_find_the_compiler_the_same_way(monkeypatch, module, env, default):
    monkeypatch.delenv(env, raising=False)
    monkeypatch.delenv("CXX", raising=False)
    assert module.compiler() == default
    monkeypatch.setenv("CXX", "clang++-x")
    assert module.compiler() == "clang++-x"
    monkeypatch.setenv(env, "my-cxx")
    assert module.compiler() == "my-cxx"


def test_a_missing_compiler_is_named_in_each_pipelines_error():
    with pytest.raises(EmulatorError, match="no-such-cxx-1 --version"):
        emu_build.compiler_id("no-such-cxx-1")
    with pytest.raises(cpu_build.NativeBuildError, match="no-such-cxx-2 --version"):
        cpu_build.compiler_id("no-such-cxx-2")


def test_locked_and_publish(tmp_path):
    cache = tmp_path / "cache"
    with paths.locked(cache):
        built = cache / "tmp.so"
        built.write_bytes(b"lib")
        final = paths.publish(built, cache / "final.so")
    assert final.read_bytes() == b"lib" and not built.exists()
    assert (cache / ".lock").exists()
