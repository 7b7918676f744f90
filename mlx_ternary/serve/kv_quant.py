"""A quantized KV cache that joins mlx-lm's continuous batching.

mlx-lm's `QuantizedKVCache` stores keys and values as `mx.quantize` triples (packed
uint32, scales, biases) but has no `merge`, so `BatchGenerator` cannot put a sequence that
holds one into a batch (mlx-lm issue #1043). `QuantizedKV` adds the merge;
`BatchQuantizedKV` is the batched twin of mlx-lm's `BatchKVCache` (left padding, filter,
extend, extract) over the same triples. Both carry `bits` and `group_size`, which is what
makes mlx-lm's attention take its quantized path.
"""

from typing import List, Optional

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.base import create_causal_mask

# _BaseCache: mlx-lm's private base every cache derives from (no public one); its helpers
# (is_trimmable, state, ...) are what BatchGenerator calls. _idx below is our own field.
from mlx_lm.models.cache import QuantizedKVCache, _BaseCache, dynamic_roll

STEP = 256


def _empty(B, H, n, dim, dtype, bits, group_size):
    # (B, H, n, dim * bits / 32) uint32, (B, H, n, dim / group) scales and biases
    return (
        mx.zeros((B, H, n, dim * bits // 32), dtype=mx.uint32),
        mx.zeros((B, H, n, dim // group_size), dtype=dtype),
        mx.zeros((B, H, n, dim // group_size), dtype=dtype),
    )


def _dims(triple, bits, group_size):
    return triple[0].shape[-1] * 32 // bits, triple[1].dtype


class QuantizedKV(QuantizedKVCache):
    """mlx-lm's single-sequence quantized cache, mergeable into a batch."""

    def size(self):
        return self.offset

    @classmethod
    def merge(cls, caches):
        return BatchQuantizedKV.merge(caches)


class BatchQuantizedKV(_BaseCache):
    """Quantized keys/values of a left-padded batch (see mlx-lm's BatchKVCache)."""

    def __init__(self, left_padding: List[int], bits: int = 8, group_size: int = 64):
        self.keys = self.values = None
        self.bits, self.group_size = bits, group_size
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding = None

    def _grow(self, keys, values, n):
        B, H, _, dk = keys.shape
        dv = values.shape[-1]
        # format.ceil_div's rule inline: importing format here makes serve's chain too deep
        size = -(-n // STEP) * STEP
        new_k = _empty(B, H, size, dk, keys.dtype, self.bits, self.group_size)
        new_v = _empty(B, H, size, dv, values.dtype, self.bits, self.group_size)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
            return
        cut = lambda x: x[..., : self._idx, :]  # noqa: E731
        self.keys = tuple(mx.concatenate([cut(a), b], axis=2) for a, b in zip(self.keys, new_k))
        self.values = tuple(mx.concatenate([cut(a), b], axis=2) for a, b in zip(self.values, new_v))

    def update_and_fetch(self, keys, values):
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            self._grow(keys, values, n)
        self._idx += n
        self.offset = self.offset + n
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for dst, src in ((self.keys, qk), (self.values, qv)):
            for a, b in zip(dst, src):
                a[..., prev : self._idx, :] = b
        return self.keys_and_values()

    def keys_and_values(self):
        return tree_map(lambda x: x[..., : self._idx, :], (self.keys, self.values))

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty cache")
            left_padding = mx.array(left_padding)
            self.left_padding += left_padding
            self.offset = self.offset - left_padding
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self):
        # Right-padded prompts of a prefill chunk become left padding, as in BatchKVCache.
        if self._right_padding is None:
            return
        pad = self._right_padding[:, None]
        roll = lambda x: dynamic_roll(x, pad, axis=2)  # noqa: E731
        self.keys, self.values = tree_map(roll, (self.keys, self.values))
        self.offset = self.offset - self._right_padding
        self.left_padding += self._right_padding
        self._right_padding = None

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def size(self):
        return self._idx

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices):
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:  # drop columns of padding every sequence now shares
            if self.keys is not None:
                self.keys, self.values = tree_map(
                    lambda x: x[..., shift:, :], (self.keys, self.values)
                )
            self._idx -= shift
            self.left_padding -= shift

    def _padded(self, idx: int, size: int, like):
        """This cache's triples right-aligned at `idx` in `size` columns (zeros around)."""
        B = self.offset.shape[0]
        src = self.keys, self.values
        if src[0] is None:
            src = tuple(
                tuple(mx.zeros((B, *a.shape[1:2], 0, *a.shape[3:]), dtype=a.dtype) for a in t)
                for t in like
            )
        left = idx - self._idx
        out = []
        for t in src:
            cols = t[0].shape[2]
            right = size - cols - left
            t = tuple(a[..., : cols + min(right, 0), :] for a in t)
            right = max(right, 0)
            out.append(
                tuple(
                    mx.pad(a, [(0, 0), (0, 0), (left, right), (0, 0)]) if left or right else a
                    for a in t
                )
            )
        return out[0], out[1], self.left_padding + left

    def extend(self, other):
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        like = (self.keys, self.values) if self.keys is not None else (other.keys, other.values)
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        size = max(size, idx)
        a, b = self._padded(idx, size, like), other._padded(idx, size, like)
        cat = lambda x, y: tuple(mx.concatenate([p, q]) for p, q in zip(x, y))  # noqa: E731
        self.keys, self.values = cat(a[0], b[0]), cat(a[1], b[1])
        self.left_padding = mx.concatenate([a[2], b[2]])
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = idx

    def extract(self, idx: int) -> QuantizedKV:
        cache = QuantizedKV(group_size=self.group_size, bits=self.bits)
        pad = self.left_padding.tolist()[idx]
        cache.keys, cache.values = tree_map(
            lambda x: mx.contiguous(x[idx : idx + 1, :, pad : self._idx]), (self.keys, self.values)
        )
        cache.offset = self._idx - pad
        return cache

    @classmethod
    def merge(cls, caches):
        lengths = [c.size() for c in caches]
        n = max(lengths)
        first = next((c for c in caches if c.keys is not None), caches[0])
        batch = cls([0] * len(caches), bits=first.bits, group_size=first.group_size)
        if n == 0:
            batch.left_padding = mx.array([0] * len(caches))
            return batch
        padding = [n - m for m in lengths]
        H = first.keys[0].shape[1]
        dk, dtype = _dims(first.keys, first.bits, first.group_size)
        dv, _ = _dims(first.values, first.bits, first.group_size)
        keys = _empty(len(caches), H, n, dk, dtype, first.bits, first.group_size)
        values = _empty(len(caches), H, n, dv, dtype, first.bits, first.group_size)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None:
                continue
            for dst, src in ((keys, c.keys), (values, c.values)):
                for a, b in zip(dst, src):
                    a[i : i + 1, :, p : p + c.offset] = b[..., : c.offset, :]
        batch.keys, batch.values = keys, values
        batch.left_padding = mx.array(padding)
        batch.offset = mx.array(lengths)
        batch._idx = n
        return batch


def make_cache(model, kv_bits: Optional[int], kv_group_size: int) -> list:
    """One sequence's cache: mlx-lm's own, or `QuantizedKV` per layer when `kv_bits`."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    if not kv_bits:
        return cache
    if not all(type(c) is KVCache for c in cache):
        kinds = sorted({type(c).__name__ for c in cache})
        raise ValueError(
            f"--kv-bits needs a plain KV cache in every layer; this model uses {', '.join(kinds)}"
        )
    return [QuantizedKV(group_size=kv_group_size, bits=kv_bits) for _ in cache]
