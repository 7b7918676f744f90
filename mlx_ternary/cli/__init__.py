"""The mlx-ternary command line. The only package that prints.

One module per job: run (generate, perplexity, lm), chat, model (convert, verify, plan),
serve, bench; common holds what they share."""

import click

from ..errors import TernaryError
from .bench import bench
from .chat import chat
from .model import convert, plan, verify
from .models import models
from .run import generate, lm, perplexity
from .serve import serve


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
@click.version_option(package_name="mlx-ternary", prog_name="mlx-ternary")
@click.pass_context
def main(ctx):
    """Run ternary (1.58-bit) LLMs with MLX."""
    if ctx.invoked_subcommand in ("generate", "chat", "bench", "perplexity", "serve"):
        _build_native()


def _build_native():
    """On the CPU, say so when the native kernel is compiled (once, before the first model)."""
    import os

    import mlx.core as mx

    if (
        os.environ.get("MLX_TERNARY_BACKEND", "native") == "native"
        and mx.default_device() == mx.cpu
    ):
        from ..runtime import cpu

        cpu.available(lambda s: click.echo(f"mlx-ternary: {s}", err=True))


for _command in (generate, chat, perplexity, convert, verify, serve, lm, plan, bench, models):
    main.add_command(_command)
