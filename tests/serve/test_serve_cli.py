"""`mlx-ternary serve` as a process: the banner, a log line per request, the port check
before loading, and SIGTERM ending in exit status 0 every time (no SIGABRT at exit)."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from openai import OpenAI

from mlx_ternary.cli import main
from mlx_ternary.serve import http as serve_http

SIGTERM_RUNS = 3  # each a fresh server: load, one request, SIGTERM, exit 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*args):
    """A serve process on a free port; returns (process, port, the banner up to its end)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_ternary.cli", "serve", "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    banner = []
    deadline = time.monotonic() + 240
    while not banner or not banner[-1].startswith("Ctrl-C"):
        line = proc.stderr.readline()
        if not line or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("no banner: " + "".join(banner) + proc.stderr.read())
        banner.append(line)
    return proc, port, "".join(banner)


def test_banner_names_urls_and_ids_and_a_client_uses_that_id_then_sigterm_exits_0():
    for run in range(SIGTERM_RUNS):
        aliases = ["--served-model-name", "shakespeare"] if run == 0 else []
        proc, port, banner = start(*aliases)
        base = f"http://127.0.0.1:{port}"
        assert f"API:       {base}/v1" in banner and f"chat page: {base}/" in banner
        model_id = re.search(r"model id:  (\S+)", banner).group(1)
        assert model_id == "tiny-shakespeare"
        client = OpenAI(base_url=f"{base}/v1", api_key="none")
        assert [m.id for m in client.models.list().data][0] == model_id
        if run == 0:
            assert "(aliases: shakespeare)" in banner and "Ctrl-C to stop" in banner
            reply = client.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": "ROMEO:"}], max_tokens=6
            )
            assert reply.usage.completion_tokens == 6
        else:
            reply = client.completions.create(model=model_id, prompt="ROMEO:", max_tokens=5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert "terminate called" not in err and "Traceback" not in err
        # One log line for the request, its numbers those of the answer.
        usage = reply.usage
        line = next(ln for ln in err.splitlines() if " POST /v1/" in ln)
        assert f" 200 model={model_id} prompt={usage.prompt_tokens} " in line, line
        assert f" completion={usage.completion_tokens} ttft=" in line and "tok/s" in line
        assert "SIGTERM: draining" in err
        assert any(" GET /v1/models 200 " in ln for ln in err.splitlines())


def test_log_level_warning_keeps_requests_quiet():
    proc, port, _ = start("--log-level", "warning")
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    client.completions.create(model="tiny-shakespeare", prompt="ROMEO:", max_tokens=2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "POST /v1/completions" not in err
    assert "SIGINT: draining" in err  # warnings still show


def test_a_port_in_use_is_refused_in_one_line_before_the_model_loads(tmp_path):
    missing = str(tmp_path / "no-model")  # loading it would fail: the port check is first
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        free = ["serve", "--model", missing, "--port", str(free_port())]
        r = subprocess.run(
            [sys.executable, "-m", "mlx_ternary.cli", *free],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 1 and "no-model" in r.stderr  # control: on a free port it loads
        args = ["serve", "--model", missing, "--port", str(port)]
        r = subprocess.run(
            [sys.executable, "-m", "mlx_ternary.cli", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in lines[0] and "--port" in lines[0]
    assert "Address already in use" in lines[0]


def test_bind_error_is_none_for_a_free_port_and_says_why_otherwise():
    assert serve_http.bind_error("127.0.0.1", 0) is None
    port = free_port()
    assert serve_http.bind_error("127.0.0.1", port) is None
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        assert "in use" in serve_http.bind_error("127.0.0.1", port)
    assert "no-such-host.invalid" in serve_http.bind_error("no-such-host.invalid", port)


def test_a_second_signal_while_draining_forces_the_exit():
    class Draining:  # a server whose drain never ends (a stuck request)
        draining, in_flight = False, 1
        drained = 0

        def drain(self):
            Draining.drained += 1
            self.draining = True

    server, forced = Draining(), []
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve_http.drain_on_signals(server, force=forced.append)
        signal.raise_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        while not server.draining and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.draining and forced == []  # the first one drains
        signal.raise_signal(signal.SIGTERM)
        assert forced == [signal.SIGTERM] and Draining.drained == 1  # the second forces
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def test_serve_warns_of_an_explicit_context_past_the_model(monkeypatch):
    class Recorder:  # stands in for the HTTP server
        def __init__(self, *args, **kwargs):
            self.server_address = ("127.0.0.1", 0)

        def serve_forever(self):
            pass

        def server_close(self):
            pass

    monkeypatch.setattr(serve_http, "Server", Recorder)
    monkeypatch.setattr(serve_http, "drain_on_signals", lambda *a, **k: None)
    r = CliRunner().invoke(main, ["serve", "--port", "0", "--max-context", "512"])
    assert r.exit_code == 0 and "max_position_embeddings (256)" in r.output, r.output
    r = CliRunner().invoke(main, ["serve", "--port", "0"])
    assert r.exit_code == 0 and "max_position_embeddings" not in r.output
