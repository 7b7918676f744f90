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
    "Model directory, .gguf file or Hugging Face repo id; owner/repo:QUANT picks one GGUF "
    "file of a GGUF repo (default: the embedded tiny model)."
)
GGUF_FILE_HELP = (
    "The GGUF file to download from a Hugging Face repo of several (or give owner/repo:QUANT)."
)


class IntChoice(click.Choice):
    """A choice among integers, given as text on the command line and passed on as an int."""

    name = "integer choice"

    def __init__(self, values):
        super().__init__([str(v) for v in values])

    def convert(self, value, param, ctx):
        return int(super().convert(str(value), param, ctx))


class QuantizeBits(IntChoice):
    """-q/--quantize's bits: `-q 4`, or `-q` alone (0: take --q-bits, as mlx-lm's convert)."""

    name = "bits"

    def convert(self, value, param, ctx):
        return 0 if value == QUANTIZE_FLAG else super().convert(value, param, ctx)


QUANTIZE_FLAG = "flag"
KV_BITS_TYPE = IntChoice(KV_BITS)
KV_GROUP_SIZE_TYPE = IntChoice(KV_GROUP_SIZES)
AFFINE_BITS_TYPE = IntChoice(AFFINE_BITS)
QUANTIZE_TYPE = QuantizeBits(AFFINE_BITS)
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
    """--model, defaulting to the embedded model (see `or_embedded`), and --gguf-file,
    which `local_model` reads from the context (commands need no parameter for it)."""

    def keep(ctx, param, value):
        ctx.meta["mlx_ternary.gguf_file"] = value

    f = click.option(
        "--gguf-file", default=None, expose_value=False, callback=keep, help=GGUF_FILE_HELP
    )(f)
    return click.option("--model", default=None, help=MODEL_HELP)(f)


def gguf_file_option(f):
    """--gguf-file for a command whose model option is not --model (convert's --hf-path)."""
    return click.option("--gguf-file", default=None, help=GGUF_FILE_HELP)(f)


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


@contextmanager
def download_bar():
    """hub.download's progress(file, done, total) as one byte-counting tqdm bar per file,
    on stderr."""
    from tqdm import tqdm

    bars = {}

    def progress(name, done, total):
        bar = bars.get(name)
        if bar is None:
            bar = bars[name] = tqdm(
                total=total or None, unit="B", unit_scale=True, desc=name[-40:], file=sys.stderr
            )
        bar.update(done - bar.n)
        if total and done >= total:
            bar.close()

    try:
        yield progress
    finally:
        for bar in bars.values():
            bar.close()


def downloaded(model: str, gguf_file=None) -> str:
    """A hub repo id (not a local path) downloaded with progress on stderr; a local path or
    anything else passes as given (the loader explains what it is not)."""
    from ..checkpoint import hub

    if Path(model).expanduser().exists() or not hub.is_repo_id(model):
        if gguf_file is not None:
            raise click.UsageError(
                "--gguf-file picks a file of a Hugging Face repo given as --model"
            )
        return model
    with download_bar() as progress:
        path = hub.download(
            model, gguf_file=gguf_file, progress=progress, notify=lambda m: click.echo(m, err=True)
        )
    return str(path)


def local_model(model: str) -> str:
    """A hub repo id is downloaded (progress on stderr), a GGUF file converted once into
    the cache (saying so); a local directory passes as given."""
    from ..checkpoint.readers.gguf import detect

    ctx = click.get_current_context(silent=True)
    model = downloaded(model, ctx.meta.get("mlx_ternary.gguf_file") if ctx else None)
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


def _apply_threads(ctx, param, value):
    """--threads: the native CPU kernel's threads, for this process (and, through the
    variable, ranks that mlx.launch pins to a block of cores keep it)."""
    if value is None:
        return value
    import os

    import mlx.core as mx

    from ..runtime import cpu
    from ..runtime.samehost import ENV_THREADS

    os.environ[ENV_THREADS] = str(value)
    if mx.default_device() == mx.cpu and cpu.available():
        cpu.set_num_threads(value)
    return value


threads_option = click.option(
    "--threads",
    default=None,
    type=click.IntRange(min=1),
    expose_value=False,
    callback=_apply_threads,
    help="CPU threads of the native kernel (default: every core this process may use, "
    "or $MLX_TERNARY_NUM_THREADS).",
)


def _finite(ctx, param, value):
    """Refuse nan and inf, which FloatRange lets through."""
    import math

    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


def sampling_options(f):
    """--temp, --top-p, --top-k, --min-p, --repetition-penalty, --seed: mlx-lm's sampling
    flags, each refused outside its range."""
    for option in reversed(
        (
            click.option(
                "--temp",
                default=0.0,
                show_default=True,
                type=click.FloatRange(min=0),
                callback=_finite,
                help="Sampling temperature (0: greedy).",
            ),
            click.option(
                "--top-p",
                default=1.0,
                show_default=True,
                type=click.FloatRange(0, 1),
                callback=_finite,
                help="Nucleus sampling.",
            ),
            click.option(
                "--top-k",
                default=0,
                show_default=True,
                type=click.IntRange(min=0),
                help="Top-k sampling (0: off).",
            ),
            click.option(
                "--min-p",
                default=0.0,
                show_default=True,
                type=click.FloatRange(0, 1),
                callback=_finite,
                help="Min-p sampling.",
            ),
            click.option(
                "--repetition-penalty",
                default=None,
                type=click.FloatRange(min=0, min_open=True),
                callback=_finite,
                help="Penalty for repeated tokens (e.g. 1.1).",
            ),
            click.option(
                "--seed",
                default=None,
                type=click.IntRange(0, 2**64 - 1),
                help="Random seed for sampling.",
            ),
        )
    ):
        f = option(f)
    return f


def context_warning(model, max_context: int, flag: str = "--max-context"):
    """A warning when `max_context` exceeds the model's max_position_embeddings (None if not)."""
    trained = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    if isinstance(trained, int) and max_context > trained:
        return (
            f"{flag} {max_context} is above this model's max_position_embeddings "
            f"({trained}): past {trained} tokens its output degrades"
        )
    return None


def default_context(model, cap: int = 4096) -> int:
    """The model's max_position_embeddings, at most `cap` (cap when it does not say)."""
    trained = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    return min(trained, cap) if isinstance(trained, int) and trained > 0 else cap


def draft_options(f):
    """--draft-model and --num-draft-tokens (speculative decoding), for generate and serve."""
    from ..speculative import DEFAULT_DRAFT_TOKENS

    f = click.option(
        "--num-draft-tokens",
        default=DEFAULT_DRAFT_TOKENS,
        show_default=True,
        type=click.IntRange(min=1),
        help="Tokens the draft model proposes per verify step.",
    )(f)
    return click.option(
        "--draft-model",
        default=None,
        help="A smaller model with the same tokenizer for speculative decoding (directory, "
        ".gguf file or repo id; ternary or any mlx-lm model). Greedy output is unchanged.",
    )(f)


def load_draft(path: str, model, tokenizer):
    """--draft-model: a ternary checkpoint (native, BitNet, GGUF) through mlx-ternary's
    loader, any other model through mlx-lm's; refused unless its vocabulary is the target's.
    Not under mlx.launch (the draft would run unsharded beside a sharded target)."""
    from .. import parallel as dist
    from ..checkpoint.load import load, resolve_model_path
    from ..lm import is_ternary_checkpoint
    from ..speculative import check_draft

    if dist.world().size() > 1:
        raise TernaryError("--draft-model is not supported under mlx.launch; drop it")
    local = resolve_model_path(local_model(path))
    if is_ternary_checkpoint(local):
        draft, draft_tokenizer = load(str(local))
    else:
        from mlx_lm import load as mlx_lm_load

        draft, draft_tokenizer = mlx_lm_load(str(local))
    check_draft(tokenizer, draft_tokenizer, model, draft, name=f"--draft-model {path}")
    return draft
