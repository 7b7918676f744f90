"""Prompt KV caches kept across requests: longest shared prefix reused, LRU, bounded in bytes.

Each entry is the KV cache of one finished sequence (its prompt and what it generated) and
the tokens it holds. A new prompt reuses the entry sharing the longest token prefix with
it, so turn 2 of a chat prefills only what turn 1 did not see, and requests sharing a
system prompt prefill it once. Entries are copied out, never handed over: the store keeps
what it has until it is evicted, least recently used first, when the bytes pass `max_bytes`.
"""

from collections import OrderedDict
from typing import List, Optional, Tuple

import mlx.core as mx


def _common_prefix(a: Tuple[int, ...], b: List[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _nbytes(cache) -> int:
    return sum(c.nbytes for c in cache)


def _prefix(cache, n: int, copy: bool = False) -> list:
    """The first `n` positions of a single-sequence cache (KVCache or QuantizedKV); with
    `copy`, in buffers of their own (a slice may otherwise keep a larger buffer alive)."""
    out = []
    for c in cache:
        new = type(c).__new__(type(c))
        new.__dict__.update(c.__dict__)
        if copy:
            cut = lambda x: mx.contiguous(x[..., :n, :])  # noqa: E731
        else:
            cut = lambda x: x[..., :n, :]  # noqa: E731
        if isinstance(c.keys, tuple):
            new.keys, new.values = tuple(map(cut, c.keys)), tuple(map(cut, c.values))
        else:
            new.keys, new.values = cut(c.keys), cut(c.values)
        new.offset = n
        out.append(new)
    return out


class PromptCache:
    """An LRU store of per-sequence KV caches, keyed by the tokens they hold."""

    def __init__(self, max_bytes: int, min_reuse: int = 1):
        self.max_bytes = max_bytes
        self.min_reuse = min_reuse
        self._entries: "OrderedDict[Tuple[int, ...], tuple]" = OrderedDict()
        self.nbytes = 0
        self.hits = self.lookups = self.reused_tokens = 0

    def __len__(self):
        return len(self._entries)

    def fetch(self, prompt: List[int]) -> Tuple[Optional[list], int]:
        """(a copy of the cache of the longest prefix of `prompt` held, its length).

        At most len(prompt) - 1 tokens are reused: the last prompt token is always fed to
        the model, so its logits start the answer. (None, 0) on a miss.
        """
        self.lookups += 1
        best, best_n = None, 0
        for key in self._entries:
            n = _common_prefix(key, prompt)
            if n > best_n:
                best, best_n = key, n
        best_n = min(best_n, len(prompt) - 1)
        if best is None or best_n < self.min_reuse:
            return None, 0
        self._entries.move_to_end(best)
        self.hits += 1
        self.reused_tokens += best_n
        return _prefix(self._entries[best][0], best_n), best_n

    def insert(self, tokens: List[int], cache: list):
        """Keep `cache` (holding `tokens`), evaluated, dropping entries it makes redundant."""
        if self.max_bytes <= 0 or not tokens:
            return
        key = tuple(tokens)
        cache = _prefix(cache, len(key), copy=True)
        mx.eval([c.state for c in cache])
        size = _nbytes(cache)
        if size > self.max_bytes:
            return
        for old in [k for k in self._entries if len(k) <= len(key) and key[: len(k)] == k]:
            self._drop(old)  # a prefix of the new entry: everything it offers, this one does
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (cache, size)
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key):
        _, size = self._entries.pop(key)
        self.nbytes -= size

    def clear(self):
        self._entries.clear()
        self.nbytes = 0
