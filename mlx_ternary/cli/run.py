"""Running a model: generate, perplexity, and mlx-lm's own tools (lm)."""

import sys

import click

from ..errors import TernaryError
from .common import (
    activations_option,
    adapter_option,
    context_warning,
    draft_options,
    kv_bits_option,
    load_draft,
    local_model,
    model_option,
    or_embedded,
    sampling_options,
    threads_option,
)


@click.command(
    epilog="""\b
Examples:
  mlx-ternary generate --prompt "ROMEO:"            # the embedded model, offline
  mlx-ternary generate --model DIR --prompt "Hi" -m 64 --temp 0.7 --seed 1
  echo "Once upon a time" | mlx-ternary generate --model DIR --prompt - --verbose
  mlx-ternary generate --model BIG --draft-model SMALL --num-draft-tokens 4 --verbose
"""
)
@model_option
@click.option(
    "--prompt",
    "-p",
    default="ROMEO:",
    show_default=True,
    help="The prompt; '-' reads it from stdin.",
)
@click.option(
    "--max-tokens",
    "-m",
    default=100,
    show_default=True,
    type=click.IntRange(min=1),
    help="Maximum number of tokens to generate.",
)
@sampling_options
@click.option("--system-prompt", default=None, help="System prompt for the chat template.")
@click.option(
    "--ignore-chat-template",
    is_flag=True,
    help="Feed the prompt as raw text even if the tokenizer has a chat template.",
)
@click.option(
    "--max-kv-size", default=None, type=click.IntRange(min=1), help="Rotating KV cache size."
)
@click.option(
    "--max-context",
    default=None,
    type=click.IntRange(min=2),
    help="Prompt + generated tokens at most: a longer prompt is refused, generation stops "
    "there (default: no limit but the memory plan's).",
)
@kv_bits_option
@adapter_option
@click.option(
    "--verbose",
    is_flag=True,
    help="Print speeds, peak memory (and the draft's acceptance rate) at the end.",
)
@activations_option()
@threads_option
@draft_options
def generate(
    model, prompt, max_tokens, max_context, adapter_path, verbose, activations, **sampling
):
    """Generate text from a prompt, streaming tokens as they come."""
    from .. import generate as gen
    from ..speculative import Acceptance

    model = or_embedded(model)
    if prompt == "":
        raise click.BadParameter("the prompt is empty; give some text", param_hint="--prompt")
    draft_path = sampling.pop("draft_model")
    lm, tokenizer, prompt, rank0 = _load_for_generate(
        model, prompt, adapter_path, activations, sampling
    )
    max_tokens = _check_generate_memory(lm, tokenizer, prompt, max_tokens, max_context, sampling)
    if draft_path is not None:
        sampling["draft_model"] = load_draft(draft_path, lm, tokenizer)
    accepted = Acceptance(sampling["num_draft_tokens"], max_tokens)
    last = None
    for last in gen.stream(lm, tokenizer, prompt, max_tokens=max_tokens, **sampling):
        accepted.add(last.from_draft)
        if rank0:
            click.echo(last.text, nl=False)
            sys.stdout.flush()
    if not rank0:
        return
    click.echo()
    if verbose and last is not None:
        _print_speeds(last)
        if draft_path is not None:
            click.echo(
                f"Draft: {accepted.accepted} of {accepted.drafted} drafted tokens accepted "
                f"({100 * accepted.rate:.1f}%)"
            )


def _load_for_generate(model, prompt, adapter_path, activations, sampling):
    """Load (tensor parallel under mlx.launch, rank 0 prints) and read a '-' prompt from stdin.

    Agrees on one seed across ranks, in `sampling`; returns (model, tokenizer, prompt, rank0)."""
    from .. import parallel as dist
    from ..checkpoint.load import load

    group = dist.world()
    if prompt == "-":
        if group.size() > 1:  # mlx.launch forwards stdin but never closes it
            raise click.BadParameter(
                "stdin cannot be read under mlx.launch; give the prompt itself",
                param_hint="--prompt",
            )
        prompt = sys.stdin.read()
    if group.size() > 1:
        lm, tokenizer = dist.sharded_load(
            local_model(model), group, adapter_path=adapter_path, activations=activations
        )
        sampling["seed"] = dist.agree_seed(sampling["seed"], group)
    else:
        lm, tokenizer = load(
            local_model(model), lazy=True, adapter_path=adapter_path, activations=activations
        )
    return lm, tokenizer, prompt, group.rank() == 0


def _check_generate_memory(lm, tokenizer, prompt, max_tokens, max_context, sampling) -> int:
    """Refuse an empty prompt, one longer than --max-context, and a run whose prompt, tokens
    and KV cache do not fit in memory; warn past the model's trained context. Returns the
    tokens to generate (--max-tokens, cut at --max-context)."""
    from .. import generate as gen
    from ..memory import plan as memory_plan

    tokens = gen.prompt_tokens(
        tokenizer, prompt, sampling["system_prompt"], sampling["ignore_chat_template"]
    )
    if not tokens:
        raise click.BadParameter(
            "the prompt is empty (no tokens); give some text", param_hint="--prompt"
        )
    if max_context is not None:
        if len(tokens) >= max_context:
            raise TernaryError(
                f"the prompt is {len(tokens)} tokens; --max-context {max_context} leaves no "
                "room to generate (give a larger --max-context or a shorter prompt)"
            )
        max_tokens = min(max_tokens, max_context - len(tokens))
    warning = context_warning(lm, len(tokens) + max_tokens, "prompt + --max-tokens")
    if warning:
        click.echo(f"WARNING: {warning}", err=True)
    mem = memory_plan(
        lm,
        len(tokens) + max_tokens,
        prefill_step_size=2048,
        kv_bits=sampling["kv_bits"],
        max_kv_size=sampling["max_kv_size"],
        flags={"context": "--max-tokens (or --max-kv-size)", "kv_bits": "--kv-bits"},
    )
    if not mem.fits:
        raise TernaryError(mem.refusal())
    return max_tokens


def _print_speeds(last):
    click.echo("=" * 10)
    click.echo(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
    click.echo(
        f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec"
    )
    click.echo(f"Peak memory: {last.peak_memory:.3f} GB")


@click.command(
    epilog="""\b
Examples:
  mlx-ternary perplexity --data heldout.txt             # the embedded model
  mlx-ternary perplexity --model DIR --data FILE --context 512 --json
"""
)
@model_option
@click.option(
    "--data", required=True, type=click.Path(dir_okay=False), help="UTF-8 text file to evaluate on."
)
@click.option(
    "--context",
    default=None,
    type=click.IntRange(min=1),
    help="Tokens per window (default: the model's max_position_embeddings, at most 2048).",
)
@click.option(
    "--batch-size",
    default=4,
    show_default=True,
    type=click.IntRange(min=1),
    help="Windows per forward pass.",
)
@click.option(
    "--max-tokens",
    default=None,
    type=click.IntRange(min=1),
    help="Evaluate only the first N tokens of the file.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@activations_option()
@threads_option
def perplexity(model, data, context, batch_size, max_tokens, as_json, activations):
    """Perplexity of a model on a text file, evaluated in consecutive windows."""
    import json

    from .. import perplexity as ppl
    from ..checkpoint.load import load

    model = or_embedded(model)
    lm, tokenizer, config = load(local_model(model), return_config=True, activations=activations)
    context = context or ppl.default_context(config)
    result = ppl.file_perplexity(
        lm, tokenizer, data, context=context, batch_size=batch_size, max_tokens=max_tokens
    )
    if as_json:
        click.echo(json.dumps({"model": model, "data": str(data), **result.to_dict()}))
        return
    click.echo(f"Perplexity: {result.perplexity:.4f} (NLL {result.nll:.4f} nats/token)")
    click.echo(f"Tokens evaluated: {result.tokens} in {result.chunks} windows of {result.context}")
    click.echo(f"Speed: {result.tokens_per_sec:.1f} tokens-per-sec ({result.seconds:.2f} s)")


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    add_help_option=False,
    epilog="""\b
Examples:
  mlx-ternary lm server --model DIR --port 8080      # mlx-lm's OpenAI-compatible server
  mlx-ternary lm lora --model DIR --train --data DATA --iters 100
  mlx-ternary lm chat --model DIR --adapter-path adapters   # or: mlx-ternary chat
  mlx-ternary lm TOOL --help                         # the tool's own flags
""",
)
@click.argument("tool", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def lm(ctx, tool, args):
    """Run an mlx-lm command with ternary checkpoints loading like any model.

    TOOL is one of mlx-lm's: server, chat, generate, lora, fuse, evaluate, cache_prompt,
    benchmark, perplexity, ... with mlx-lm's own flags. Ternary checkpoints (native,
    Hugging Face BitNet) load through mlx-ternary; other models through mlx-lm unchanged.
    `mlx-ternary chat` is this project's own chat (the memory plan, /reset, --threads).
    """
    from ..lm import run_tool

    if tool is None or tool in ("-h", "--help"):
        click.echo(ctx.get_help())
        return
    run_tool(tool, list(args), notify=lambda line: click.echo(line, err=True))
