"""The native sources' shape (scripts/check_csrc_headers.py): no include inside a namespace, no
include circle, kernels/ and arch/ free of MLX - on the real tree, and each rule against a tree
that breaks it. (Compiling every header alone is the script's job in CI: it takes a minute.)"""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_csrc_headers.py"


def checker(csrc=None):
    spec = importlib.util.spec_from_file_location("check_csrc_headers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if csrc is not None:
        mod.CSRC = csrc
    return mod


def problems(mod):
    files = mod.sources()
    return [p for f in files for p in mod.include_problems(f)] + mod.cycles(files)


def test_the_sources_keep_their_shape():
    mod = checker()
    names = {p.relative_to(mod.CSRC).as_posix() for p in mod.sources()}
    assert {"bindings.cpp", "ops/primitive.h", "kernels/layer.h", "arch/select.h"} <= names
    assert problems(mod) == []


def write(root: Path, files: dict) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_each_rule_catches_its_break(tmp_path):
    root = write(
        tmp_path,
        {
            "bindings.cpp": 'namespace m {\n#include "ops/a.h"\n}  // namespace m\n',
            "ops/a.h": '#pragma once\n#include "../kernels/b.h"\n',
            "kernels/b.h": '#pragma once\n#include "c.h"\n#include "mlx/mlx.h"\n',
            "kernels/c.h": '#pragma once\n#include "b.h"\n',
        },
    )
    found = problems(checker(root))
    assert any("bindings.cpp:2" in p and "inside a namespace" in p for p in found)
    assert any("kernels/b.h:3" in p and "mlx/mlx.h" in p for p in found)
    assert any(p.startswith("include circle") and "kernels/c.h" in p for p in found)
    assert len(found) == 3
