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

import anthropic
import mlx.core as mx
import openai
import pytest
from click.testing import CliRunner
from tiny import ternary_checkpoint  # noqa: E402

import mlx_ternary  # noqa: E402
from mlx_ternary.cli import main  # noqa: E402
from mlx_ternary.serve.http import ServeConfig, Server  # noqa: E402

MAX_CONTEXT = 256
NEW = 24  # tokens per answer in the correctness checks
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
PROMPTS = [
    f"{w} {i}:"
    for i, w in enumerate(
        [
            "ROMEO",
            "JULIET",
            "Hello",
            "What is",
            "Once upon",
            "To be",
            "MERCUTIO",
            "Nurse",
            "abc",
            "xyz",
            "The king",
            "Good morrow",
            "Wherefore",
            "O",
            "Tybalt",
            "Friar",
        ]
    )
]


def greedy(model, tokenizer, tokens, max_tokens=NEW):
    """(text, finish_reason, tokens generated) from mlx-lm's single-sequence generator;
    the text is `tokenizer.decode` of the tokens it generated (end-of-sequence excluded)."""
    from mlx_lm import stream_generate

    ids, last = [], None
    for last in stream_generate(model, tokenizer, tokens, max_tokens=max_tokens):
        ids.append(last.token)
    if last.finish_reason == "stop":
        ids.pop()
    return tokenizer.decode(ids), last.finish_reason, last.generation_tokens


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path, _ = ternary_checkpoint(tmp_path_factory.mktemp("serve"), "llama")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    model, tokenizer = mlx_ternary.load(str(path))
    ref_model, _ = mlx_ternary.load(str(path))  # the test thread's own copy
    refs = {}  # computed before the server starts: one thread uses the model at a time
    for p in PROMPTS:
        refs[("text", p)] = greedy(model, tokenizer, tokenizer.encode(p))
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True
        )
        refs[("chat", p)] = greedy(model, tokenizer, chat)
    server = Server(
        model,
        tokenizer,
        ServeConfig(
            model_name="tiny", max_context=MAX_CONTEXT, prefill_step_size=32, max_concurrency=8
        ),
        "127.0.0.1",
        0,
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60
    )
    claude = anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{port}", api_key="none", max_retries=0, timeout=60
    )
    yield dict(
        server=server,
        port=port,
        client=client,
        refs=refs,
        tokenizer=tokenizer,
        path=path,
        ref_model=ref_model,
        claude=claude,
    )
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
    r = srv["client"].chat.completions.create(
        model="tiny", messages=msgs, max_tokens=NEW, temperature=0
    )
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == reason and r.usage.completion_tokens == n
    chunks = list(
        srv["client"].chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=NEW,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    assert chunks[-1].usage.completion_tokens == n
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_completions_stream_and_done_marker(srv):
    p = PROMPTS[3]
    text, reason, _ = srv["refs"][("text", p)]
    chunks = list(
        srv["client"].completions.create(
            model="tiny", prompt=p, max_tokens=NEW, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason
    body = json.dumps({"prompt": p, "max_tokens": 4, "stream": True}).encode()
    status, data = raw_post(srv["port"], "/v1/completions", body)
    assert status == 200 and data.rstrip().endswith(b"data: [DONE]")


def test_stop_string_cuts_the_text(srv):
    p = PROMPTS[4]
    text = srv["refs"][("text", p)][0]
    i = next(
        i
        for i in range(3, len(text) - 1)
        if text[i : i + 2].isascii() and text[i : i + 2].isprintable()
    )
    stop = text[i : i + 2]
    want = text[: text.find(stop)]
    for stream in (False, True):
        r = srv["client"].completions.create(
            model="tiny", prompt=p, max_tokens=NEW, temperature=0, stop=[stop], stream=stream
        )
        if stream:
            chunks = list(r)
            got, reason = (
                "".join(c.choices[0].text for c in chunks),
                chunks[-1].choices[0].finish_reason,
            )
        else:
            got, reason = r.choices[0].text, r.choices[0].finish_reason
        assert (got, reason) == (want, "stop")
    assert idle(srv["server"])


def test_seed_makes_sampling_reproducible(srv):
    def ask(seed):
        return (
            srv["client"]
            .completions.create(
                model="tiny", prompt="ROMEO:", max_tokens=16, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

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
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": p}],
                max_tokens=NEW,
                temperature=0,
                stream=True,
            )
        )
        return (
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
            [c.choices[0].finish_reason for c in chunks if c.choices][-1],
        )

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
    kept = server.engine.prompt_cache.nbytes  # the prompt cache keeps what its bound allows
    assert 0 < kept <= server.config.prompt_cache_bytes
    assert mx.get_active_memory() - baseline < kept + 64 * 1024  # nothing else kept


BAD = [
    ("malformed json", "/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, None),
    (
        "wrong type",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
        400,
        None,
    ),
    ("bool as int", "/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, None),
    ("stream not bool", "/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, None),
    ("missing messages", "/v1/chat/completions", {"model": "tiny"}, 400, None),
    ("bad message", "/v1/chat/completions", {"messages": [1]}, 400, None),
    (
        "bad content",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": {"x": 1}}]},
        400,
        None,
    ),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, None),
    (
        "unknown model",
        "/v1/completions",
        {"model": "gpt-9", "prompt": "hi"},
        404,
        "model_not_found",
    ),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, None),
    (
        "huge max_tokens",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 10**9},
        400,
        "context_length_exceeded",
    ),
    (
        "n > 1",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "n": 3},
        400,
        None,
    ),
    ("bad stop", "/v1/completions", {"prompt": "hi", "stop": [1, 2]}, 400, None),
    ("token id out of range", "/v1/completions", {"prompt": [5, 100000]}, 400, None),
    (
        "top_logprobs > 20",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        400,
        None,
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        None,
    ),
    (
        "unknown response_format",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
        400,
        None,
    ),
    (
        "tools without a tool template",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        },
        400,
        None,
    ),
    ("two prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400, None),
    ("suffix", "/v1/completions", {"prompt": "a", "suffix": "b"}, 400, None),
    (
        "echo on chat",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "echo": True},
        400,
        None,
    ),
    (
        "legacy functions",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]},
        400,
        None,
    ),
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
        srv["client"].chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}]
        )


def test_missing_content_length_is_411(srv):
    with socket.create_connection(("127.0.0.1", srv["port"]), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):  # the server closes after the response
            data += chunk
    assert data.startswith(b"HTTP/1.1 411") and b'"error"' in data


def test_disconnect_mid_stream_stops_generation(srv):
    server = srv["server"]
    assert idle(server)
    before = server.engine.tokens_generated
    want = MAX_CONTEXT - 16
    body = json.dumps(
        {
            "prompt": "ROMEO:",
            "max_tokens": want,
            "stream": True,
            "temperature": 0,
            "logit_bias": {"1": -100},
        }
    ).encode()
    s = socket.create_connection(("127.0.0.1", srv["port"]), timeout=10)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    got = b""
    while got.count(b"data: ") < 2:
        got += s.recv(4096)
    s.close()
    assert idle(server), "the vanished client's sequence is still in the batch"
    assert server.engine.tokens_generated - before < want
    assert (
        srv["client"]
        .completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
        .usage.completion_tokens
        == 2
    )
    conn = http.client.HTTPConnection("127.0.0.1", srv["port"], timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200


def test_serve_and_generate_refuse_when_the_plan_does_not_fit(srv):
    runner = CliRunner()
    r = runner.invoke(
        main,
        [
            "serve",
            "--model",
            str(srv["path"]),
            "--port",
            "0",
            "--max-context",
            "65536",
            "--memory-limit",
            "0.01",
        ],
    )
    assert r.exit_code == 1
    assert "does not fit" in r.output and "--max-context" in r.output
    assert "GiB" in r.output or "MiB" in r.output
    r = runner.invoke(
        main,
        ["generate", "--model", str(srv["path"]), "--prompt", "hi", "--max-tokens", str(10**9)],
    )
    assert r.exit_code == 1
    assert "does not fit" in r.output and "--kv-bits 8" in r.output
    r = runner.invoke(
        main,
        [
            "serve",
            "--model",
            str(srv["path"]),
            "--port",
            "0",
            "--memory-limit",
            "8",
            "--prompt-cache-bytes",
            "30GB",
        ],
    )
    assert r.exit_code == 1 and "prompt cache 30.00 GiB" in r.output
    assert "--prompt-cache-bytes" in r.output  # the advice names the flag
    r = runner.invoke(
        main,
        [
            "serve",
            "--model",
            str(srv["path"]),
            "--port",
            "0",
            "--kv-bits",
            "8",
            "--kv-group-size",
            "32",
        ],
    )
    assert r.exit_code == 1 and "head size 16" in r.output  # 64 hidden / 4 heads
    r = runner.invoke(main, ["serve", "--model", str(srv["path"]), "--prompt-cache-bytes", "lots"])
    assert r.exit_code == 2 and "not a size" in r.output


# ----------------------------------------------------------------------------- prompt cache


def greedy_ids(model, tokens, n):
    """n greedy token ids after `tokens`, by full forward passes (no cache at all)."""
    out = []
    for _ in range(n):
        logits = model(mx.array(tokens + out)[None])[0, -1]
        out.append(int(mx.argmax(logits).item()))
    return out


def common_prefix(a, b):
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def test_prompt_cache_reuses_the_previous_turn_and_changes_nothing(srv):
    server, client, tok = srv["server"], srv["client"], srv["tokenizer"]
    assert idle(server)
    server.engine.prompt_cache.clear()
    turn1 = [{"role": "user", "content": "ROMEO: speak, " * 6}]
    r1 = client.chat.completions.create(model="tiny", messages=turn1, max_tokens=NEW, temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0  # nothing cached yet
    p1 = tok.apply_chat_template(turn1, add_generation_prompt=True)
    gen1 = greedy_ids(srv["ref_model"], p1, r1.usage.completion_tokens)
    turn2 = turn1 + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "JULIET: and then?"},
    ]
    p2 = tok.apply_chat_template(turn2, add_generation_prompt=True)
    # the KV cache of turn 1 holds its prompt and all generated tokens but the last
    want = min(common_prefix(p1 + gen1[:-1], p2), len(p2) - 1)
    assert want > len(p1) // 2
    for stream in (False, True):
        if stream:
            chunks = list(
                client.chat.completions.create(
                    model="tiny",
                    messages=turn2,
                    max_tokens=NEW,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            use = chunks[-1].usage
        else:
            r2 = client.chat.completions.create(
                model="tiny", messages=turn2, max_tokens=NEW, temperature=0
            )
            text, use = r2.choices[0].message.content, r2.usage
        # the second time, turn 2 itself is cached: all its prompt but the last token
        assert use.prompt_tokens_details.cached_tokens == (len(p2) - 1 if stream else want)
        assert text == greedy(srv["ref_model"], tok, p2)[0]  # same answer as without a cache


def test_completions_hit_the_cache_and_report_it(srv):
    server, client = srv["server"], srv["client"]
    assert idle(server)
    server.engine.prompt_cache.clear()
    p = PROMPTS[6]
    first = client.completions.create(model="tiny", prompt=p, max_tokens=NEW, temperature=0)
    again = client.completions.create(model="tiny", prompt=p, max_tokens=NEW, temperature=0)
    n = len(srv["tokenizer"].encode(p))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == n - 1
    assert first.choices[0].text == again.choices[0].text == srv["refs"][("text", p)][0]


def test_prompt_cache_is_bounded_in_bytes_lru():
    from mlx_lm.models.cache import KVCache

    from mlx_ternary.serve.prompt_cache import PromptCache

    def entry(n):
        c = KVCache()
        c.update_and_fetch(mx.ones((1, 2, n, 8)), mx.ones((1, 2, n, 8)))
        return [c]

    per = 2 * 2 * 8 * 4  # bytes per token: keys + values, 2 heads x 8 dims, float32
    store = PromptCache(max_bytes=25 * per)
    store.insert(list(range(10)), entry(10))
    store.insert(list(range(100, 110)), entry(10))
    assert store.nbytes == 20 * per and len(store) == 2
    assert store.fetch(list(range(5)) + [7, 7])[1] == 5  # the longest shared prefix
    store.insert(list(range(200, 210)), entry(10))  # over the bound: LRU goes
    assert store.nbytes == 20 * per
    assert store.fetch(list(range(100, 110)) + [1])[1] == 0  # 100.. was least recent
    assert store.fetch(list(range(10)) + [1])[1] == 10
    store.insert(list(range(12)), entry(12))  # extends 0..9: replaces it
    assert len(store) == 2 and store.nbytes == 22 * per
    cache, n = store.fetch(list(range(12)))
    assert n == 11 and cache[0].keys.shape[2] == 11


# ----------------------------------------------------------------------------- logprobs


def log_softmax_rows(model, tokens):
    """The model's log softmax over `tokens`, run with a KV cache as serve runs it (the fused
    CPU block keeps its keys and values in float16)."""
    from mlx_lm.models.cache import make_prompt_cache

    logits = model(mx.array(tokens)[None], cache=make_prompt_cache(model))[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_chat_logprobs_are_the_models_log_softmax(srv):
    tok = srv["tokenizer"]
    msgs = [{"role": "user", "content": PROMPTS[7]}]
    r = srv["client"].chat.completions.create(
        model="tiny", messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5
    )
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)
    ids = greedy_ids(srv["ref_model"], prompt, 8)
    rows = log_softmax_rows(srv["ref_model"], prompt + ids)[len(prompt) - 1 :]
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for i, item in enumerate(content):
        want = rows[i]
        assert item.token == tok.decode([ids[i]])
        assert item.logprob == pytest.approx(want[ids[i]].item(), abs=1e-4)
        top = mx.argsort(-want)[:5].tolist()
        assert [t.token for t in item.top_logprobs] == [tok.decode([t]) for t in top]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(
            [want[t].item() for t in top], abs=1e-4
        )
    # negative control: the rows of another position do not fit
    assert content[1].logprob != pytest.approx(rows[0][ids[1]].item(), abs=1e-4)


def test_completion_echo_gives_prompt_logprobs(srv):
    tok, client = srv["tokenizer"], srv["client"]
    p = PROMPTS[8] + " and so on"
    ids = tok.encode(p)
    rows = log_softmax_rows(srv["ref_model"], ids)
    for max_tokens in (0, 1):  # lm-eval's loglikelihood asks for 1 (older versions 0)
        r = client.completions.create(
            model="tiny", prompt=p, max_tokens=max_tokens, temperature=0, echo=True, logprobs=1
        )
        lp = r.choices[0].logprobs
        assert r.choices[0].text.startswith(tok.decode(ids))
        assert len(lp.tokens) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.text_offset[0] == 0
        got = lp.token_logprobs[1 : len(ids)]
        assert got == pytest.approx(
            [rows[i - 1][ids[i]].item() for i in range(1, len(ids))], abs=1e-4
        )
        top = [max(d, key=d.get) for d in lp.top_logprobs[1 : len(ids)]]
        assert top == [tok.decode([int(mx.argmax(rows[i]).item())]) for i in range(len(ids) - 1)]
    streamed = list(
        client.completions.create(
            model="tiny", prompt=p, max_tokens=2, temperature=0, echo=True, logprobs=0, stream=True
        )
    )
    assert streamed[0].choices[0].text == tok.decode(ids)
    assert streamed[0].choices[0].logprobs.token_logprobs[1:] == pytest.approx(got, abs=1e-4)


# ----------------------------------------------------------------------------- Anthropic


def test_anthropic_messages_text_system_stream_and_stop(srv):
    tok, claude = srv["tokenizer"], srv["claude"]
    system, p = "You are Nurse.", PROMPTS[9]
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": p}],
        add_generation_prompt=True,
    )
    text, reason, n = greedy(srv["ref_model"], tok, prompt)
    ask = dict(
        model="tiny",
        max_tokens=NEW,
        system=system,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": p}],
    )
    m = claude.messages.create(**ask)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text == text
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[reason]
    assert m.usage.output_tokens == n
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(prompt)
    with claude.messages.stream(**ask) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text and final.content[0].text == text
    assert final.usage.output_tokens == n
    stop = text[4:6]
    m = claude.messages.create(**ask, stop_sequences=[stop])
    assert m.content[0].text == text[: text.find(stop)]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop


def test_anthropic_errors_have_anthropics_shape(srv):
    claude = srv["claude"]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model="tiny",
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
        )
    assert "image" in e.value.message
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(
            model="claude-9", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    status, data = raw_post(
        srv["port"],
        "/v1/messages",
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
    )
    body = json.loads(data)
    assert status == 400 and body["type"] == "error"
    assert (
        body["error"]["type"] == "invalid_request_error"
        and "max_tokens" in body["error"]["message"]
    )


def test_sixteen_multi_turn_clients_get_their_answers_within_the_plan(srv):
    from mlx_ternary.memory import plan

    server, client, tok = srv["server"], srv["client"], srv["tokenizer"]
    cfg = server.config
    assert idle(server)
    mx.clear_cache()
    baseline = mx.get_active_memory()
    mx.reset_peak_memory()

    def conversation(p):
        msgs = [{"role": "user", "content": p}]
        r1 = client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=12, temperature=0
        )
        msgs += [
            {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": "and then?"},
        ]
        r2 = client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=12, temperature=0
        )
        return msgs, r2.choices[0].message.content, r2.usage.prompt_tokens_details.cached_tokens

    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(conversation, PROMPTS, timeout=300))
    peak = mx.get_peak_memory() - baseline
    for msgs, text, cached in results:
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)
        assert text == greedy(srv["ref_model"], tok, prompt, 12)[0]
        assert cached > 0  # turn 2 reused turn 1
    mem = plan(
        srv["ref_model"],
        cfg.max_context,
        batch=cfg.max_concurrency,
        prefill_step_size=cfg.prefill_step_size,
        prompt_cache=cfg.prompt_cache_bytes,
    )
    assert peak <= mem.kv_cache + mem.prompt_cache + mem.batching + mem.activations
