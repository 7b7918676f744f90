"""Turn 2 answered from the prompt cache equals an uncached run of the same prompt.

The engine runs alone (no HTTP): a 2-layer llama, turn 1 decoded in a batch with other
sequences of other lengths (left padding in the batch cache), turn 2 = turn 1's prompt,
its answer and more, over prefill chunks that do not line up with the cached length.
Compared: the greedy tokens and the top-5 logprobs of every answer token (1e-4).
"""

import random
import threading

import mlx.core as mx
import numpy as np
import pytest
from tiny import ternary_checkpoint

import mlx_ternary
from mlx_ternary.serve.engine import Engine, Job

GREEDY = dict(temperature=0, top_p=1, top_k=0, min_p=0)


def run(engine, prompt, max_tokens):
    """(records, cached tokens) of one greedy job with top-5 logprobs."""
    job = Job(prompt=prompt, max_tokens=max_tokens, sampling=GREEDY, logprobs=5)
    engine.submit(job)
    records = []
    while True:
        event = job.events.get(timeout=120)
        if event[0] == "text":
            records += event[2]
        if event[0] == "error":
            raise AssertionError(event[1])
        if event[0] == "done":
            return records, job.cached_tokens


def gap(a, b) -> float:
    assert [r["id"] for r in a] == [r["id"] for r in b]
    return max(
        abs(v1 - v2)
        for x, y in zip(a, b)
        for (i1, v1), (i2, v2) in zip(x["top"], y["top"])
        if i1 == i2 or pytest.fail(f"top-5 order differs: {x['top']} vs {y['top']}")
    )


@pytest.mark.parametrize("activation_bits", [None, 8])
def test_turn_two_from_the_cache_equals_an_uncached_run(tmp_path, activation_bits):
    path, _ = ternary_checkpoint(tmp_path, "llama", activation_bits=activation_bits)
    model, tok = mlx_ternary.load(str(path))
    rng = random.Random(0)
    words = lambda n: [rng.randrange(2, 128) for _ in range(n)]  # noqa: E731
    turn1 = words(300)
    cached = Engine(model, tok, 4, 64, prompt_cache_bytes=1 << 28)
    plain = Engine(model, tok, 4, 64, prompt_cache_bytes=0)
    cached.start()
    plain.start()
    try:
        others = [threading.Thread(target=run, args=(cached, words(n), 30)) for n in (9, 150)]
        for t in others:
            t.start()
        first, _ = run(cached, turn1, 24)
        for t in others:
            t.join()
        turn2 = turn1 + [r["id"] for r in first] + words(45)
        again, n = run(cached, turn2, 16)
        fresh, none = run(plain, turn2, 16)
    finally:
        cached.stop()
        plain.stop()
    assert n >= len(turn1) and none == 0  # turn 2 did come from the cache
    assert gap(again, fresh) <= 1e-4


def offline(model, prompt, max_tokens):
    """mlx-lm's own greedy decode over the whole prompt, no cache reuse: [(id, logprobs)]."""
    from mlx_lm.generate import generate_step

    steps = generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, sampler=lambda lp: mx.argmax(lp, -1)
    )
    return [(int(t), np.array(lp)) for t, lp in steps]


def plain_llama(tmp_path):
    """Stock mlx-lm llama with nn.Linear layers in float32 (no ternary layer), prepared for
    the backend mlx_ternary.load would pick (the native one: its attention and SwiGLU)."""
    from mlx_lm.utils import load_tokenizer
    from tiny import float_model, write_tokenizer

    from mlx_ternary.runtime import dispatch
    from mlx_ternary.runtime.cpu import attention, tables

    model, _ = float_model("llama", seed=3)
    backend = dispatch.resolve_backend()
    tables.adopt(model, {}, mx.float32, backend=backend)
    assert attention.routed(model) == (backend == "native")
    write_tokenizer(tmp_path / "tok")
    return model, load_tokenizer(tmp_path / "tok", eos_token_ids=[1])


def model_for(kind, tmp_path):
    if kind == "embedded":  # int8 activations
        from mlx_ternary.generate import EMBEDDED_MODEL

        return mlx_ternary.load(str(EMBEDDED_MODEL))
    if kind == "plain":
        return plain_llama(tmp_path)
    path, _ = ternary_checkpoint(tmp_path, "llama", activation_bits=None)  # float activations
    return mlx_ternary.load(str(path))


@pytest.mark.parametrize("kind", ["embedded", "float", "plain"])
def test_served_turn_two_of_a_long_chat_equals_mlx_lms_uncached_run(tmp_path, kind):
    """A >1,000-token chat: turn 1 decoded in a batch with two other sequences (left padding),
    turn 2 prefilled from the prompt cache in chunks that do not line up with it; its answer's
    top-5 logprobs equal mlx-lm's generate_step over the whole prompt offline: exactly with int8
    activations (integer sums, the same float32 epilogue), to 1e-5 with float activations (a
    ternary model's, and a plain float llama's: nn.Linear, no ternary layer)."""
    model, tok = model_for(kind, tmp_path)
    vocab = model.args.vocab_size
    rng = random.Random(1)
    words = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    turn1 = words(1000)
    engine = Engine(model, tok, 4, 96, prompt_cache_bytes=1 << 28)
    engine.start()
    try:
        others = [threading.Thread(target=run, args=(engine, words(n), 20)) for n in (17, 230)]
        for t in others:
            t.start()
        first, _ = run(engine, turn1, 12)
        for t in others:
            t.join()
        turn2 = turn1 + [r["id"] for r in first] + words(40)
        again, n = run(engine, turn2, 8)
    finally:
        engine.stop()
    assert n >= len(turn1)  # turn 2 did come from the cache
    want = offline(model, turn2, 8)
    assert [r["id"] for r in again] == [t for t, _ in want]
    worst = max(abs(v - float(lp[i])) for r, (_, lp) in zip(again, want) for i, v in r["top"])
    assert worst <= (0.0 if kind == "embedded" else 1e-5), worst
