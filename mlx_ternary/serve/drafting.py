"""One request decoded speculatively inside serve's engine, by mlx-lm's own
`speculative_generate_step` (draft k tokens, verify them in one target pass, keep the
agreeing prefix).

mlx-lm's BatchGenerator cannot speculate (each sequence would rewind its KV cache by its
own count), so the engine speculates only while one request is active and none waits;
`close` stops it between rounds and hands back the target's KV cache, which then joins a
batch as a cached prompt prefix would (docs/SERVE.md).
"""

from typing import List, Optional, Tuple

import mlx.core as mx

from .kv_quant import make_cache


def _prefill(model, cache: list, tokens: List[int], step: int):
    for start in range(0, len(tokens), step):
        model(mx.array(tokens[start : start + step])[None], cache=cache)
        mx.eval([c.state for c in cache])


class Speculation:
    """A request's target and draft KV caches and mlx-lm's speculative generator over them.

    `cache` holds the target's KV of `prompt[:cached]` (a prompt-cache hit, else empty);
    the draft's cache is built and prefilled with the same prefix here.
    """

    def __init__(
        self,
        model,
        draft,
        prompt: List[int],
        cache: list,
        cached: int,
        *,
        max_tokens: int,
        sampler,
        processors: list,
        acceptance,
        eos_ids,
        prefill_step_size: int,
        kv_bits: Optional[int],
        kv_group_size: int,
        stream,
    ):
        from mlx_lm.generate import speculative_generate_step

        self.prompt, self.cache, self.cached, self.max_tokens = prompt, cache, cached, max_tokens
        self.sampler, self.processors, self.eos_ids = sampler, processors, set(eos_ids)
        self.draft_cache = make_cache(draft, kv_bits, kv_group_size)
        with mx.stream(stream):
            _prefill(draft, self.draft_cache, prompt[:cached], prefill_step_size)
        self.generated: List[int] = []
        self.acceptance = acceptance  # a speculative.Acceptance, counting as tokens come
        self._steps = speculative_generate_step(
            mx.array(prompt[cached:]),
            model,
            draft,
            stream,
            num_draft_tokens=acceptance.num_draft_tokens,
            max_tokens=max_tokens,
            sampler=sampler,
            logits_processors=processors,
            prompt_cache=cache + self.draft_cache,  # mlx-lm's layout: target's, then draft's
            prefill_step_size=prefill_step_size,
        )

    def round(self) -> List[Tuple[int, mx.array, Optional[str]]]:
        """The next round's tokens: (token, logprobs (vocab,), finish reason or None)."""
        out = []
        for token, logprobs, from_draft in self._steps:
            self.generated.append(token)
            self.acceptance.add(from_draft)
            reason = "stop" if token in self.eos_ids else None
            if reason is None and len(self.generated) == self.max_tokens:
                reason = "length"
            out.append((token, logprobs, reason))
            if reason is not None or not from_draft:
                break
        return out

    def close(self, used: int) -> Tuple[list, List[int], List[int]]:
        """Stop (between rounds) and return (target cache, the tokens it holds, the tokens
        still to feed): with `used` tokens generated, it holds the prompt and all but the
        last, which is to feed; with none, the cached prefix, and the rest of the prompt."""
        from mlx_lm.models.cache import trim_prompt_cache

        self._steps.close()  # mlx-lm's `finally` rewinds the rejected drafts
        if used == 0:
            return self.cache, self.prompt[: self.cached], self.prompt[self.cached :]
        tokens = self.prompt + self.generated[: used - 1]
        extra = self.cache[0].offset - len(tokens)
        if extra < 0:
            raise RuntimeError(f"the speculative KV cache holds {-extra} tokens too few")
        trim_prompt_cache(self.cache, extra)
        return self.cache, tokens, self.generated[used - 1 : used]

    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache + self.draft_cache)
