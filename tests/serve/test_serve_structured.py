"""Structured output and the quantized KV cache, on the embedded tiny-shakespeare model.

JSON answers are checked with `jsonschema` (an independent validator); the batched
quantized cache against mlx-lm's own single-sequence QuantizedKVCache.
"""

import concurrent.futures as cf
import json
import threading

import jsonschema
import mlx.core as mx
import numpy as np
import openai
import pytest

import mlx_ternary  # noqa: E402
from mlx_ternary.generate import EMBEDDED_MODEL  # noqa: E402
from mlx_ternary.serve.http import ServeConfig, Server  # noqa: E402

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "mood", "tags", "alive"],
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["merry", "sad", "wroth"]},
        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 6}},
        "alive": {"type": "boolean"},
    },
}
ASK = [{"role": "user", "content": "ROMEO: Who art thou?"}]


def start(model, tokenizer, **kw):
    server = Server(
        model,
        tokenizer,
        ServeConfig(
            model_name="tiny", max_context=256, prefill_step_size=64, max_concurrency=8, **kw
        ),
        "127.0.0.1",
        0,
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.server_address[1]}/v1",
        api_key="none",
        max_retries=0,
        timeout=120,
    )
    return server, client


@pytest.fixture(scope="module")
def srv():
    model, tokenizer = mlx_ternary.load(str(EMBEDDED_MODEL))
    server, client = start(model, tokenizer)
    yield dict(server=server, client=client, tokenizer=tokenizer)
    server.shutdown()
    server.server_close()


def outside_strings(text: str) -> str:
    """The characters of a JSON text that are not inside string literals."""
    out, inside, escaped = [], False, False
    for ch in text:
        if inside:
            inside = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
        elif ch == '"':
            inside = True
        else:
            out.append(ch)
    return "".join(out)


def test_json_schema_answers_always_match_the_schema(srv):
    client, server = srv["client"], srv["server"]
    runs = [(seed, t) for seed in range(3) for t in (0.0, 0.8, 1.3)]
    seen = []

    def ask(run):
        seed, temperature = run
        r = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=120,
            seed=seed,
            temperature=temperature,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON},
            },
        )
        seen.append(len(server.engine.active))
        return r.choices[0]

    with cf.ThreadPoolExecutor(len(runs)) as pool:
        choices = list(pool.map(ask, runs, timeout=300))
    for run, choice in zip(runs, choices):
        text = choice.message.content
        jsonschema.validate(json.loads(text), PERSON)
        assert choice.finish_reason == "stop", (run, text)  # finished well within max_tokens
        assert not any(c.isspace() for c in outside_strings(text)), text  # compact
    assert max(seen) > 1  # the constrained requests shared the batch
    assert len({c.message.content for c in choices}) > 1  # sampling still samples
    # negative control: the same model unconstrained writes Shakespeare, not JSON
    free = (
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, temperature=0)
        .choices[0]
        .message.content
    )
    with pytest.raises(ValueError):
        json.loads(free)


def test_json_object_and_streamed_schema(srv):
    client = srv["client"]
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        max_tokens=100,
        seed=5,
        temperature=1.0,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # an unbounded object may run out of tokens, but never leaves the grammar
        assert r.choices[0].message.content.startswith("{")
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="JULIET:",
            max_tokens=120,
            seed=1,
            temperature=0.9,
            stream=True,
            extra_body={
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": PERSON},
                }
            },
        )
    )
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks)), PERSON)


@pytest.mark.parametrize(
    "schema,word",
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "string", "frobnicate": 1}, "frobnicate"),
        ({"type": "string", "format": "no-such-format"}, "format"),
    ],
)
def test_unsupported_schema_is_a_400_naming_it(srv, schema, word):
    with pytest.raises(openai.BadRequestError) as e:
        srv["client"].chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    assert word in e.value.message


# ----------------------------------------------------------------------------- --kv-bits


def test_batched_quantized_cache_equals_mlx_lm_single_caches():
    from mlx_lm.models.base import scaled_dot_product_attention
    from mlx_lm.models.cache import QuantizedKVCache

    from mlx_ternary.serve.kv_quant import BatchQuantizedKV, QuantizedKV

    rng = np.random.default_rng(0)
    H, D, lengths = 2, 64, [5, 9, 3]
    kv = [
        (
            mx.array(rng.normal(size=(1, H, n, D)).astype(np.float32)),
            mx.array(rng.normal(size=(1, H, n, D)).astype(np.float32)),
        )
        for n in lengths
    ]
    q = mx.array(rng.normal(size=(len(lengths), 4, 1, D)).astype(np.float32))
    new_k = mx.array(rng.normal(size=(len(lengths), H, 1, D)).astype(np.float32))
    new_v = mx.array(rng.normal(size=(len(lengths), H, 1, D)).astype(np.float32))
    refs, singles = [], []
    for i, (k, v) in enumerate(kv):
        ref = QuantizedKVCache(bits=8)
        ref.update_and_fetch(k, v)
        keys, values = ref.update_and_fetch(new_k[i : i + 1], new_v[i : i + 1])
        refs.append(scaled_dot_product_attention(q[i : i + 1], keys, values, ref, 0.125, None))
        single = QuantizedKV(bits=8)
        single.update_and_fetch(k, v)
        singles.append(single)
    batch = BatchQuantizedKV.merge(singles[:2])
    batch.extend(BatchQuantizedKV.merge(singles[2:]))
    mask = batch.make_mask(1)
    keys, values = batch.update_and_fetch(new_k, new_v)
    out = scaled_dot_product_attention(q, keys, values, batch, 0.125, mask)
    for i, ref in enumerate(refs):
        np.testing.assert_allclose(np.array(out[i]), np.array(ref[0]), atol=1e-5)
    back = batch.extract(1)
    assert back.offset == lengths[1] + 1 and back.keys[0].shape[2] == lengths[1] + 1
    batch.filter([2])  # the padding both others needed goes with them
    assert batch.size() == lengths[2] + 1
    # negative control: without the padding mask the short sequences see zeros
    out = scaled_dot_product_attention(q, keys, values, batch, 0.125, None)
    assert not np.allclose(np.array(out[2]), np.array(refs[2][0]), atol=1e-3)


def quantized_reference(model, tokens, n):
    """(greedy ids, their log-softmax) with mlx-lm's QuantizedKVCache from the first token."""
    from mlx_lm.models.cache import QuantizedKVCache

    cache = [QuantizedKVCache(bits=8) for _ in model.layers]
    logits = model(mx.array(tokens)[None], cache=cache)[0, -1]
    ids, lps = [], []
    for _ in range(n):
        lp = logits - mx.logsumexp(logits)
        ids.append(int(mx.argmax(lp).item()))
        lps.append(lp[ids[-1]].item())
        logits = model(mx.array([[ids[-1]]]), cache=cache)[0, -1]
    return ids, lps


def test_kv_bits_serve_batches_and_matches_mlx_lm_quantized_cache(srv):
    model, tok = mlx_ternary.load(str(EMBEDDED_MODEL))
    ref_model, _ = mlx_ternary.load(str(EMBEDDED_MODEL))
    server, client = start(model, tok, kv_bits=8)
    try:
        prompts = ["ROMEO:", "JULIET: O", "First Citizen:\nBefore", "KING:"]
        seen = []

        def ask(p):
            r = client.completions.create(
                model="tiny", prompt=p, max_tokens=12, temperature=0, logprobs=0
            )
            seen.append(len(server.engine.active))
            return r.choices[0]

        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(ask, prompts, timeout=300))
        assert max(seen) > 1
        for p, choice in zip(prompts, got):
            ids, lps = quantized_reference(ref_model, tok.encode(p), len(choice.logprobs.tokens))
            assert choice.logprobs.tokens == [tok.decode([i]) for i in ids]
            assert choice.logprobs.token_logprobs == pytest.approx(lps, abs=2e-3)
        entries = list(server.engine.prompt_cache._entries.values())
        assert entries and all(c.bits == 8 for c in entries[0][0])
        again = client.completions.create(
            model="tiny", prompt=prompts[2], max_tokens=12, temperature=0, logprobs=0
        )
        assert again.usage.prompt_tokens_details.cached_tokens == len(tok.encode(prompts[2])) - 1
        assert again.choices[0].logprobs.tokens == got[2].logprobs.tokens  # from the 8-bit cache
        # negative control: the float cache's logprobs differ beyond that tolerance
        plain = srv["client"].completions.create(
            model="tiny", prompt=prompts[0], max_tokens=12, temperature=0, logprobs=0
        )
        assert plain.choices[0].logprobs.token_logprobs != pytest.approx(
            got[0].logprobs.token_logprobs, abs=1e-5
        )
    finally:
        server.shutdown()
        server.server_close()


def test_plan_counts_the_prompt_cache_and_kv_bits():
    from mlx_ternary.memory import kv_bytes, parse_bytes, plan

    model, _ = mlx_ternary.load(str(EMBEDDED_MODEL), lazy=True)
    full = kv_bytes(model, 512, 4)
    q8 = kv_bytes(model, 512, 4, kv_bits=8)
    # 4 layers x 4 heads x 64 dims x 2 (K, V) x 512 tokens x 4 sequences, float16 with the
    # fused CPU block (its cache: runtime/cpu/block.py kv_dtype), else float32
    elems = 4 * 4 * 64 * 2 * 512 * 4
    from mlx_ternary.memory import fused_blocks

    assert full == elems * (2 if fused_blocks(model) else 4)
    assert q8 == elems * (1 + 2 * 4 / 64)  # 1 byte + a float32 scale and bias per 64
    p = plan(model, 512, batch=4, kv_bits=8, prompt_cache=parse_bytes("3MB"))
    assert p.prompt_cache == 3 * 1024**2
    # continuous batching: 255 positions of step slack per sequence + one sequence's copy
    per_token = q8 // (4 * 512)
    assert p.batching == 4 * 255 * per_token + 512 * per_token
    total = p.weights_total + q8 + p.prompt_cache + p.batching + p.activations + p.overhead
    assert p.total == total
    assert any("prompt cache" in line for line in p.lines())
    assert parse_bytes("1.5GiB") == int(1.5 * 1024**3) and parse_bytes("0") == 0
    with pytest.raises(ValueError):
        parse_bytes("lots")
