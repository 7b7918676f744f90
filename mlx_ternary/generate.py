"""Text generation through mlx-lm's own generator, sampler and prompt cache."""

from pathlib import Path
from typing import Iterator, List, Optional

import mlx.core as mx

from .errors import TernaryError
from .format import KV_GROUP_SIZE
from .speculative import DEFAULT_DRAFT_TOKENS, check_draft_tokens, check_rewindable

EMBEDDED_MODEL = Path(__file__).parent / "assets" / "tiny-shakespeare"


def prompt_tokens(
    tokenizer, prompt: str, system_prompt: Optional[str] = None, ignore_chat_template: bool = False
) -> List[int]:
    """Token ids for a user prompt, through the chat template when the tokenizer has one."""
    if not ignore_chat_template and getattr(tokenizer, "has_chat_template", False):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = f"{system_prompt}\n{prompt}" if system_prompt else prompt
    return tokenizer.encode(text)


def stream(
    model,
    tokenizer,
    prompt: str,
    *,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: Optional[float] = None,
    seed: Optional[int] = None,
    system_prompt: Optional[str] = None,
    ignore_chat_template: bool = False,
    max_kv_size: Optional[int] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = KV_GROUP_SIZE,
    prefill_step_size: int = 2048,
    draft_model=None,
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS,
) -> Iterator:
    """Yield mlx-lm GenerationResponse objects (text segment, token, speeds, peak memory).

    With `draft_model` (same tokenizer: speculative.check_draft) mlx-lm's speculative
    decoding runs, `num_draft_tokens` drafted a round; each response's `from_draft` says
    whether the draft proposed its token (speculative.Acceptance counts them)."""
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    if seed is not None:
        mx.random.seed(seed)
    tokens = prompt_tokens(tokenizer, prompt, system_prompt, ignore_chat_template)
    sampler, processors = sampling_processors(temp, top_p, top_k, min_p, repetition_penalty)
    cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    speculative = {}
    if draft_model is not None:
        if max_kv_size is not None:
            raise TernaryError(
                "--max-kv-size's rotating cache cannot rewind rejected draft tokens; "
                "drop it or --draft-model"
            )
        cache += make_prompt_cache(draft_model)  # mlx-lm's layout: target's, then draft's
        check_rewindable(cache)
        speculative = dict(
            draft_model=draft_model, num_draft_tokens=check_draft_tokens(num_draft_tokens)
        )
    yield from stream_generate(
        model,
        tokenizer,
        tokens,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=processors,
        prompt_cache=cache,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        prefill_step_size=prefill_step_size,
        **speculative,
    )


def sampling_processors(
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: Optional[float] = None,
):
    """mlx-lm's sampler and logits processors for these settings."""
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    return make_sampler(temp, top_p, min_p, top_k=top_k), make_logits_processors(
        repetition_penalty=repetition_penalty
    )


class Chat:
    """A conversation with one model: the messages so far and the KV cache they left.

    Each turn tokenizes the whole conversation (the chat template, when the tokenizer has
    one, else the messages one per line) and prefills only what the cache does not hold yet:
    the cache is trimmed back to the longest prefix it shares with the new prompt (a reply
    can tokenize differently once templated). `reply` yields mlx-lm GenerationResponse
    objects, as `stream` does; `reset` forgets the conversation."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        system_prompt: Optional[str] = None,
        max_context: Optional[int] = None,
        max_kv_size: Optional[int] = None,
        kv_bits: Optional[int] = None,
        kv_group_size: int = KV_GROUP_SIZE,
        prefill_step_size: int = 2048,
        **sampling,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.system_prompt, self.max_context = system_prompt, max_context
        self._cache_args = {"max_kv_size": max_kv_size}
        self._gen_args = {
            "kv_bits": kv_bits,
            "kv_group_size": kv_group_size,
            "prefill_step_size": prefill_step_size,
        }
        seed = sampling.pop("seed", None)
        if seed is not None:
            mx.random.seed(seed)
        self.sampler, self.processors = sampling_processors(**sampling)
        self.reset()

    def reset(self) -> None:
        self.messages: List[dict] = (
            [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        )
        self._cache, self._cached = None, []

    def tokens(self, messages: List[dict]) -> List[int]:
        """Token ids of `messages` with the assistant's turn opened."""
        if getattr(self.tokenizer, "has_chat_template", False):
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        return self.tokenizer.encode("\n".join(m["content"] for m in messages) + "\n")

    def context_used(self) -> int:
        """Tokens the conversation holds now (its KV cache)."""
        return len(self._cached)

    def reply(self, text: str, max_tokens: int = 512) -> Iterator:
        """Add the user's `text`, stream the answer, and keep it in the conversation.

        Raises ContextFull (before anything is generated) when the conversation and one
        token of answer exceed max_context; the answer stops at max_context otherwise."""
        from mlx_lm import stream_generate

        messages = self.messages + [{"role": "user", "content": text}]
        full = self.tokens(messages)
        if self.max_context is not None and len(full) >= self.max_context:
            raise ContextFull(len(full), self.max_context)
        if self.max_context is not None:
            max_tokens = min(max_tokens, self.max_context - len(full))
        prompt = self._reuse(full)
        generated, answer, finished = [], [], False
        try:
            for response in stream_generate(
                self.model,
                self.tokenizer,
                prompt,
                max_tokens=max_tokens,
                sampler=self.sampler,
                logits_processors=self.processors,
                prompt_cache=self._cache,
                **self._gen_args,
            ):
                generated.append(response.token)
                answer.append(response.text)
                yield response
            finished = True
        finally:  # an answer cut short (Ctrl-C, close()) is kept as far as it went
            held = _cache_offset(self._cache) if finished else None
            if held is None:  # the cache may hold part of a step: start it over next turn
                self._cache, self._cached = None, []
            else:
                self._cached = (full + generated)[:held]
            self.messages = messages + [{"role": "assistant", "content": "".join(answer)}]

    def _reuse(self, full: List[int]) -> List[int]:
        """The part of `full` to prefill, the cache trimmed (or made anew) to hold the rest."""
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

        common = 0
        for a, b in zip(self._cached, full):
            if a != b:
                break
            common += 1
        common = min(common, len(full) - 1)  # at least one token is fed
        if self._cache is not None and common > 0 and can_trim_prompt_cache(self._cache):
            trim_prompt_cache(self._cache, len(self._cached) - common)
            return full[common:]
        self._cache = make_prompt_cache(self.model, **self._cache_args)
        return full


def _cache_offset(cache) -> Optional[int]:
    """Tokens a prompt cache holds (None when its layers do not say)."""
    offset = getattr(cache[0], "offset", None) if cache else None
    return offset if isinstance(offset, int) else None


class ContextFull(TernaryError):
    """The conversation no longer fits in the context."""

    def __init__(self, tokens: int, limit: int):
        self.tokens, self.limit = tokens, limit
        super().__init__(
            f"the conversation is {tokens} tokens, at the context limit of {limit}; "
            "/reset starts a new one (or give a larger --max-context)"
        )
