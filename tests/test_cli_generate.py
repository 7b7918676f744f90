"""`mlx-ternary generate` end to end, and its error paths: one line, non-zero, no traceback."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from mlx_lm import generate as mlx_lm_generate
from tiny import ternary_checkpoint

import mlx_ternary
from mlx_ternary.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ternary_checkpoint(tmp_path_factory.mktemp("cli"), "llama", "compact", "row")[0]


def _run(*args, stdin=None):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "mlx_ternary.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_generate_streams_the_greedy_text_of_mlx_lm(model_dir):
    model, tok = mlx_ternary.load(model_dir)
    want = mlx_lm_generate(model, tok, "the fox", max_tokens=10)
    res = _run("generate", "--model", str(model_dir), "--prompt", "the fox", "-m", "10")
    assert res.returncode == 0, res.stderr
    assert res.stdout.rstrip("\n") == want


def test_generate_reads_prompt_from_stdin_and_reports_speed(model_dir):
    res = CliRunner().invoke(
        main,
        [
            "generate",
            "--model",
            str(model_dir),
            "--prompt",
            "-",
            "-m",
            "5",
            "--verbose",
            "--seed",
            "3",
            "--temp",
            "0.8",
            "--top-p",
            "0.9",
            "--top-k",
            "20",
            "--min-p",
            "0.01",
            "--repetition-penalty",
            "1.1",
            "--max-kv-size",
            "64",
        ],
        input="the lazy dog",
    )
    assert res.exit_code == 0, res.output
    assert "Generation: 5 tokens" in res.output
    assert "Peak memory:" in res.output


def test_sampling_with_a_seed_is_reproducible(model_dir):
    args = [
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        "x",
        "-m",
        "8",
        "--temp",
        "1.0",
        "--seed",
        "7",
    ]
    a = CliRunner().invoke(main, args).output
    b = CliRunner().invoke(main, args).output
    assert a == b


def test_kv_bits_run(model_dir):
    res = CliRunner().invoke(
        main, ["generate", "--model", str(model_dir), "--prompt", "ab", "-m", "4", "--kv-bits", "8"]
    )
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("case", ["missing_dir", "missing_config", "bad_model_type"])
def test_errors_are_one_line_without_traceback(tmp_path, model_dir, case):
    if case == "missing_dir":
        target, expect = tmp_path / "nope", "no such model directory"
    elif case == "missing_config":
        target, expect = tmp_path, "no config.json"
    else:
        target = tmp_path / "m"
        target.mkdir()
        cfg = json.loads((model_dir / "config.json").read_text())
        cfg["model_type"] = "not_a_model"
        (target / "config.json").write_text(json.dumps(cfg))
        expect = "model_type 'not_a_model' is not an architecture"
    if case == "missing_dir":  # one real process: what a user sees on stderr
        res = _run("generate", "--model", str(target), "--prompt", "hi")
        code, stderr = res.returncode, res.stderr
    else:
        res = CliRunner().invoke(main, ["generate", "--model", str(target), "--prompt", "hi"])
        code, stderr = res.exit_code, res.stderr
        assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit)
    assert code == 1
    assert "Traceback" not in stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and expect in lines[0], stderr


def test_help_lists_examples():
    res = CliRunner().invoke(main, ["generate", "--help"])
    assert res.exit_code == 0
    assert "Examples:" in res.output and "--max-tokens" in res.output


@pytest.mark.parametrize("command", ["generate", "plan", "serve"])
def test_kv_bits_is_one_choice_in_every_command(command, model_dir):
    """7 bits passes an IntRange(2, 8) and fails inside MLX: all three refuse it as click does."""
    r = CliRunner().invoke(main, [command, "--model", str(model_dir), "--kv-bits", "7"])
    assert r.exit_code == 2 and "'7' is not one of '2', '3', '4', '5', '6', '8'" in r.output


@pytest.mark.parametrize("command", ["generate", "perplexity", "plan", "serve"])
def test_every_command_refuses_a_missing_embedded_model(command, monkeypatch, tmp_path):
    from mlx_ternary import generate as gen

    monkeypatch.setattr(gen, "EMBEDDED_MODEL", tmp_path / "gone")
    args = [command, "--data", str(tmp_path / "t.txt")] if command == "perplexity" else [command]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and "the embedded model is missing" in r.output, r.output
    assert str(tmp_path / "gone") in r.output
