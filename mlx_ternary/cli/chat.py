"""chat: an interactive conversation with any model, in the terminal."""

import sys

import click

from ..errors import TernaryError
from .common import (
    activations_option,
    adapter_option,
    context_warning,
    default_context,
    kv_bits_option,
    local_model,
    model_option,
    or_embedded,
    sampling_options,
    threads_option,
)

COMMANDS = {
    "/reset": "forget the conversation",
    "/exit": "leave (also /quit, Ctrl-D)",
    "/help": "this list",
}
PROMPT = ">>> "


@click.command(
    epilog="""\b
Examples:
  mlx-ternary chat                                   # the embedded model, offline
  mlx-ternary chat --model microsoft/bitnet-b1.58-2B-4T --system-prompt "Be brief."
  mlx-ternary chat --model DIR --max-context 8192 --temp 0.7 --threads 4
"""
)
@model_option
@click.option("--system-prompt", default=None, help="System prompt for the whole conversation.")
@click.option(
    "--max-context",
    default=None,
    type=click.IntRange(min=2),
    help="Tokens the conversation may hold (default: the model's max_position_embeddings, "
    "at most 4096); the memory plan is made for it.",
)
@click.option(
    "--max-tokens",
    "-m",
    default=512,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens per answer at most.",
)
@sampling_options
@click.option(
    "--max-kv-size", default=None, type=click.IntRange(min=1), help="Rotating KV cache size."
)
@kv_bits_option
@adapter_option
@activations_option()
@threads_option
def chat(model, system_prompt, max_context, max_tokens, adapter_path, activations, **sampling):
    """Chat with a model in the terminal: answers stream as they come, the conversation is
    kept (/reset forgets it, /exit or Ctrl-D leaves, Ctrl-C stops an answer)."""
    from ..checkpoint.load import load
    from ..generate import Chat

    _line_editing()
    model = or_embedded(model)
    lm, tokenizer = load(
        local_model(model), lazy=True, adapter_path=adapter_path, activations=activations
    )
    max_context = max_context or default_context(lm)
    _check_chat_memory(lm, max_context, sampling)
    session = Chat(lm, tokenizer, system_prompt=system_prompt, max_context=max_context, **sampling)
    click.echo(
        f"Chatting with {model} (context {max_context} tokens). "
        "/help for commands, /exit or Ctrl-D to leave.",
        err=True,
    )
    while True:
        line = _read_line()
        if line is None:
            return
        command = line.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return
        if command == "/reset":
            session.reset()
            click.echo("(conversation forgotten)", err=True)
            continue
        if command in ("/help", "/?"):
            for name, what in COMMANDS.items():
                click.echo(f"  {name:8} {what}", err=True)
            continue
        if command.startswith("/") and " " not in command:
            click.echo(f"unknown command {command}; /help lists them", err=True)
            continue
        _answer(session, line, max_tokens)


def _line_editing() -> None:
    """Arrow keys and history at the prompt, where the terminal has them (readline also
    puts the prompt on stdout, where Python's plain input() writes it to stderr)."""
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401
        except ImportError:  # not built into this Python (some Windows builds)
            pass


def _read_line():
    """One line from the user; None at end of input (Ctrl-D) or Ctrl-C at the prompt."""
    try:
        return input(PROMPT)
    except EOFError:
        click.echo()
        return None
    except KeyboardInterrupt:
        click.echo()
        return None


def _answer(session, text: str, max_tokens: int) -> None:
    """Stream one answer; Ctrl-C stops it (what was said so far is kept)."""
    answer = session.reply(text, max_tokens=max_tokens)
    try:
        for response in answer:
            click.echo(response.text, nl=False)
            sys.stdout.flush()
    except KeyboardInterrupt:
        answer.close()  # the conversation keeps the answer as far as it went
        click.echo("\n(stopped)", err=True)
        return
    except TernaryError as e:
        click.echo(f"Error: {e}", err=True)
        return
    click.echo()


def _check_chat_memory(lm, max_context: int, sampling) -> None:
    """Refuse a conversation of --max-context tokens that does not fit; warn past the
    model's trained context."""
    from ..memory import plan as memory_plan

    warning = context_warning(lm, max_context)
    if warning:
        click.echo(f"WARNING: {warning}", err=True)
    mem = memory_plan(
        lm,
        max_context,
        prefill_step_size=2048,
        kv_bits=sampling["kv_bits"],
        max_kv_size=sampling["max_kv_size"],
        flags={"context": "--max-context (or --max-kv-size)", "kv_bits": "--kv-bits"},
    )
    if not mem.fits:
        raise TernaryError(mem.refusal())
