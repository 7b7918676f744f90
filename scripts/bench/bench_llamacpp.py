"""mlx-ternary against llama.cpp on the same ternary weights, side by side on the same cores.

    python scripts/bench/bench_llamacpp.py --llama-cpp NODE_MODULES --dir /tmp/tq2 \
        --threads 1,2 --prompt-tokens 128 --gen-tokens 64 --repeats 3

1. DIR/model.gguf: a random TQ2_0 llama of the shape below (written once; F16 embedding and
   output layer, or --tables Q4_K,Q6_K (llama-quantize's choice for TQ models) and the other
   llama.cpp table types; F32 norms, a stub byte-level vocabulary llama.cpp accepts).
2. DIR/<variant>: the same GGUF converted by `mlx_ternary.convert` (fast / compact packing),
   run as written: llama.cpp's own activations (q8k: int8 per 256 columns, ggml's Q8_K, what
   its TQ2_0 dot product computes); "-act8" variants are the same checkpoint run with BitNet
   int8 per-token activations, "-float" ones with float activations.
3. Every engine runs in a fresh process per measurement (peak RSS is the process's), in an
   order rotated each repeat; prefill = prompt tokens / time to the first token, decode =
   further tokens / their time (greedy). The table gives medians (min-max) and each
   mlx-ternary row's ratio to llama.cpp at the same number of threads, and the megabytes a
   decode step reads (llama.cpp: the GGUF's tensors, one embedding row; mlx-ternary: the
   loaded model's parameters the same way).

NODE_MODULES is the node_modules directory of `npm install node-llama-cpp@3.21.1` (or set
$MLX_TERNARY_LLAMA_CPP); `node` must be on PATH.
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

SHAPE = dict(
    layers=12,
    hidden=2048,
    intermediate=5632,
    vocab=32000,
    heads=32,
    kv_heads=4,
    rope_theta=10000.0,
    context=2048,
    eps=1e-5,
)
VARIANTS = ("fast-act8", "fast", "fast-float", "compact-act8", "compact", "compact-float")
# quantization fields each variant suffix sets in the converted checkpoint's config.json
SUFFIXES = {
    "-act8": {"activation_bits": 8, "activations": "model"},
    "-float": {"activations": "float"},
}


TABLE_TYPES = ("F16", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def _header(w, shape: dict) -> None:
    """The llama metadata and a stub byte-level vocabulary llama.cpp accepts."""
    from gguf import LlamaFileType

    h, v = shape["hidden"], shape["vocab"]
    head_dim = h // shape["heads"]
    w.add_name("random ternary llama (mlx-ternary benchmark)")
    w.add_context_length(shape["context"])
    w.add_embedding_length(h)
    w.add_block_count(shape["layers"])
    w.add_feed_forward_length(shape["intermediate"])
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_layer_norm_rms_eps(shape["eps"])
    w.add_rope_freq_base(shape["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(v)
    w.add_file_type(LlamaFileType.MOSTLY_TQ2_0)
    # A byte-level BPE vocabulary with no merges: llama.cpp needs one to load the model.
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "ab"] + [f"<t{i}>" for i in range(v - 6)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (v - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_gguf(path: Path, shape: dict = SHAPE, seed: int = 0, tables=("F16", "F16")) -> None:
    """A random TQ2_0 llama: trits uniform, one float16 scale per row (exact in TQ2_0);
    `tables` = the (embedding, output layer) types: F16, or llama.cpp blocks written by
    mlx-ternary's own encoder (checkpoint/writers/gguf_kquants.py)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, quants

    from mlx_ternary.checkpoint.writers.gguf_kquants import encode

    rng = np.random.default_rng(seed)
    h, inter, v = shape["hidden"], shape["intermediate"], shape["vocab"]
    head_dim = h // shape["heads"]
    w = GGUFWriter(str(path), "llama")
    _header(w, shape)

    def half(shape_, scale=0.02):
        return (scale * rng.standard_normal(shape_)).astype(np.float16)

    def table(name, type_name):
        values = half((v, h))
        if type_name == "F16":
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, encode(values.astype(np.float32), type_name), raw_dtype=Q[type_name])

    def ternary(n, k):
        t = rng.integers(-1, 2, (n, k)).astype(np.float32)
        d = rng.uniform(0.01, 0.05, (n, 1)).astype(np.float16).astype(np.float32)
        return quants.quantize(t * d, Q.TQ2_0), Q.TQ2_0

    table("token_embd.weight", tables[0])
    kv = head_dim * shape["kv_heads"]
    for i in range(shape["layers"]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))
        for name, (n, k) in (
            ("attn_q", (h, h)),
            ("attn_k", (kv, h)),
            ("attn_v", (kv, h)),
            ("attn_output", (h, h)),
            ("ffn_gate", (inter, h)),
            ("ffn_up", (inter, h)),
            ("ffn_down", (h, inter)),
        ):
            data, q = ternary(n, k)
            w.add_tensor(f"blk.{i}.{name}.weight", data, raw_dtype=q)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    table("output.weight", tables[1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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


def prepare(d: Path, tables: tuple, variants) -> None:
    """DIR/model.gguf (with `tables`) and the converted variants, where missing."""
    gguf = d / "model.gguf"
    if not gguf.exists():
        print(f"writing {gguf}", file=sys.stderr)
        write_gguf(gguf.with_suffix(".tmp"), tables=tables)
        shutil.move(gguf.with_suffix(".tmp"), gguf)
        (d / "tables.txt").write_text(",".join(tables))
    make_variants(d, variants)


def gguf_bytes_per_token(path: Path) -> int:
    """What llama.cpp reads per decoded token: every tensor once, one token_embd row."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    emb = tensors["token_embd.weight"]
    if "output.weight" in tensors:  # untied: the embedding is gathered, not read whole
        total -= int(emb.n_bytes) - int(emb.n_bytes) // int(emb.shape[-1])
    return total


def worker(model_dir: str, prompt_tokens: int, gen_tokens: int, seed: int) -> dict:
    """One mlx-ternary measurement in this (fresh) process."""
    import mlx.core as mx

    from mlx_ternary.bench.formats import time_generation
    from mlx_ternary.checkpoint.load import load_model
    from mlx_ternary.runtime import cpu, dispatch

    model, config = load_model(Path(model_dir))
    rng = np.random.default_rng(seed)
    prompt = mx.array(rng.integers(3, config["vocab_size"], prompt_tokens), dtype=mx.uint32)
    time_generation(model, prompt[:1], 2)  # warm-up
    run, _, _ = time_generation(model, prompt, gen_tokens)
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    emb = params["model.embed_tokens.weight"]
    tied = "lm_head.weight" not in params
    # what a decode step reads: every weight once, one embedding row (all of it when tied)
    per_token = sum(p.nbytes for p in params.values()) - (0 if tied else emb.nbytes)
    per_token += 0 if tied else emb.nbytes // emb.shape[0]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss *= 1 if sys.platform == "darwin" else 1024
    return {
        "prefill_tps": run.prefill_tps,
        "decode_tps": run.decode_tps,
        "peak_rss": rss,
        "bytes_per_token": per_token,
        "backend": dispatch.resolve_backend(),
        "isa": cpu.info().get("isa", ""),
    }


def run_mlx(model_dir: Path, threads: int, a) -> dict:
    env = {**os.environ, "MLX_TERNARY_NUM_THREADS": str(threads)}
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        str(model_dir),
        "--prompt-tokens",
        str(a.prompt_tokens),
        "--gen-tokens",
        str(a.gen_tokens),
        "--seed",
        str(a.seed),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"mlx-ternary run failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fmt(values, digits=1):
    v = [x for x in values if x == x]
    if not v:
        return "-"
    return f"{statistics.median(v):.{digits}f} ({min(v):.{digits}f}-{max(v):.{digits}f})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--llama-cpp", help="node_modules holding node-llama-cpp (default $MLX_TERNARY_LLAMA_CPP)"
    )
    ap.add_argument("--dir", type=Path, default=Path("/tmp/mlx-ternary-tq2"))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--variants", default="fast,fast-float")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tables",
        default="F16,F16",
        help=f"embedding,output types of the GGUF written ({', '.join(TABLE_TYPES)})",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker, a.prompt_tokens, a.gen_tokens, a.seed)))
        return
    if a.prepare:
        prepare(a.dir, tuple(a.tables.split(",")), [v for v in a.variants.split(",") if v])
        return

    from mlx_ternary.bench import llamacpp

    node_modules = llamacpp.find(a.llama_cpp)
    if node_modules is None:
        ap.error("pass --llama-cpp NODE_MODULES or set $MLX_TERNARY_LLAMA_CPP")
    threads = [int(t) for t in a.threads.split(",")]
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; choose from {VARIANTS}")
    a.dir.mkdir(parents=True, exist_ok=True)
    tables = tuple(a.tables.split(","))
    if len(tables) != 2 or not set(tables) <= set(TABLE_TYPES):
        ap.error(f"--tables takes two of {TABLE_TYPES}, got {a.tables!r}")
    gguf, stamp = a.dir / "model.gguf", a.dir / "tables.txt"
    if gguf.exists() and stamp.exists() and stamp.read_text() != a.tables:
        ap.error(f"{gguf} has tables {stamp.read_text()}; use another --dir for {a.tables}")
    # Written and converted in a child: Linux carries a process's peak RSS into the children
    # it forks and execs, so a conversion here would inflate every engine's peak RSS.
    prep = [sys.executable, __file__, "--prepare", "--dir", str(a.dir), "--tables", a.tables]
    subprocess.run(prep + ["--variants", a.variants], check=True)

    engines = [("llama.cpp TQ2_0", t) for t in threads] + [
        (f"mlx-ternary {v}", t) for v in variants for t in threads
    ]
    results = {e: [] for e in engines}
    for r in range(a.repeats):
        order = engines[r % len(engines) :] + engines[: r % len(engines)]
        for name, t in order:
            print(f"repeat {r + 1}/{a.repeats}: {name}, {t} thread(s)", file=sys.stderr)
            if name.startswith("llama.cpp"):
                res = llamacpp.run(
                    node_modules,
                    gguf,
                    threads=t,
                    prompt_tokens=a.prompt_tokens,
                    gen_tokens=a.gen_tokens,
                    seed=a.seed,
                )
                run = dict(res["runs"][0], peak_rss=res["peak_rss"])
            else:
                run = run_mlx(a.dir / name.split()[-1], t, a)
            results[(name, t)].append(run)

    rows = [
        "| engine | threads | prefill tok/s | decode tok/s | peak RSS MB | MB read / token | "
        "prefill × | decode × | memory × |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    file_bytes = gguf_bytes_per_token(gguf)
    base = {t: results[("llama.cpp TQ2_0", t)] for t in threads}
    med = lambda runs, k: statistics.median(x[k] for x in runs)  # noqa: E731
    for (name, t), runs in results.items():
        ratio = ["", "", ""]
        if not name.startswith("llama.cpp"):
            ratio = [
                f"{med(runs, k) / med(base[t], k):.2f}"
                for k in ("prefill_tps", "decode_tps", "peak_rss")
            ]
        rows.append(
            f"| {name} | {t} | {fmt([x['prefill_tps'] for x in runs])} | "
            f"{fmt([x['decode_tps'] for x in runs])} | "
            f"{fmt([x['peak_rss'] / 1e6 for x in runs], 0)} | "
            f"{runs[0].get('bytes_per_token', file_bytes) / 1e6:.1f} | " + " | ".join(ratio) + " |"
        )
    print("\n".join(rows))
    if a.json:
        a.json.write_text(json.dumps({f"{n} @{t}": v for (n, t), v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
