"""Perplexity of a causal LM over a text, in fixed-size chunks.

The token stream is cut into windows of `context + 1` tokens that overlap by one
token, so every token after the first is predicted exactly once, from at most
`context` tokens of its own window (no state is carried between windows).
Windows of equal length run in batches; the last, shorter one runs alone.
Log-probabilities are taken in float32 and summed in float64.
"""

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from .errors import TernaryError

DEFAULT_CONTEXT = 2048


@dataclass
class PerplexityResult:
    """What one evaluation measured.

    Attributes:
        perplexity: exp(nll).
        nll: mean negative log-likelihood per evaluated token, in nats.
        tokens: tokens evaluated (predicted), len(ids) - 1.
        chunks: windows run.
        context: the window length used.
        seconds: wall time of the forward passes.
        tokens_per_sec: tokens / seconds.
    """

    perplexity: float
    nll: float
    tokens: int
    chunks: int
    context: int
    seconds: float
    tokens_per_sec: float

    def to_dict(self) -> dict:
        return asdict(self)


def chunk_bounds(n_tokens: int, context: int) -> List[tuple]:
    """[(start, end)] of the windows ids[start:end]; each predicts ids[start+1:end]."""
    if context < 1:
        raise TernaryError(f"the context must be at least 1 token, got {context}")
    return [(s, min(s + context + 1, n_tokens)) for s in range(0, n_tokens - 1, context)]


def _window_nll(model, windows: mx.array) -> np.ndarray:
    """Summed NLL (float64) of each window (B, L + 1): inputs [:, :-1], targets [:, 1:]."""
    logits = model(windows[:, :-1]).astype(mx.float32)  # (B, L, V)
    targets = windows[:, 1:]
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = mx.logsumexp(logits, axis=-1) - picked  # (B, L)
    return np.array(nll).astype(np.float64).sum(axis=1)


def perplexity(
    model,
    ids: Sequence[int],
    *,
    context: int = DEFAULT_CONTEXT,
    batch_size: int = 4,
    progress: Optional[Callable[[int], None]] = None,
) -> PerplexityResult:
    """Perplexity of `model` on the token ids `ids`.

    Args:
        model: an mlx-lm model: (B, L) int ids -> (B, L, vocab) logits.
        ids: the token stream (at least 2 tokens).
        context: tokens each window conditions on (at most).
        batch_size: windows per forward pass.
        progress: called with the number of tokens evaluated after each batch.

    Returns:
        A PerplexityResult.

    Raises:
        TernaryError: fewer than 2 tokens, or a context or batch size below 1.
    """
    ids = np.asarray(ids, dtype=np.int32).reshape(-1)
    if ids.size < 2:
        raise TernaryError(
            f"perplexity needs at least 2 tokens, got {ids.size}; pass a longer text"
        )
    if batch_size < 1:
        raise TernaryError(f"the batch size must be at least 1, got {batch_size}")
    bounds = chunk_bounds(ids.size, context)
    full = [b for b in bounds if b[1] - b[0] == context + 1]
    tail = [b for b in bounds if b[1] - b[0] != context + 1]
    batches = [full[i : i + batch_size] for i in range(0, len(full), batch_size)]
    batches += [[b] for b in tail]
    total, done = 0.0, 0
    start = time.perf_counter()
    for batch in batches:
        windows = mx.array(np.stack([ids[s:e] for s, e in batch]))
        total += float(_window_nll(model, windows).sum())
        done += sum(e - s - 1 for s, e in batch)
        if progress is not None:
            progress(done)
    seconds = time.perf_counter() - start
    nll = total / done
    return PerplexityResult(
        perplexity=math.exp(nll),
        nll=nll,
        tokens=done,
        chunks=len(bounds),
        context=context,
        seconds=seconds,
        tokens_per_sec=done / seconds if seconds > 0 else float("inf"),
    )


def read_text(path) -> str:
    """The text of a UTF-8 data file, or a TernaryError naming it."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TernaryError(f"{path}: no such data file") from None
    except UnicodeDecodeError as e:
        raise TernaryError(
            f"{path}: not UTF-8 text (byte {e.start}); pass a plain text file"
        ) from None


def default_context(config: dict) -> int:
    """The model's trained length where its config states one, capped at DEFAULT_CONTEXT."""
    n = config.get("max_position_embeddings")
    return min(int(n), DEFAULT_CONTEXT) if n else DEFAULT_CONTEXT


def file_perplexity(
    model,
    tokenizer,
    path,
    *,
    context: int = DEFAULT_CONTEXT,
    batch_size: int = 4,
    max_tokens: Optional[int] = None,
    progress: Optional[Callable[[int], None]] = None,
) -> PerplexityResult:
    """Tokenize a text file as the tokenizer does by default, then `perplexity`.

    Args:
        max_tokens: evaluate only the first max_tokens + 1 ids of the file.
    """
    text = read_text(path)
    try:  # verbose=False: Hugging Face tokenizers warn about texts longer than the model
        ids = tokenizer.encode(text, verbose=False)
    except TypeError:
        ids = tokenizer.encode(text)
    if max_tokens is not None:
        ids = ids[: max_tokens + 1]
    if len(ids) < 2:
        raise TernaryError(f"{path}: tokenizes to {len(ids)} token(s); perplexity needs at least 2")
    return perplexity(model, ids, context=context, batch_size=batch_size, progress=progress)
