"""Checkpoints and their memory: convert, verify, plan."""

import click

from .common import (
    AFFINE_BITS_TYPE,
    AFFINE_GROUP_SIZE_TYPE,
    PACKING_TYPE,
    activations_option,
    kv_bits_option,
    local_model,
    memory_limit_option,
    model_option,
    or_embedded,
    prefill_option,
    prompt_cache_bytes,
    tensor_bar,
)


@click.command(
    epilog="""\b
Examples:
  mlx-ternary convert --hf-path microsoft/bitnet-b1.58-2B-4T --mlx-path bitnet-ternary
  mlx-ternary convert --hf-path DIR --mlx-path out-4bit -q 4 --q-group-size 64
  mlx-ternary convert --hf-path model.gguf --mlx-path out --packing fast
  mlx-ternary convert --hf-path DIR --to-gguf model-tq2.gguf
"""
)
@click.option(
    "--hf-path",
    required=True,
    help="Source: a model directory, a Hugging Face repo id, or a .gguf file.",
)
@click.option(
    "--mlx-path",
    "--output-dir",
    "mlx_path",
    default=None,
    help="Output directory (written beside, then renamed into place).",
)
@click.option(
    "--packing",
    type=PACKING_TYPE,
    default=None,
    help="Native packing (default: the kernels' default).",
)
@click.option(
    "-q",
    "--q-bits",
    type=AFFINE_BITS_TYPE,
    default=None,
    help="Write a stock MLX affine checkpoint at this many bits (exact ternary).",
)
@click.option(
    "--q-group-size",
    type=AFFINE_GROUP_SIZE_TYPE,
    default=64,
    show_default=True,
    help="Group size of the MLX affine checkpoint.",
)
@click.option(
    "--dtype",
    type=click.Choice(["float16", "bfloat16", "float32"]),
    default=None,
    help="dtype of float tensors (default: as stored).",
)
@click.option("-d", "--dequantize", is_flag=True, help="Write a float checkpoint.")
@click.option("--to-gguf", default=None, help="Write a llama.cpp GGUF file.")
@click.option(
    "--gguf-type",
    type=click.Choice(["TQ1_0", "TQ2_0"]),
    default="TQ2_0",
    show_default=True,
    help="GGUF type of ternary rows of whole 256-weight blocks (others: Q8_0 codes).",
)
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit).")
@click.option(
    "--activation-bits",
    type=click.Choice(["8", "0"]),
    default=None,
    help="Override the source's activation quantization: 8 (BitNet int8) or 0 "
    "(none). Default: as the source's config says.",
)
@click.option("--force", is_flag=True, help="Replace an existing output.")
@click.option("--verbose", is_flag=True, help="Also print the peak memory of the conversion.")
@activations_option(
    "Recorded in the checkpoint. Default: q8k from llama.cpp's GGUF files, else model."
)
def convert(hf_path, mlx_path, q_bits, q_group_size, activation_bits, verbose, **options):
    """Convert a ternary checkpoint to the ternary format, stock MLX or GGUF."""
    from ..checkpoint.convert import convert as run_convert

    if mlx_path is None and options["to_gguf"] is None:
        raise click.UsageError("give --mlx-path DIR or --to-gguf FILE")
    with tensor_bar() as progress:
        report = run_convert(
            hf_path,
            mlx_path,
            q_bits,
            q_group_size,
            progress=progress,
            activation_bits=None if activation_bits is None else int(activation_bits),
            **options,
        )
    click.echo(f"Source: {report.source} ({report.source_kind})")
    click.echo(f"Wrote {report.output}: {report.target}, {len(report.tensors)} tensors")
    if report.bits_per_weight:
        click.echo(
            f"Ternary weights: {report.ternary_weights:,}, "
            f"{report.bits_per_weight:.3f} bits per weight"
        )
    click.echo(f"Round trip verified per tensor: max error {report.max_error:.3g}")
    for note in report.notes:
        click.echo(f"Note: {note}")
    if verbose and report.peak_rss:
        from ..memory import fmt_bytes

        click.echo(f"Peak memory: {fmt_bytes(report.peak_rss)} resident (the whole process)")


@click.command()
@click.argument("path")
def verify(path):
    """Check a converted checkpoint: manifest hashes, shards, tensor shapes vs config."""
    from ..checkpoint.verify import verify as run_verify

    report = run_verify(path)
    for problem in report.problems:
        click.echo(f"FAIL {problem}", err=True)
    if not report.ok:
        raise SystemExit(1)
    manifest = (
        f"{report.files} files match the manifest, "
        if report.manifest
        else "no manifest.json (not written by convert), "
    )
    click.echo(f"OK {report.path}: {manifest}{report.tensors} tensors match the config")


@click.command(
    epilog="""\b
Examples:
  mlx-ternary plan --model DIR --max-context 8192
  mlx-ternary plan --model DIR --max-context 32768 --batch 4 --kv-bits 8 --json
"""
)
@model_option
@click.option(
    "--max-context",
    default=4096,
    show_default=True,
    type=click.IntRange(min=1),
    help="Prompt + generated tokens per sequence.",
)
@click.option(
    "--batch",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Sequences decoded together.",
)
@kv_bits_option
@prefill_option
@memory_limit_option
@click.option(
    "--prompt-cache-bytes",
    "prompt_cache",
    default="0",
    show_default=True,
    help="Bytes of KV serve keeps across requests, e.g. 512MB.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
def plan(model, max_context, prompt_cache, as_json, **sizes):
    """Memory plan: weights, KV cache, activations and overhead against the memory there is."""
    import json

    from ..checkpoint.load import load
    from ..memory import plan as memory_plan

    cache_bytes = prompt_cache_bytes(prompt_cache)
    lm, _ = load(local_model(or_embedded(model)), lazy=True)
    mem = memory_plan(lm, max_context, prompt_cache=cache_bytes, **sizes)
    if as_json:
        click.echo(json.dumps(mem.to_dict()))
        return
    for line in mem.lines():
        click.echo(line)
    click.echo("fits" if mem.fits else f"does not fit; {'; '.join(mem.advice())}")
