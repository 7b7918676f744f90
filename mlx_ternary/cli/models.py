"""What is on this machine: models downloaded and converted; remove one, prune conversions."""

import click


def _table(entries) -> None:
    from ..checkpoint.hub import fmt_size

    width = max(len(e.id) for e in entries)
    for e in entries:
        click.echo(f"{e.id:<{width}}  {e.where:<10}  {fmt_size(e.size):>9}  {e.what}")


@click.group(
    invoke_without_command=True,
    epilog="""\b
Examples:
  mlx-ternary models
  mlx-ternary models rm microsoft/bitnet-b1.58-2B-4T
  mlx-ternary models prune --yes
""",
)
@click.pass_context
def models(ctx):
    """List the models downloaded (Hugging Face cache) and converted (GGUF cache)."""
    if ctx.invoked_subcommand is not None:
        return
    from ..checkpoint import store
    from ..checkpoint.hub import fmt_size

    entries = store.stored()
    hf, *converted = store.locations()
    where = f"downloads in {hf}; conversions in {', '.join(map(str, converted))}"
    if not entries:
        click.echo(f"No models downloaded or converted yet ({where}).")
        return
    _table(entries)
    click.echo(f"{len(entries)} models, {fmt_size(sum(e.size for e in entries))} ({where})")


@models.command("rm")
@click.argument("model_id")
def remove(model_id):
    """Remove one downloaded repo (every revision) or one converted copy."""
    from ..checkpoint import store
    from ..checkpoint.hub import fmt_size

    entry = store.remove(model_id)
    click.echo(f"Removed {entry.id} ({entry.where}, {fmt_size(entry.size)}) from {entry.path}")


@models.command()
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
def prune(yes):
    """Clear the conversion cache (GGUF files and other formats converted on first use)."""
    from ..checkpoint import store
    from ..checkpoint.hub import fmt_size

    entries = store.converted()
    if not entries:
        click.echo("The conversion cache is empty.")
        return
    size = fmt_size(sum(e.size for e in entries))
    if not yes:
        _table(entries)
        click.confirm(
            f"Remove these {len(entries)} converted copies ({size})? They are made again "
            "from their source on next use",
            abort=True,
        )
    gone = store.prune()
    click.echo(f"Removed {len(gone)} converted copies, {size}")
