"""Speculative decoding (`--draft-model`): mlx-lm's own speculative step over ternary and
stock mlx-lm drafts gives the greedy tokens of decoding without a draft, on the native,
emulated-Metal and reference backends.

References: mlx-lm's `stream_generate` without a draft on the same model (the tokens), and
the draft model's own calls, counted by a wrapper (one call per drafted token after the
prompt's prefill), for the acceptance numbers.
"""

import json
import shutil

import mlx.nn as nn
import pytest
from click.testing import CliRunner
from mlx_lm import stream_generate
from tiny import float_model, ternary_checkpoint, write_tokenizer

import mlx_ternary
from mlx_ternary import generate as gen
from mlx_ternary.cli import main
from mlx_ternary.cli.common import load_draft
from mlx_ternary.errors import TernaryError
from mlx_ternary.runtime.layers import TernaryLinear
from mlx_ternary.speculative import Acceptance, check_draft

PROMPT = "the quick brown fox"  # > 2 tokens: the draft's prefill call is told apart
BACKENDS = ["native", "emulate", "reference"]


class Counting:
    """A draft model that records the token count of each call."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, x, cache=None):
        self.calls.append(x.shape[1])
        return self.model(x, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def drafted(self) -> int:  # the prefill call has len(prompt) - 1 > 2 tokens
        return sum(n <= 2 for n in self.calls)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec")
    target, _ = ternary_checkpoint(tmp / "target", "llama", "fast", "row")
    other, _ = ternary_checkpoint(tmp / "other", "llama", "compact", seed=1)
    stock = tmp / "stock"  # a float llama saved as mlx-lm saves one: a stock draft
    model, config = float_model("llama", seed=2)
    stock.mkdir()
    model.save_weights(str(stock / "model.safetensors"))
    (stock / "config.json").write_text(json.dumps(config))
    write_tokenizer(stock)
    return dict(target=target, other=other, stock=stock)


def reference(model, tokenizer, max_tokens):
    return [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=max_tokens)]


def speculate(model, tokenizer, draft, max_tokens, k):
    counting = Counting(draft)
    acc = Acceptance(k, max_tokens)
    tokens = []
    for r in gen.stream(
        model, tokenizer, PROMPT, max_tokens=max_tokens, draft_model=counting, num_draft_tokens=k
    ):
        tokens.append(r.token)
        acc.add(r.from_draft)
    return tokens, acc, counting.drafted()


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_equal_decoding_without_a_draft(dirs, backend):
    model, tok = mlx_ternary.load(str(dirs["target"]), backend=backend)
    want = reference(model, tok, 24)
    itself, _ = mlx_ternary.load(str(dirs["target"]), backend=backend)
    other, _ = mlx_ternary.load(str(dirs["other"]), backend=backend)
    tokens, acc, drafted = speculate(model, tok, itself, 24, 3)
    assert tokens == want
    assert acc.drafted == drafted > 0 and acc.accepted == acc.drafted and acc.rate == 1.0
    tokens, acc, drafted = speculate(model, tok, other, 24, 2)
    assert tokens == want
    assert acc.drafted == drafted > 0 and acc.accepted < acc.drafted  # a draft that errs


def test_embedded_model_drafting_for_itself_accepts_everything():
    model, tok = mlx_ternary.load(str(gen.EMBEDDED_MODEL))
    draft, _ = mlx_ternary.load(str(gen.EMBEDDED_MODEL))
    want = reference(model, tok, 40)
    tokens, acc, drafted = speculate(model, tok, draft, 40, 4)
    assert tokens == want and len(want) == 40
    assert acc.drafted == drafted == 32 and acc.accepted == 32  # 8 rounds of 4 + 1


def test_cli_verbose_reports_acceptance_and_the_same_text(dirs):
    target, stock = str(dirs["target"]), str(dirs["stock"])
    base = ["generate", "--model", target, "--prompt", PROMPT, "-m", "16"]
    plain = CliRunner().invoke(main, base)
    spec = CliRunner().invoke(main, [*base, "--draft-model", stock, "--verbose"])
    itself = CliRunner().invoke(
        main, [*base, "--draft-model", target, "--num-draft-tokens", "5", "--verbose"]
    )
    assert plain.exit_code == spec.exit_code == itself.exit_code == 0, spec.output
    text = plain.output.rstrip("\n")
    assert spec.output.startswith(text + "\n=") and itself.output.startswith(text + "\n=")
    assert "drafted tokens accepted" not in plain.output
    line = next(s for s in spec.output.splitlines() if s.startswith("Draft: "))
    accepted, drafted = int(line.split()[1]), int(line.split()[3])
    assert 0 < drafted and accepted < drafted  # a random float draft errs
    assert "accepted (100.0%)" in itself.output


def test_drafts_load_through_their_own_loader(dirs):
    model, tok = mlx_ternary.load(str(dirs["target"]))
    ternary = load_draft(str(dirs["other"]), model, tok)
    stock = load_draft(str(dirs["stock"]), model, tok)
    kinds = lambda m: {type(x) for _, x in m.named_modules()}  # noqa: E731
    assert TernaryLinear in kinds(ternary) and TernaryLinear not in kinds(stock)
    assert nn.Linear in kinds(stock)


def test_incompatible_draft_is_refused_in_one_line(dirs, tmp_path):
    res = CliRunner().invoke(
        main, ["generate", "--model", str(dirs["target"]), "--draft-model", str(gen.EMBEDDED_MODEL)]
    )
    assert res.exit_code == 1
    assert "vocabulary differs from the target model's (4096 tokens against" in res.output
    assert "Traceback" not in res.output
    # Same size, one token moved: refused, naming it; the unchanged copy passes.
    swapped = tmp_path / "swapped"
    shutil.copytree(dirs["other"], swapped)
    spec = json.loads((swapped / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    model, tok = mlx_ternary.load(str(dirs["target"]))
    _, same = mlx_ternary.load(str(dirs["other"]))
    _, moved = mlx_ternary.load(str(swapped))
    check_draft(tok, same)
    with pytest.raises(TernaryError, match="token 'b' is id 66 in the draft, 67 in the target"):
        check_draft(tok, moved, name="draft")


def test_a_rotating_cache_is_refused(dirs):
    model, tok = mlx_ternary.load(str(dirs["target"]))
    with pytest.raises(TernaryError, match="--max-kv-size's rotating cache cannot rewind"):
        next(gen.stream(model, tok, PROMPT, max_kv_size=64, draft_model=model))
