"""The mlx-ternary command line. The only module that prints."""

import sys

import click

from . import __version__
from .errors import TernaryError


class _Group(click.Group):
    """Turns user-facing errors into one line on stderr and exit status 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TernaryError as e:
            raise click.ClickException(str(e)) from None
        except FileNotFoundError as e:
            raise click.ClickException(f"{e.filename or e}: no such file or directory") from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlx-ternary")
def main():
    """Run ternary (1.58-bit) LLMs with MLX."""


@main.command(epilog="""\b
Examples:
  mlx-ternary generate --prompt "ROMEO:"            # the embedded model, offline
  mlx-ternary generate --model DIR --prompt "Hi" -m 64 --temp 0.7 --seed 1
  echo "Once upon a time" | mlx-ternary generate --model DIR --prompt - --verbose
""")
@click.option("--model", default=None,
              help="Model directory or Hugging Face repo id (default: the embedded tiny model).")
@click.option("--prompt", "-p", default="ROMEO:", show_default=True,
              help="The prompt; '-' reads it from stdin.")
@click.option("--max-tokens", "-m", default=100, show_default=True, type=int,
              help="Maximum number of tokens to generate.")
@click.option("--temp", default=0.0, show_default=True, type=float, help="Sampling temperature.")
@click.option("--top-p", default=1.0, show_default=True, type=float, help="Nucleus sampling.")
@click.option("--top-k", default=0, show_default=True, type=int, help="Top-k sampling (0: off).")
@click.option("--min-p", default=0.0, show_default=True, type=float, help="Min-p sampling.")
@click.option("--repetition-penalty", default=None, type=float,
              help="Penalty for repeated tokens (e.g. 1.1).")
@click.option("--seed", default=None, type=int, help="Random seed for sampling.")
@click.option("--system-prompt", default=None, help="System prompt for the chat template.")
@click.option("--ignore-chat-template", is_flag=True,
              help="Feed the prompt as raw text even if the tokenizer has a chat template.")
@click.option("--max-kv-size", default=None, type=int, help="Rotating KV cache size.")
@click.option("--kv-bits", default=None, type=click.IntRange(2, 8),
              help="Quantize the KV cache to this many bits.")
@click.option("--verbose", is_flag=True, help="Print speeds and peak memory at the end.")
def generate(model, prompt, max_tokens, temp, top_p, top_k, min_p, repetition_penalty, seed,
             system_prompt, ignore_chat_template, max_kv_size, kv_bits, verbose):
    """Generate text from a prompt, streaming tokens as they come."""
    from . import generate as gen
    from .load import load

    if model is None:
        if not gen.EMBEDDED_MODEL.exists():
            raise TernaryError(f"the embedded model is missing from this installation "
                               f"({gen.EMBEDDED_MODEL}); reinstall mlx-ternary or pass --model")
        model = str(gen.EMBEDDED_MODEL)
    if prompt == "-":
        prompt = sys.stdin.read()
    if max_tokens < 1:
        raise click.BadParameter("must be at least 1", param_hint="--max-tokens")
    lm, tokenizer = load(model)
    last = None
    for last in gen.stream(lm, tokenizer, prompt, max_tokens=max_tokens, temp=temp,
                           top_p=top_p, top_k=top_k, min_p=min_p,
                           repetition_penalty=repetition_penalty, seed=seed,
                           system_prompt=system_prompt,
                           ignore_chat_template=ignore_chat_template,
                           max_kv_size=max_kv_size, kv_bits=kv_bits):
        click.echo(last.text, nl=False)
        sys.stdout.flush()
    click.echo()
    if verbose and last is not None:
        click.echo("=" * 10)
        click.echo(f"Prompt: {last.prompt_tokens} tokens, "
                   f"{last.prompt_tps:.3f} tokens-per-sec")
        click.echo(f"Generation: {last.generation_tokens} tokens, "
                   f"{last.generation_tps:.3f} tokens-per-sec")
        click.echo(f"Peak memory: {last.peak_memory:.3f} GB")


if __name__ == "__main__":
    main()
