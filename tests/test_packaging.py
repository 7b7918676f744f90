"""The Metal sources ship inside the wheel and are found from a wheel and from a checkout."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mlx_ternary.runtime.metal.sources import metal_dir, read_source

ROOT = Path(__file__).resolve().parent.parent
METAL_FILES = sorted(p.name for p in (ROOT / "metal").iterdir() if p.is_file())


def test_metal_sources_found_from_the_checkout():
    assert any(name.endswith(".metal") for name in METAL_FILES)
    assert metal_dir().resolve() == (ROOT / "metal").resolve()
    assert read_source(METAL_FILES[0]) == (ROOT / "metal" / METAL_FILES[0]).read_text()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    (whl,) = out.glob("mlx_ternary-*.whl")
    return whl


def test_wheel_contains_metal_sources_and_assets(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for f in METAL_FILES:
        assert f"mlx_ternary/metal/{f}" in names
    assert any(n.startswith("mlx_ternary/") and n.endswith(".py") for n in names)
    pkg = ROOT / "mlx_ternary"
    for sub in ("emulator/csrc", "assets"):  # non-Python files the package needs at run time
        files = [p for p in (pkg / sub).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        assert files
        for f in files:
            assert f"mlx_ternary/{f.relative_to(pkg).as_posix()}" in names
    assert not any(n.startswith(("tests/", "metal/")) for n in names)


def test_installed_wheel_finds_its_metal_sources(wheel, tmp_path):
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)  # what a --no-deps install lays down
    code = (
        "import json, mlx_ternary.runtime.metal.sources as m; d = m.metal_dir(); "
        "print(d); print(json.dumps(sorted(p.name for p in d.iterdir())))"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    found_dir, listing = res.stdout.splitlines()
    assert Path(found_dir).resolve() == (target / "mlx_ternary" / "metal").resolve()
    assert json.loads(listing) == METAL_FILES


# The pre-0.1 module names a removed import hook kept alive (issue 28: STYLE.md leaves such
# machinery out; no release ever shipped them), each with the module that holds it now.
PRE_0_1_NAMES = {
    "nn": "runtime.layers",
    "kernels": "runtime.dispatch",
    "reference": "runtime.reference",
    "lora": "runtime.lora",
    "adapters": "runtime.adapters",
    "native": "runtime.cpu",
    "readers": "checkpoint.readers",
    "writers": "checkpoint.writers",
    "plan": "memory",
    "distributed": "parallel",
}


def test_pre_0_1_module_names_are_gone_and_their_modules_import():
    import importlib

    for old, new in PRE_0_1_NAMES.items():
        importlib.import_module(f"mlx_ternary.{new}")  # the control: the module is there
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"mlx_ternary.{old}")


def _imported_distributions():
    """Top-level names of the third-party modules the package imports (any depth)."""
    import ast

    names = set()
    for path in (ROOT / "mlx_ternary").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names.add((node.module or "").split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "mlx_ternary"}


def _dependencies(section: str):
    """Module names of a dependency list of pyproject.toml ("dependencies" or an extra)."""
    import re

    text = (ROOT / "pyproject.toml").read_text()
    body = re.search(rf"^{section} = \[(.*?)\]\s*$", text, re.S | re.M).group(1)
    dists = re.findall(r'(?:^\s*|\[|, )"([A-Za-z0-9_.-]+)', body, re.M)
    return {d.replace("-", "_").lower() for d in dists}


def test_dependencies_match_the_package_imports():
    runtime = _dependencies("dependencies")
    # matplotlib: `bench --plot` only, imported when asked for (the bench extra)
    optional = {"matplotlib"} & _dependencies("bench")
    imported = _imported_distributions()
    assert imported - optional == runtime, (imported - optional) ^ runtime
    assert "safetensors" not in runtime and "pytest" not in runtime  # the controls
