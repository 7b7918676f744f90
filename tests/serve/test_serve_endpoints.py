"""/tokenize, /detokenize (llama-server's and vLLM's shapes), /tokenizer_info, /metrics.

References: the tokenizer itself, and prometheus_client's own text-format parser.
"""

import http.client
import json
import threading

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny import ternary_checkpoint

import mlx_ternary
from mlx_ternary.serve.http import ServeConfig, Server

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path, _ = ternary_checkpoint(tmp_path_factory.mktemp("ep"), "llama")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    model, tok = mlx_ternary.load(str(path))
    config = ServeConfig(model_name="tiny", max_context=256, prefill_step_size=32)
    server = Server(model, tok, config, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, tok
    server.shutdown()
    server.server_close()


def call(server, method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    conn.request(method, path, body=None if body is None else json.dumps(body).encode())
    resp = conn.getresponse()
    status, kind, data = resp.status, resp.getheader("Content-Type"), resp.read()
    conn.close()
    return status, kind, data


def test_tokenize_and_detokenize_in_both_shapes(srv):
    server, tok = srv
    text = "ROMEO: but soft, what light"
    status, _, data = call(server, "POST", "/tokenize", {"content": text})
    ids = tok.encode(text, add_special_tokens=False)
    assert status == 200 and json.loads(data) == {"tokens": ids}
    _, _, data = call(server, "POST", "/tokenize", {"content": "ab", "with_pieces": True})
    assert json.loads(data)["tokens"] == [
        {"id": t, "piece": tok.decode([t])} for t in tok.encode("ab", add_special_tokens=False)
    ]
    _, _, data = call(server, "POST", "/tokenize", {"prompt": text, "model": "tiny"})
    assert json.loads(data) == {"count": len(ids), "max_model_len": 256, "tokens": tok.encode(text)}
    _, _, data = call(server, "POST", "/detokenize", {"tokens": ids})
    assert json.loads(data) == {"content": tok.decode(ids), "prompt": tok.decode(ids)}
    assert tok.decode(ids) == text  # the round trip, against the tokenizer itself
    assert call(server, "POST", "/detokenize", {"tokens": [10**9]})[0] == 400
    assert call(server, "POST", "/tokenize", {"content": 3})[0] == 400
    assert call(server, "POST", "/tokenize", {"content": "a", "model": "x"})[0] == 404


def test_tokenizer_info(srv):
    server, _ = srv
    status, _, data = call(server, "GET", "/tokenizer_info")
    info = json.loads(data)
    assert status == 200 and info["eos_token"] == "</s>" and info["bos_token"] == "<s>"
    assert info["chat_template"] == TEMPLATE


def test_metrics_parse_with_prometheus_client(srv):
    server, tok = srv
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="x", max_retries=0
    )
    before = server.engine.tokens_generated
    r = client.completions.create(model="tiny", prompt="ab", max_tokens=6, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny", prompt="abc", max_tokens=6, temperature=0, stream=True
        )
    )
    assert chunks and call(server, "GET", "/nope")[0] == 404
    generated = server.engine.tokens_generated - before
    assert generated >= r.usage.completion_tokens + 1
    status, kind, data = call(server, "GET", "/metrics")
    assert status == 200 and kind.startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(data.decode())}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    key = lambda name, **lb: (name, tuple(sorted(lb.items())))  # noqa: E731
    assert samples[key("mlx_ternary_requests_total", path="/v1/completions", status="200")] >= 2
    assert samples[key("mlx_ternary_requests_total", path="other", status="404")] >= 1
    assert families["mlx_ternary_time_to_first_token_seconds"].type == "histogram"
    ttft = samples[key("mlx_ternary_time_to_first_token_seconds_count")]
    per_token = samples[key("mlx_ternary_time_per_output_token_seconds_count")]
    assert ttft >= 2 and per_token >= generated - ttft
    inf = samples[key("mlx_ternary_time_to_first_token_seconds_bucket", le="+Inf")]
    assert inf == ttft
    total = samples[key("mlx_ternary_generation_tokens_total")]
    assert total == server.engine.tokens_generated
    assert samples[key("mlx_ternary_prompt_tokens_total")] >= 2
    assert samples[key("mlx_ternary_prompt_cache_bytes")] == server.engine.prompt_cache.nbytes > 0
    for gauge in ("queue_depth", "batch_size", "kv_cache_bytes"):
        assert families[f"mlx_ternary_{gauge}"].type == "gauge"


def test_the_chat_page_is_one_self_contained_file(srv):
    server, _ = srv
    status, kind, data = call(server, "GET", "/")
    page = data.decode()
    assert status == 200 and kind.startswith("text/html")
    assert "/v1/chat/completions" in page and "stream: true" in page and 'id="stop"' in page
    assert "src=" not in page and "<link" not in page and "https://" not in page  # no CDN
