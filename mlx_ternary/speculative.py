"""Speculative decoding through mlx-lm's own `speculative_generate_step`: the draft check
and the acceptance count that `generate` and `serve` share.

mlx-lm drafts min(k, tokens left) tokens a round, verifies them in one target forward
pass and yields the accepted draft tokens (from_draft=True) and then the target's own
token (from_draft=False); a round that accepts every draft token up to max_tokens yields
no target token.
"""

from dataclasses import dataclass

from .errors import TernaryError

DEFAULT_DRAFT_TOKENS = 3  # mlx-lm's own default for --num-draft-tokens


def check_draft(tokenizer, draft_tokenizer, model=None, draft=None, name: str = "the draft"):
    """Refuse a draft whose token ids do not mean what the target's mean.

    Args:
        tokenizer, draft_tokenizer: the target's and the draft's tokenizers.
        model, draft: the models; when both have `args.vocab_size`, the draft's output
            rows must not outnumber the target's embedding rows.
        name: how the error names the draft (its path).

    Raises:
        TernaryError: the vocabularies differ (size or a token's id).
    """
    want, got = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    detail = None
    if len(want) != len(got):
        detail = f"{len(got)} tokens against the target's {len(want)}"
    elif want != got:
        token = next(t for t, i in sorted(got.items(), key=lambda kv: kv[1]) if want.get(t) != i)
        detail = f"token {token!r} is id {got[token]} in the draft, {want.get(token)} in the target"
    else:
        rows, draft_rows = (
            getattr(getattr(m, "args", None), "vocab_size", None) for m in (model, draft)
        )
        if rows and draft_rows and draft_rows > rows:
            detail = f"its output has {draft_rows} rows, the target's embedding {rows}"
    if detail is not None:
        raise TernaryError(
            f"{name}: its vocabulary differs from the target model's ({detail}); speculative "
            "decoding needs the same tokenizer: pick a draft of the target's model family"
        )


def check_rewindable(cache: list, name: str = "the model"):
    """Refuse a KV cache that cannot drop rejected draft tokens (mlx-lm trims it)."""
    kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
    if kinds:
        raise TernaryError(
            f"{name}'s KV cache ({', '.join(kinds)}) cannot rewind rejected draft tokens, "
            "which speculative decoding needs; run without --draft-model"
        )


def check_draft_tokens(n: int) -> int:
    """--num-draft-tokens must be at least 1."""
    if n < 1:
        raise TernaryError(f"the number of draft tokens must be at least 1, got {n}")
    return n


@dataclass
class Acceptance:
    """Draft tokens proposed and accepted, counted from the from_draft flags of mlx-lm's
    speculative stream of one sequence (`add` once per generated token, in order)."""

    num_draft_tokens: int
    max_tokens: int
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    _in_round: bool = False

    def add(self, from_draft: bool) -> None:
        if not self._in_round:  # a round starts: mlx-lm drafts min(k, tokens left)
            self.drafted += min(self.num_draft_tokens, self.max_tokens - self.generated)
            self._in_round = True
        self.generated += 1
        self.accepted += bool(from_draft)
        self._in_round = bool(from_draft)  # the target's own token ends the round

    @property
    def rate(self) -> float:
        """Accepted / drafted (0.0 before any draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0
