"""Turn 2 answered from the prompt cache equals an uncached run of the same prompt.

The engine runs alone (no HTTP): a 2-layer llama, turn 1 decoded in a batch with other
sequences of other lengths (left padding in the batch cache), turn 2 = turn 1's prompt,
its answer and more, over prefill chunks that do not line up with the cached length.
Compared: the greedy tokens and the top-5 logprobs of every answer token (1e-4).
"""

import random
import threading

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
