"""Run by test_parallel.py under `mlx.launch -n 2 --backend ring`: samehost.all_sum (the same-host
sum over shared memory) beside mx.distributed.all_sum on random float32 arrays.

Writes out_dir/local_sum.rank{r}.npz: per case, the rank's input, both sums, and the count of
sums run over shared memory before and after.
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_ternary.parallel import world
from mlx_ternary.runtime import samehost

SHAPES = {"one": (1,), "row": (2048,), "odd": (1001,), "2d": (3, 517), "chunks": (3, 100_003)}


def main(out_dir: str) -> None:
    group = world()
    rank = group.rank()
    done = samehost.share_host(group)
    rng = np.random.default_rng(rank)
    saved = {}
    for name, shape in SHAPES.items():
        x = mx.array(rng.standard_normal(shape).astype(np.float32) * 10.0 ** rng.integers(-3, 4))
        before = samehost.local_sums()
        ours = samehost.all_sum(x, group)
        mx.eval(ours)
        used = samehost.local_sums() - before
        theirs = mx.distributed.all_sum(x, group=group)
        saved.update({f"{name}.x": x, f"{name}.ours": ours, f"{name}.mlx": theirs})
        saved[f"{name}.used"] = np.array(used)
    # a transposed (non-contiguous) input and one under mx.grad (MLX's all_sum there)
    t = mx.array(rng.standard_normal((64, 33)).astype(np.float32)).T
    saved.update(
        {
            "t.x": t,
            "t.ours": samehost.all_sum(t, group),
            "t.mlx": mx.distributed.all_sum(t, group=group),
        }
    )
    before = samehost.local_sums()
    g = mx.grad(lambda v: samehost.all_sum(v * v, group).sum())(mx.ones((8,)) * (rank + 1))
    mx.eval(g)
    saved["grad"], saved["grad.used"] = g, np.array(samehost.local_sums() - before)
    np.savez(
        Path(out_dir) / f"local_sum.rank{rank}.npz", **{k: np.array(v) for k, v in saved.items()}
    )
    (Path(out_dir) / f"local_sum.rank{rank}.json").write_text(json.dumps(done))


if __name__ == "__main__":
    main(sys.argv[1])
