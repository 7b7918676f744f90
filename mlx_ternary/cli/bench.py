"""bench: each representation of a model, the kernels (--kernels) or the graph-building
overhead (--overhead; --host is its deprecated old name)."""

import json

import click

from .common import threads_option


@click.command(
    epilog="""\b
Examples:
  python scripts/fixtures/make_synthetic_model.py --shape bitnet-2b --out /tmp/bitnet-2b
  mlx-ternary bench --model /tmp/bitnet-2b --prompt-tokens 16 --gen-tokens 8 --repeats 2
  mlx-ternary bench --model DIR --formats fast,q4 --json bench.json --plot bench.png
  mlx-ternary bench --kernels --json kernels.json     # on a Mac: every kernel vs stock MLX
  mlx-ternary bench --kernels --backend emulate --quick  # off a Mac: a smoke run, no timing
  mlx-ternary bench --overhead                        # graph time per layer call and token
  mlx-ternary bench --model DIR --formats fast --llama-cpp NODE_MODULES --gguf model.gguf
  mlx-ternary bench --model model.gguf --formats fast --measure-bandwidth --llama-threads 2 \
      --peer "ik_llama.cpp IQ2_BN=IK/build/bin/llama-bench:model-iq2_bn.gguf"
"""
)
@click.option(
    "--model",
    default=None,
    help="Model directory or Hugging Face repo id (not for --kernels/--overhead).",
)
@click.option(
    "--kernels",
    is_flag=True,
    help="Benchmark the Metal kernels against stock MLX (docs/KERNELS.md).",
)
@click.option(
    "--overhead",
    is_flag=True,
    help="Measure the graph-construction (Python) time per layer call and decode token.",
)
@click.option("--host", "old_overhead", is_flag=True, hidden=True, help="Deprecated: --overhead.")
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
@click.option(
    "--peer",
    "peers",
    multiple=True,
    metavar="LABEL=BIN:GGUF",
    help="A source-built llama-bench (llama.cpp, ik_llama.cpp, bitnet.cpp) on its own GGUF "
    "of the same weights: one more row (repeatable), run with --llama-threads.",
)
@click.option(
    "--measure-bandwidth",
    is_flag=True,
    help="On a CPU: measure the streaming-read bandwidth for the ceiling column.",
)
@threads_option
def bench(model, kernels, overhead, backend, quick, json_path, plot_path, markdown, **run):
    """Measure each representation of a model: bytes, peak memory, prefill and decode speed."""
    if run.pop("old_overhead"):  # "host" now means only `serve --host`; remove in 0.3
        click.echo(
            "warning: `bench --host` is deprecated (removed in 0.3): use --overhead", err=True
        )
        overhead = True
    run["bandwidth_gbs"] = run.pop("bandwidth")
    run["peer_benches"] = [_peer(p) for p in run.pop("peers")]
    if kernels or overhead:
        _bench_kernels_or_overhead(kernels, backend, quick, run["bandwidth_gbs"], json_path)
        return
    if model is None:
        raise click.UsageError("give --model DIR (or --kernels / --overhead)")
    from ..bench import formats as bench_

    names = [f.strip() for f in run.pop("formats").split(",") if f.strip()]
    result = bench_.run_bench(model, names, progress=lambda s: click.echo(s, err=True), **run)
    _print_bench(result, markdown)
    if json_path:
        _write_json(json_path, result.to_dict())
    if plot_path:
        bench_.plot(result, plot_path)


def _peer(spec: str):
    """LABEL=BIN:GGUF -> (label, binary, gguf)."""
    label, _, rest = spec.partition("=")
    binary, _, gguf = rest.rpartition(":")
    if not (label and binary and gguf):
        raise click.BadParameter(f"{spec!r}: give LABEL=BIN:GGUF", param_hint="--peer")
    return label, binary, gguf


def _bench_kernels_or_overhead(kernels, backend, quick, bandwidth, json_path):
    if kernels:
        from ..bench import kernels as mod

        result = mod.run(backend, quick, bandwidth, progress=lambda s: click.echo(s, err=True))
    else:
        from ..bench import overhead as mod

        result = mod.report()
    for line in mod.lines(result):
        click.echo(line)
    if json_path:
        _write_json(json_path, result)


def _write_json(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def _print_bench(result, markdown):
    from ..bench import formats as bench_

    d, s = result.device, result.settings
    click.echo(
        f"{result.model} on {d['device']} ({d['mlx_device']}, ternary backend "
        f"{d['ternary_backend']}, {d['cpu_count']} CPUs), MLX {d['mlx']}, "
        f"mlx-lm {d['mlx_lm']}"
    )
    click.echo(
        f"prompt {s['prompt_tokens']} tokens, {s['gen_tokens']} generated, {s['repeats']} "
        "interleaved repeats; median (min-max)"
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
        f"{s['ceiling_context']} tokens of context (16-bit floats and KV)"
    )
    click.echo(bench_.render(bench_.apple_rows(result), markdown))
