"""Where a tensor-parallel decode step's time goes on one host: compute, collectives, the rest.

    python scripts/bench/tp_cost.py --model DIR --compare     # both settings and the ratio
    python scripts/bench/tp_cost.py --llama /tmp/tq2 --compare   # on the 0.53 G llama
    MLX_TERNARY_NUM_THREADS=2 python scripts/bench/tp_cost.py --model DIR          # 1 process
    MLX_TERNARY_NUM_THREADS=1 mlx.launch -n 2 --backend ring -- \\
        python scripts/bench/tp_cost.py --model DIR                               # 2 ranks

`--llama DIR` writes the 0.53 G random TQ2_0 llama of bench_llamacpp.py into DIR/model.gguf
and its fast-packed conversion into DIR/fast (once; minutes) and measures that.
`--compare` runs one process with `--threads 2` threads and `--ranks 2` ranks of one thread
each (`mlx.launch --backend ring`), alternating `--repeats` times, and prints ms per token
for both and the ratio of their decode speeds (2 ranks / 1 process: 0.5 means the ranks
decode at half the single process's speed).

Each rank loads the model (`load()` + `model.shard(group)` under mlx.launch), prefills a
16-token seeded prompt and times `--gen-tokens` greedy decode steps three ways, printing one
JSON line per rank (milliseconds per token):
  ms_per_token   the real run;
  compute_ms     the same steps with the collectives (mx.distributed's, samehost.all_sum's)
                 replaced by the identity
                 (same shapes and kernels, no waiting on the other rank; wrong numbers);
  collectives_ms the collectives counted in one step times one all_sum of the hidden size
                 timed back to back (after 20 warm-up calls);
  rest_ms        what is left: waiting for the other rank to arrive (scheduling, skew).
Over the real run it also reads each thread's scheduler account (/proc/self/task/*/schedstat
on Linux), per token: `cpu_ms` on a core and `queued_ms` runnable but waiting for a core,
for the main thread, the threads mx.distributed.init started (the ring backend's) and the
others (MLX's CPU stream, the native kernel's pool), and the ranks' CPU affinity.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx

COLLECTIVES = ("all_sum", "all_max", "all_gather")
TASKS = Path("/proc/self/task")


def thread_ids() -> set:
    return {int(t.name) for t in TASKS.iterdir()} if TASKS.exists() else set()


def schedstat() -> dict:
    """{tid: (ns on a core, ns runnable in a queue)} of this process's threads."""
    out = {}
    for tid in thread_ids():
        try:
            run, wait, _ = (TASKS / str(tid) / "schedstat").read_text().split()
        except (OSError, ValueError):
            continue
        out[tid] = (int(run), int(wait))
    return out


def thread_account(before: dict, after: dict, ring: set, steps: int) -> dict:
    """cpu_ms / queued_ms per token for the main thread, the ring's threads and the rest."""
    main = threading.get_native_id()
    acc = {k: [0.0, 0.0] for k in ("main", "ring", "other")}
    for tid, (run, wait) in after.items():
        r0, w0 = before.get(tid, (0, 0))
        kind = "main" if tid == main else "ring" if tid in ring else "other"
        acc[kind][0] += (run - r0) / 1e6 / steps
        acc[kind][1] += (wait - w0) / 1e6 / steps
    return {k: {"cpu_ms": round(c, 3), "queued_ms": round(q, 3)} for k, (c, q) in acc.items()}


def decode_ms(model, steps: int, ring: set = frozenset(), account: dict = None) -> float:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    vocab = model.model.embed_tokens.weight.shape[0]
    prompt = mx.random.randint(0, vocab, (1, 16), key=mx.random.key(0))
    tok = mx.argmax(model(prompt, cache=cache)[:, -1], -1)
    mx.eval(tok)
    before = schedstat()
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = mx.argmax(model(tok[:, None], cache=cache)[:, -1], -1)
        mx.eval(tok)
    ms = (time.perf_counter() - t0) / max(steps, 1) * 1e3
    if account is not None:
        account.update(thread_account(before, schedstat(), ring, max(steps, 1)))
    return ms


def _host():
    try:
        from mlx_ternary.runtime import samehost
    except ImportError:  # a checkout from before it (the "before" measurement)
        return None
    return samehost if hasattr(samehost, "all_sum") else None


def patched(replacement):
    """Replace mx.distributed's collectives by replacement(name, original); returns undo.
    samehost.all_sum (the same-host sum, where it is on) is routed through the replaced
    all_sum meanwhile, so it is counted and replaced too."""
    real = {k: getattr(mx.distributed, k) for k in COLLECTIVES}
    for k, f in real.items():
        setattr(mx.distributed, k, replacement(k, f))
    samehost = _host()
    if samehost is not None:
        local = samehost.all_sum
        samehost.all_sum = lambda x, group: mx.distributed.all_sum(x, group=group)
    undo = [lambda: [setattr(mx.distributed, k, f) for k, f in real.items()]]
    if samehost is not None:
        undo.append(lambda: setattr(samehost, "all_sum", local))
    return lambda: [u() for u in undo]


def identity(name: str, world: int):
    """A collective's stand-in with the right shape and no communication."""
    if name == "all_gather":
        return lambda x, *a, **kw: mx.concatenate([x] * world)
    return lambda x, *a, **kw: x


def collectives_per_step(model) -> int:
    count = {"n": 0}

    def counting(_, f):
        def call(*a, **kw):
            count["n"] += 1
            return f(*a, **kw)

        return call

    undo = patched(counting)
    decode_ms(model, 1)
    one = count["n"]
    count["n"] = 0
    decode_ms(model, 3)
    undo()
    return (count["n"] - one) // 2


def one_all_sum_ms(model, group, calls: int = 200) -> float:
    """One all_sum of the hidden size, the way the model sums (samehost.all_sum where it is)."""
    samehost = _host()
    total = (
        samehost.all_sum if samehost else lambda x, group: mx.distributed.all_sum(x, group=group)
    )
    x = mx.ones((1, 1, model.model.embed_tokens.weight.shape[1]))
    for _ in range(20):
        mx.eval(total(x, group))
    t0 = time.perf_counter()
    for _ in range(calls):
        mx.eval(total(x, group))
    return (time.perf_counter() - t0) / calls * 1e3


def measure(args) -> dict:
    """This process's row (one rank, or the single process)."""
    from mlx_ternary.checkpoint.load import load
    from mlx_ternary.parallel import world

    try:
        from mlx_ternary.runtime.samehost import share_host
    except ImportError:  # a checkout from before it (the "before" measurement)
        share_host = None

    before = thread_ids()
    group = world()
    ring = thread_ids() - before
    model = load(args.model)[0]
    if group.size() > 1:
        model.shard(group)
    mx.eval(model.parameters())
    per_step = collectives_per_step(model) if group.size() > 1 else 0
    threads = {}
    total = decode_ms(model, args.gen_tokens, ring, threads)
    compute, one = total, 0.0
    if group.size() > 1:
        undo = patched(lambda name, _: identity(name, group.size()))
        compute = decode_ms(model, args.gen_tokens)
        undo()
        one = one_all_sum_ms(model, group)
    return dict(
        rank=group.rank(),
        ranks=group.size(),
        ms_per_token=round(total, 3),
        compute_ms=round(compute, 3),
        collectives_per_token=per_step,
        one_all_sum_ms=round(one, 3),
        collectives_ms=round(one * per_step, 3),
        rest_ms=round(total - compute - one * per_step, 3),
        threads=threads,
        host=share_host(group) if share_host else None,
        local_sums=_host().local_sums() if _host() else None,
    )


def run_setting(args, ranks: int, threads: int) -> list:
    from mlx_ternary.parallel import local_launch

    me = [str(Path(__file__).resolve()), "--model", args.model]
    me += ["--gen-tokens", str(args.gen_tokens)]
    cmd = local_launch(ranks, *me) if ranks > 1 else [sys.executable, *me]
    env = {**os.environ, "MLX_TERNARY_NUM_THREADS": str(threads)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if len(rows) != ranks:  # mlx.launch exits 0 when a rank fails
        raise SystemExit(f"{' '.join(cmd)}: {len(rows)} of {ranks} rows:\n{done.stderr}")
    return sorted(rows, key=lambda r: r["rank"])


def compare(args) -> None:
    settings = {(1, args.threads): [], (args.ranks, 1): []}
    for _ in range(args.repeats):  # interleaved, so load on the machine hits both alike
        for (ranks, threads), runs in settings.items():
            rows = run_setting(args, ranks, threads)
            runs.append(rows)
            for row in rows:
                print(json.dumps({"threads_per_rank": threads, **row}), flush=True)
    one, tp = (
        [max(r["ms_per_token"] for r in rows) for rows in runs] for runs in settings.values()
    )
    med1, medn = statistics.median(one), statistics.median(tp)
    print(f"1 process x {args.threads} threads: {med1:.1f} ms/token (runs: {one})")
    print(f"{args.ranks} ranks x 1 thread:      {medn:.1f} ms/token (runs: {tp})")
    print(f"ratio (decode speed, {args.ranks} ranks / 1 process): {med1 / medn:.3f}")


def make_llama(d: Path) -> str:
    """bench_llamacpp.py's random TQ2_0 llama, converted with fast packing (once)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_llamacpp import make_variants, write_gguf

    d.mkdir(parents=True, exist_ok=True)
    if not (d / "model.gguf").exists():
        write_gguf(d / "model.gguf.tmp")
        (d / "model.gguf.tmp").rename(d / "model.gguf")
    make_variants(d, ["fast"])
    return str(d / "fast")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlx_ternary/assets/tiny-shakespeare")
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--compare", action="store_true", help="run both settings, print the ratio")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="threads of the single process")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--llama", type=Path, help="make (once) and measure the 0.53 G llama here")
    args = ap.parse_args()
    if args.llama:
        args.model = make_llama(args.llama)
    if args.compare:
        compare(args)
    else:
        print(json.dumps(measure(args)), flush=True)


if __name__ == "__main__":
    main()
