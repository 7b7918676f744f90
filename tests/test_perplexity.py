"""The perplexity harness on tiny seeded models, against a per-token float64 reference."""

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from tiny import ternary_checkpoint

import mlx_ternary
from mlx_ternary import TernaryError
from mlx_ternary.cli import main
from mlx_ternary.perplexity import chunk_bounds, file_perplexity, perplexity

TEXT = "When shall we three meet again\nIn thunder, lightning, or in rain?\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, ternary model, tokenizer, float twin), without activation quantization."""
    path, twin = ternary_checkpoint(tmp_path_factory.mktemp("ppl"), "llama", "compact", "row")
    model, tok = mlx_ternary.load(path)
    return path, model, tok, twin


def reference_nll(model, ids, context):
    """Mean NLL where token j >= 1 is predicted from ids[start:j], start = (j-1)//context*context:
    one forward pass per token, log-softmax in float64."""
    total = 0.0
    for j in range(1, len(ids)):
        start = (j - 1) // context * context
        logits = np.array(model(mx.array(ids[start:j])[None])[0, -1], dtype=np.float64)
        m = logits.max()
        total += m + math.log(np.exp(logits - m).sum()) - logits[ids[j]]
    return total / (len(ids) - 1)


@pytest.mark.parametrize("context", [7, 64])
def test_matches_per_token_reference_of_the_float_twin(tiny, context):
    _, model, tok, twin = tiny
    ids = tok.encode(TEXT)[:40]
    got = perplexity(model, ids, context=context, batch_size=2)
    want = reference_nll(twin, ids, context)
    assert got.tokens == len(ids) - 1
    assert got.chunks == math.ceil((len(ids) - 1) / context)
    assert got.nll == pytest.approx(want, rel=1e-4)
    assert got.perplexity == pytest.approx(math.exp(want), rel=1e-4)
    assert got.tokens_per_sec > 0


def test_window_boundaries_matter(tiny):
    # Negative control for the reference above: a shorter context must change the result.
    _, model, tok, _ = tiny
    ids = tok.encode(TEXT)[:40]
    assert (
        abs(perplexity(model, ids, context=3).nll - perplexity(model, ids, context=64).nll) > 1e-3
    )


def test_batch_size_does_not_change_the_result(tiny):
    _, model, tok, _ = tiny
    ids = tok.encode(TEXT * 2)
    results = [perplexity(model, ids, context=10, batch_size=b).nll for b in (1, 3, 100)]
    assert results[1] == pytest.approx(results[0], rel=1e-6)
    assert results[2] == pytest.approx(results[0], rel=1e-6)


def test_chunk_bounds_predict_every_token_once():
    for n, c in [(2, 1), (11, 5), (10, 3), (100, 7), (5, 50)]:
        predicted = [j for s, e in chunk_bounds(n, c) for j in range(s + 1, e)]
        assert predicted == list(range(1, n))
        assert all(e - s <= c + 1 for s, e in chunk_bounds(n, c))


def test_bad_inputs_raise_ternary_errors(tiny, tmp_path):
    _, model, tok, _ = tiny
    with pytest.raises(TernaryError, match="at least 2 tokens"):
        perplexity(model, [5], context=4)
    with pytest.raises(TernaryError, match="context must be at least 1"):
        perplexity(model, [5, 6, 7], context=0)
    with pytest.raises(TernaryError, match="batch size"):
        perplexity(model, [5, 6, 7], context=2, batch_size=0)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9 au lait")
    with pytest.raises(TernaryError, match="not UTF-8"):
        file_perplexity(model, tok, bad)
    with pytest.raises(TernaryError, match="no such data file"):
        file_perplexity(model, tok, tmp_path / "missing.txt")


def test_cli_json_equals_the_library(tiny, tmp_path):
    path, model, tok, _ = tiny
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    res = CliRunner().invoke(
        main, ["perplexity", "--model", str(path), "--data", str(data), "--context", "16", "--json"]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    want = file_perplexity(model, tok, data, context=16)
    assert out["perplexity"] == pytest.approx(want.perplexity, rel=1e-6)
    assert out["tokens"] == want.tokens == len(tok.encode(TEXT)) - 1
    assert out["context"] == 16 and out["tokens_per_sec"] > 0


def test_cli_text_output_and_max_tokens(tiny, tmp_path):
    path, _, _, _ = tiny
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    res = CliRunner().invoke(
        main, ["perplexity", "--model", str(path), "--data", str(data), "--max-tokens", "20"]
    )
    assert res.exit_code == 0, res.output
    assert "Perplexity:" in res.output and "tokens-per-sec" in res.output
    assert "Tokens evaluated: 20 in 1 windows of 2048" in res.output


def test_cli_missing_data_is_one_line(tiny, tmp_path):
    path, _, _, _ = tiny
    res = CliRunner().invoke(
        main, ["perplexity", "--model", str(path), "--data", str(tmp_path / "nope.txt")]
    )
    assert res.exit_code == 1
    assert "no such data file" in res.output and "Traceback" not in res.output
