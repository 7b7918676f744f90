"""The OpenAI-compatible server, driven by the real `openai` client over loopback only.

Correct = equal to the greedy output of mlx-lm's own single-sequence generator for the
same prompt tokens. The server runs in-process on a free port, so the tests can also
watch the engine (its batch, its token count) and MLX's active memory.
"""

import concurrent.futures as cf
import http.client
import json
import socket
import threading
import time

import mlx.core as mx
import pytest
from click.testing import CliRunner

openai = pytest.importorskip("openai")

import mlx_ternary  # noqa: E402
from mlx_ternary.cli import main  # noqa: E402
from mlx_ternary.serve import ServeConfig, Server  # noqa: E402
from tiny import ternary_checkpoint  # noqa: E402

MAX_CONTEXT = 256
NEW = 24  # tokens per answer in the correctness checks
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
PROMPTS = [f"{w} {i}:" for i, w in enumerate(
    ["ROMEO", "JULIET", "Hello", "What is", "Once upon", "To be", "MERCUTIO", "Nurse",
     "abc", "xyz", "The king", "Good morrow", "Wherefore", "O", "Tybalt", "Friar"])]


def greedy(model, tokenizer, tokens, max_tokens=NEW):
    """(text, finish_reason, tokens generated) from mlx-lm's single-sequence generator."""
    from mlx_lm import stream_generate

    text, last = "", None
    for last in stream_generate(model, tokenizer, tokens, max_tokens=max_tokens):
        text += last.text
    return text, last.finish_reason, last.generation_tokens


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path, _ = ternary_checkpoint(tmp_path_factory.mktemp("serve"), "llama")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    model, tokenizer = mlx_ternary.load(str(path))
    refs = {}  # computed before the server starts: one thread uses the model at a time
    for p in PROMPTS:
        refs[("text", p)] = greedy(model, tokenizer, tokenizer.encode(p))
        chat = tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                             add_generation_prompt=True)
        refs[("chat", p)] = greedy(model, tokenizer, chat)
    server = Server(model, tokenizer, ServeConfig(model_name="tiny", max_context=MAX_CONTEXT,
                                                  prefill_step_size=32, max_concurrency=8),
                    "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0, timeout=60)
    yield dict(server=server, port=port, client=client, refs=refs, tokenizer=tokenizer,
               path=path)
    server.shutdown()
    server.server_close()


def idle(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while server.engine.load() and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.engine.load() == 0


def raw_post(port, path, body: bytes, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, body=body, headers=headers or {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def test_completion_equals_greedy_reference(srv):
    p = PROMPTS[0]
    text, reason, n = srv["refs"][("text", p)]
    r = srv["client"].completions.create(model="tiny", prompt=p, max_tokens=NEW, temperature=0)
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == reason
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.usage.prompt_tokens == len(srv["tokenizer"].encode(p))
    assert r.usage.completion_tokens == n
    assert r.usage.total_tokens == r.usage.prompt_tokens + n
    # negative control: another prompt gives another answer
    assert srv["refs"][("text", PROMPTS[1])][0] != text


def test_chat_equals_greedy_reference_stream_and_not(srv):
    p = PROMPTS[2]
    text, reason, n = srv["refs"][("chat", p)]
    msgs = [{"role": "user", "content": p}]
    r = srv["client"].chat.completions.create(model="tiny", messages=msgs, max_tokens=NEW,
                                              temperature=0)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == reason and r.usage.completion_tokens == n
    chunks = list(srv["client"].chat.completions.create(
        model="tiny", messages=msgs, max_tokens=NEW, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    assert chunks[-1].usage.completion_tokens == n
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_completions_stream_and_done_marker(srv):
    p = PROMPTS[3]
    text, reason, _ = srv["refs"][("text", p)]
    chunks = list(srv["client"].completions.create(model="tiny", prompt=p, max_tokens=NEW,
                                                   temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason
    body = json.dumps({"prompt": p, "max_tokens": 4, "stream": True}).encode()
    status, data = raw_post(srv["port"], "/v1/completions", body)
    assert status == 200 and data.rstrip().endswith(b"data: [DONE]")


def test_stop_string_cuts_the_text(srv):
    p = PROMPTS[4]
    text = srv["refs"][("text", p)][0]
    i = next(i for i in range(3, len(text) - 1) if text[i:i + 2].isascii()
             and text[i:i + 2].isprintable())
    stop = text[i:i + 2]
    want = text[:text.find(stop)]
    for stream in (False, True):
        r = srv["client"].completions.create(model="tiny", prompt=p, max_tokens=NEW,
                                             temperature=0, stop=[stop], stream=stream)
        if stream:
            chunks = list(r)
            got, reason = "".join(c.choices[0].text for c in chunks), \
                chunks[-1].choices[0].finish_reason
        else:
            got, reason = r.choices[0].text, r.choices[0].finish_reason
        assert (got, reason) == (want, "stop")
    assert idle(srv["server"])


def test_seed_makes_sampling_reproducible(srv):
    def ask(seed):
        return srv["client"].completions.create(model="tiny", prompt="ROMEO:", max_tokens=16,
                                                temperature=1.0, seed=seed).choices[0].text
    a, b, c = ask(7), ask(7), ask(8)
    assert a == b
    assert a != c  # negative control: another seed, another sample


def test_models_and_health(srv):
    assert [m.id for m in srv["client"].models.list().data] == ["tiny"]
    conn = http.client.HTTPConnection("127.0.0.1", srv["port"], timeout=10)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"


def test_sixteen_concurrent_streams_are_correct_and_memory_returns(srv):
    server, client = srv["server"], srv["client"]
    assert idle(server)
    mx.clear_cache()
    baseline = mx.get_active_memory()
    seen_batch = []

    def watch(stop):
        while not stop.is_set():
            seen_batch.append(len(server.engine.active))
            time.sleep(0.01)

    def one(p):
        chunks = list(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": p}], max_tokens=NEW,
            temperature=0, stream=True))
        return ("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                [c.choices[0].finish_reason for c in chunks if c.choices][-1])

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,))
    watcher.start()
    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, PROMPTS, timeout=120))
    stop.set()
    watcher.join()
    for p, (text, reason) in zip(PROMPTS, results):
        ref_text, ref_reason, _ = srv["refs"][("chat", p)]
        assert (text, reason) == (ref_text, ref_reason), p
    assert max(seen_batch) > 1  # batched, not one after another
    assert idle(server)
    mx.clear_cache()
    assert mx.get_active_memory() - baseline < 64 * 1024  # nothing kept after the burst


BAD = [
    ("malformed json", "/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("wrong type", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, None),
    ("bool as int", "/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, None),
    ("stream not bool", "/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, None),
    ("missing messages", "/v1/chat/completions", {"model": "tiny"}, 400, None),
    ("bad message", "/v1/chat/completions", {"messages": [1]}, 400, None),
    ("bad content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": {"x": 1}}]}, 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, None),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404,
     "model_not_found"),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, None),
    ("huge max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 9}, 400,
     "context_length_exceeded"),
    ("n > 1", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "n": 3}, 400, None),
    ("bad stop", "/v1/completions", {"prompt": "hi", "stop": [1, 2]}, 400, None),
    ("token id out of range", "/v1/completions", {"prompt": [5, 100000]}, 400, None),
    ("unknown path", "/v1/embeddings", {"input": "hi"}, 404, None),
]


@pytest.mark.parametrize("name,path,body,status,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error(srv, name, path, body, status, code):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, data = raw_post(srv["port"], path, raw)
    assert got == status
    err = json.loads(data)["error"]
    assert err["message"] and err["type"] and (code is None or err["code"] == code)
    assert b"Traceback" not in data and b'File "' not in data


def test_over_context_prompt_is_400_with_the_numbers(srv):
    prompt = "a" * (MAX_CONTEXT + 44)
    n = len(srv["tokenizer"].encode(prompt))
    with pytest.raises(openai.BadRequestError) as e:
        srv["client"].completions.create(model="tiny", prompt=prompt, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    assert str(n) in e.value.message and str(MAX_CONTEXT) in e.value.message
    with pytest.raises(openai.NotFoundError):
        srv["client"].chat.completions.create(model="nope", messages=[
            {"role": "user", "content": "hi"}])


def test_missing_content_length_is_411(srv):
    with socket.create_connection(("127.0.0.1", srv["port"]), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):  # the server closes after the response
            data += chunk
    assert data.startswith(b"HTTP/1.0 411") and b'"error"' in data


def test_disconnect_mid_stream_stops_generation(srv):
    server = srv["server"]
    assert idle(server)
    before = server.engine.tokens_generated
    want = MAX_CONTEXT - 16
    body = json.dumps({"prompt": "ROMEO:", "max_tokens": want, "stream": True,
                       "temperature": 0, "logit_bias": {"1": -100}}).encode()
    s = socket.create_connection(("127.0.0.1", srv["port"]), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while got.count(b"data: ") < 2:
        got += s.recv(4096)
    s.close()
    assert idle(server), "the vanished client's sequence is still in the batch"
    assert server.engine.tokens_generated - before < want
    assert srv["client"].completions.create(model="tiny", prompt="hi", max_tokens=2,
                                            temperature=0).usage.completion_tokens == 2
    conn = http.client.HTTPConnection("127.0.0.1", srv["port"], timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200


def test_serve_and_generate_refuse_when_the_plan_does_not_fit(srv):
    runner = CliRunner()
    r = runner.invoke(main, ["serve", "--model", str(srv["path"]), "--port", "0",
                             "--max-context", "65536", "--memory-limit", "0.01"])
    assert r.exit_code == 1
    assert "does not fit" in r.output and "--max-context" in r.output
    assert "GiB" in r.output or "MiB" in r.output
    r = runner.invoke(main, ["generate", "--model", str(srv["path"]), "--prompt", "hi",
                             "--max-tokens", str(10 ** 9)])
    assert r.exit_code == 1
    assert "does not fit" in r.output and "--kv-bits 8" in r.output
