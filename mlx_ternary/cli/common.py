"""What the commands share: the --model option and its fallback, the KV options, progress bars."""

import sys
from contextlib import contextmanager
from pathlib import Path

import click

from ..errors import TernaryError
from ..format import (
    ACTIVATION_MODES,
    AFFINE_BITS,
    AFFINE_GROUP_SIZES,
    KV_BITS,
    KV_GROUP_SIZES,
    PACKINGS,
)

MODEL_HELP = (
    "Model directory, .gguf file or Hugging Face repo id (default: the embedded tiny model)."
)


class IntChoice(click.Choice):
    """A choice among integers, given as text on the command line and passed on as an int."""

    name = "integer choice"

    def __init__(self, values):
        super().__init__([str(v) for v in values])

    def convert(self, value, param, ctx):
        return int(super().convert(str(value), param, ctx))


KV_BITS_TYPE = IntChoice(KV_BITS)
KV_GROUP_SIZE_TYPE = IntChoice(KV_GROUP_SIZES)
AFFINE_BITS_TYPE = IntChoice(AFFINE_BITS)
AFFINE_GROUP_SIZE_TYPE = IntChoice(AFFINE_GROUP_SIZES)
PACKING_TYPE = click.Choice(PACKINGS)

# Options several commands share, defined once.
LOAD_DEFAULT = "Default: what the checkpoint records (q8k for llama.cpp's GGUF files)."


def activations_option(help_default: str = LOAD_DEFAULT):
    """--activations, for every command that loads or converts a model."""
    return click.option(
        "--activations",
        default=None,
        type=click.Choice(ACTIVATION_MODES),
        help="What ternary layers do with their input: model (its own definition: BitNet "
        "int8 per token, else float), q8k (llama.cpp's int8 per 256 columns) or float. "
        + help_default,
    )


kv_bits_option = click.option(
    "--kv-bits", default=None, type=KV_BITS_TYPE, help="Quantize the KV cache to this many bits."
)
prefill_option = click.option(
    "--prefill-step-size",
    default=512,
    show_default=True,
    type=click.IntRange(min=1),
    help="Prompt tokens per prefill chunk.",
)
memory_limit_option = click.option(
    "--memory-limit",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    help="Memory limit in GiB for the plan (default: the memory available).",
)
adapter_option = click.option(
    "--adapter-path",
    default=None,
    help="Directory of LoRA/DoRA adapters (mlx-lm's adapters.safetensors and "
    "adapter_config.json) to apply.",
)


def model_option(f):
    """--model, defaulting to the embedded model (see `or_embedded`)."""
    return click.option("--model", default=None, help=MODEL_HELP)(f)


def or_embedded(model: str | None) -> str:
    """The model given, or the embedded tiny model; refused when that one is missing."""
    if model is not None:
        return model
    from ..generate import EMBEDDED_MODEL

    if not EMBEDDED_MODEL.exists():
        raise TernaryError(
            f"the embedded model is missing from this installation "
            f"({EMBEDDED_MODEL}); reinstall mlx-ternary or pass --model"
        )
    return str(EMBEDDED_MODEL)


@contextmanager
def tensor_bar(desc: str = "convert", file=None):
    """A tqdm bar created on the first progress(name, done, total) call, closed on exit."""
    from tqdm import tqdm

    bar = None

    def progress(name, done, total):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, unit="tensor", desc=desc, file=file)
        bar.set_postfix_str(name[-40:], refresh=False)
        bar.update(1)

    try:
        yield progress
    finally:
        if bar is not None:
            bar.close()


def local_model(model: str) -> str:
    """A GGUF file is converted once into the cache, saying so on stderr; others pass as given."""
    from ..checkpoint.readers.gguf import detect

    if not detect(Path(model).expanduser()):
        return model
    from ..checkpoint.gguf_cache import ternary_dir

    with tensor_bar(file=sys.stderr) as progress:
        return str(
            ternary_dir(Path(model).expanduser(), lambda m: click.echo(m, err=True), progress)
        )


def prompt_cache_bytes(text: str) -> int:
    """--prompt-cache-bytes as a byte count ("512MB"), refused as a bad parameter."""
    from ..memory import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--prompt-cache-bytes") from None


def check_kv_groups(model, kv_bits: int | None, group_size: int) -> None:
    """--kv-group-size must divide the model's head size when the KV cache is quantized."""
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    dim = getattr(args, "head_dim", None) or (heads and getattr(args, "hidden_size", 0) // heads)
    if kv_bits and dim and dim % group_size:
        sizes = ", ".join(str(s) for s in KV_GROUP_SIZES[:-1]) + f" or {KV_GROUP_SIZES[-1]}"
        raise TernaryError(
            f"--kv-group-size {group_size} does not divide this model's head "
            f"size {dim}; pick {sizes} dividing it"
        )
