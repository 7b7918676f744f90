"""Long prompts, deep context, several sequences: mlx-ternary against the C++ engines.

    python scripts/bench/bench_scaling.py --shape small --dir /tmp/peers-small \
        --ik IK/build/bin --llama-cpp NODE_MODULES --threads 2 --repeats 2 --json small.json

One shape per run (bench_llamacpp.py's SHAPES and files: DIR/model.gguf, TQ2_0 as
llama.cpp writes it, which mlx-ternary loads as written; DIR/model-ik-iq2_bn.gguf, the same
weights quantized by ik_llama.cpp's own llama-quantize). The work, each a column:

- prefill P (--prefill, default 512, 2048, 8192): P prompt tokens / the time to the first
  generated token. ik: `llama-bench -p P`.
- decode at depth D (--depths, default 0, 128, 2048, 8192): --gen tokens after a D-token
  prompt (D = 0: a one-token prompt), their count less one / their time. ik:
  `llama-bench -gp D,G` (`-n G` for D = 0), which times the generation only.
- B sequences (--batches, default 1, 4, 8, 16): B prompts of --batch-prompt tokens each, then
  --batch-gen tokens each; aggregate decode = B x (tokens after the first) / their time.
  mlx-ternary: mlx-lm's BatchGenerator (the path serve runs), all B prefilled together;
  ik: `llama-batched-bench -npp P -ntg G -npl B` (S_TG of its table).
- KV cache bytes per token of context: mlx-ternary's cache arrays after the deepest prompt
  (per token of their allocated length, and per token used, with mlx-lm's step slack);
  the C++ engines' f16 cache (2 bytes x (K + V widths) x layers, their default).

bitnet.cpp (--bitnet BIN_DIR, where it builds: docs/NATIVE.md, Peers): its llama-bench on
DIR/model-bitnet-i2_s.gguf (the F16 file quantized by its own llama-quantize to I2_S, F16
tables), prefill and decode at depth 0 only (its llama.cpp fork's llama-bench has no -gp).

The engines alternate, the order rotated each repeat; each engine's tokens/s are reported as
the best (min time) and median of the repeats (the machine may be shared: say so); the
"paired" rows give the median of each repeat's own ratio, its range and count: on a host
whose memory bandwidth moves between runs they decide what the ratio of two bests cannot.
mlx-ternary runs in fresh processes of this script (--worker), node-llama-cpp (llama.cpp,
prompt and depth columns only) through bench/llamacpp.py, ik through its binaries.
"""

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import bench_llamacpp as peers_script  # noqa: E402


def _ids(n: int, vocab: int, seed: int):
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def _prompt_work(model, vocab: int, prefill, depths, gen: int, seed: int) -> dict:
    """{"prefill:P": tok/s, "decode:D": tok/s, "kv": {...}} with mlx-lm's generate_step."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    out, kv = {}, {}
    lengths = sorted({p for p in prefill} | {max(d, 1) for d in depths})
    for i, n in enumerate(lengths):
        prompt = mx.array(_ids(n, vocab, seed + i), dtype=mx.uint32)
        if i == 0:  # warm-up: the native build, the first graph
            for _ in generate_step(prompt[:4], model, max_tokens=2):
                pass
        cache = make_prompt_cache(model)
        want = gen + 1 if n in depths or (n == 1 and 0 in depths) else 1
        tic = time.perf_counter()
        first = None
        for k, _ in enumerate(generate_step(prompt, model, max_tokens=want, prompt_cache=cache)):
            if k == 0:
                first = time.perf_counter()
        end = time.perf_counter()
        if n in prefill:
            out[f"prefill:{n}"] = n / (first - tic)
        if want > 1:
            out[f"decode:{0 if n == 1 else n}"] = (want - 1) / (end - first)
        kv = _kv_bytes(cache) or kv
        del cache
        mx.clear_cache()
    out["kv"] = kv
    return out


def _kv_bytes(cache) -> dict:
    """{"per_token": bytes per token of the arrays' length, "per_token_used": per token of
    context held, "dtype"} of mlx-lm's cache list."""
    total, length, used, dtype = 0, 0, 0, None
    for c in cache:
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if keys is None or isinstance(keys, (list, tuple)):
            return {}
        total += keys.nbytes + values.nbytes
        length, used, dtype = keys.shape[2], c.offset, str(keys.dtype)
    if not used:
        return {}
    return {"per_token": total / length, "per_token_used": total / used, "dtype": dtype}


def _batch_work(model, vocab: int, batches, prompt_tokens: int, gen: int, seed: int) -> dict:
    """{"batch:B": aggregate decode tok/s} with mlx-lm's BatchGenerator, B prompts at once."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    out = {}
    for b in batches:
        gen_ = BatchGenerator(
            model, stop_tokens=None, prefill_batch_size=b, completion_batch_size=b
        )
        prompts = [_ids(prompt_tokens, vocab, seed + 100 + i) for i in range(b)]
        gen_.insert(prompts, [gen] * b)
        seen, tokens, start = set(), 0, None
        while responses := gen_.next_generated():
            for r in responses:
                if r.uid in seen:
                    tokens += 1
                seen.add(r.uid)
            if start is None and len(seen) == b:
                start = time.perf_counter()
        out[f"batch:{b}"] = tokens / (time.perf_counter() - start)
        gen_.close()
        mx.clear_cache()
    return out


def worker(spec: dict) -> dict:
    """One mlx-ternary measurement group in this (fresh) process."""
    import mlx_ternary
    from mlx_ternary.runtime import cpu

    cpu.info()
    model, _, config = mlx_ternary.load(spec["model"], return_config=True)
    v = config["vocab_size"]
    if spec["group"] == "prompt":
        out = _prompt_work(model, v, spec["prefill"], spec["depths"], spec["gen"], spec["seed"])
    else:
        out = _batch_work(
            model, v, spec["batches"], spec["batch_prompt"], spec["batch_gen"], spec["seed"]
        )
    import resource

    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["isa"] = cpu.info().get("isa", "")
    return out


def run_mlx(a, group: str) -> dict:
    from mlx_ternary.bench import peers

    spec = {"model": str(a.dir / "model.gguf"), "group": group, "seed": a.seed}
    spec.update(prefill=a.prefill, depths=a.depths, gen=a.gen, batches=a.batches)
    spec.update(batch_prompt=a.batch_prompt, batch_gen=a.batch_gen)
    env = {**os.environ, "MLX_TERNARY_NUM_THREADS": str(a.threads)}
    env["MLX_TERNARY_GGUF_CACHE"] = str(a.dir / "cache")
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
    rc, out, err, rss = peers.run_child(cmd, env=env, timeout=7200)
    if rc:
        raise SystemExit(f"mlx-ternary run failed:\n{err[-3000:]}")
    return dict(json.loads(out.strip().splitlines()[-1]), peak_rss=rss)


def run_ik_bench(a, gguf: Path) -> dict:
    """ik's llama-bench: -p (prefill), -n (decode at depth 0), -gp D,G (decode at depth D)."""
    return run_llama_bench(Path(a.ik) / "llama-bench", a, gguf, depth_flag=True)


def run_bitnet_bench(a, gguf: Path) -> dict:
    """bitnet.cpp's llama-bench (its llama.cpp fork, 2024: no -gp): -p (prefill) and -n
    (decode at depth 0); decode at depth D > 0 is not measured."""
    return run_llama_bench(Path(a.bitnet) / "llama-bench", a, gguf, depth_flag=False)


def run_llama_bench(binary: Path, a, gguf: Path, depth_flag: bool) -> dict:
    from mlx_ternary.bench import peers

    cmd = [str(binary), "-m", str(gguf), "-t", str(a.threads), "-r", "1"]
    cmd += ["-o", "json", "-p", ",".join(map(str, a.prefill))]
    cmd += ["-n", str(a.gen) if 0 in a.depths else "0"]
    for d in a.depths:
        if d and depth_flag:
            cmd += ["-gp", f"{d},{a.gen}"]
    rc, out, err, rss = peers.run_child(cmd, timeout=7200)
    if rc:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(err or out)[-2000:]}")
    res = {"peak_rss": rss}
    for r in json.loads(out[out.find("[") :]):
        p, g = r.get("n_prompt", 0), r.get("n_gen", 0)
        key = f"prefill:{p}" if g == 0 else f"decode:{p}"
        res[key] = float(r["avg_ts"])
    return res


_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 7)


def run_ik_batched(a, gguf: Path) -> dict:
    """ik's llama-batched-bench: S_TG (aggregate decode tok/s) for each number of sequences."""
    from mlx_ternary.bench import peers

    ctx = max(a.batches) * (a.batch_prompt + a.batch_gen) + 16
    cmd = [str(Path(a.ik) / "llama-batched-bench"), "-m", str(gguf), "-t", str(a.threads)]
    cmd += ["-c", str(ctx), "-npp", str(a.batch_prompt), "-ntg", str(a.batch_gen)]
    cmd += ["-npl", ",".join(map(str, a.batches))]
    rc, out, err, rss = peers.run_child(cmd, timeout=7200)
    if rc:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(err or out)[-2000:]}")
    res = {"peak_rss": rss}
    for line in (out + "\n" + err).splitlines():
        m = _ROW.match(line.strip())
        if m:
            res[f"batch:{int(m.group(3))}"] = float(m.group(8))
    return res


def run_node(a, gguf: Path, vocab: int) -> dict:
    """llama.cpp (node-llama-cpp): one generation per prompt length; prefill and decode."""
    from mlx_ternary.bench import llamacpp

    node = llamacpp.find(a.llama_cpp)
    res = {}
    for n in sorted(set(a.prefill) | {max(d, 1) for d in a.depths}):
        r = llamacpp.run(
            node, gguf, threads=a.threads, prompt_tokens=n, gen_tokens=a.gen + 1,
            context=n + a.gen + 16, seed=a.seed, vocab=vocab,
        )["runs"][0]  # fmt: skip
        if n in a.prefill:
            res[f"prefill:{n}"] = r["prefill_tps"]
        if n in a.depths or (n == 1 and 0 in a.depths):
            res[f"decode:{0 if n == 1 else n}"] = r["decode_tps"]
    return res


def kv_f16(shape: dict) -> int:
    """Bytes per token of a llama.cpp f16 KV cache of `shape`."""
    kv = shape["hidden"] // shape["heads"] * shape["kv_heads"]
    return 2 * 2 * kv * shape["layers"]


def columns(a) -> list:
    cols = [f"prefill:{p}" for p in a.prefill] + [f"decode:{d}" for d in a.depths]
    return cols + [f"batch:{b}" for b in a.batches]


def table(a, results: dict, shape: dict) -> list:
    """Markdown: best (median) tok/s per engine and column; mlx-ternary / engine ratios of the
    best figures, then the median (range, count) of the repeats' paired ratios
    (peers.paired_ratios: one repeat's two runs, minutes apart); KV bytes per token."""
    from mlx_ternary.bench import peers

    cols = columns(a)
    head = "| engine | " + " | ".join(cols) + " | KV bytes / token | peak RSS MB |"
    rows = [head, "|" + "---|" * (len(cols) + 3)]
    best = {}
    for name, runs in results.items():
        cells = []
        for c in cols:
            v = [r[c] for r in runs if c in r and r[c] == r[c]]
            best[(name, c)] = max(v) if v else float("nan")
            cells.append(f"{max(v):.1f} ({statistics.median(v):.1f})" if v else "-")
        kv = "-"
        if name.startswith("mlx-ternary"):
            k = next((r["kv"] for r in runs if r.get("kv")), None)
            if k:
                kv = f"{k['per_token']:.0f} ({k['dtype']}; {k['per_token_used']:.0f} used)"
        else:
            kv = f"{kv_f16(shape)} (f16)"
        rss = max((r["peak_rss"] for r in runs if r.get("peak_rss")), default=0) / 1e6
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {kv} | {rss:.0f} |")
    ours = next((n for n in results if n.startswith("mlx-ternary")), None)
    for name in results:
        if name == ours or ours is None:
            continue
        cells = []
        for c in cols:
            x, y = best[(ours, c)], best[(name, c)]
            cells.append(f"{x / y:.2f}" if x == x and y == y and y else "-")
        rows.append(f"| mlx-ternary / {name} | " + " | ".join(cells) + " | | |")
        cells = []
        for c in cols:
            r = sorted(peers.paired_ratios(results[ours], results[name], c))
            med = statistics.median(r) if r else 0
            cells.append(f"{med:.2f} ({r[0]:.2f}-{r[-1]:.2f}, {len(r)})" if r else "-")
        rows.append(f"| paired / {name} | " + " | ".join(cells) + " | | |")
    return rows


def _merge(runs: list) -> list:
    """One dict per repeat from the groups each repeat ran."""
    out = {}
    for r, group_result in runs:
        merged = out.setdefault(r, {})
        rss = max(merged.get("peak_rss", 0), group_result.get("peak_rss", 0))
        merged.update(group_result, peak_rss=rss)
    return [out[k] for k in sorted(out)]


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(peers_script.SHAPES), default="small")
    ap.add_argument("--dir", type=Path, help="default /tmp/mlx-ternary-peers-SHAPE")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ik", help="ik_llama.cpp's build/bin (llama-bench, llama-batched-bench, "
                    "llama-quantize)")  # fmt: skip
    ap.add_argument("--llama-cpp", help="node_modules holding node-llama-cpp")
    ap.add_argument("--bitnet", help="bitnet.cpp's build/bin (llama-bench, llama-quantize; "
                    "docs/NATIVE.md, Peers, says how it was built)")  # fmt: skip
    ap.add_argument("--prefill", default="512,2048,8192")
    ap.add_argument("--depths", default="0,128,2048,8192")
    ap.add_argument("--gen", type=int, default=32, help="decoded tokens a depth")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--batch-prompt", type=int, default=128)
    ap.add_argument("--batch-gen", type=int, default=32)
    ap.add_argument("--groups", default="prompt,batch", help="prompt (prefill and depth), batch")
    ap.add_argument("--engines", default="mlx,ik,node,bitnet", help="of mlx, ik, node, bitnet")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    a.prefill, a.depths, a.batches = ints(a.prefill), ints(a.depths), ints(a.batches)
    a.groups, a.engines = a.groups.split(","), a.engines.split(",")
    a.dir = a.dir or Path(f"/tmp/mlx-ternary-peers-{a.shape}")
    return a


def tasks(a, shape: dict) -> list:
    """[(engine name, group, run() -> dict)] in the order of a first repeat."""
    gguf = peers_script.ensure_gguf(a.dir / "model.gguf", shape, a.seed)
    out = []
    if "mlx" in a.engines:
        for g in a.groups:
            out.append(("mlx-ternary gguf (q8k)", g, lambda g=g: run_mlx(a, g)))
    if "ik" in a.engines and a.ik:
        ik = peers_script.ik_gguf(a, shape)
        if "prompt" in a.groups:
            out.append(("ik_llama.cpp IQ2_BN", "prompt", lambda: run_ik_bench(a, ik)))
        if "batch" in a.groups:
            out.append(("ik_llama.cpp IQ2_BN", "batch", lambda: run_ik_batched(a, ik)))
    if "bitnet" in a.engines and a.bitnet and "prompt" in a.groups:
        i2s = peers_script.bitnet_gguf(a, shape)
        out.append(("bitnet.cpp I2_S", "prompt", lambda: run_bitnet_bench(a, i2s)))
    if "node" in a.engines and a.llama_cpp and "prompt" in a.groups:
        if shape.get("arch", "llama") == "llama":  # mainline reads no bitnet-b1.58 file
            out.append(
                ("llama.cpp TQ2_0 (node)", "prompt", lambda: run_node(a, gguf, shape["vocab"]))
            )
    return out


def main(argv=None):
    a = parse(argv)
    if a.worker:
        print(json.dumps(worker(json.loads(a.worker))))
        return
    shape = peers_script.SHAPES[a.shape]
    a.dir.mkdir(parents=True, exist_ok=True)
    todo = tasks(a, shape)
    runs = {name: [] for name, *_ in todo}
    for r in range(a.repeats):
        k = r % len(todo)
        for name, group, run in todo[k:] + todo[:k]:
            print(f"{time.strftime('%H:%M:%S')} repeat {r + 1}/{a.repeats}: {name}, {group}",
                  file=sys.stderr, flush=True)  # fmt: skip
            runs[name].append((r, run()))
    results = {name: _merge(rs) for name, rs in runs.items()}
    print(
        f"shape {a.shape}, {a.threads} threads, {a.repeats} rotated repeats; tok/s best "
        f"(median); decode {a.gen} tokens a depth; batches of {a.batch_prompt} + {a.batch_gen}"
    )
    print("\n".join(table(a, results, shape)))
    if a.json:
        a.json.write_text(json.dumps({"shape": a.shape, "args": vars(a) | {"dir": str(a.dir),
                          "json": str(a.json)}, "results": results}, indent=2, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
