"""The mlx-ternary command line. The only module that prints."""

import sys
from functools import partial

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


def _activations_option(help_default: str):
    """--activations, one definition for every command that loads or converts a model."""
    from .format import ACTIVATION_MODES

    return click.option(
        "--activations",
        default=None,
        type=click.Choice(ACTIVATION_MODES),
        help="What ternary layers do with their input: model (its own definition: BitNet "
        "int8 per token, else float), q8k (llama.cpp's int8 per 256 columns) or float. "
        + help_default,
    )


_LOAD_DEFAULT = "Default: what the checkpoint records (q8k for llama.cpp's GGUF files)."


def _model(model: str) -> str:
    """--model: a GGUF file is converted once into the cache, saying so on stderr."""
    from pathlib import Path

    from .checkpoint.readers.gguf import detect

    if not detect(Path(model).expanduser()):
        return model
    from tqdm import tqdm

    from .checkpoint.gguf_cache import native_dir

    bar = None

    def progress(name, done, total):
        nonlocal bar
        bar = bar or tqdm(total=total, unit="tensor", desc="convert", file=sys.stderr)
        bar.update(1)

    try:
        return str(
            native_dir(Path(model).expanduser(), lambda m: click.echo(m, err=True), progress)
        )
    finally:
        if bar is not None:
            bar.close()


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlx-ternary")
@click.pass_context
def main(ctx):
    """Run ternary (1.58-bit) LLMs with MLX."""
    if ctx.invoked_subcommand in ("generate", "bench", "perplexity", "serve"):
        _build_native()


def _build_native():
    """On the CPU, say so when the native kernel is compiled (once, before the first model)."""
    import os

    import mlx.core as mx

    if (
        os.environ.get("MLX_TERNARY_BACKEND", "native") == "native"
        and mx.default_device() == mx.cpu
    ):
        from .runtime import cpu

        cpu.available(lambda s: click.echo(f"mlx-ternary: {s}", err=True))


@main.command(
    epilog="""\b
Examples:
  mlx-ternary generate --prompt "ROMEO:"            # the embedded model, offline
  mlx-ternary generate --model DIR --prompt "Hi" -m 64 --temp 0.7 --seed 1
  echo "Once upon a time" | mlx-ternary generate --model DIR --prompt - --verbose
"""
)
@click.option(
    "--model",
    default=None,
    help="Model directory, .gguf file or Hugging Face repo id (default: the embedded tiny model).",
)
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
    type=int,
    help="Maximum number of tokens to generate.",
)
@click.option("--temp", default=0.0, show_default=True, type=float, help="Sampling temperature.")
@click.option("--top-p", default=1.0, show_default=True, type=float, help="Nucleus sampling.")
@click.option("--top-k", default=0, show_default=True, type=int, help="Top-k sampling (0: off).")
@click.option("--min-p", default=0.0, show_default=True, type=float, help="Min-p sampling.")
@click.option(
    "--repetition-penalty", default=None, type=float, help="Penalty for repeated tokens (e.g. 1.1)."
)
@click.option("--seed", default=None, type=int, help="Random seed for sampling.")
@click.option("--system-prompt", default=None, help="System prompt for the chat template.")
@click.option(
    "--ignore-chat-template",
    is_flag=True,
    help="Feed the prompt as raw text even if the tokenizer has a chat template.",
)
@click.option("--max-kv-size", default=None, type=int, help="Rotating KV cache size.")
@click.option(
    "--kv-bits",
    default=None,
    type=click.IntRange(2, 8),
    help="Quantize the KV cache to this many bits.",
)
@click.option(
    "--adapter-path",
    default=None,
    help="Directory of LoRA/DoRA adapters (mlx-lm's adapters.safetensors and "
    "adapter_config.json) to apply.",
)
@click.option("--verbose", is_flag=True, help="Print speeds and peak memory at the end.")
@_activations_option(_LOAD_DEFAULT)
def generate(
    model,
    prompt,
    max_tokens,
    temp,
    top_p,
    top_k,
    min_p,
    repetition_penalty,
    seed,
    system_prompt,
    ignore_chat_template,
    max_kv_size,
    kv_bits,
    adapter_path,
    verbose,
    activations,
):
    """Generate text from a prompt, streaming tokens as they come."""
    from . import generate as gen
    from .checkpoint.load import load

    if model is None:
        if not gen.EMBEDDED_MODEL.exists():
            raise TernaryError(
                f"the embedded model is missing from this installation "
                f"({gen.EMBEDDED_MODEL}); reinstall mlx-ternary or pass --model"
            )
        model = str(gen.EMBEDDED_MODEL)
    if max_tokens < 1:
        raise click.BadParameter("must be at least 1", param_hint="--max-tokens")
    from . import parallel as dist

    group = dist.world()  # under mlx.launch: tensor parallel, rank 0 prints
    rank0 = group.rank() == 0
    if prompt == "-":
        if group.size() > 1:  # mlx.launch forwards stdin but never closes it
            raise click.BadParameter(
                "stdin cannot be read under mlx.launch; give the prompt itself",
                param_hint="--prompt",
            )
        prompt = sys.stdin.read()
    if group.size() > 1:
        if adapter_path:
            raise click.BadParameter(
                "adapters are not applied under mlx.launch (sharded "
                "layers take no LoRA); run without mlx.launch, or fuse "
                "with `mlx-ternary lm fuse --dequantize`",
                param_hint="--adapter-path",
            )
        lm, tokenizer = dist.sharded_load(_model(model), group)
        seed = dist.agree_seed(seed, group)
    else:
        lm, tokenizer = load(
            _model(model), lazy=True, adapter_path=adapter_path, activations=activations
        )
    from .memory import plan as memory_plan

    n_prompt = len(gen.prompt_tokens(tokenizer, prompt, system_prompt, ignore_chat_template))
    mem = memory_plan(
        lm,
        n_prompt + max_tokens,
        prefill_step_size=2048,
        kv_bits=kv_bits,
        max_kv_size=max_kv_size,
        flags={"context": "--max-tokens (or --max-kv-size)", "kv_bits": "--kv-bits"},
    )
    if not mem.fits:
        raise TernaryError(mem.refusal())
    last = None
    for last in gen.stream(
        lm,
        tokenizer,
        prompt,
        max_tokens=max_tokens,
        temp=temp,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        system_prompt=system_prompt,
        ignore_chat_template=ignore_chat_template,
        max_kv_size=max_kv_size,
        kv_bits=kv_bits,
    ):
        if rank0:
            click.echo(last.text, nl=False)
            sys.stdout.flush()
    if not rank0:
        return
    click.echo()
    if verbose and last is not None:
        click.echo("=" * 10)
        click.echo(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
        click.echo(
            f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec"
        )
        click.echo(f"Peak memory: {last.peak_memory:.3f} GB")


@main.command(
    epilog="""\b
Examples:
  mlx-ternary perplexity --data heldout.txt             # the embedded model
  mlx-ternary perplexity --model DIR --data FILE --context 512 --json
"""
)
@click.option(
    "--model",
    default=None,
    help="Model directory, .gguf file or Hugging Face repo id (default: the embedded tiny model).",
)
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
@_activations_option(_LOAD_DEFAULT)
def perplexity(model, data, context, batch_size, max_tokens, as_json, activations):
    """Perplexity of a model on a text file, evaluated in consecutive windows."""
    import json

    from . import generate as gen
    from . import perplexity as ppl
    from .checkpoint.load import load

    if model is None:
        if not gen.EMBEDDED_MODEL.exists():
            raise TernaryError(
                f"the embedded model is missing from this installation "
                f"({gen.EMBEDDED_MODEL}); reinstall mlx-ternary or pass --model"
            )
        model = str(gen.EMBEDDED_MODEL)
    lm, tokenizer, config = load(_model(model), return_config=True, activations=activations)
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


@main.command(
    epilog="""\b
Examples:
  mlx-ternary convert --hf-path microsoft/bitnet-b1.58-2B-4T --mlx-path bitnet-native
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
    type=click.Choice(["compact", "fast"]),
    default=None,
    help="Native packing (default: the kernels' default).",
)
@click.option(
    "-q",
    "--q-bits",
    type=click.Choice(["2", "3", "4", "5", "6", "8"]),
    default=None,
    help="Write a stock MLX affine checkpoint at this many bits (exact ternary).",
)
@click.option(
    "--q-group-size",
    type=click.Choice(["32", "64", "128"]),
    default="64",
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
@_activations_option(
    "Recorded in the checkpoint. Default: q8k from llama.cpp's GGUF files, else model."
)
def convert(
    hf_path,
    mlx_path,
    packing,
    q_bits,
    q_group_size,
    dtype,
    dequantize,
    to_gguf,
    gguf_type,
    revision,
    activation_bits,
    force,
    activations,
):
    """Convert a ternary checkpoint to the native format, stock MLX or GGUF."""
    from tqdm import tqdm

    from .checkpoint.convert import convert as run_convert

    if mlx_path is None and to_gguf is None:
        raise click.UsageError("give --mlx-path DIR or --to-gguf FILE")
    bar = None

    def progress(name, done, total):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, unit="tensor", desc="convert")
        bar.set_postfix_str(name[-40:], refresh=False)
        bar.update(1)

    try:
        report = run_convert(
            hf_path,
            mlx_path,
            int(q_bits) if q_bits else None,
            int(q_group_size),
            packing=packing,
            dtype=dtype,
            dequantize=dequantize,
            to_gguf=to_gguf,
            gguf_type=gguf_type,
            force=force,
            revision=revision,
            progress=progress,
            activation_bits=None if activation_bits is None else int(activation_bits),
            activations=activations,
        )
    finally:
        if bar is not None:
            bar.close()
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


@main.command()
@click.argument("path")
def verify(path):
    """Check a converted checkpoint: manifest hashes, shards, tensor shapes vs config."""
    from .checkpoint.verify import verify as run_verify

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


@main.command(
    epilog="""\b
Examples:
  mlx-ternary serve --model DIR                     # http://127.0.0.1:8080/v1
  mlx-ternary serve --model DIR --max-context 8192 --max-concurrency 4 --memory-limit 12
"""
)
@click.option(
    "--model",
    default=None,
    help="Model directory, .gguf file or Hugging Face repo id (default: the embedded tiny model).",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (loopback by default; 0.0.0.0 exposes it).",
)
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--max-context",
    default=4096,
    show_default=True,
    type=click.IntRange(min=2),
    help="Prompt + generated tokens per request; longer prompts get HTTP 400.",
)
@click.option(
    "--memory-limit",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    help="Memory limit in GiB for the plan (default: the memory available).",
)
@click.option(
    "--prefill-step-size",
    default=512,
    show_default=True,
    type=click.IntRange(min=1),
    help="Prompt tokens per prefill chunk.",
)
@click.option(
    "--max-concurrency",
    default=8,
    show_default=True,
    type=click.IntRange(min=1),
    help="Requests decoded together in one batch; more wait in a queue.",
)
@click.option(
    "--kv-bits",
    default=None,
    type=click.Choice(["2", "3", "4", "5", "6", "8"]),
    help="Quantize the KV cache (and the prompt cache) to this many bits.",
)
@click.option(
    "--kv-group-size",
    default=64,
    show_default=True,
    type=click.Choice(["32", "64", "128"]),
    help="Group size of --kv-bits.",
)
@click.option(
    "--prompt-cache-bytes",
    default=None,
    help="Bytes of KV kept across requests for prompt reuse, e.g. 512MB "
    "(default: as much as the live KV cache; 0 turns it off).",
)
@click.option(
    "--adapter-path",
    default=None,
    help="Directory of LoRA/DoRA adapters (mlx-lm's format) to apply.",
)
@_activations_option(_LOAD_DEFAULT)
def serve(
    model,
    host,
    port,
    max_context,
    memory_limit,
    prefill_step_size,
    max_concurrency,
    kv_bits,
    kv_group_size,
    prompt_cache_bytes,
    adapter_path,
    activations,
):
    """An OpenAI- and Anthropic-compatible HTTP server (/v1/chat/completions,
    /v1/completions, /v1/messages)."""
    from . import generate as gen
    from . import parallel as dist
    from .memory import kv_bytes, parse_bytes
    from .memory import plan as memory_plan
    from .serve.http import ServeConfig, Server, load_model, make_engine
    from .serve.lockstep import LockstepEngine, follow

    model = model or str(gen.EMBEDDED_MODEL)
    kv_bits = int(kv_bits) if kv_bits else None
    kv_group_size = int(kv_group_size)
    group = dist.world()  # under mlx.launch: tensor parallel, rank 0 serves
    path = _model(model)
    if group.size() > 1 and adapter_path:
        raise click.BadParameter(
            "adapters are not applied under mlx.launch (sharded layers take no LoRA)",
            param_hint="--adapter-path",
        )
    lm, tokenizer = (
        dist.sharded_load(path, group)
        if group.size() > 1
        else load_model(path, adapter_path, activations)
    )
    _check_kv_groups(lm, kv_bits, kv_group_size)
    try:
        cache_bytes = (
            kv_bytes(lm, max_context, max_concurrency, kv_bits, kv_group_size)
            if prompt_cache_bytes is None
            else parse_bytes(prompt_cache_bytes)
        )
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--prompt-cache-bytes") from None
    mem = memory_plan(
        lm,
        max_context,
        batch=max_concurrency,
        prefill_step_size=prefill_step_size,
        memory_limit=memory_limit,
        kv_bits=kv_bits,
        prompt_cache=cache_bytes,
        flags={
            "context": "--max-context",
            "batch": "--max-concurrency",
            "prefill": "--prefill-step-size",
            "kv_bits": "--kv-bits",
            "prompt_cache": "--prompt-cache-bytes",
        },
    )
    if not mem.fits:
        raise TernaryError(mem.refusal())
    config = ServeConfig(
        model_name=model,
        max_context=max_context,
        prefill_step_size=prefill_step_size,
        max_concurrency=max_concurrency,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        prompt_cache_bytes=cache_bytes,
    )
    lockstep = partial(LockstepEngine, group=group) if group.size() > 1 else None
    try:
        if lockstep is not None and group.rank() != 0:
            follow(make_engine(lm, tokenizer, config, lockstep))
            return
        server = Server(lm, tokenizer, config, host, port, engine_class=lockstep)
    except ValueError as e:  # a model whose caches --kv-bits cannot quantize
        raise TernaryError(str(e)) from None
    click.echo(
        f"Serving {model} on http://{host}:{server.server_address[1]}/v1 "
        f"(plan: {mem.total / 1024**3:.2f} of {mem.limit / 1024**3:.2f} GiB)",
        err=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def _check_kv_groups(model, kv_bits, group_size):
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    dim = getattr(args, "head_dim", None) or (heads and getattr(args, "hidden_size", 0) // heads)
    if kv_bits and dim and dim % group_size:
        raise TernaryError(
            f"--kv-group-size {group_size} does not divide this model's head "
            f"size {dim}; pick 32, 64 or 128 dividing it"
        )


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    add_help_option=False,
    epilog="""\b
Examples:
  mlx-ternary lm server --model DIR --port 8080      # mlx-lm's OpenAI-compatible server
  mlx-ternary lm lora --model DIR --train --data DATA --iters 100
  mlx-ternary lm chat --model DIR --adapter-path adapters
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
    """
    from .lm import run_tool

    if tool is None or tool in ("-h", "--help"):
        click.echo(ctx.get_help())
        return
    run_tool(tool, list(args), notify=lambda line: click.echo(line, err=True))


@main.command(
    epilog="""\b
Examples:
  mlx-ternary plan --model DIR --max-context 8192
  mlx-ternary plan --model DIR --max-context 32768 --batch 4 --kv-bits 8 --json
"""
)
@click.option(
    "--model",
    default=None,
    help="Model directory, .gguf file or Hugging Face repo id (default: the embedded tiny model).",
)
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
@click.option(
    "--kv-bits",
    default=None,
    type=click.IntRange(2, 8),
    help="Quantize the KV cache to this many bits.",
)
@click.option(
    "--prefill-step-size",
    default=512,
    show_default=True,
    type=click.IntRange(min=1),
    help="Prompt tokens per prefill chunk.",
)
@click.option(
    "--memory-limit",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    help="Memory limit in GiB (default: the memory available).",
)
@click.option(
    "--prompt-cache-bytes",
    default="0",
    show_default=True,
    help="Bytes of KV serve keeps across requests, e.g. 512MB.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
def plan(
    model, max_context, batch, kv_bits, prefill_step_size, memory_limit, prompt_cache_bytes, as_json
):
    """Memory plan: weights, KV cache, activations and overhead against the memory there is."""
    import json

    from . import generate as gen
    from .checkpoint.load import load
    from .memory import parse_bytes
    from .memory import plan as memory_plan

    try:
        cache_bytes = parse_bytes(prompt_cache_bytes)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--prompt-cache-bytes") from None
    lm, _ = load(_model(model or str(gen.EMBEDDED_MODEL)), lazy=True)
    mem = memory_plan(
        lm,
        max_context,
        batch=batch,
        prefill_step_size=prefill_step_size,
        kv_bits=kv_bits,
        memory_limit=memory_limit,
        prompt_cache=cache_bytes,
    )
    if as_json:
        click.echo(json.dumps(mem.to_dict()))
        return
    for line in mem.lines():
        click.echo(line)
    click.echo("fits" if mem.fits else f"does not fit; {'; '.join(mem.advice())}")


@main.command(
    epilog="""\b
Examples:
  python scripts/make_synthetic_model.py --shape bitnet-2b --out /tmp/bitnet-2b
  mlx-ternary bench --model /tmp/bitnet-2b --prompt-tokens 16 --gen-tokens 8 --repeats 2
  mlx-ternary bench --model DIR --formats fast,q4 --json bench.json --plot bench.png
  mlx-ternary bench --kernels --json kernels.json     # on a Mac: every kernel vs stock MLX
  mlx-ternary bench --kernels --backend emulate --quick  # off a Mac: a smoke run, no timing
  mlx-ternary bench --host                            # host time per layer call and token
  mlx-ternary bench --model DIR --formats fast --llama-cpp NODE_MODULES --gguf model.gguf
"""
)
@click.option(
    "--model",
    default=None,
    help="Model directory or Hugging Face repo id (not for --kernels/--host).",
)
@click.option(
    "--kernels",
    is_flag=True,
    help="Benchmark the Metal kernels against stock MLX (docs/KERNELS.md).",
)
@click.option(
    "--host",
    is_flag=True,
    help="Measure host (graph-construction) time per layer call and decode token.",
)
@click.option(
    "--backend",
    type=click.Choice(["metal", "emulate"]),
    default="metal",
    show_default=True,
    help="--kernels: the GPU, or the CPU emulator (no timing).",
)
@click.option("--quick", is_flag=True, help="--kernels: one shape, fewer token counts.")
@click.option(
    "--formats",
    default="compact,fast,q2,q4,bf16",
    show_default=True,
    help="Comma-separated: compact, fast, q2, q4, bf16, f32.",
)
@click.option(
    "--prompt-tokens",
    default=512,
    show_default=True,
    type=int,
    help="Prompt length (seeded random token ids).",
)
@click.option(
    "--gen-tokens", default=128, show_default=True, type=int, help="Tokens generated per run."
)
@click.option(
    "--repeats",
    default=3,
    show_default=True,
    type=int,
    help="Timed runs per format, interleaved across formats.",
)
@click.option(
    "--context",
    default=None,
    type=int,
    help="Context for the Apple ceiling table (default: prompt + gen tokens).",
)
@click.option(
    "--bandwidth",
    default=None,
    type=float,
    help="This device's memory bandwidth in GB/s, when it is not an Apple chip.",
)
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for the prompt.")
@click.option(
    "--json",
    "json_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Write the full results as JSON to this file.",
)
@click.option(
    "--plot",
    "plot_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Write a PNG of tokens/s and memory per format (needs matplotlib).",
)
@click.option("--markdown", is_flag=True, help="Print the tables as Markdown.")
@click.option(
    "--llama-cpp",
    default=None,
    metavar="DIR",
    help="node_modules with node-llama-cpp (or $MLX_TERNARY_LLAMA_CPP): adds a "
    "llama.cpp row on --gguf.",
)
@click.option(
    "--gguf",
    default=None,
    type=click.Path(dir_okay=False),
    help="The same weights as a llama.cpp GGUF, for the llama.cpp row.",
)
@click.option(
    "--llama-threads",
    default=None,
    type=int,
    help="llama.cpp threads (default: as many as the native kernels use).",
)
def bench(
    model,
    kernels,
    host,
    backend,
    quick,
    formats,
    prompt_tokens,
    gen_tokens,
    repeats,
    context,
    bandwidth,
    seed,
    json_path,
    plot_path,
    markdown,
    llama_cpp,
    gguf,
    llama_threads,
):
    """Measure each representation of a model: bytes, peak memory, prefill and decode speed."""
    import json as json_

    from .bench import formats as bench_

    if kernels or host:
        if kernels:
            from .bench import kernels as mod

            result = mod.run(backend, quick, bandwidth, progress=lambda s: click.echo(s, err=True))
        else:
            from .bench import host as mod

            result = mod.report()
        for line in mod.lines(result):
            click.echo(line)
        if json_path:
            with open(json_path, "w") as f:
                json_.dump(result, f, indent=2)
        return
    if model is None:
        raise click.UsageError("give --model DIR (or --kernels / --host)")

    names = [f.strip() for f in formats.split(",") if f.strip()]
    result = bench_.run_bench(
        model,
        names,
        prompt_tokens,
        gen_tokens,
        repeats,
        context,
        bandwidth,
        seed,
        progress=lambda s: click.echo(s, err=True),
        llama_cpp=llama_cpp,
        gguf=gguf,
        llama_threads=llama_threads,
    )
    d = result.device
    click.echo(
        f"{result.model} on {d['device']} ({d['mlx_device']}, ternary backend "
        f"{d['ternary_backend']}, {d['cpu_count']} CPUs), MLX {d['mlx']}, "
        f"mlx-lm {d['mlx_lm']}"
    )
    click.echo(
        f"prompt {prompt_tokens} tokens, {gen_tokens} generated, {repeats} interleaved "
        "repeats; median (min-max)"
    )
    click.echo("measured:")
    click.echo(bench_.render(bench_.table_rows(result), markdown))
    bw = (
        f"{result.bandwidth_gbs:g} GB/s ({result.bandwidth_source})"
        if result.bandwidth_gbs
        else result.bandwidth_source
    )
    click.echo(f"bandwidth: {bw}")
    click.echo(
        f"computed: decode ceiling tokens/s on Apple chips at "
        f"{result.settings['ceiling_context']} tokens of context (16-bit floats and KV)"
    )
    click.echo(bench_.render(bench_.apple_rows(result), markdown))
    if json_path:
        with open(json_path, "w") as f:
            json_.dump(result.to_dict(), f, indent=2)
    if plot_path:
        bench_.plot(result, plot_path)


if __name__ == "__main__":
    main()
