"""Build tiny Hugging Face BitNet checkpoints and the logits transformers computes for them.

mlx-ternary's tests compare against these files without torch installed. Each fixture is a
checkpoint laid out as on the Hub plus what transformers' own forward returns for it, so a
test that matches the logits matches transformers, activation quantization included.

Run (torch, transformers and accelerate are needed here, never by the tests):

    . /work/venv/bin/activate
    pip install torch==2.13.0 accelerate      # transformers' bitnet quantizer needs accelerate
    python scripts/make_hf_fixtures.py         # (re)writes tests/fixtures/hf/<name>/
    python scripts/make_hf_fixtures.py --check # numpy only: re-derive every fixture's logits

Each tests/fixtures/hf/<name>/ holds
    config.json           HF config with quantization_config (or none, see FIXTURES)
    model.safetensors     the checkpoint: packed uint8 ternary weights + weight_scale, or
                          bfloat16 latent weights; norms and embeddings in bfloat16
    expected.safetensors  input_ids (1, T) int32; logits (1, T, vocab) float32 from
                          `AutoModelForCausalLM.from_pretrained(dir, dtype=float32)(input_ids)`
    fixture.json          seed, versions, what each tensor means

The random draw uses numpy's PCG64 only (platform independent); torch is used for
transformers' `pack_weights`, loading and the forward pass. Every float that goes on disk is
rounded to bfloat16 first, so float32 compute from the file is exact on both sides.

After writing, the script re-derives the logits from the files with a numpy twin of
transformers' forward (unpacking per docs: FORMATS.md) and checks the unpacked ternary
weights against what transformers itself unpacked; `--check` runs that part alone.
"""

import argparse
import json
import math
import struct
from pathlib import Path

import numpy as np

SEED = 1158
SEQ_LEN = 12
OUT_ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# model_type bitnet in the legacy key style of microsoft/bitnet-b1.58-2B-4T's config.json
# (top-level rope_theta, torch_dtype) -- what loaders meet on the Hub.
BITNET_CONFIG = {
    "architectures": ["BitNetForCausalLM"],
    "model_type": "bitnet",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "relu2",
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}

# model_type llama written by transformers 5 itself (rope_parameters, dtype); the rope_theta
# of Falcon3 is not the llama default, so a loader that ignores rope_parameters fails.
LLAMA_KWARGS = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000042.0},
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

FIXTURES = {
    "bitnet_offline_autobitlinear": {
        "arch": "bitnet",
        "quantization_config": {
            "quant_method": "bitnet",
            "linear_class": "autobitlinear",
            "quantization_mode": "offline",
        },
        "about": "BitNetForCausalLM like microsoft/bitnet-b1.58-2B-4T: packed uint8 weights, "
        "weight_scale = mean|W| (output multiplied by it), tied embeddings, relu2, sub-norms.",
    },
    "llama_offline_bitlinear": {
        "arch": "llama",
        "quantization_config": {
            "quant_method": "bitnet",
            "linear_class": "bitlinear",
            "quantization_mode": "offline",
            "modules_to_not_convert": None,
        },
        "about": "LlamaForCausalLM like tiiuae/Falcon3-*-1.58bit / HF1BitLLM: packed uint8 "
        "weights, weight_scale = 1/mean|W| (output divided by it), float lm_head.",
    },
    # transformers honours quantization_mode "online" only for linear_class autobitlinear
    # (BitLinear always expects packed uint8), so the online fixture is autobitlinear.
    "llama_online_autobitlinear": {
        "arch": "llama",
        "quantization_config": {
            "quant_method": "bitnet",
            "linear_class": "autobitlinear",
            "quantization_mode": "online",
        },
        "about": "LlamaForCausalLM with bfloat16 latent weights; transformers ternarizes them in "
        "every forward (absmean per tensor) and quantizes activations per token.",
    },
}

TENSOR_DOCS = {
    "expected.safetensors:input_ids": "(1, T) int32 token ids (batch 1, no padding, no cache)",
    "expected.safetensors:logits": "(1, T, vocab) float32, transformers' forward in float32",
    "model.safetensors": "embeddings, norms (and lm_head) bfloat16; projections see 'weights'",
}
WEIGHT_DOCS = {
    "offline": "*_proj.weight: (ceil(out/4), in) uint8, 2-bit field i (bits 2i..2i+1) of row r "
    "is output row r + i*ceil(out/4), value t+1; *_proj.weight_scale: (1,) bfloat16",
    "online": "*_proj.weight: (out, in) bfloat16 latent; s = mean|W| over the tensor, "
    "t = clamp(round(W/s), -1, 1), effective weight s*t; no weight_scale",
    "autobitlinear": "per token: scale_x = 127/max(max|x|, 1e-5), x_q = clamp(round(x*scale_x), "
    "-128, 127); y = (x_q/scale_x) @ W.T with W = t*weight_scale offline, s*t online",
    "bitlinear": "per token: scale_x and x_q as for autobitlinear; y = (x_q @ t.T) / "
    "(scale_x * weight_scale), so weight_scale holds 1/mean|W|",
}


# ---------------------------------------------------------------- random weights (numpy)


def bf16_round(x):
    """Round float32 values to the nearest bfloat16 (ties to even), returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.reshape(-1).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32).reshape(x.shape)


def ternary(rng, shape):
    """Ternary codes, each of -1, 0, +1 with probability 1/3."""
    return rng.integers(-1, 2, size=shape).astype(np.int8)


def latent_weight(rng, shape, scale):
    """A latent float weight whose absmean ternarization is far from every rounding tie.

    |W|/mean|W| is kept at least 0.02 away from 0.5 and every entry is bfloat16, so any
    correct absmean implementation (float32, any summation order) gets the same codes.
    """
    w = bf16_round(rng.normal(0.0, scale, size=shape).astype(np.float32))
    for _ in range(100):
        s = np.abs(w.astype(np.float64)).mean()
        r = np.abs(w) / s
        near = np.abs(r - 0.5) < 0.02
        if not near.any():
            return w
        push = np.where(r[near] < 0.5, 0.9, 1.1)
        w[near] = bf16_round((w[near] * push).astype(np.float32))
    raise RuntimeError("could not move latent weights away from the rounding tie at 0.5")


def norm_weight(rng, n):
    return bf16_round((1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))


def draw_model(rng, cfg, mode):
    """Random weights by HF name. Projections: (t int8, s float) offline or latent float."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    shapes = {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    w = {"model.embed_tokens.weight": bf16_round(rng.normal(0, 0.5, (v, h)).astype(np.float32)),
         "model.norm.weight": norm_weight(rng, h)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = bf16_round(rng.normal(0, 0.3, (v, h)).astype(np.float32))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(rng, h)
        w[p + "post_attention_layernorm.weight"] = norm_weight(rng, h)
        if cfg["model_type"] == "bitnet":
            w[p + "self_attn.attn_sub_norm.weight"] = norm_weight(rng, h)
            w[p + "mlp.ffn_sub_norm.weight"] = norm_weight(rng, inter)
        for name in PROJECTIONS:
            group = "self_attn." if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp."
            key = p + group + name
            s = float(rng.uniform(0.03, 0.1))
            if mode == "online":
                w[key + ".weight"] = latent_weight(rng, shapes[name], s)
            else:
                w[key + ".weight"] = (ternary(rng, shapes[name]), float(bf16_round(np.float32(s))))
    return w


# ---------------------------------------------------------------- safetensors without torch


def read_safetensors(path):
    """name -> numpy array (bfloat16 widened to float32), parsed by hand: numpy has no bf16."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        buf = raw[8 + n + a : 8 + n + b]
        dt = info["dtype"]
        if dt == "BF16":
            arr = (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            np_dt = {"F32": np.float32, "F16": np.float16, "U8": np.uint8, "I8": np.int8,
                     "I32": np.int32, "I64": np.int64}[dt]
            arr = np.frombuffer(buf, np_dt)
        out[name] = arr.reshape(info["shape"])
    return out


def unpack_ternary(packed, out_features):
    """(ceil(out/4), in) uint8 -> (out, in) int8 codes; field i of row r is row r + i*rows."""
    rows = packed.shape[0]
    fields = [((packed >> (2 * i)) & 3).astype(np.int8) - 1 for i in range(4)]
    return np.concatenate(fields, axis=0)[:out_features]


def pack_ternary(t):
    """Inverse of unpack_ternary: (out, in) codes -> (ceil(out/4), in) uint8."""
    out = t.shape[0]
    rows = -(-out // 4)
    padded = np.zeros((4 * rows, t.shape[1]), np.uint8)
    padded[:out] = (t + 1).astype(np.uint8)
    packed = np.zeros((rows, t.shape[1]), np.uint8)
    for i in range(4):
        packed |= padded[i * rows : (i + 1) * rows] << (2 * i)
    return packed


# ---------------------------------------------------------------- numpy twin of the forward


def act_quant(x):
    """transformers' per-token int8 absmax: returns integer-valued codes and 127/max|x|."""
    scale = 127.0 / np.maximum(np.abs(x).max(-1, keepdims=True), np.float32(1e-5))
    return np.clip(np.round(x * scale), -128, 127).astype(np.float32), scale.astype(np.float32)


def rms_norm(x, w, eps):
    var = (x * x).mean(-1, keepdims=True)
    return w * (x / np.sqrt(var + np.float32(eps))).astype(np.float32)


def rope(x, theta):
    """HF rotate_half RoPE on (heads, T, hd), positions 0..T-1."""
    hd, t = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / hd)
    ang = np.arange(t, dtype=np.float32)[:, None] * inv[None, :].astype(np.float32)
    emb = np.concatenate([ang, ang], -1)
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    half = hd // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def ternary_weights(files, cfg, qc):
    """name -> (t int8 (out, in), multiplier s) so that W_eff = s * t, from the files."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    outs = {"q_proj": h, "k_proj": kv, "v_proj": kv, "o_proj": h,
            "gate_proj": inter, "up_proj": inter, "down_proj": h}
    res = {}
    for key, arr in files.items():
        if not key.endswith(".weight") or key.split(".")[-2] not in outs:
            continue
        stem = key[: -len(".weight")]
        if qc.get("quantization_mode", "offline") == "online":
            s = np.abs(arr).mean(dtype=np.float32)
            res[stem] = (np.clip(np.round(arr / s), -1, 1).astype(np.int8), np.float32(s))
        else:
            ws = files[stem + ".weight_scale"].astype(np.float32).reshape(())
            s = ws if qc.get("linear_class", "bitlinear") == "autobitlinear" else 1.0 / ws
            res[stem] = (unpack_ternary(arr, outs[key.split(".")[-2]]), np.float32(s))
    return res


def numpy_forward(files, cfg, qc, ids):
    """Logits (T, vocab) for one sequence, following transformers' modeling_{llama,bitnet}."""
    tern = ternary_weights(files, cfg, qc)
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // nh
    eps = cfg["rms_norm_eps"]
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    bitnet = cfg["model_type"] == "bitnet"

    def lin(stem, x):
        t, s = tern[stem]
        xq, xs = act_quant(x)
        return (xq @ t.T.astype(np.float32)) / xs * s

    x = files["model.embed_tokens.weight"][ids].astype(np.float32)
    T = len(ids)
    causal = np.triu(np.full((T, T), -np.inf, np.float32), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms_norm(x, files[p + "input_layernorm.weight"], eps)
        q = lin(p + "self_attn.q_proj", a).reshape(T, nh, hd).transpose(1, 0, 2)
        k = lin(p + "self_attn.k_proj", a).reshape(T, nkv, hd).transpose(1, 0, 2)
        v = lin(p + "self_attn.v_proj", a).reshape(T, nkv, hd).transpose(1, 0, 2)
        q, k = rope(q, theta), rope(k, theta)
        k, v = np.repeat(k, nh // nkv, 0), np.repeat(v, nh // nkv, 0)
        sc = q @ k.transpose(0, 2, 1) / np.float32(math.sqrt(hd)) + causal
        sc = np.exp(sc - sc.max(-1, keepdims=True))
        o = ((sc / sc.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(T, nh * hd)
        if bitnet:
            o = rms_norm(o, files[p + "self_attn.attn_sub_norm.weight"], eps)
        x = x + lin(p + "self_attn.o_proj", o)
        m = rms_norm(x, files[p + "post_attention_layernorm.weight"], eps)
        g, u = lin(p + "mlp.gate_proj", m), lin(p + "mlp.up_proj", m)
        if bitnet:
            hmid = rms_norm(np.maximum(g, 0) ** 2 * u, files[p + "mlp.ffn_sub_norm.weight"], eps)
        else:
            hmid = g / (1 + np.exp(-g)) * u
        x = x + lin(p + "mlp.down_proj", hmid)
    x = rms_norm(x, files["model.norm.weight"], eps)
    head = files.get("lm_head.weight", files["model.embed_tokens.weight"])
    return x @ head.T.astype(np.float32)


def check_fixture(d):
    """Re-derive a fixture's logits with numpy alone; return (max abs diff, logit std)."""
    cfg = json.loads((d / "config.json").read_text())
    files = read_safetensors(d / "model.safetensors")
    exp = read_safetensors(d / "expected.safetensors")
    qc = cfg.get("quantization_config", {})
    for key, arr in files.items():  # packed layout round trip, byte for byte
        if arr.dtype == np.uint8:
            t = unpack_ternary(arr, 4 * arr.shape[0])
            if not np.array_equal(pack_ternary(t), arr):
                raise AssertionError(f"{d.name}: {key} does not round-trip through unpack/pack")
    got = numpy_forward(files, cfg, qc, exp["input_ids"][0].astype(np.int64))
    return float(np.abs(got - exp["logits"][0]).max()), float(exp["logits"].std())


# ---------------------------------------------------------------- transformers side (torch)


def build_fixture(name, spec, rng):
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.integrations.bitnet import AutoBitLinear, BitLinear, pack_weights, unpack_weights

    qc = spec["quantization_config"]
    if spec["arch"] == "bitnet":
        cfg = dict(BITNET_CONFIG)
    else:
        cfg = LlamaConfig(**LLAMA_KWARGS, architectures=["LlamaForCausalLM"], dtype="bfloat16")
        cfg = {k: v for k, v in cfg.to_diff_dict().items() if k != "transformers_version"}
    cfg["quantization_config"] = qc

    mode = qc["quantization_mode"]
    weights = draw_model(rng, cfg, mode)
    ids = np.concatenate([[1], rng.integers(3, cfg["vocab_size"], SEQ_LEN - 1)]).astype(np.int32)

    tensors, codes = {}, {}
    for key, val in weights.items():
        if isinstance(val, tuple):  # (t, s): pack with transformers' own pack_weights
            t, s = val
            codes[key] = t
            tensors[key] = pack_weights(torch.from_numpy(t.astype(np.int64)).clone())
            if not np.array_equal(tensors[key].numpy(), pack_ternary(t)):
                raise AssertionError(f"{key}: numpy packing differs from transformers' pack_weights")
            stored = s if qc["linear_class"] == "autobitlinear" else float(bf16_round(np.float32(1 / s)))
            tensors[key + "_scale"] = torch.tensor([stored], dtype=torch.bfloat16)
        else:
            tensors[key] = torch.from_numpy(val).to(torch.bfloat16)

    d = OUT_ROOT / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    # transformers 5.24 keeps non-projection weights (embeddings, norms) in the checkpoint's
    # dtype when linear_class is autobitlinear/offline (its deserializer claims every
    # ".weight"), so bf16 norms meet fp32 projections. Widening is exact: all floats are bf16.
    model = model.to(torch.float32)
    if type(model).__name__ != cfg["architectures"][0]:
        raise AssertionError(f"{name}: loaded {type(model).__name__}")
    theta = model.config.rope_parameters["rope_theta"]
    if theta != (cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]):
        raise AssertionError(f"{name}: transformers read rope_theta {theta}")
    want = AutoBitLinear if qc["linear_class"] == "autobitlinear" else BitLinear
    swapped = {n for n, m in model.named_modules() if isinstance(m, want)}
    if len(swapped) != len(PROJECTIONS) * cfg["num_hidden_layers"] or any("lm_head" in n for n in swapped):
        raise AssertionError(f"{name}: unexpected converted modules {sorted(swapped)}")

    # What transformers itself unpacked must equal the codes we drew (numpy unpack is
    # checked against the file in check_fixture).
    for key, t in codes.items():
        mod = model.get_submodule(key[: -len(".weight")])
        got = mod.weight if isinstance(mod, AutoBitLinear) else unpack_weights(mod.weight, torch.float32)
        if not np.array_equal(got.detach().float().numpy(), t.astype(np.float32)):
            raise AssertionError(f"{name}: transformers unpacked {key} differently")
        if not np.array_equal(unpack_ternary(tensors[key].numpy(), t.shape[0]), t):
            raise AssertionError(f"{name}: numpy unpack of {key} differs")

    with torch.no_grad():
        logits = model(torch.from_numpy(ids[None].astype(np.int64))).logits.float()
    save_file(
        {"input_ids": torch.from_numpy(ids[None].copy()), "logits": logits.contiguous()},
        str(d / "expected.safetensors"),
    )
    meta = {
        "about": spec["about"],
        "seed": SEED,
        "seq_len": SEQ_LEN,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "produced_by": "scripts/make_hf_fixtures.py",
        "how": "AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32).eval()"
        ".to(torch.float32); logits = model(input_ids.long()).logits",
        "tensors": TENSOR_DOCS,
        "weights": WEIGHT_DOCS[mode] if mode == "online" else WEIGHT_DOCS["offline"],
        "activations": WEIGHT_DOCS["autobitlinear" if mode == "online" else qc["linear_class"]],
    }
    (d / "fixture.json").write_text(json.dumps(meta, indent=2) + "\n")
    return d


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="numpy-only re-check, write nothing")
    args = ap.parse_args()
    if not args.check:
        for i, (name, spec) in enumerate(FIXTURES.items()):
            build_fixture(name, spec, np.random.Generator(np.random.PCG64([SEED, i])))
    for name in FIXTURES:
        d = OUT_ROOT / name
        diff, std = check_fixture(d)
        size = sum(f.stat().st_size for f in d.iterdir())
        print(f"{name}: {size / 1024:.1f} KiB, numpy twin max|dlogit| = {diff:.2e} (logit std {std:.2f})")


if __name__ == "__main__":
    main()
