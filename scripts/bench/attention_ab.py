"""The native attention op alone at a benchmark shape's heads, A/B between source trees.

    python scripts/bench/attention_ab.py [--shape small] [--prefill 2048] [--depths 2048,8192]
        [--rounds 5] [--other /path/to/another/checkout]

Times `attention(q, k, v)` as the fused block calls it (float32 queries, float16 K/V, one
batch row): a causal prefill of `--prefill` tokens and one decode step at each depth, 2
threads unless `--threads`. Each measurement is the minimum over `--repeats` calls in a fresh
process; with `--other` (a checkout of another revision: its `mlx_ternary` is imported from
there and its extension built from its own sources) the processes of the two trees alternate
for `--rounds` rounds. Prints the minimum over rounds of each, wall and process CPU time (both threads: steadier
on a loaded machine), in ms, and other / this.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def measure(shape: str, prefill: int, depths, repeats: int, threads: int) -> dict:
    """{case: min ms} in this process."""
    import mlx.core as mx
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_llamacpp import SHAPES

    from mlx_ternary.runtime import cpu

    cpu.set_num_threads(threads)
    s = SHAPES[shape]
    hq, hkv = s["heads"], s["kv_heads"]
    d = s["hidden"] // hq
    rng = np.random.default_rng(0)
    out = {}

    def case(name, lq, lk, causal):
        q = mx.array(rng.normal(size=(1, hq, lq, d)).astype(np.float32))
        k, v = (mx.array(rng.normal(size=(1, hkv, lk, d)).astype(np.float16)) for _ in range(2))
        mx.eval(q, k, v)
        wall = cpu_s = float("inf")
        for _ in range(repeats):
            t, c = time.perf_counter(), time.process_time()
            mx.eval(cpu.require().attention(q, k, v, d**-0.5, causal))
            wall, cpu_s = min(wall, time.perf_counter() - t), min(cpu_s, time.process_time() - c)
        out[name] = 1e3 * wall
        out[f"{name} CPU"] = 1e3 * cpu_s

    if prefill:
        case(f"prefill {prefill}", prefill, prefill, True)
    for depth in depths:
        case(f"decode at {depth}", 1, depth, False)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--depths", default="2048,8192")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--other", help="a checkout of another revision to compare against")
    ap.add_argument("--json-one", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    depths = [int(x) for x in a.depths.split(",") if x]
    if a.json_one:
        print(json.dumps(measure(a.shape, a.prefill, depths, a.repeats, a.threads)))
        return

    trees = {"this": ROOT} | ({"other": Path(a.other).resolve()} if a.other else {})
    best: dict = {}
    for r in range(a.rounds):
        for name, tree in trees.items() if r % 2 == 0 else reversed(trees.items()):
            env = dict(os.environ, PYTHONPATH=str(tree))
            args = [sys.executable, __file__, "--json-one", "--shape", a.shape]
            args += ["--prefill", str(a.prefill), "--depths", a.depths]
            args += ["--repeats", str(a.repeats), "--threads", str(a.threads)]
            got = json.loads(
                subprocess.run(
                    args, env=env, check=True, capture_output=True, text=True, cwd=tree
                ).stdout
            )
            for case, ms in got.items():
                best.setdefault(case, {}).setdefault(name, []).append(ms)
    for case, per in best.items():
        row = {name: min(v) for name, v in per.items()}
        line = f"{case:>18}: " + "  ".join(f"{n} {ms:8.2f} ms" for n, ms in row.items())
        if "other" in row:
            line += f"  other/this {row['other'] / row['this']:.3f}"
        print(line)


if __name__ == "__main__":
    main()
