"""serve: the OpenAI- and Anthropic-compatible HTTP server (tensor parallel under mlx.launch)."""

from functools import partial

import click

from ..errors import TernaryError
from ..format import KV_GROUP_SIZE
from .common import (
    KV_BITS_TYPE,
    KV_GROUP_SIZE_TYPE,
    activations_option,
    adapter_option,
    check_kv_groups,
    context_warning,
    draft_options,
    load_draft,
    local_model,
    memory_limit_option,
    model_option,
    or_embedded,
    prefill_option,
    prompt_cache_bytes,
    threads_option,
)

LOG_LEVELS = ("debug", "info", "warning", "error")
NETWORK_OPTIONS = ("served_names", "api_key", "cors_origins", "read_timeout", "max_connections")
SERVE_FLAGS = {
    "context": "--max-context",
    "batch": "--max-concurrency",
    "prefill": "--prefill-step-size",
    "kv_bits": "--kv-bits",
    "prompt_cache": "--prompt-cache-bytes",
}


@click.command(
    epilog="""\b
Examples:
  mlx-ternary serve --model DIR                     # http://127.0.0.1:8080/v1
  mlx-ternary serve --model DIR --max-context 8192 --max-concurrency 4 --memory-limit 12
  mlx-ternary serve --model BIG --draft-model SMALL   # speculative while one request runs
"""
)
@model_option
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
@memory_limit_option
@prefill_option
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
    type=KV_BITS_TYPE,
    help="Quantize the KV cache (and the prompt cache) to this many bits.",
)
@click.option(
    "--kv-group-size",
    default=KV_GROUP_SIZE,
    show_default=True,
    type=KV_GROUP_SIZE_TYPE,
    help="Group size of --kv-bits.",
)
@click.option(
    "--prompt-cache-bytes",
    "prompt_cache",
    default=None,
    help="Bytes of KV kept across requests for prompt reuse, e.g. 512MB "
    "(default: as much as the live KV cache; 0 turns it off).",
)
@adapter_option
@click.option(
    "--served-model-name",
    "served_names",
    multiple=True,
    help="Another name clients may give as 'model' (repeatable); the id is the model's "
    "short name (directory name, repo id or GGUF stem).",
)
@click.option(
    "--api-key",
    default=None,
    envvar="MLX_TERNARY_API_KEY",
    help="Require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every path but /health "
    "(default: $MLX_TERNARY_API_KEY).",
)
@click.option(
    "--cors-origin",
    "cors_origins",
    multiple=True,
    help="A browser origin allowed to call the API, e.g. http://localhost:3000, or * (repeatable).",
)
@click.option(
    "--read-timeout",
    default=60.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds a connection may send nothing before it is closed.",
)
@click.option(
    "--max-connections",
    default=1024,
    show_default=True,
    type=click.IntRange(min=1),
    help="Open connections at most; more get HTTP 503 with Retry-After.",
)
@activations_option()
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    help="info: one line per request (status, tokens, time to first token, tokens/s); "
    "warning: only problems; debug: also each connection's raw request line.",
)
@threads_option
@draft_options
@click.pass_context
def serve(ctx, model, host, port, memory_limit, prompt_cache, adapter_path, activations, **options):
    """An OpenAI- and Anthropic-compatible HTTP server (/v1/chat/completions,
    /v1/completions, /v1/messages) with a chat page at /."""
    from .. import parallel as dist
    from ..serve.http import ServeConfig, Server, bind_error, make_engine, short_name
    from ..serve.lockstep import LockstepEngine, follow

    _configure_logging(options.pop("log_level"))
    network = {k: options.pop(k) for k in NETWORK_OPTIONS}
    draft_path = options.pop("draft_model")
    sizes = options
    model = or_embedded(model)
    group = dist.world()  # under mlx.launch: tensor parallel, rank 0 serves
    if group.rank() == 0:  # refused before minutes of loading, not after
        error = bind_error(host, port)
        if error:
            click.echo(f"Error: {error}", err=True)
            ctx.exit(2)
    lm, tokenizer = _load_for_serve(local_model(model), group, adapter_path, activations)
    check_kv_groups(lm, sizes["kv_bits"], sizes["kv_group_size"])
    explicit = ctx.get_parameter_source("max_context") != click.core.ParameterSource.DEFAULT
    warning = explicit and context_warning(lm, sizes["max_context"])
    if warning:
        click.echo(f"WARNING: {warning}", err=True)
    cache_bytes = _prompt_cache_size(lm, prompt_cache, sizes)
    mem = _check_serve_memory(lm, memory_limit, cache_bytes, sizes)
    draft = load_draft(draft_path, lm, tokenizer) if draft_path is not None else None
    config = ServeConfig(
        model_name=short_name(model),
        aliases=list(network["served_names"]),
        api_key=network["api_key"] or None,
        cors_origins=list(network["cors_origins"]),
        read_timeout=network["read_timeout"],
        max_connections=network["max_connections"],
        prompt_cache_bytes=cache_bytes,
        **sizes,
    )
    lockstep = partial(LockstepEngine, group=group) if group.size() > 1 else None
    try:
        if lockstep is not None and group.rank() != 0:
            follow(make_engine(lm, tokenizer, config, lockstep))
            return
        server = Server(lm, tokenizer, config, host, port, engine_class=lockstep, draft_model=draft)
    except ValueError as e:  # a model whose caches --kv-bits cannot quantize
        raise TernaryError(str(e)) from None
    except OSError as e:  # the port was taken while the model loaded
        click.echo(f"Error: cannot listen on {host}:{port}: {e.strerror or e}", err=True)
        ctx.exit(2)
    _announce(server, model, config, host, mem)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    if getattr(server, "draining", False):
        _leave(0)


def _announce(server, model, config, host, mem):
    """What is served where (API, chat page, the model's ids), the memory plan, a warning
    when exposed without a key; then SIGTERM/SIGINT drain the server (in-flight requests
    finish, new ones get 503) and a second one forces the exit."""
    from ..serve.http import drain_on_signals, exposure_warning

    base = f"http://{_url_host(host)}:{server.server_address[1]}"
    aliases = config.names[1:]
    click.echo(
        f"Serving {model}\n"
        f"  model id:  {config.names[0]}"
        + (f" (aliases: {', '.join(aliases)})" if aliases else "")
        + f"\n  API:       {base}/v1  (OpenAI and Anthropic)"
        f"\n  chat page: {base}/"
        f"\n  memory:    {mem.total / 1024**3:.2f} of {mem.limit / 1024**3:.2f} GiB planned"
        "\nCtrl-C to stop (twice to force).",
        err=True,
    )
    warning = exposure_warning(host, config.api_key)
    if warning:
        click.echo(f"WARNING: {warning}", err=True)
    drain_on_signals(server, force=_force)


def _url_host(host: str) -> str:
    """The host as a URL writes it (an address on every interface is reached on loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _force(signum: int) -> None:
    click.echo("mlx-ternary serve: forced exit", err=True)
    _leave(128 + signum)


def _leave(code: int) -> None:
    """Exit now, without the interpreter's shutdown: a thread that used MLX (the engine's,
    a connection's) runs MLX's thread-local destructors as it ends, and they take the GIL;
    once the interpreter is finalizing, taking the GIL ends the thread by a forced unwind
    that C++ turns into std::terminate (SIGABRT, "terminate called without an active
    exception"). The server is closed by now: nothing is left to finalize."""
    import logging
    import os
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _configure_logging(level: str) -> None:
    """The server's log (one line per request at info) on stderr, with the time."""
    import logging

    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("mlx_ternary").setLevel(getattr(logging, level.upper()))


def _load_for_serve(path, group, adapter_path, activations):
    from .. import parallel as dist
    from ..serve.http import load_lazily

    if group.size() > 1:
        return dist.sharded_load(path, group, adapter_path=adapter_path, activations=activations)
    return load_lazily(path, adapter_path, activations)


def _prompt_cache_size(lm, prompt_cache, sizes) -> int:
    """--prompt-cache-bytes, by default as many bytes as the live KV cache."""
    from ..memory import kv_bytes

    if prompt_cache is not None:
        return prompt_cache_bytes(prompt_cache)
    return kv_bytes(
        lm, sizes["max_context"], sizes["max_concurrency"], sizes["kv_bits"], sizes["kv_group_size"]
    )


def _check_serve_memory(lm, memory_limit, cache_bytes, sizes):
    from ..memory import plan as memory_plan

    mem = memory_plan(
        lm,
        sizes["max_context"],
        batch=sizes["max_concurrency"],
        prefill_step_size=sizes["prefill_step_size"],
        memory_limit=memory_limit,
        kv_bits=sizes["kv_bits"],
        prompt_cache=cache_bytes,
        flags=SERVE_FLAGS,
    )
    if not mem.fits:
        raise TernaryError(mem.refusal())
    return mem
