"""The README's quick start and Python section, run as written on a stand-in: its repo ids
are served by a local stand-in for the Hugging Face Hub (tests/hub_standin.py) holding the
embedded model (and its GGUF conversion), so README and test cannot drift apart. Only the
port changes: the server runs on a free one instead of 8080."""

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hub_standin import StandinHub
from pty_session import PtySession

import mlx_ternary
from mlx_ternary.generate import EMBEDDED_MODEL

README = Path(__file__).resolve().parent.parent / "README.md"
OUTPUTS = ("--mlx-path", "--to-mlx-lm", "--to-gguf")
DEFAULT_PORT = "8080"  # what the README's client snippet connects to
GGUF_NAME = "ggml-model-i2_s.gguf"  # the file name in microsoft/bitnet-b1.58-2B-4T-gguf


def section(title: str) -> str:
    """The README's text under `## title`, up to the next `## ` heading."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def blocks(text: str, lang: str):
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def commands(block: str):
    """Each `mlx-ternary ...` command of a bash block, split as a shell would."""
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(ln, comments=True)[1:] for ln in lines if ln.startswith("mlx-ternary ")]


def repo_ids(args):
    return [a for a in args if re.fullmatch(r"[\w.-]+/[\w.-]+(:\w+)?", a)]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readme")
    gguf = tmp / GGUF_NAME
    mlx_ternary.convert(str(EMBEDDED_MODEL), to_gguf=str(gguf))
    repos = {
        "microsoft/bitnet-b1.58-2B-4T": EMBEDDED_MODEL,
        "microsoft/bitnet-b1.58-2B-4T-gguf": {GGUF_NAME: gguf.read_bytes()},
        "SpectraSuite/TriLM_99M_Unpacked": EMBEDDED_MODEL,
    }
    with StandinHub(repos) as standin:
        env = {
            **os.environ,
            "HF_ENDPOINT": standin.url,
            "HF_HOME": str(tmp / "hf"),
            "MLX_TERNARY_GGUF_CACHE": str(tmp / "gguf-cache"),
            "PYTHONWARNINGS": "ignore",
        }
        yield standin, env, tmp


def cli(args, env, cwd):
    return subprocess.run(
        [sys.executable, "-m", "mlx_ternary.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
    )


def python(code, env, cwd):
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_the_readme_starts_with_the_two_commands_ci_runs():
    first = blocks(README.read_text(), "bash")[:2]
    assert first[0].strip().endswith('mlx-ternary generate --prompt "ROMEO:"')
    assert first[1].strip().endswith("python -m pytest -q tests")
    assert "pytest -q tests" in (README.parent / ".ci" / "run").read_text()
    assert len(README.read_bytes()) <= 10_000


def test_quick_start_generate_chat_serve_and_client(hub):
    standin, env, cwd = hub
    quick = section("Quick start")
    cmds = commands(blocks(quick, "bash")[0])  # the commands; the next block is Open WebUI
    assert [c[0] for c in cmds] == ["generate", "generate", "chat", "serve"]
    served = set()
    for args in cmds:
        for rid in repo_ids(args):
            assert rid.split(":")[0] in standin.repos, f"the stand-in Hub lacks {rid}"
        if args[0] == "generate":
            r = cli(args, env, cwd)
            assert r.returncode == 0 and r.stdout.strip(), r.stderr
            assert "Traceback" not in r.stderr
        elif args[0] == "chat":
            s = PtySession(*args, env={**env, "TERM": "dumb"})
            s.read_until(">>> ")
            s.send("Hi\n")
            assert s.read_until(">>> ").strip() != "Hi"  # an answer came back
            s.send("/exit\n")
            assert s.wait() == 0
        else:
            served.update(_serve_and_call(args, blocks(quick, "python"), env, cwd))
    assert served == {"microsoft/bitnet-b1.58-2B-4T"}
    # The GGUF repo gave one file, the i2_s one, as llama-cli -hf OWNER/REPO:Q does.
    assert standin.gets(GGUF_NAME)


def _serve_and_call(args, snippets, env, cwd):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_ternary.cli", *args, "--port", port],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=cwd,
    )
    try:
        banner, deadline = "", time.monotonic() + 300
        while "Ctrl-C to stop" not in banner:
            line = proc.stderr.readline()
            assert line and time.monotonic() < deadline, banner
            banner += line
        model_id = re.search(r"model id:  (\S+)", banner).group(1)
        assert f"http://127.0.0.1:{port}/v1" in banner
        assert snippets, "the quick start has no client snippet"
        for code in snippets:
            assert f'model="{model_id}"' in code  # the id the server answers to
            r = python(code.replace(DEFAULT_PORT, port), env, cwd)
            assert r.returncode == 0 and r.stdout.strip(), r.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return {model_id}


def test_python_section_runs_as_written(hub):
    standin, env, cwd = hub
    (code,) = blocks(section("Python, in mlx-lm pipelines"), "python")
    r = python(code, env, cwd)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


def test_convert_section_runs_as_written(hub):
    """Each convert line, its placeholders made real in a fresh folder: DIR a model
    directory, model.gguf a GGUF file; repo ids come from the stand-in Hub."""
    standin, env, tmp = hub
    cwd = tmp / "convert"
    cwd.mkdir()
    shutil.copytree(EMBEDDED_MODEL, cwd / "DIR")
    shutil.copy(tmp / GGUF_NAME, cwd / "model.gguf")
    cmds = commands(blocks(section("Convert"), "bash")[0])
    assert cmds and all(c[0] == "convert" for c in cmds)
    for args in cmds:
        for rid in repo_ids(args):
            assert rid in standin.repos, f"the stand-in Hub lacks {rid}"
        r = cli(args, env, cwd)
        assert r.returncode == 0, r.stderr
        out = args[args.index(next(a for a in args if a in OUTPUTS)) + 1]
        assert (cwd / out).exists(), out
    assert cli(["verify", "bitnet-ternary"], env, cwd).returncode == 0
