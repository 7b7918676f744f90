"""No module reaches another module's private name (issue 28): an AST walk over the package,
the tests and the scripts for `from <project module> import _name` and `<project module>._name`.
What another module uses is public; a name that stays private stays inside its module."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mlx_ternary"

# The one list of allowed reaches: (file relative to the root, module, name) -> why. Empty:
# what another module uses is public. An entry added here names its reason.
ALLOWED: dict = {}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_project_module(name: str) -> bool:
    """Whether `name` (dotted) is a module or package of mlx_ternary."""
    if not (name == "mlx_ternary" or name.startswith("mlx_ternary.")):
        return False
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _absolute(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module name of an import-from, relative ones resolved against `path`."""
    if not node.level:
        return node.module or ""
    here = _module_name(path).split(".")
    base = here if path.name == "__init__.py" else here[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def reaches(path: Path):
    """(line, module, private name) for each reach of `path` into another project module."""
    tree = ast.parse(path.read_text(), str(path))
    own = _module_name(path)
    modules = {}  # local name -> the project module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_project_module(a.name):  # `import a.b` binds a, `import a.b as c` a.b
                    head = a.name.split(".")[0]
                    modules[a.asname or head] = a.name if a.asname else head
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(path, node)
            if not _is_project_module(source):
                continue
            for a in node.names:
                if _is_project_module(f"{source}.{a.name}"):
                    modules[a.asname or a.name] = f"{source}.{a.name}"
                elif _private(a.name) and source != own:
                    found.append((node.lineno, source, a.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, base = [], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                target = ".".join([modules[base.id], *reversed(chain)])
                if _is_project_module(target) and target != own:
                    found.append((node.lineno, target, node.attr))
    return found


def _files():
    for folder in ("mlx_ternary", "tests", "scripts"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_module_reaches_another_modules_private_names():
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {module}.{name}"
        for path in _files()
        for line, module, name in reaches(path)
        if (str(path.relative_to(ROOT)), module, name) not in ALLOWED
    ]
    assert not bad, "make these public (no leading underscore) or keep them in their module:\n" + (
        "\n".join(bad)
    )


def test_every_allowed_reach_still_exists():
    """An exception whose reach is gone is dropped from ALLOWED, so the list stays true."""
    found = {
        (str(path.relative_to(ROOT)), module, name)
        for path in _files()
        for _, module, name in reaches(path)
    }
    assert not set(ALLOWED) - found, f"drop these from ALLOWED: {sorted(set(ALLOWED) - found)}"


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from mlx_ternary.format import _hidden\n", [(1, "mlx_ternary.format", "_hidden")]),
        ("from ..format import _hidden\n", [(1, "mlx_ternary.format", "_hidden")]),
        ("from .. import format as f\nf._hidden\n", [(2, "mlx_ternary.format", "_hidden")]),
        ("import mlx_ternary.format\nmlx_ternary.format._x\n", [(2, "mlx_ternary.format", "_x")]),
        ("from ..format import public\nfrom os import _exit\nimport os\nos._exit\n", []),
        ("from .. import format as f\nf.__name__\nself._own\n", []),
    ],
)
def test_the_walk_finds_a_reach_and_only_a_reach(tmp_path, source, expected, monkeypatch):
    # a file inside the package, so relative imports resolve (mlx_ternary/bench/x.py)
    path = PACKAGE / "bench" / "_private_names_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source)
    assert reaches(path) == expected
