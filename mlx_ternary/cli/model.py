"""Checkpoints and their memory: convert, verify, plan."""

import click

from .common import (
    AFFINE_BITS_TYPE,
    AFFINE_GROUP_SIZE_TYPE,
    PACKING_TYPE,
    QUANTIZE_FLAG,
    QUANTIZE_TYPE,
    activations_option,
    download_bar,
    gguf_file_option,
    kv_bits_option,
    local_model,
    memory_limit_option,
    model_option,
    or_embedded,
    prefill_option,
    prompt_cache_bytes,
    tensor_bar,
)

PLAN_DOES_NOT_FIT = 3  # plan's exit status when the run does not fit (1: an error, 2: usage)


@click.command(
    epilog="""\b
Examples:
  mlx-ternary convert --hf-path microsoft/bitnet-b1.58-2B-4T --mlx-path bitnet-ternary
  mlx-ternary convert --hf-path DIR --mlx-path out-4bit -q --q-bits 4 --q-group-size 64
  mlx-ternary convert --hf-path microsoft/bitnet-b1.58-2B-4T --to-mlx-lm bitnet-mlx-lm
  mlx-ternary convert --hf-path model.gguf --mlx-path out --packing fast
  mlx-ternary convert --hf-path DIR --to-gguf model-tq2.gguf
"""
)
@click.option(
    "--hf-path",
    required=True,
    help="Source: a model directory, a Hugging Face repo id (owner/repo:QUANT: one GGUF "
    "file of it), or a .gguf file.",
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
    "--to-mlx-lm",
    default=None,
    metavar="DIR",
    help="Write what stock mlx_lm.load (and LM Studio's MLX engine) loads: mlx-lm's "
    "BitLinear layout for bitnet models, else the exact 2-bit (or -q) checkpoint.",
)
@click.option(
    "-q",
    "--quantize",
    type=QUANTIZE_TYPE,
    is_flag=False,
    flag_value=QUANTIZE_FLAG,
    default=None,
    help="Write a stock MLX affine checkpoint (exact ternary) at --q-bits; `-q N` "
    "sets the bits too.",
)
@click.option(
    "--q-bits",
    type=AFFINE_BITS_TYPE,
    default=None,
    help="Bits of the MLX affine checkpoint (default 4; implies -q).",
)
@click.option(
    "--q-group-size",
    type=AFFINE_GROUP_SIZE_TYPE,
    default=None,
    help="Group size of the MLX affine checkpoint (default 64).",
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
    default=None,
    help="GGUF type of ternary rows of whole 256-weight blocks (others: Q8_0 codes); "
    "default TQ2_0. Only with --to-gguf.",
)
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit).")
@gguf_file_option
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
def convert(hf_path, mlx_path, quantize, q_bits, q_group_size, activation_bits, verbose, **options):
    """Convert a ternary checkpoint to the ternary format, stock MLX or GGUF."""
    from ..checkpoint.convert import convert as run_convert

    if mlx_path is None and options["to_gguf"] is None and options["to_mlx_lm"] is None:
        raise click.UsageError("give --mlx-path DIR, --to-mlx-lm DIR or --to-gguf FILE")
    bits = _affine_bits(quantize, q_bits, q_group_size, options["to_mlx_lm"])
    with download_bar() as downloads, tensor_bar() as progress:
        report = run_convert(
            hf_path,
            mlx_path,
            bits,
            q_group_size or 64,
            progress=progress,
            download_progress=downloads,
            notify=lambda m: click.echo(m, err=True),
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


def _affine_bits(quantize, q_bits, q_group_size, to_mlx_lm):
    """The affine bits asked for: `-q N`, `-q --q-bits N` (mlx-lm's form), `--q-bits N`
    alone, or `-q` alone (4); None when no affine checkpoint is asked for."""
    if quantize and q_bits and quantize != q_bits:
        raise click.UsageError(f"-q {quantize} and --q-bits {q_bits} disagree; give one")
    bits = (quantize or q_bits or 4) if quantize is not None else q_bits
    if q_group_size is not None and bits is None and to_mlx_lm is None:
        raise click.UsageError("--q-group-size applies to -q/--quantize or --to-mlx-lm only")
    return bits


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
    """Memory plan: weights, KV cache, activations and overhead against the memory there is.

    Exits 0 when the run fits, 3 when it does not (the plan is printed either way)."""
    import json

    from ..checkpoint.load import load
    from ..memory import plan as memory_plan

    cache_bytes = prompt_cache_bytes(prompt_cache)
    lm, _ = load(local_model(or_embedded(model)), lazy=True)
    mem = memory_plan(lm, max_context, prompt_cache=cache_bytes, **sizes)
    if as_json:
        click.echo(json.dumps(mem.to_dict()))
        if not mem.fits:
            raise SystemExit(PLAN_DOES_NOT_FIT)
        return
    for line in mem.lines():
        click.echo(line)
    click.echo("fits" if mem.fits else f"does not fit; {'; '.join(mem.advice())}")
    if not mem.fits:
        raise SystemExit(PLAN_DOES_NOT_FIT)
