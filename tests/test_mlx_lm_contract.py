"""scripts/mlx_lm_contract.py's own pieces, without mlx-lm's repository: the redirection its
conftest puts under mlx-lm's test files, the import pruning and the verdicts."""

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from tiny import float_model, write_tokenizer

from mlx_ternary.generate import EMBEDDED_MODEL
from mlx_ternary.runtime.layers import TernaryLinear

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
HUB_ID = "mlx-community/Qwen1.5-0.5B-Chat-4bit"


def _module(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def redirect(monkeypatch):
    monkeypatch.delenv("MLX_LM_CONTRACT_SIDE", raising=False)  # import without installing
    return _module("mlx_lm_contract_conftest")


@pytest.mark.native
def test_ternary_side_sends_hub_loads_to_mlx_ternary_on_the_native_backend(redirect):
    import mlx_lm.utils

    from mlx_ternary.runtime.dispatch import resolve_backend

    stock = mlx_lm.utils.load
    with redirect.install("ternary", EMBEDDED_MODEL):
        model, tokenizer = mlx_lm.utils.load(HUB_ID)
        layer = model.layers[0].self_attn.q_proj
        assert isinstance(layer, TernaryLinear) and resolve_backend() == "native"
        assert redirect.REDIRECTED[-1] == HUB_ID
        assert str(mlx_lm.utils.hf_repo_to_path(HUB_ID)) == str(EMBEDDED_MODEL)
        assert tokenizer.encode("ROMEO:")
    assert mlx_lm.utils.load is stock  # undone on close


def test_float_side_loads_the_twin_with_stock_mlx_lm(redirect, tmp_path):
    import mlx_lm.utils
    from mlx_lm.utils import save_model

    model, config = float_model("llama")
    write_tokenizer(tmp_path)
    save_model(tmp_path, model)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with redirect.install("float", tmp_path):
        loaded, _ = mlx_lm.utils.load(HUB_ID)
    assert type(loaded.layers[0].self_attn.q_proj) is nn.Linear
    ids = mx.array([[3, 14, 15]])
    assert mx.array_equal(loaded(ids), model(ids)).item()
    with pytest.raises(ValueError, match="ternary"):
        redirect.install("int4", tmp_path)


def test_missing_names_leave_the_imports_and_keep_line_numbers():
    contract = _module("mlx_lm_contract")
    source = (
        "import os\n"
        "from mlx_lm.generate import (\n"
        "    generate,\n"
        "    NoSuchThing,\n"
        ")\n"
        "from mlx_lm.utils import NotThereEither\n"
        "x = generate\n"
    )
    out, missing = contract.drop_missing_imports(source)
    assert missing == ["mlx_lm.generate.NoSuchThing", "mlx_lm.utils.NotThereEither"]
    lines = out.splitlines()
    assert len(lines) == 7 and lines[-1] == "x = generate"
    assert lines[1] == "from mlx_lm.generate import generate" and lines[5] == ""
    namespace = {}
    exec(compile(out, "t", "exec"), namespace)
    assert "NoSuchThing" not in namespace
    assert contract.drop_missing_imports("from mlx_lm.utils import load\n") == (
        "from mlx_lm.utils import load\n",
        [],
    )


def test_verdicts_flag_only_what_passes_on_the_float_twin_alone():
    contract = _module("mlx_lm_contract")
    fail = "fail (AssertionError)"
    results = {
        "float": {"a": "pass", "b": fail, "c": "pass", "d": "skip", "e": fail},
        "ternary": {"a": "pass", "b": fail, "c": "error (KeyError)", "d": "pass", "e": "fail"},
    }
    verdicts = {r[0]: r[3] for r in contract.compare(results)}
    want = {"a": "agree", "b": "agree", "c": "regression", "d": "differ", "e": "differ"}
    assert verdicts == want


def test_outcomes_read_pytest_junit_reports(tmp_path):
    contract = _module("mlx_lm_contract")
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="test_generate.TestGenerate" name="test_a" />'
        '<testcase classname="test_generate.TestGenerate" name="test_b">'
        "<failure message=\"AssertionError: 'TEST' != 'x'\">...</failure></testcase>"
        '<testcase classname="test_utils.TestUtils" name="test_c">'
        '<error message="failed on setup with &quot;ValueError: no&quot;">...</error>'
        "</testcase>"
        '<testcase classname="test_utils.TestUtils" name="test_d">'
        '<skipped message="unsupported" /></testcase>'
        "</testsuite></testsuites>"
    )
    assert contract.outcomes(report) == {
        "test_generate::TestGenerate::test_a": "pass",
        "test_generate::TestGenerate::test_b": "fail (AssertionError)",
        "test_utils::TestUtils::test_c": "error",
        "test_utils::TestUtils::test_d": "skip (unsupported)",
    }
