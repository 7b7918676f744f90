"""`serve --draft-model`: a request running alone decodes speculatively (mlx-lm's
speculative step), hands over to the batch when a second one arrives, and every answer
equals mlx-lm's greedy decoding without a draft; /metrics counts drafted and accepted
tokens.

The engine runs alone for the backends and the hand-over (a subclass submits the second
job right after the first one's second round, so the hand-over point is fixed), then the
HTTP server end to end with the openai client.
"""

import random
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from click.testing import CliRunner
from mlx_lm import stream_generate
from tiny import ternary_checkpoint

import mlx_ternary
from mlx_ternary.cli import main
from mlx_ternary.generate import EMBEDDED_MODEL
from mlx_ternary.serve.engine import Engine, Job
from mlx_ternary.serve.http import ServeConfig, Server

GREEDY = dict(temperature=0, top_p=1, top_k=0, min_p=0)
K = 3  # draft tokens a round


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return ternary_checkpoint(tmp_path_factory.mktemp("draft"), "llama", "fast", "row")[0]


def greedy(model, tokenizer, prompt, max_tokens):
    """mlx-lm's greedy tokens without a draft, end-of-sequence dropped."""
    ids = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]
    return [t for t in ids if t not in tokenizer.eos_token_ids]


class SecondArrives(Engine):
    """Submits `then` right after the speculating job's second round."""

    then = None
    rounds = 0

    def _speculate(self, gen):
        super()._speculate(gen)
        self.rounds += 1
        if self.rounds == 2 and self.then is not None:
            self.submit(self.then)


def job(prompt, max_tokens):
    return Job(prompt=prompt, max_tokens=max_tokens, sampling=GREEDY, logprobs=0)


def tokens(j: Job):
    out = []
    while True:
        event = j.events.get(timeout=120)
        if event[0] == "error":
            raise AssertionError(event[1])
        if event[0] == "text":
            out += [r["id"] for r in event[2]]
        if event[0] == "done":
            return out


@pytest.mark.parametrize("backend", ["native", "emulate", "reference"])
def test_alone_speculates_two_batch_and_answers_equal_greedy(path, backend):
    model, tok = mlx_ternary.load(str(path), backend=backend)
    draft, _ = mlx_ternary.load(str(path), backend=backend)  # itself: every draft accepted
    rng = random.Random(0)
    a, b = [rng.randrange(2, 128) for _ in range(9)], [rng.randrange(2, 128) for _ in range(14)]
    want_a, want_b = greedy(model, tok, a, 20), greedy(model, tok, b, 12)
    engine = SecondArrives(model, tok, 4, 8, prompt_cache_bytes=1 << 26, draft_model=draft)
    engine.num_draft_tokens = K
    engine.then = job_b = job(b, 12)
    engine.start()
    try:
        job_a = job(a, 20)
        engine.submit(job_a)
        assert len(want_a) == 20 and len(want_b) == 12  # no end-of-sequence: a runs on in the batch
        assert tokens(job_a) == want_a and tokens(job_b) == want_b
        # a went to the batch after two rounds of K drafts each; b never speculated
        assert engine.draft_tokens_proposed == engine.draft_tokens_accepted == 2 * K
        # Alone again, on a prompt-cache hit: speculates from the cached prefix.
        engine.then = None
        again = a + want_a + [5, 6, 7]
        job_c = job(again, 10)
        engine.submit(job_c)
        assert tokens(job_c) == greedy(model, tok, again, 10)
        assert job_c.cached_tokens > len(a)
        assert engine.draft_tokens_proposed == engine.draft_tokens_accepted > 2 * K
    finally:
        engine.stop()


def _draft_counts(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return (
        int(values["mlx_ternary_draft_tokens_total"]),
        int(values["mlx_ternary_draft_tokens_accepted_total"]),
    )


def test_http_answers_equal_greedy_and_metrics_count_drafts(path, tmp_path):
    other, _ = ternary_checkpoint(tmp_path, "llama", "compact", seed=1)  # a draft that errs
    model, tok = mlx_ternary.load(str(path))
    draft, _ = mlx_ternary.load(str(other))
    prompts = ["the fox", "a lazy dog", "ROMEO:", "xyz", "Once upon"]
    want = {p: tok.decode(greedy(model, tok, tok.encode(p), 16)) for p in prompts}
    server = Server(
        model,
        tok,
        ServeConfig(model_name="tiny", max_context=128, num_draft_tokens=2),
        "127.0.0.1",
        0,
        draft_model=draft,
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60
    )

    def ask(p):
        answer = client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0)
        return answer.choices[0].text

    try:
        assert _draft_counts(port) == (0, 0)
        assert ask(prompts[0]) == want[prompts[0]]
        drafted, accepted = _draft_counts(port)
        assert 0 < drafted and accepted < drafted
        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(ask, prompts)) == [want[p] for p in prompts]
    finally:
        server.shutdown()
        server.server_close()


def test_serve_refuses_an_incompatible_draft(path):
    res = CliRunner().invoke(
        main, ["serve", "--model", str(path), "--draft-model", str(EMBEDDED_MODEL), "--port", "0"]
    )
    assert res.exit_code == 1
    assert "vocabulary differs from the target model's" in res.output


def test_quantized_kv_and_a_cancelled_speculation(tmp_path):
    """With --kv-bits 8 the speculating job equals the same engine's batch decoding
    without a draft; a speculating job cancelled mid-answer frees the engine for the next."""
    path, _ = ternary_checkpoint(tmp_path, "llama", num_attention_heads=2, num_key_value_heads=1)
    model, tok = mlx_ternary.load(str(path))  # head size 32: one KV quantization group
    draft, _ = mlx_ternary.load(str(path))
    prompt = [9, 40, 77, 3, 101, 55, 12]
    plain = Engine(model, tok, 2, 8, kv_bits=8, kv_group_size=32)
    spec = Engine(model, tok, 2, 8, kv_bits=8, kv_group_size=32, draft_model=draft)
    plain.start()
    spec.start()
    try:
        plain_job, first = job(prompt, 24), job(prompt, 24)
        plain.submit(plain_job)
        spec.submit(first)
        assert tokens(first) == tokens(plain_job)
        assert spec.draft_tokens_accepted == spec.draft_tokens_proposed > 0
        gone = job(prompt, 200)
        spec.submit(gone)
        assert gone.events.get(timeout=60)[0] == "text"
        gone.cancelled.set()
        after = job(prompt[:4], 12)
        spec.submit(after)
        assert tokens(after) == greedy(model, tok, prompt[:4], 12)
        assert spec.speculation is None and not spec.active
    finally:
        plain.stop()
        spec.stop()
