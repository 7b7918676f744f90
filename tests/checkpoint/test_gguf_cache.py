"""A .gguf path where a model directory goes: converted once into the cache, then reused."""

import os

import gguf_build as gb
import mlx.core as mx
import numpy as np
from click.testing import CliRunner

import mlx_ternary
from mlx_ternary.checkpoint import gguf_cache
from mlx_ternary.cli import main

TOKENS = mx.array([[3, 17, 42, 5]])


def test_converted_once_reused_and_redone_when_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path, _, _ = gb.write(tmp_path / "m.gguf", "llama", output=None)
    model, _ = mlx_ternary.load(str(path))
    root = tmp_path / "xdg" / "mlx_ternary" / "gguf"
    [first] = list(root.iterdir())
    assert (first / "manifest.json").is_file()
    logits = np.array(model(TOKENS))

    def no_convert(*a, **k):
        raise AssertionError("converted again")

    from mlx_ternary.checkpoint import convert as conv

    with monkeypatch.context() as m:  # the second load reads the cached copy
        m.setattr(conv, "convert", no_convert)
        again, _ = mlx_ternary.load(str(path))
    np.testing.assert_array_equal(np.array(again(TOKENS)), logits)

    gb.write(path, "llama", output=None, seed=1)  # a different file at the same path
    os.utime(path, ns=(1, 1))
    changed, _ = mlx_ternary.load(str(path))
    [second] = list(root.iterdir())  # the stale conversion is gone
    assert second != first
    assert np.abs(np.array(changed(TOKENS)) - logits).max() > 1e-3


def test_cli_generate_from_gguf_says_it_converts_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path, _, _ = gb.write(tmp_path / "m.gguf", "llama", output=None)
    runner = CliRunner()
    args = [
        "generate",
        "--model",
        str(path),
        "--prompt",
        "the",
        "-m",
        "3",
        "--ignore-chat-template",
    ]
    first = runner.invoke(main, args)
    assert first.exit_code == 0, first.output
    assert "converting the GGUF file to mlx-ternary's format once" in first.stderr
    second = runner.invoke(main, args)
    assert second.exit_code == 0 and "converting" not in second.stderr
    assert second.stdout == first.stdout
    assert gguf_cache.cache_dir(path).parent == tmp_path / "xdg" / "mlx_ternary" / "gguf"


def test_mlx_lm_tools_take_a_gguf_model(tmp_path, monkeypatch):
    """`mlx-ternary lm generate --model X.gguf`: mlx-lm's own tool on the converted copy,
    greedy text equal to `mlx-ternary generate` on the same file."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path, _, _ = gb.write(tmp_path / "m.gguf", "llama", output=None)
    runner = CliRunner()
    ours = runner.invoke(
        main,
        ["generate", "--model", str(path), "--prompt", "the", "-m", "6", "--ignore-chat-template"],
    )
    assert ours.exit_code == 0, ours.output
    tool = runner.invoke(
        main,
        [
            "lm",
            "generate",
            f"--model={path}",
            "--prompt",
            "the",
            "-m",
            "6",
            "--ignore-chat-template",
        ],
    )
    assert tool.exit_code == 0, tool.output
    text = tool.stdout.split("==========")[1].strip()
    assert text and text == ours.stdout.strip()
