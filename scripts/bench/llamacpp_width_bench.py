"""How should a ternary layer whose width is not whole TQ blocks go into a GGUF? (llama.cpp)

    python scripts/bench/llamacpp_width_bench.py --node-modules DIR --repeats 5

Writes four synthetic llama GGUFs (hidden 1024, 4 layers, an FFN intermediate size of
2880 = 11.25 TQ blocks; random trits, d = s) that differ only in how ffn_down (rows of
2880) and, where padded, gate/up are stored:
  q8      ffn_down as Q8_0 with codes t in {-1, 0, 1} and d = s (exact, 8.5 bits/weight)
  pad     intermediate zero-padded to 3072: gate/up/down all TQ2_0 (exact: act(0) * 0 = 0)
  pad_q8  padded as `pad`, ffn_down as Q8_0 codes (isolates the Q8_0 cost at equal shape)
  f16     ffn_down as F16 (the old export)
and times llama.cpp (node-llama-cpp through mlx_ternary/bench/llamacpp.py, one thread) on each,
interleaved: prompt of 128 tokens (prefill tokens/s) then 32 greedy tokens (decode
tokens/s). Prints file sizes and median (min-max) speeds.
"""

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np

from mlx_ternary.bench import llamacpp

H, I, PADDED, L, HEADS, V = 1024, 2880, 3072, 4, 8, 4096
VARIANTS = ("q8", "pad", "pad_q8", "f16")


def q8_codes(t: np.ndarray, d: float) -> np.ndarray:
    n, k = t.shape
    head = np.full((n, k // 32, 1), d, np.float16).view(np.uint8)
    body = t.reshape(n, k // 32, 32).astype(np.int8).view(np.uint8)
    return np.concatenate([head, body], -1).reshape(n, -1)


def build(path: Path, variant: str) -> None:
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, quants

    rng = np.random.default_rng(0)
    inter = PADDED if variant.startswith("pad") else I
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(inter)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(H // HEADS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([f"t{i}" for i in range(V)])
    w.add_token_types([1] * V)
    w.add_token_merges(["t 1"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_tensor("token_embd.weight", rng.normal(0, 0.5, (V, H)).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    s = np.float32(np.float16(0.02))

    def tq(name, t):
        w.add_tensor(name, quants.quantize(t * s, Q.TQ2_0), raw_dtype=Q.TQ2_0)

    for i in range(L):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(H, np.float32))
        for g in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tq(f"blk.{i}.{g}.weight", rng.integers(-1, 2, (H, H)).astype(np.float32))
        for g in ("ffn_gate", "ffn_up"):
            t = rng.integers(-1, 2, (inter, H)).astype(np.float32)
            t[I:] = 0
            tq(f"blk.{i}.{g}.weight", t)
        t = rng.integers(-1, 2, (H, inter)).astype(np.float32)
        t[:, I:] = 0
        name = f"blk.{i}.ffn_down.weight"
        if variant == "pad":
            tq(name, t)
        elif variant in ("q8", "pad_q8"):
            w.add_tensor(name, q8_codes(t, s), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, (t * s).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def time_once(node_modules: Path, model: Path) -> dict:
    prompt = [(7 * i) % (V - 2) + 2 for i in range(128)]
    return llamacpp.evaluate(node_modules, model, threads=1, prompt_ids=prompt, max_tokens=33)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--node-modules", default=None, help=f"default: ${llamacpp.ENV}")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="keep the GGUF files here")
    args = ap.parse_args()
    node_modules = llamacpp.find(args.node_modules)
    if node_modules is None:
        ap.error(f"give --node-modules DIR (or set {llamacpp.ENV})")
    tmp = tempfile.TemporaryDirectory()
    folder = Path(args.dir or tmp.name)
    folder.mkdir(parents=True, exist_ok=True)
    for v in VARIANTS:
        build(folder / f"{v}.gguf", v)
    speed = {v: {"prefill": [], "decode": []} for v in VARIANTS}
    for _ in range(args.repeats):
        for v in VARIANTS:
            r = time_once(node_modules, folder / f"{v}.gguf")["runs"][0]
            speed[v]["prefill"].append(r["prefill_tps"])
            speed[v]["decode"].append(r["decode_tps"])
    print("| ffn_down | file bytes | prefill tokens/s | decode tokens/s |\n|---|---|---|---|")
    for v in VARIANTS:
        p, d = speed[v]["prefill"], speed[v]["decode"]
        print(
            f"| {v} | {(folder / f'{v}.gguf').stat().st_size:,} | "
            f"{statistics.median(p):.0f} ({min(p):.0f}-{max(p):.0f}) | "
            f"{statistics.median(d):.1f} ({min(d):.1f}-{max(d):.1f}) |"
        )


if __name__ == "__main__":
    main()
