"""Prefill CPU seconds on a loaded machine: mlx-ternary source trees alternated, and ik_llama.cpp.

    python scripts/bench/prefill_cpu.py --dir /work/peers/data/small --prefill 128,2048 \\
        [--threads 1] [--rounds 2] [--ik IK_BIN_DIR] [tree=PYTHONPATH ...]

Where other work keeps the cores busy, wall-clock tok/s measures the load. The CPU time a
prefill takes does not (much), so this prints it: for each tree (name=path of a checkout whose
mlx_ternary is imported, "" for the installed one) the least process CPU time of a prefill of P
tokens of DIR/model.gguf over the rounds (alternated, fresh processes), as mlx-lm's
generate_step runs it (the prompt but its last token into the cache, then the last token's
logits); with --ik, ik_llama.cpp's llama-bench on DIR/model-ik-iq2_bn.gguf, whose CPU time per
prefill is that of a run of R + 1 repetitions less that of a run of 1, over R. With one thread
the numbers compare the engines' work per prompt; with more, spinning workers count too.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def worker(spec: dict) -> dict:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    import mlx_ternary

    model, _, config = mlx_ternary.load(spec["model"], return_config=True)
    rng = np.random.default_rng(0)
    vocab = config["vocab_size"]
    mx.eval(model(mx.array(rng.integers(3, vocab, (1, 8)), dtype=mx.uint32)))
    out = {}
    for p in spec["prefill"]:
        ids = mx.array(rng.integers(3, vocab, (1, p)), dtype=mx.uint32)
        best = None
        for _ in range(spec["reps"]):
            cache = make_prompt_cache(model)
            c = time.process_time()
            for i in range(0, p - 1, 2048):
                model(ids[:, i : min(i + 2048, p - 1)], cache=cache)
                mx.eval([x.state for x in cache])
            mx.eval(model(ids[:, -1:], cache=cache))
            used = time.process_time() - c
            best = used if best is None else min(best, used)
            del cache
            mx.clear_cache()
        out[str(p)] = best
    return out


def ik_cpu(bench: Path, gguf: Path, p: int, threads: int, reps: int) -> float:
    """CPU seconds of one ik prefill of p tokens: (run of reps + 1) - (run of 1), over reps."""

    def run(r: int) -> float:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        cmd = [str(bench), "-m", str(gguf), "-t", str(threads), "-r", str(r), "-p", str(p)]
        subprocess.run([*cmd, "-n", "0"], check=True, capture_output=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)

    one = run(1)
    return (run(reps + 1) - one) / reps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--prefill", default="128,2048")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ik", type=Path, help="ik_llama.cpp's build/bin")
    ap.add_argument("--worker")
    ap.add_argument("trees", nargs="*", default=["installed="])
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(json.loads(a.worker))))
        return
    prefill = [int(p) for p in a.prefill.split(",")]
    spec = {"model": str(a.dir / "model.gguf"), "prefill": prefill, "reps": a.reps}
    best = {}
    for r in range(a.rounds):
        for tree in a.trees if r % 2 == 0 else a.trees[::-1]:
            name, path = tree.split("=", 1)
            env = {**os.environ, "MLX_TERNARY_NUM_THREADS": str(a.threads)}
            env["MLX_TERNARY_GGUF_CACHE"] = str(a.dir / "cache")
            env.pop("PYTHONPATH", None)
            if path:
                env["PYTHONPATH"] = path
            cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/")
            if res.returncode:
                raise SystemExit(res.stderr[-3000:])
            for p, v in json.loads(res.stdout.strip().splitlines()[-1]).items():
                best[name, p] = min(best.get((name, p), v), v)
    for p in prefill:
        row = [f"{name.split('=')[0]} {best[name.split('=')[0], str(p)]:.3f} s" for name in a.trees]
        if a.ik:
            gguf = a.dir / "model-ik-iq2_bn.gguf"
            row.append(f"ik {ik_cpu(a.ik / 'llama-bench', gguf, p, a.threads, a.reps):.3f} s")
        print(f"prefill {p}, {a.threads} thread(s), CPU seconds: " + ", ".join(row))


if __name__ == "__main__":
    main()
