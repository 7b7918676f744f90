"""A generation step that raises fails its own batch only: those requests get an error in
the API's own shape (OpenAI or Anthropic), the batch and its caches are reset, and the
next requests are answered as if nothing had happened (equal to mlx-lm's greedy output).

The fault is injected into mlx-lm's BatchGenerator.next, the call the engine's step makes.
"""

import json
import threading
import time

import anthropic
import mlx.core as mx
import openai
import pytest
from tiny import ternary_checkpoint  # noqa: E402

import mlx_ternary  # noqa: E402
from mlx_ternary.serve.engine import Engine  # noqa: E402
from mlx_ternary.serve.http import ServeConfig, Server  # noqa: E402
from mlx_ternary.serve.lockstep import LockstepEngine  # noqa: E402

NEW = 16
PROMPT = "ROMEO 0:"


class Fault:
    """Wraps BatchGenerator.next: raises on the next `arm` calls, counting what it did."""

    def __init__(self, real):
        self.real, self.armed, self.raised, self.calls = real, 0, 0, 0

    def __call__(self, gen, *args, **kwargs):
        self.calls += 1
        if self.armed:
            self.armed -= 1
            self.raised += 1
            raise RuntimeError("injected fault in a generation step")
        return self.real(gen, *args, **kwargs)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from test_serve import greedy  # the same reference as the main server tests

    path, _ = ternary_checkpoint(tmp_path_factory.mktemp("recovery"), "llama")
    model, tokenizer = mlx_ternary.load(str(path))
    return model, tokenizer, greedy(model, tokenizer, tokenizer.encode(PROMPT), NEW)


def lockstep_of_one(*args, **kwargs):
    """serve.lockstep's engine on a group of one rank: its own admit rounds, no peers."""
    return LockstepEngine(*args, group=mx.distributed.init(), **kwargs)


@pytest.fixture(scope="module", params=[Engine, lockstep_of_one], ids=["engine", "lockstep"])
def srv(request, model):
    from mlx_lm.generate import BatchGenerator

    model, tokenizer, ref = model
    fault = Fault(BatchGenerator.next)
    mp = pytest.MonkeyPatch()
    mp.setattr(BatchGenerator, "next", lambda gen, *a, **k: fault(gen, *a, **k))
    server = Server(
        model,
        tokenizer,
        ServeConfig(
            model_name="tiny",
            max_context=256,
            prefill_step_size=32,
            max_concurrency=4,
            prompt_cache_bytes=1 << 24,
        ),
        "127.0.0.1",
        0,
        engine_class=request.param,
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    yield dict(server=server, port=port, fault=fault, ref=ref)
    server.shutdown()
    server.server_close()
    mp.undo()


def clients(port):
    kw = dict(api_key="none", max_retries=0, timeout=60)
    return (
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", **kw),
        anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", **kw),
    )


def complete(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens


def test_fault_is_raised_and_fails_only_its_batch(srv):
    client, claude = clients(srv["port"])
    fault = srv["fault"]
    assert complete(client) == srv["ref"]  # before: correct
    before = fault.calls

    fault.armed = 1
    with pytest.raises(openai.InternalServerError) as e:
        complete(client)
    # Negative control: the fault really ran inside a step, and it is what failed.
    assert fault.raised == 1 and fault.calls > before
    body = e.value.body
    assert body["type"] == "server_error" and "generation failed" in body["message"]
    engine = srv["server"].engine
    assert engine.healthy and not engine.active
    deadline = time.monotonic() + 10  # the reset follows the error event
    while len(engine.prompt_cache) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine.prompt_cache) == 0  # the cache state went with the failed batch

    assert complete(client) == srv["ref"]  # after: served normally, same numbers

    fault.armed = 1  # the Anthropic endpoint gets Anthropic's error object
    with pytest.raises(anthropic.InternalServerError) as e:
        claude.messages.create(
            model="tiny", max_tokens=NEW, messages=[{"role": "user", "content": "hi"}]
        )
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "api_error"
    assert fault.raised == 2
    assert complete(client) == srv["ref"]


def test_a_fault_mid_stream_ends_the_stream_with_an_error_and_the_next_is_served(srv):
    client, _ = clients(srv["port"])
    fault = srv["fault"]
    fault.armed = 1
    with pytest.raises(openai.APIError):
        for _ in client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True
        ):
            pass
    assert fault.raised >= 1
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True
        )
    )
    assert text == srv["ref"][0]


def test_every_request_of_the_failing_batch_gets_the_error_and_health_stays_ok(srv):
    import concurrent.futures as cf
    import http.client

    client, _ = clients(srv["port"])
    fault = srv["fault"]
    gate = threading.Event()
    real = fault.real

    def held(gen, *a, **k):  # hold the first step until all four requests are in the batch
        gate.wait(10)
        return real(gen, *a, **k)

    fault.real = held
    raised = fault.raised
    try:
        with cf.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(complete, client) for _ in range(4)]
            while srv["server"].engine.load() < 4:
                threading.Event().wait(0.02)
            fault.armed = 1
            gate.set()
            errors = [f.exception(timeout=60) for f in futures]
    finally:
        fault.real = real
    assert fault.raised == raised + 1  # negative control: the armed step raised
    assert all(isinstance(e, openai.InternalServerError) for e in errors), errors
    conn = http.client.HTTPConnection("127.0.0.1", srv["port"], timeout=10)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"
    assert complete(client) == srv["ref"]


def test_rounds_failing_in_a_row_stop_the_engine_and_health_says_so(model):
    """A broken engine (every round raises, with or without requests) stops after
    MAX_FAILED_TURNS instead of spinning; `healthy` is then False (the server 503s)."""
    from mlx_ternary.serve import engine as engine_mod

    model, tokenizer, _ = model
    engine = Engine(model, tokenizer, max_concurrency=2)
    calls = []

    def broken(gen, block):
        calls.append(block)
        raise RuntimeError("injected: admit fails")

    engine._admit = broken
    engine.start()
    engine._thread.join(timeout=30)
    assert not engine._thread.is_alive() and not engine.healthy
    assert len(calls) == engine_mod.MAX_FAILED_TURNS  # it tried that often, then stopped
    assert "failed in a row" in engine.failed
