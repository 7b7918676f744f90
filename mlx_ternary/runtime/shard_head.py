"""The output layer split by vocabulary across tensor-parallel ranks.

mlx-lm's `shard()` plans leave the output layer whole on every rank, so each rank computes
every logit: on a 0.53 G ternary llama the float16 32000 x 2048 head is as many bytes as
all twelve layers' trits, read in full by every rank each token. Here each rank keeps a
block of the head's rows (a block of the vocabulary), computes those logits and the ranks
gather them (one all_gather per call). Each logit is the same row's dot product as in the
whole layer, so the gathered logits are the single process's.

Untied heads (`model.lm_head`, any layer whose parameters are per output row: nn.Linear,
the native HalfLinear, QuantizedLinear) are replaced by a `VocabShardedHead` holding a copy
of the rank's rows; a tied head (`embed_tokens.as_linear`) is given an `as_linear` over a
view of the rank's rows of the embedding, which every rank still holds whole for lookups.
A vocabulary that does not divide by the ranks, a ternary head and one wrapped by an adapter
stay replicated.
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import sum_gradients

from .layers import TernaryLinear


def _rows(module: nn.Module, vocab: int, a: int, b: int, copy: bool) -> nn.Module:
    """A shallow twin of `module` whose per-row parameters (first dimension `vocab`) are
    rows a..b: copies (the whole table can be freed) or views of the same buffer."""
    part = type(module).__new__(type(module))
    nn.Module.__init__(part)
    part.__dict__.update({k: v for k, v in module.__dict__.items() if k not in part.__dict__})
    for key, value in module.items():
        if isinstance(value, mx.array) and value.ndim and value.shape[0] == vocab:
            value = mx.contiguous(value[a:b]) if copy else value[a:b]
        part[key] = value
    # now, on this thread's stream: a lazy slice would run on the first call's thread, which
    # (the server's engine thread) may not have this thread's stream
    mx.eval(part.parameters())
    return part


def gather_vocab(y: mx.array, vocab: int, group) -> mx.array:
    """(..., vocab / ranks) logits of each rank -> (..., vocab) on every rank."""
    lead, n, world = y.shape[:-1], y.shape[-1], group.size()
    every = mx.distributed.all_gather(y.reshape(-1, n), group=group)  # (world * M, n)
    every = every.reshape(world, -1, n).transpose(1, 0, 2)  # (M, world, n)
    return every.reshape(*lead, vocab)


class VocabShardedHead(nn.Module):
    """This rank's block of an output layer's rows; calls return every rank's logits."""

    def __init__(self, local: nn.Module, vocab: int, group):
        super().__init__()
        self.local = local
        self.vocab, self.group = vocab, group
        # x is whole on every rank: its gradient is the sum over the ranks (mlx's convention)
        self._summed = sum_gradients(group)

    def __call__(self, x: mx.array) -> mx.array:
        return gather_vocab(self.local(self._summed(x)), self.vocab, self.group)


def _block(vocab: int, group) -> Optional[tuple]:
    world = group.size()
    if world == 1 or vocab % world:
        return None
    step = vocab // world
    return group.rank() * step, (group.rank() + 1) * step


def shard_output(model: nn.Module, group) -> Optional[str]:
    """Split `model`'s output layer by vocabulary across `group` (module docstring);
    returns which head was split ("lm_head", "embed_tokens") or None."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Module) and not isinstance(head, (TernaryLinear, VocabShardedHead)):
        weight = head.get("weight") if isinstance(head.get("weight"), mx.array) else None
        block = None if weight is None or weight.ndim != 2 else _block(weight.shape[0], group)
        if block is None:
            return None
        model.lm_head = VocabShardedHead(
            _rows(head, weight.shape[0], *block, True), weight.shape[0], group
        )
        return "lm_head"
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", True)
    if head is None and tied and hasattr(embed, "as_linear") and "as_linear" not in vars(embed):
        vocab = embed.weight.shape[0]
        block = _block(vocab, group)
        if block is None:
            return None
        part, summed = _rows(embed, vocab, *block, False), sum_gradients(group)
        object.__setattr__(
            embed, "as_linear", lambda x: gather_vocab(part.as_linear(summed(x)), vocab, group)
        )
        return "embed_tokens"
    return None
