"""mlx-ternary against the other CPU engines on the same ternary weights, side by side.

    python scripts/bench/bench_llamacpp.py --shape small --dir /tmp/peers-small \
        --llama-cpp NODE_MODULES --ik IK_BUILD/bin --threads 2 --repeats 3

1. DIR/model.gguf: a random TQ2_0 llama of the chosen shape (--shape small: issue 15's
   12 layers, hidden 2048, 0.53 G ternary weights; --shape bitnet-2b: BitNet b1.58 2B4T's
   30 layers, 2560/6912, 20/5 heads, vocab 128256, 2.08 G ternary weights), F16 embedding
   and output layer, F32 norms, a stub byte-level vocabulary llama.cpp and ik accept.
   One shape per run.
2. The engines, each in a fresh process per measurement, in an order rotated each repeat:
   - mlx-ternary on the GGUF as written (variant "gguf": `mlx_ternary.load(model.gguf)`,
     converted once into DIR/cache; the conversion run's peak RSS is reported apart), and
     optionally the converted checkpoint's variants (fast, fast-float, ...);
   - llama.cpp TQ2_0 through node-llama-cpp (--llama-cpp NODE_MODULES); its peak RSS holds
     node and the library (measured alone, and subtracted in the "- runtime" column);
   - llama.cpp TQ2_0 through a source build's llama-bench (--llama-bench BIN);
   - ik_llama.cpp IQ2_BN (--ik BIN_DIR with its llama-bench and llama-quantize): the same
     weights written as an F16 GGUF (DIR/model-f16.gguf: the values s·t exactly) and
     quantized by ik's own `llama-quantize ... IQ2_BN` (embedding and output kept F16);
   - bitnet.cpp I2_S (--bitnet BIN_DIR, its llama-bench and llama-quantize) where it builds:
     its repository pins its llama.cpp fork at a commit the fork does not publish; built
     against the fork's merge-dev branch it runs (docs/NATIVE.md, "Peers"); without a build
     the row is skipped with the reason.
3. The machine's streaming-read bandwidth on 1 and on --threads threads (bench/bandwidth.py)
   and each engine's fraction of the ceiling: decode tokens/s x bytes read per token (every
   tensor of its file once, one row of the embedding) / bandwidth.

The table (markdown) gives medians (min-max), the ratio mlx-ternary / engine for each peer
(the first mlx-ternary variant is the reference) and peak RSS raw and less its runtime
(node + node-llama-cpp for the node row; Python + MLX + mlx_ternary imported for ours);
--json writes every run.
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

SHAPES = {
    "small": dict(
        layers=12,
        hidden=2048,
        intermediate=5632,
        vocab=32000,
        heads=32,
        kv_heads=4,
        rope_theta=10000.0,
        context=2048,
        eps=1e-5,
    ),
    "bitnet-2b": dict(
        layers=30,
        hidden=2560,
        intermediate=6912,
        vocab=128256,
        heads=20,
        kv_heads=5,
        rope_theta=500000.0,
        context=4096,
        eps=1e-5,
    ),
}
# BitNet b1.58 2B4T's own architecture as bitnet.cpp and ik_llama.cpp read it: the
# `bitnet-b1.58` GGUF (an RMSNorm before o_proj and before down_proj, squared ReLU, the
# embedding tied to the output layer); mlx-ternary runs it as mlx-lm's bitnet model
SHAPES["bitnet-2b4t"] = dict(SHAPES["bitnet-2b"], arch="bitnet-b1.58")
SHAPE = SHAPES["small"]
VARIANTS = ("gguf", "fast-act8", "fast", "fast-float", "compact-act8", "compact", "compact-float")
# quantization fields each variant suffix sets in the converted checkpoint's config.json
SUFFIXES = {
    "-act8": {"activation_bits": 8, "activations": "model"},
    "-float": {"activations": "float"},
}
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
BITNET_SKIP = (
    "no bitnet.cpp build given (--bitnet BIN_DIR): its repository pins its llama.cpp fork "
    "at a commit the fork does not publish; docs/NATIVE.md, Peers, says which source it "
    "was built from and how"
)


def _header(w, shape: dict, file_type) -> None:
    h, v = shape["hidden"], shape["vocab"]
    w.add_name(f"random ternary {shape.get('arch', 'llama')} (mlx-ternary benchmark)")
    w.add_context_length(shape["context"])
    w.add_embedding_length(h)
    w.add_block_count(shape["layers"])
    w.add_feed_forward_length(shape["intermediate"])
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_layer_norm_rms_eps(shape["eps"])
    w.add_rope_freq_base(shape["rope_theta"])
    w.add_rope_dimension_count(h // shape["heads"])
    w.add_vocab_size(v)
    w.add_file_type(file_type)
    # A byte-level BPE vocabulary with no merges: llama.cpp needs one to load the model.
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "ab"] + [f"<t{i}>" for i in range(v - 6)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (v - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


TABLE_TYPES = ("F16", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def tensor_plan(shape: dict):
    """[(name, kind, (rows, cols))] in file order; kind: table, norm or ternary. A bitnet
    shape adds its two sub-norms a layer and has no output layer (tied embedding)."""
    h, inter, v = shape["hidden"], shape["intermediate"], shape["vocab"]
    kv = h // shape["heads"] * shape["kv_heads"]
    dims = dict(attn_q=(h, h), attn_k=(kv, h), attn_v=(kv, h), attn_output=(h, h))
    dims.update(ffn_gate=(inter, h), ffn_up=(inter, h), ffn_down=(h, inter))
    bitnet = shape.get("arch", "llama").startswith("bitnet")
    plan = [("token_embd.weight", "table", (v, h))]
    for i in range(shape["layers"]):
        plan.append((f"blk.{i}.attn_norm.weight", "norm", (h,)))
        plan += [(f"blk.{i}.{n}.weight", "ternary", dims[n]) for n in LINEARS]
        plan.append((f"blk.{i}.ffn_norm.weight", "norm", (h,)))
        if bitnet:
            plan.append((f"blk.{i}.attn_sub_norm.weight", "norm", (h,)))
            plan.append((f"blk.{i}.ffn_sub_norm.weight", "norm", (inter,)))
    plan.append(("output_norm.weight", "norm", (h,)))
    return plan if bitnet else plan + [("output.weight", "table", (v, h))]


def _tensors(shape: dict, seed: int, f16: bool, tables=("F16", "F16")):
    """(name, array, raw type or None) in file order, drawn one at a time: trits uniform,
    one float16 scale per row (exact in TQ2_0, and s*t exact in float16); the (embedding,
    output layer) `tables` F16, or llama.cpp blocks written by mlx-ternary's own encoder
    (checkpoint/writers/gguf_kquants.py)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    from mlx_ternary.checkpoint.writers.gguf_kquants import encode

    rng = np.random.default_rng(seed)
    kinds = iter(tables)
    for name, kind, dims in tensor_plan(shape):
        if kind == "norm":
            yield name, np.ones(dims, np.float32), None
        elif kind == "table":
            values, type_name = (0.02 * rng.standard_normal(dims)).astype(np.float16), next(kinds)
            if type_name == "F16":
                yield name, values, None
            else:
                yield name, encode(values.astype(np.float32), type_name), Q[type_name]
        else:
            t = rng.integers(-1, 2, dims).astype(np.float32)
            d = rng.uniform(0.01, 0.05, (dims[0], 1)).astype(np.float16).astype(np.float32)
            if f16:
                yield name, (t * d).astype(np.float16), None
            else:
                yield name, quants.quantize(t * d, Q.TQ2_0), Q.TQ2_0


def write_gguf(
    path: Path, shape: dict = SHAPE, seed: int = 0, f16: bool = False, tables=("F16", "F16")
) -> None:
    """The random llama as TQ2_0 (or, f16=True, the same values as F16), streamed to disk
    one tensor at a time: memory holds one tensor, never the model. `tables`: the
    embedding's and output layer's types (F16 or one of TABLE_TYPES' llama.cpp blocks)."""
    from gguf import GGML_QUANT_SIZES, GGUFWriter, LlamaFileType
    from gguf import GGMLQuantizationType as Q

    w = GGUFWriter(str(path), shape.get("arch", "llama"))
    _header(w, shape, LlamaFileType.MOSTLY_F16 if f16 else LlamaFileType.MOSTLY_TQ2_0)
    kinds = iter(tables)
    for name, kind, dims in tensor_plan(shape):
        q = Q.TQ2_0 if kind == "ternary" and not f16 else None
        if kind == "table" and (t := next(kinds)) != "F16":
            q = Q[t]
        if q is not None:
            block, size = GGML_QUANT_SIZES[q]
            nbytes = dims[0] * dims[1] // block * size
            w.add_tensor_info(name, (dims[0], nbytes // dims[0]), np.uint8, nbytes, q)
        else:
            dt = np.float32 if kind == "norm" else np.float16
            w.add_tensor_info(name, dims, np.dtype(dt), int(np.prod(dims)) * dt().itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, data, _ in _tensors(shape, seed, f16, tables):
        w.write_tensor_data(data)
    w.close()


def ensure_gguf(path: Path, shape: dict, seed: int, f16: bool = False, tables=None) -> Path:
    if not path.exists():
        print(f"writing {path}", file=sys.stderr)
        tmp = path.with_suffix(".tmp")
        write_gguf(tmp, shape, seed, f16, tables or ("F16", "F16"))
        shutil.move(tmp, path)
    return path


def make_variants(d: Path, variants) -> None:
    import mlx_ternary

    for packing in ("fast", "compact"):
        if any(v.startswith(packing) for v in variants) and not (d / packing).exists():
            print(f"converting to {d / packing}", file=sys.stderr)
            mlx_ternary.convert(str(d / "model.gguf"), str(d / packing), packing=packing)
        for suffix, fields in SUFFIXES.items():
            act = d / f"{packing}{suffix}"
            if f"{packing}{suffix}" not in variants or act.exists():
                continue
            act.mkdir()
            for f in (d / packing).iterdir():
                if f.name != "config.json":
                    os.symlink(f.resolve(), act / f.name)
            config = json.loads((d / packing / "config.json").read_text())
            config["quantization"].update(fields)
            (act / "config.json").write_text(json.dumps(config, indent=2))


def _peak_rss() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024)


def worker(model: str, prompt_tokens: int, gen_tokens: int, seed: int) -> dict:
    """One mlx-ternary measurement in this (fresh) process; `model` a .gguf file (loaded as a
    user loads it: model and tokenizer) or a converted directory. prompt_tokens 0: load only
    (the baseline with "-", the conversion run with a .gguf)."""
    import mlx.core as mx

    import mlx_ternary
    from mlx_ternary.bench.formats import time_generation
    from mlx_ternary.runtime import cpu, dispatch

    cpu.info()  # the native extension loaded: part of the runtime's baseline
    if model == "-":  # the runtime alone: what a load imports before it reads a weight
        import mlx_lm.generate  # noqa: F401
        import mlx_lm.models.llama  # noqa: F401
        import mlx_lm.utils  # noqa: F401
        import transformers  # noqa: F401 (the tokenizer's)

        return {"peak_rss": _peak_rss()}
    model_, _tok, config = mlx_ternary.load(model, return_config=True)
    out = {"load_rss": _peak_rss(), "backend": dispatch.resolve_backend()}
    if prompt_tokens:
        rng = np.random.default_rng(seed)
        prompt = mx.array(rng.integers(3, config["vocab_size"], prompt_tokens), dtype=mx.uint32)
        time_generation(model_, prompt[:1], 2)  # warm-up
        run, _, _ = time_generation(model_, prompt, gen_tokens)
        out.update(prefill_tps=run.prefill_tps, decode_tps=run.decode_tps)
    return dict(out, peak_rss=_peak_rss(), isa=cpu.info().get("isa", ""))


def run_mlx(model: str, threads: int, a, prompt_tokens=None) -> dict:
    from mlx_ternary.bench import peers

    env = {**os.environ, "MLX_TERNARY_NUM_THREADS": str(threads)}
    env["MLX_TERNARY_GGUF_CACHE"] = str(a.dir / "cache")
    pt = a.prompt_tokens if prompt_tokens is None else prompt_tokens
    cmd = [sys.executable, __file__, "--worker", model, "--prompt-tokens", str(pt)]
    cmd += ["--gen-tokens", str(a.gen_tokens), "--seed", str(a.seed)]
    rc, out, err, rss = peers.run_child(cmd, env=env)
    if rc:
        raise SystemExit(f"mlx-ternary run failed:\n{err[-2000:]}")
    return dict(json.loads(out.strip().splitlines()[-1]), peak_rss=rss)


def ik_gguf(a, shape: dict) -> Path:
    """The same weights quantized by ik_llama.cpp's llama-quantize to IQ2_BN (F16 tables)."""
    out = a.dir / "model-ik-iq2_bn.gguf"
    if out.exists():
        return out
    src = ensure_gguf(a.dir / "model-f16.gguf", shape, a.seed, f16=True)
    _quantize(Path(a.ik) / "llama-quantize", src, out, "IQ2_BN")
    return out


def bitnet_gguf(a, shape: dict) -> Path:
    """The same weights quantized by bitnet.cpp's llama-quantize to I2_S (F16 tables)."""
    out = a.dir / "model-bitnet-i2_s.gguf"
    if not out.exists():
        src = ensure_gguf(a.dir / "model-f16.gguf", shape, a.seed, f16=True)
        _quantize(Path(a.bitnet) / "llama-quantize", src, out, "I2_S")
    return out


def _quantize(binary: Path, src: Path, out: Path, qtype: str) -> None:
    print(f"{binary}: quantizing {src} to {qtype}", file=sys.stderr)
    tmp = out.with_suffix(".tmp")
    cmd = [str(binary), "--token-embedding-type", "f16", "--output-tensor-type", "f16"]
    cmd += [str(src), str(tmp), qtype, "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(proc.stderr or proc.stdout)[-2000:]}")
    shutil.move(tmp, out)


def engines(a, shape: dict, threads: list) -> tuple:
    """([(name, threads, run() -> dict, bytes per token, runtime RSS)], {skipped: reason})."""
    from mlx_ternary.bench import llamacpp, peers

    gguf = ensure_gguf(a.dir / "model.gguf", shape, a.seed, tables=a.tables)
    v = shape["vocab"]
    tq2 = peers.decode_bytes(peers.tensor_sizes(gguf), rows=v)
    out, skipped = [], {}
    mlx_base = {t: run_mlx("-", t, a)["peak_rss"] for t in threads}
    for name in a.variants:
        model = str(gguf) if name == "gguf" else str(a.dir / name)
        sizes = peers.safetensors_sizes(_converted(a, gguf) if name == "gguf" else a.dir / name)
        nbytes = peers.decode_bytes(sizes, "model.embed_tokens.weight", "lm_head.weight", v)
        for t in threads:
            run = lambda m=model, t=t: run_mlx(m, t, a)  # noqa: E731
            out.append((f"mlx-ternary {name}", t, run, nbytes, mlx_base[t]))
    node = llamacpp.find(a.llama_cpp)
    if node is None:
        skipped["llama.cpp TQ2_0 (node)"] = "pass --llama-cpp NODE_MODULES"
    else:
        base = llamacpp.baseline_rss(node)["node_llama_cpp"]
        for t in threads:
            out.append(("llama.cpp TQ2_0 (node)", t, _node_run(node, gguf, t, a, v), tq2, base))
    bench = [("llama.cpp TQ2_0 (llama-bench)", a.llama_bench, lambda: gguf)]
    bench.append(("ik_llama.cpp IQ2_BN", a.ik and str(Path(a.ik) / "llama-bench"), None))
    bench.append(("bitnet.cpp I2_S", a.bitnet and str(Path(a.bitnet) / "llama-bench"), None))
    files = {"ik_llama.cpp IQ2_BN": lambda: ik_gguf(a, shape)}
    files["bitnet.cpp I2_S"] = lambda: bitnet_gguf(a, shape)
    for name, binary, file in bench:
        if not binary:
            skipped[name] = BITNET_SKIP if name.startswith("bitnet") else "no binary given"
            continue
        try:
            path = (file or files[name])()
        except SystemExit as e:
            skipped[name] = str(e)[-500:]
            continue
        nbytes = peers.decode_bytes(peers.tensor_sizes(path), rows=v)
        for t in threads:
            extra = a.ik_args.split() if name.startswith("ik_") else ()
            out.append((name, t, _bench_run(binary, path, t, a, extra), nbytes, 0))
    return out, skipped


def _converted(a, gguf: Path) -> Path:
    """The cache's conversion of the GGUF (made by a first load in a fresh process, whose
    peak RSS is the conversion's: kept in a.first_load)."""
    from mlx_ternary import paths
    from mlx_ternary.checkpoint import gguf_cache

    os.environ[paths.CACHE_ENV["gguf"]] = str(a.dir / "cache")
    d = gguf_cache.cache_dir(gguf)
    if not d.exists():
        print("first load of the GGUF (converts into DIR/cache)", file=sys.stderr)
        a.first_load = run_mlx(str(gguf), 2, a, prompt_tokens=0)
    return d


def _node_run(node, gguf, t, a, vocab):
    from mlx_ternary.bench import llamacpp

    def run():
        res = llamacpp.run(
            node,
            gguf,
            threads=t,
            prompt_tokens=a.prompt_tokens,
            gen_tokens=a.gen_tokens,
            seed=a.seed,
            vocab=vocab,
        )
        return dict(res["runs"][0], peak_rss=res["peak_rss"])

    return run


def _bench_run(binary, path, t, a, extra):
    from mlx_ternary.bench import peers

    return lambda: peers.llama_bench(
        Path(binary),
        path,
        threads=t,
        prompt_tokens=a.prompt_tokens,
        gen_tokens=a.gen_tokens,
        extra=extra,
    )


def fmt(values, digits=1):
    v = [x for x in values if x == x]
    if not v:
        return "-"
    return f"{statistics.median(v):.{digits}f} ({min(v):.{digits}f}-{max(v):.{digits}f})"


def table(results, meta, bandwidth) -> list:
    """Markdown rows: medians, ratios mlx-ternary / engine, RSS, bandwidth fractions."""
    med = lambda runs, k: statistics.median(x[k] for x in runs)  # noqa: E731
    rows = [
        "| engine | threads | prefill tok/s | decode tok/s | peak RSS MB | RSS - runtime MB "
        "| mlx-ternary / engine: prefill, decode, RSS, RSS - runtime | MB read / token "
        "| ceiling tok/s | % of ceiling |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ref = {}
    for (name, t), runs in results.items():
        if name.startswith("mlx-ternary") and t not in ref:
            ref[t] = (runs, meta[(name, t)][1])
    for (name, t), runs in results.items():
        nbytes, base = meta[(name, t)]
        gbs = bandwidth.get(t) if bandwidth else None
        ratio = ""
        if t in ref and not name.startswith("mlx-ternary"):
            r, rb = ref[t]
            ratio = ", ".join(
                f"{med(r, k) / med(runs, k):.2f}" for k in ("prefill_tps", "decode_tps", "peak_rss")
            )
            ratio += f", {(med(r, 'peak_rss') - rb) / (med(runs, 'peak_rss') - base):.2f}"
        ceil = f"{gbs * 1e9 / nbytes:.1f}" if gbs else "-"
        from mlx_ternary.bench.peers import ceiling_fraction

        frac = ceiling_fraction(med(runs, "decode_tps"), nbytes, gbs)
        rows.append(
            f"| {name} | {t} | {fmt([x['prefill_tps'] for x in runs])} | "
            f"{fmt([x['decode_tps'] for x in runs])} | "
            f"{fmt([x['peak_rss'] / 1e6 for x in runs], 0)} | "
            f"{fmt([(x['peak_rss'] - base) / 1e6 for x in runs], 0)} | {ratio} | "
            f"{nbytes / 1e6:.0f} | {ceil} | {'-' if frac != frac else f'{100 * frac:.0f} %'} |"
        )
    return rows


def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="The module's docstring has the details."
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--dir", type=Path, help="default /tmp/mlx-ternary-peers-SHAPE")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--variants", default="gguf", help=f"mlx-ternary rows, of {VARIANTS}")
    ap.add_argument("--llama-cpp", help="node_modules holding node-llama-cpp")
    ap.add_argument("--llama-bench", help="a mainline llama.cpp source build's llama-bench")
    ap.add_argument("--ik", help="ik_llama.cpp's build/bin (llama-bench, llama-quantize)")
    ap.add_argument("--ik-args", default="", help="extra llama-bench arguments for ik")
    ap.add_argument("--bitnet", help="bitnet.cpp's build/bin (llama-bench, llama-quantize)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tables",
        default="F16,F16",
        help=f"embedding,output layer types of model.gguf, of {TABLE_TYPES} (e.g. Q4_K,Q6_K: "
        "llama-quantize's choice for TQ models)",
    )
    ap.add_argument("--bandwidth-mb", type=int, default=1024, help="0: skip the bandwidth probe")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; choose from {VARIANTS}")
    a.tables = tuple(a.tables.split(","))
    if len(a.tables) != 2 or not set(a.tables) <= set(TABLE_TYPES):
        ap.error(f"--tables takes two of {TABLE_TYPES}, got {','.join(a.tables)!r}")
    tag = "" if a.tables == ("F16", "F16") else "-" + "-".join(a.tables)
    a.dir = a.dir or Path(f"/tmp/mlx-ternary-peers-{a.shape}{tag}")
    a.first_load = None
    return a


def main(argv=None):
    a = parse(argv)
    if a.worker:
        print(json.dumps(worker(a.worker, a.prompt_tokens, a.gen_tokens, a.seed)))
        return
    from mlx_ternary.bench import bandwidth as bw

    shape, threads = SHAPES[a.shape], [int(t) for t in a.threads.split(",")]
    a.dir.mkdir(parents=True, exist_ok=True)
    if any(v != "gguf" for v in a.variants):
        ensure_gguf(a.dir / "model.gguf", shape, a.seed, tables=a.tables)
        make_variants(a.dir, a.variants)
    todo, skipped = engines(a, shape, threads)
    results = {(n, t): [] for n, t, *_ in todo}
    for r in range(a.repeats):
        k = r % len(todo)
        for name, t, run, *_ in todo[k:] + todo[:k]:
            print(f"repeat {r + 1}/{a.repeats}: {name}, {t} thread(s)", file=sys.stderr)
            results[(name, t)].append(run())
    probe = bw.measure(sorted({1, *threads}), a.bandwidth_mb) if a.bandwidth_mb else None
    meta = {(n, t): (nbytes, base) for n, t, _, nbytes, base in todo}
    print(
        f"shape {a.shape}, prompt {a.prompt_tokens}, generated {a.gen_tokens}, "
        f"{a.repeats} rotated repeats; median (min-max)"
    )
    print("\n".join(table(results, meta, probe and probe["gbs"])))
    if probe:
        print(
            "bandwidth GB/s: "
            + ", ".join(f"{t} thread(s) {g:.1f}" for t, g in probe["gbs"].items())
            + f" ({probe['method']}, {probe['buffer_mb']} MB)"
        )
    if a.first_load:
        print(
            f"mlx-ternary first load of the GGUF (conversion into the cache): peak RSS "
            f"{a.first_load['peak_rss'] / 1e6:.0f} MB"
        )
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    if a.json:
        a.json.write_text(json.dumps(_doc(a, probe, skipped, results, meta), indent=2))


def _doc(a, probe, skipped, results, meta) -> dict:
    settings = {k: getattr(a, k) for k in ("prompt_tokens", "gen_tokens", "repeats", "seed")}
    rows = [
        {"name": n, "threads": t, "bytes_per_token": meta[(n, t)][0]}
        | {"runtime_rss": meta[(n, t)][1], "runs": runs}
        for (n, t), runs in results.items()
    ]
    return {"shape": a.shape, "settings": settings, "bandwidth": probe} | {
        "first_load": a.first_load,
        "skipped": skipped,
        "engines": rows,
    }


if __name__ == "__main__":
    main()
