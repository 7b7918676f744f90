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
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    if seed is not None:
        mx.random.seed(seed)
    tokens = prompt_tokens(tokenizer, prompt, system_prompt, ignore_chat_template)
    sampler = make_sampler(temp, top_p, min_p, top_k=top_k)
    processors = make_logits_processors(repetition_penalty=repetition_penalty)
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
