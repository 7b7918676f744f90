"""One rank of the tensor-parallel test: run by `mlx.launch` from tests/test_parallel.py.

It runs `mlx-ternary generate` with each of the JSON file's (argv[1]) "generate" argument
lists, keeping each rank's stdout in argv[2]/<name>/generate.rank<r>.txt; then for each of
its "cases" (a checkpoint, with an adapter directory where the case has one) it writes,
per rank, into argv[2]:
`<name>.rank<r>.npz` with the logits of
  disk:    mlx_ternary.parallel.sharded_load (each rank reads its slices from disk),
  memory:  mlx_ternary.load, then model.shard(group) (mlx-lm's call, slicing in memory),
  control: the memory model with per-rank activation absmax (the negative control),
and `<name>.rank<r>.json` with the ternary bytes each rank holds, MLX's peak memory
during each load, how the output layer was split and how many of its blocks ran the fused
tensor-parallel path (runtime/shard_block.py); for a case marked "fused", also
  unfused:   the memory model with the fused block off (mlx-lm's block, sharded layers),
  decode[_unfused]: the logits of a prefill and DECODE_STEPS greedy steps with a KV cache,
  grad_e[_unfused], grad_w[_unfused]: `block_grads` (fused on, off); then `collectives.rank<r>.npz` (large
collectives over the ring's sockets as runtime/samehost.py left them) and `host.rank<r>.json`
(what it did).
"""

import gc
import json
import sys
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_ternary.checkpoint.load import load
from mlx_ternary.parallel import sharded_load, world
from mlx_ternary.runtime import shard_block
from mlx_ternary.runtime.cpu import block
from mlx_ternary.runtime.shard import ShardedToAllTernaryLinear, ternary_bytes

DECODE_STEPS = 4


def prefill_logits(model, tokens) -> np.ndarray:
    return np.array(model(tokens).astype(mx.float32))


def decode_logits(model, tokens) -> np.ndarray:
    """The logits of a prefill of `tokens` and DECODE_STEPS greedy steps, with mlx-lm's
    KV cache, concatenated over the positions (the test's single process runs it too); with
    the fused block off, a cache that stores the float16 K/V the fused block gives it."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    class HalfKV(KVCache):
        def update_and_fetch(self, keys, values):
            return super().update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))

    half = not block.is_enabled() and block.kv_dtype() == "float16"
    cache = [HalfKV() for _ in model.layers] if half else make_prompt_cache(model)
    out = [model(tokens, cache=cache)]
    for _ in range(DECODE_STEPS):
        out.append(model(mx.argmax(out[-1][:, -1:], axis=-1), cache=cache))
    return np.concatenate([np.array(o[0]) for o in out])


def block_grads(model, tokens):
    """The gradient of the last position's logits' sum with respect to the input
    embeddings and the first block's input norm weight, in eval mode (no train())."""
    norm = model.model.layers[0].input_layernorm
    w0 = norm.weight

    def loss(e, w):
        norm.weight = w
        return model(tokens, input_embeddings=e)[0, -1].sum()

    try:
        e = model.model.embed_tokens(tokens)
        return tuple(np.array(g) for g in mx.grad(loss, argnums=(0, 1))(e, w0))
    finally:
        norm.weight = w0


def fused_and_unfused(fn, info: dict, key: str):
    """fn() with the fused block on, then off: (on, off); info[key] = the sharded blocks
    that ran fused in the first."""
    n, g = shard_block.fused_calls(), shard_block.gradient_nodes()
    on = fn()
    info[key] = shard_block.fused_calls() - n
    info[key + "_gradient_nodes"] = shard_block.gradient_nodes() - g
    block.set_enabled(False)
    try:
        return on, fn()
    finally:
        block.set_enabled(None)


def per_rank_absmax(model) -> int:
    """Let each sharded-to-all layer quantize its K-slice with its own absmax."""
    n = 0
    for _, m in model.named_modules():
        if isinstance(m, ShardedToAllTernaryLinear) and m.activation_bits:
            m.linear.activation_bits, m.activation_bits = m.activation_bits, None
            n += 1
    return n


def measured(fn):
    """(model, MLX's peak memory while building it, over what was held before)."""
    gc.collect()  # a model is a reference cycle (its `shard` attribute): free it now
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    model = fn()
    mx.eval(model.parameters())
    return model, mx.get_peak_memory() - base


def generate(args, out: Path, rank: int) -> None:
    """`mlx-ternary generate ARGS` in this rank, its stdout kept in generate.rank<r>.txt."""
    import contextlib
    import io

    from mlx_ternary.cli import main as cli

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        cli(["generate", *args], standalone_mode=False)
    out.mkdir(exist_ok=True)
    (out / f"generate.rank{rank}.txt").write_text(text.getvalue())


def head_kind(model) -> str:
    head = getattr(model, "lm_head", None)
    if head is not None:
        return type(head).__name__
    return "tied-split" if "as_linear" in vars(model.model.embed_tokens) else "tied"


def collectives(group, out: Path, rank: int) -> None:
    """4 MB all_sum / all_gather: the ring runs both directions of both sockets, the case
    where a receive sleeping in front of a send on the same socket would hang."""
    from mlx_ternary.runtime.samehost import local_sums, share_host

    x = mx.arange(1 << 20, dtype=mx.float32) * (rank + 1)
    total = mx.distributed.all_sum(x, group=group)
    every = mx.distributed.all_gather(x.reshape(2, -1), group=group)
    np.savez(out / f"collectives.rank{rank}.npz", sum=np.array(total), gather=np.array(every))
    done = {**share_host(group), "local_sums": local_sums()}  # over every case above
    (out / f"host.rank{rank}.json").write_text(json.dumps(done))


def main(spec_file: str, out_dir: str) -> None:
    group = world()
    rank, out = group.rank(), Path(out_dir)
    spec = json.loads(Path(spec_file).read_text())
    for name, args in spec["generate"].items():
        generate(args, out / name, rank)
    for case in spec["cases"]:
        tokens = mx.array([case["tokens"]])
        acts, adapter = case.get("activations"), case.get("adapter")
        kw = dict(activations=acts, adapter_path=adapter)
        disk, peak_disk = measured(lambda: sharded_load(case["path"], group, **kw)[0])
        info = {"ternary_bytes_disk": ternary_bytes(disk), "peak_disk": peak_disk}
        n = shard_block.fused_calls()
        logits = {"disk": disk(tokens)}
        mx.eval(logits["disk"])
        info["fused_blocks_disk"] = shard_block.fused_calls() - n
        del disk

        def in_memory():
            model = load(case["path"], lazy=True, **kw)[0]
            model.shard(group)
            return model

        memory, peak_memory = measured(in_memory)
        logits["memory"], unfused = fused_and_unfused(
            partial(prefill_logits, memory, tokens), info, "fused_blocks_memory"
        )
        if case.get("fused"):
            logits["unfused"] = unfused
            logits["decode"], logits["decode_unfused"] = fused_and_unfused(
                partial(decode_logits, memory, tokens), info, "fused_blocks_decode"
            )
            (
                (logits["grad_e"], logits["grad_w"]),
                (logits["grad_e_unfused"], logits["grad_w_unfused"]),
            ) = fused_and_unfused(partial(block_grads, memory, tokens), info, "fused_blocks_grad")
        info.update(
            ternary_bytes_memory=ternary_bytes(memory),
            peak_memory=peak_memory,
            head=head_kind(memory),
            sharded_to_all=per_rank_absmax(memory),
        )
        if info["sharded_to_all"]:
            logits["control"] = memory(tokens)
        np.savez(
            out / f"{case['name']}.rank{rank}.npz",
            **{
                k: np.array(v.astype(mx.float32)) if isinstance(v, mx.array) else v
                for k, v in logits.items()
            },
        )
        (out / f"{case['name']}.rank{rank}.json").write_text(json.dumps(info))
        del memory, logits
    collectives(group, out, rank)
    print(f"rank {rank} of {group.size()}: {len(spec['cases'])} cases done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
