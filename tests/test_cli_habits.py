"""Habits carried over from mlx-lm, llama.cpp and Ollama: --threads, generate --max-context,
plan's exit status, refusals in one line, a warning past the trained context, and no
traceback on any option a user can type."""

import os
import re

import pytest
from click.testing import CliRunner

from mlx_ternary.cli import main
from mlx_ternary.cli.model import PLAN_DOES_NOT_FIT
from mlx_ternary.runtime import cpu
from mlx_ternary.runtime.samehost import ENV_THREADS


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


def one_line_error(r):
    lines = [ln for ln in r.output.splitlines() if ln.startswith("Error")]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    return lines[0]


def test_plan_exits_non_zero_when_the_run_does_not_fit():
    fits = run("plan", "--max-context", "256")
    assert fits.exit_code == 0 and fits.output.rstrip().endswith("fits")
    over = run("plan", "--max-context", "256", "--memory-limit", "0.001")
    assert over.exit_code == PLAN_DOES_NOT_FIT and "does not fit" in over.output
    as_json = run("plan", "--max-context", "256", "--memory-limit", "0.001", "--json")
    assert as_json.exit_code == PLAN_DOES_NOT_FIT and '"fits": false' in as_json.output


def test_generate_max_context_cuts_the_answer_and_refuses_a_longer_prompt():
    full = run("generate", "-m", "20", "--verbose")
    assert "Generation: 20 tokens" in full.output
    prompt = int(re.search(r"Prompt: (\d+) tokens", full.output).group(1))
    cut = run("generate", "-m", "20", "--max-context", str(prompt + 6), "--verbose")
    assert cut.exit_code == 0 and "Generation: 6 tokens" in cut.output, cut.output
    assert full.output.startswith(cut.output.split("\n==========")[0].rstrip("\n"))
    long = run("generate", "--max-context", str(prompt))
    assert long.exit_code == 1
    assert f"the prompt is {prompt} tokens; --max-context {prompt} leaves no room" in (
        one_line_error(long)
    )


def test_a_context_past_max_position_embeddings_is_warned():
    over = run("generate", "-m", "300", "--max-context", "260")
    assert over.exit_code == 0 and "above this model's max_position_embeddings (256)" in over.output
    under = run("generate", "-m", "5")
    assert under.exit_code == 0 and "max_position_embeddings" not in under.output


def test_threads_sets_the_native_kernels_threads_and_keeps_the_output(monkeypatch):
    if not cpu.available():
        pytest.skip(f"no native CPU backend here: {cpu.unavailable_reason()}")
    monkeypatch.setenv(ENV_THREADS, "")  # restored after the test, whatever --threads sets
    before = cpu.info()["threads"]
    try:
        default = run("generate", "-m", "8")
        one = run("generate", "-m", "8", "--threads", "1")
        assert one.exit_code == 0 and cpu.info()["threads"] == 1
        assert one.output == default.output  # the same text on one thread
        run("generate", "-m", "1", "--threads", "3")
        assert cpu.info()["threads"] == 3  # control: the option, not a default, set it
        assert os.environ[ENV_THREADS] == "3"  # what ranks pinned by mlx.launch keep
    finally:
        cpu.set_num_threads(before)


@pytest.mark.parametrize("prompt", ["", "-"])
def test_an_empty_prompt_is_refused_in_one_line(prompt):
    r = run("generate", "-p", prompt, input="")
    assert r.exit_code == 2 and "the prompt is" in one_line_error(r)


# Options a user can type, each with the exit status it gets: 0 ran, 1 refused with a
# reason, 2 refused as a usage error. None may end in a traceback.
FUZZ = [
    (["generate", "--temp", "-1"], 2),
    (["generate", "--temp", "nan"], 2),
    (["generate", "--top-p", "1.5"], 2),
    (["generate", "--top-p", "nan"], 2),
    (["chat", "--repetition-penalty", "nan"], 2),
    (["generate", "--top-k", "-3"], 2),
    (["generate", "--min-p", "-0.1"], 2),
    (["generate", "--repetition-penalty", "0"], 2),
    (["generate", "-m", "0"], 2),
    (["generate", "-m", "-5"], 2),
    (["generate", "-m", "abc"], 2),
    (["generate", "--max-kv-size", "0"], 2),
    (["generate", "--max-context", "0"], 2),
    (["generate", "--threads", "0"], 2),
    (["generate", "--seed", "x"], 2),
    (["generate", "--seed", "-1"], 2),
    (["generate", "--temp", "inf"], 2),
    (["generate", "--model", "/nonexistent/dir"], 1),
    (["generate", "--model", "no/such-repo-here"], 1),
    (["generate", "--adapter-path", "/nonexistent"], 1),
    (["generate", "-p", "\x00\x01 ünïcödé 🙂", "-m", "2"], 0),
    (["generate", "--system-prompt", "", "-m", "2"], 0),
    (["generate", "-m", "2", "--temp", "5", "--top-k", "1", "--seed", "7"], 0),
    (["chat", "--max-context", "abc"], 2),
    (["chat", "--model", "/nonexistent/dir"], 1),
    (["plan", "--max-context", "-1"], 2),
    (["plan", "--batch", "0"], 2),
    (["plan", "--prompt-cache-bytes", "lots"], 2),
    (["plan", "--memory-limit", "-2"], 2),
    (["plan", "--model", "/nonexistent/dir"], 1),
    (["serve", "--port", "70000"], 2),
    (["serve", "--port", "-1"], 2),
    (["serve", "--max-context", "1"], 2),
    (["serve", "--log-level", "loud"], 2),
    (["serve", "--host", "no-such-host.invalid", "--port", "9"], 2),
    (["serve", "--model", "/nonexistent/dir", "--port", "0"], 1),
]


@pytest.mark.parametrize("args, status", FUZZ, ids=[" ".join(a) for a, _ in FUZZ])
def test_no_traceback_on_what_a_user_can_type(args, status, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run(*args, input="")
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert "Traceback" not in r.output
    assert r.exit_code == status, r.output
