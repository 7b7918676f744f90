"""serve on a network: model names, the API key, CORS, keep-alive, timeouts, bounds, drain.

Clients: the `openai` and `anthropic` SDKs and raw sockets, over loopback only.
"""

import http.client
import json
import socket
import threading
import time

import anthropic
import openai
import pytest
from tiny import ternary_checkpoint

import mlx_ternary
from mlx_ternary.serve.http import PUBLIC, ROUTES, ServeConfig, Server, exposure_warning
from mlx_ternary.serve.openai import short_name

KEY = "sk-test-0123456789"
ORIGIN = "http://app.example"


def start(model, tok, **cfg):
    config = ServeConfig(model_name="tiny", max_context=256, prefill_step_size=32, **cfg)
    server = Server(model, tok, config, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    path, _ = ternary_checkpoint(tmp_path_factory.mktemp("net"), "llama")
    return path, *mlx_ternary.load(str(path))


@pytest.fixture(scope="module")
def srv(lm):
    _, model, tok = lm
    server = start(model, tok, aliases=["alias-a", "alias-b"], api_key=KEY, cors_origins=[ORIGIN])
    yield server
    server.shutdown()
    server.server_close()


def url(server):
    return f"http://127.0.0.1:{server.server_address[1]}"


def request(server, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers=headers or {})
    resp = conn.getresponse()
    out = resp.status, dict(resp.getheaders()), resp.read()
    conn.close()
    return out


def test_short_names(tmp_path):
    (tmp_path / "bitnet-2b").mkdir()
    (tmp_path / "model-q.gguf").write_bytes(b"GGUF")
    assert short_name(str(tmp_path / "bitnet-2b")) == "bitnet-2b"
    assert short_name(str(tmp_path / "bitnet-2b") + "/") == "bitnet-2b"
    assert short_name(str(tmp_path / "model-q.gguf")) == "model-q"
    assert short_name("microsoft/bitnet-b1.58-2B-4T") == "microsoft/bitnet-b1.58-2B-4T"


def test_every_listed_name_is_accepted_and_others_404(srv):
    client = openai.OpenAI(base_url=url(srv) + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny", "alias-a", "alias-b"]
    for name in ("tiny", "alias-a", "alias-b"):
        r = client.completions.create(model=name, prompt="ab", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="other", prompt="ab", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    claude = anthropic.Anthropic(base_url=url(srv), api_key=KEY, max_retries=0)
    msg = [{"role": "user", "content": "hi"}]
    assert claude.messages.create(model="alias-b", max_tokens=2, messages=msg).content
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="other", max_tokens=2, messages=msg)
    assert e.value.body["error"]["type"] == "not_found_error"


def test_a_refused_request_with_a_body_keeps_the_connection(srv):
    """A wrong key on a POST is refused before its body is read; the body is then read, so
    the 401 arrives (closing with unread bytes resets the connection, which the SDKs report
    as a connection error) and the same connection serves the next request."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
    body = json.dumps({"model": "tiny", "prompt": "a" * 100_000, "max_tokens": 1}).encode()
    for _ in range(3):
        conn.request("POST", "/v1/completions", body=body, headers={"x-api-key": "nope"})
        resp = conn.getresponse()
        assert resp.status == 401 and json.loads(resp.read())["error"]["code"] == "invalid_api_key"
    conn.request("GET", "/v1/models", headers={"x-api-key": KEY})
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["data"]
    conn.close()
    # a body over the limit is not read: that connection is closed after the refusal
    raw = socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=30)
    raw.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nx-api-key: nope\r\n"
        b"Content-Length: 999999999999\r\n\r\n"
    )
    reply = raw.recv(65536)
    assert reply.startswith(b"HTTP/1.") and b" 401 " in reply.split(b"\r\n", 1)[0]
    raw.close()


def test_the_api_key_is_required_on_every_path_but_health(srv):
    assert request(srv, "GET", "/health")[0] == 200
    for (method, path), _ in ROUTES.items():
        if path in PUBLIC:
            continue
        body = {} if method == "POST" else None
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": KEY[:-1]}):
            status, head, data = request(srv, method, path, body, headers)
            assert status == 401, (method, path, headers)
            err = json.loads(data)
            if "messages" in path:
                assert err == {"type": "error", "error": err["error"]}
                assert err["error"]["type"] == "authentication_error"
            else:
                assert err["error"]["code"] == "invalid_api_key"
        # negative control: the right key gets past the check (400 for the empty body)
        for good in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
            assert request(srv, method, path, body, good)[0] in (200, 400), (method, path)


def test_sdks_with_the_right_and_wrong_key(srv):
    msg = [{"role": "user", "content": "hi"}]
    good = openai.OpenAI(base_url=url(srv) + "/v1", api_key=KEY, max_retries=0)
    assert good.chat.completions.create(model="tiny", messages=msg, max_tokens=2).choices
    bad = openai.OpenAI(base_url=url(srv) + "/v1", api_key="nope", max_retries=0)
    for call in (
        lambda: bad.models.list(),
        lambda: bad.completions.create(model="tiny", prompt="a", max_tokens=2),
        lambda: bad.chat.completions.create(model="tiny", messages=msg, max_tokens=2),
        lambda: list(bad.chat.completions.create(model="tiny", messages=msg, stream=True)),
    ):
        with pytest.raises(openai.AuthenticationError):
            call()
    claude = anthropic.Anthropic(base_url=url(srv), api_key=KEY, max_retries=0)
    assert claude.messages.create(model="tiny", max_tokens=2, messages=msg).content
    wrong = anthropic.Anthropic(base_url=url(srv), api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model="tiny", max_tokens=2, messages=msg)


def test_cors_preflight_and_headers(srv):
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    status, head, _ = request(srv, "OPTIONS", "/v1/chat/completions", headers=pre)
    assert status == 204 and head["Access-Control-Allow-Origin"] == ORIGIN
    assert "authorization" in head["Access-Control-Allow-Headers"].lower()
    status, head, _ = request(
        srv, "GET", "/v1/models", headers={"Origin": ORIGIN, "x-api-key": KEY}
    )
    assert status == 200 and head["Access-Control-Allow-Origin"] == ORIGIN
    status, head, _ = request(srv, "GET", "/v1/models", headers={"Origin": "http://evil"})
    assert "Access-Control-Allow-Origin" not in head  # not an allowed origin


def test_keep_alive_serves_requests_on_one_connection(srv):
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
    socks = []
    for _ in range(3):
        conn.request("GET", "/v1/models", headers={"x-api-key": KEY})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.version == 11 and json.loads(resp.read())["data"]
        socks.append(conn.sock)
    assert socks[0] is not None and socks[0] is socks[1] is socks[2]  # never reconnected
    conn.close()


def test_bounds_timeout_and_drain(lm):
    _, model, tok = lm
    server = start(model, tok, read_timeout=1.0, max_connections=3)
    try:
        idle = [socket.create_connection(("127.0.0.1", server.server_address[1])) for _ in range(3)]
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5) as s:
            busy = s.recv(65536)
        assert busy.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in busy
        for s in idle:  # the read timeout closes a connection that sends nothing
            s.settimeout(5)
            assert s.recv(10) == b""
            s.close()
        time.sleep(0.2)
        assert request(server, "GET", "/health")[0] == 200  # room again
        client = openai.OpenAI(base_url=url(server) + "/v1", api_key="x", max_retries=0)
        stream = client.completions.create(
            model="tiny", prompt="ab", max_tokens=60, temperature=0, stream=True
        )
        first = next(iter(stream))
        server.track(+1)  # one more request in flight, held until the checks below are done
        drained = {}
        t = threading.Thread(target=lambda: drained.update(ok=server.drain(20)))
        t.start()
        time.sleep(0.2)
        status, head, _ = request(server, "POST", "/v1/completions", {"prompt": "a"})
        assert status == 503 and head["Retry-After"] == "1"
        rest = list(stream)  # the in-flight stream finishes
        assert rest[-1].choices[0].finish_reason is not None
        assert len(first.choices[0].text + "".join(c.choices[0].text for c in rest)) > 0
        assert request(server, "GET", "/health")[0] == 503  # draining
        assert t.is_alive()  # waiting for the held request
        server.track(-1)
        t.join(30)
        assert drained == {"ok": True}
    finally:
        server.server_close()


def test_exposure_warning():
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("localhost", None) is None
    assert exposure_warning("::1", None) is None
    assert "--api-key" in exposure_warning("0.0.0.0", None)
    assert exposure_warning("0.0.0.0", "k") is None
