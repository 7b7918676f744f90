"""Build tiny Hugging Face BitNet checkpoints and the logits transformers computes for them.

mlx-ternary's tests compare against these files without torch installed. Each fixture is a
checkpoint laid out as on the Hub plus what transformers' own forward returns for it, so a
test that matches the logits matches transformers, activation quantization included.

Run (torch, transformers and accelerate are needed here, never by the tests):

    pip install -e ".[test]"                   # from the repository root
    pip install torch==2.13.0 accelerate      # transformers' bitnet quantizer needs accelerate
    python scripts/make_hf_fixtures.py         # (re)writes tests/fixtures/hf/<name>/
    python scripts/make_hf_fixtures.py --check # numpy only: re-derive every fixture's logits

Each tests/fixtures/hf/<name>/ holds
    config.json           the checkpoint's config, as such checkpoints ship it
    model.safetensors     packed uint8 ternary weights + weight_scale, or float latent weights;
                          embeddings and norms in bfloat16 (float16 for the 1bitLLM layout)
    expected.safetensors  input_ids (1, T) int32; logits (1, T, vocab) float32 computed by
                          transformers from that checkpoint in float32
    fixture.json          seed, versions, how the logits were made, what each tensor means

The random draw uses numpy's PCG64 only (platform independent), one stream per fixture;
torch runs transformers' `pack_weights`, loading and forward. Every float is rounded to its
storage dtype before use, so float32 compute from the file is exact on both sides. Latent
weights are kept away from the absmean rounding tie (|W|/mean|W| = 0.5), so any correct
ternarizer finds the same codes. Two runs write identical bytes.

After writing, the script re-derives each fixture's logits from the files alone with a
numpy twin of transformers' forward (unpacking as FORMATS.md describes), and checks that the
ternary weights transformers holds equal the ones numpy unpacks or ternarizes; `--check` runs
that part alone. input_ids are chosen so that no activation sits near an int8 rounding tie
(see TIE_MARGIN).
"""

import argparse
import json
import math
import struct
import tempfile
from pathlib import Path

import numpy as np

SEED = 1158
SEQ_LEN = 12
# A single int8 activation code rounded the other way moves these logits by up to ~0.25,
# as much as dropping activation quantization altogether. So input_ids are redrawn until
# every x*127/max|x| sits at least this far (relative, ~250 float32 ulp) from a .5 tie: an
# implementation within a few ulp of transformers then gets every code right.
TIE_MARGIN = 3e-5
MAX_DRAWS = 1000
OUT_ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

# model_type bitnet in the legacy key style of microsoft/bitnet-b1.58-2B-4T's config.json
# (top-level rope_theta, torch_dtype): what loaders meet on the Hub.
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

# model_type llama as transformers 5 writes it (rope_parameters, dtype). Falcon3's rope_theta
# is not llama's default, so a loader that ignores rope_parameters fails these fixtures.
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

# 1bitLLM/bitnet_b1_58-large layout: model_type llama, custom class BitnetForCausalLM
# (remote code, auto_map left out here), float16 latent weights, no quantization_config,
# sub-norms named inner_attn_ln / ffn_layernorm, silu.
ONEBITLLM_CONFIG = {
    "architectures": ["BitnetForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "pretraining_tp": 1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "input_bits": 8,
    "weight_bits": 1,
    "torch_dtype": "float16",
    "use_cache": True,
}
ONEBITLLM_NAMES = {
    "self_attn.attn_sub_norm.": "self_attn.inner_attn_ln.",
    "mlp.ffn_sub_norm.": "mlp.ffn_layernorm.",
}

ONLINE = {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"}

FIXTURES = {
    "bitnet_offline_autobitlinear": {
        "arch": "bitnet",
        "dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "bitnet",
            "linear_class": "autobitlinear",
            "quantization_mode": "offline",
        },
        "about": "BitNetForCausalLM like microsoft/bitnet-b1.58-2B-4T: packed uint8 weights, "
        "weight_scale = mean|W| (output multiplied by it), tied embeddings, relu2, "
        "attn_sub_norm before o_proj, ffn_sub_norm before down_proj.",
    },
    "llama_offline_bitlinear": {
        "arch": "llama",
        "dtype": "bfloat16",
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
    # (its BitLinear always expects packed uint8), so the online fixture is autobitlinear.
    "llama_online_autobitlinear": {
        "arch": "llama",
        "dtype": "bfloat16",
        "quantization_config": ONLINE,
        "about": "LlamaForCausalLM with bfloat16 latent weights; transformers ternarizes them in "
        "every forward (absmean per tensor) and quantizes activations per token.",
    },
    # transformers cannot load this layout as BitNet by itself (it would build a plain
    # LlamaForCausalLM and drop the sub-norms); its logits come from transformers'
    # BitNetForCausalLM with the two sub-norm keys renamed and ONLINE supplied, which is the
    # math of 1bitLLM's remote code (utils_quant.BitLinear: absmean weights, per-token int8
    # activations, both dequantized in float32 before F.linear; modeling_bitnet.py: llama
    # with inner_attn_ln before o_proj and ffn_layernorm before down_proj).
    "bitnet_latent_noquantconfig": {
        "arch": "1bitllm",
        "dtype": "float16",
        "quantization_config": None,
        "about": "1bitLLM/bitnet_b1_58-large layout: float16 latent weights, no "
        "quantization_config (input_bits 8, weight_bits 1), inner_attn_ln / ffn_layernorm "
        "sub-norms, silu, untied lm_head. Run as BitNet: absmean ternary + int8 activations.",
    },
}

TENSOR_DOCS = {
    "expected.safetensors:input_ids": "(1, T) int32 token ids (batch 1, no padding, no cache)",
    "expected.safetensors:logits": "(1, T, vocab) float32, transformers' forward in float32",
    "model.safetensors": "embeddings, norms, lm_head in the storage dtype; projections: see "
    "'weights'",
}
WEIGHT_DOCS = {
    "offline": "*_proj.weight: (ceil(out/4), in) uint8, 2-bit field i (bits 2i..2i+1) of row r "
    "is output row r + i*ceil(out/4), value t+1; *_proj.weight_scale: (1,) bfloat16",
    "online": "*_proj.weight: (out, in) float latent; s = mean|W| over the tensor (float32), "
    "t = clamp(round(W/s), -1, 1), effective weight s*t; no weight_scale",
}
ACT_DOCS = {
    "autobitlinear": "per token: scale_x = 127/max(max|x|, 1e-5), x_q = clamp(round(x*scale_x), "
    "-128, 127); y = (x_q/scale_x) @ W.T with W = t*weight_scale offline, s*t online",
    "bitlinear": "per token: scale_x and x_q as for autobitlinear; y = (x_q @ t.T) / "
    "(scale_x * weight_scale), so weight_scale holds 1/mean|W|",
}


# ---------------------------------------------------------------- random weights (numpy)


def bf16_round(x):
    """Round to the nearest bfloat16 (ties to even), returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.reshape(-1).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32).reshape(x.shape)


def fp16_round(x):
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def latent_weight(rng, shape, scale, rnd):
    """A latent float weight whose absmean ternarization is far from every rounding tie.

    |W|/mean|W| is kept at least 0.02 from 0.5, so any correct absmean (float32, any
    summation order) gives the same codes.
    """
    w = rnd(rng.normal(0.0, scale, size=shape))
    for _ in range(100):
        r = np.abs(w) / np.abs(w.astype(np.float64)).mean()
        near = np.abs(r - 0.5) < 0.02
        if not near.any():
            return w
        w[near] = rnd(w[near] * np.where(r[near] < 0.5, 0.9, 1.1))
    raise RuntimeError("could not move latent weights away from the rounding tie at 0.5")


def draw_model(rng, cfg, online, rnd):
    """Random weights by HF bitnet/llama name; projections are (t, s) or latent floats."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    shapes = {
        "q_proj": (h, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, h),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }
    sub_norms = cfg["model_type"] == "bitnet"

    def norm(n):
        return rnd(1.0 + 0.1 * rng.standard_normal(n))

    # Tied: the embedding is also the head, so 0.5 gives logits of std ~4. Untied: a small
    # embedding keeps the residual stream from drowning what the layers add.
    emb_std = 0.5 if cfg["tie_word_embeddings"] else 0.1
    w = {
        "model.embed_tokens.weight": rnd(rng.normal(0, emb_std, (v, h))),
        "model.norm.weight": norm(h),
    }
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rnd(rng.normal(0, 0.3, (v, h)))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        if sub_norms:
            w[p + "self_attn.attn_sub_norm.weight"] = norm(h)
            w[p + "mlp.ffn_sub_norm.weight"] = norm(inter)
        for name in ATTN + MLP:
            key = p + ("self_attn." if name in ATTN else "mlp.") + name + ".weight"
            s = float(rng.uniform(0.03, 0.1))
            if online:
                w[key] = latent_weight(rng, shapes[name], s, rnd)
            else:  # ternary codes, each of -1, 0, +1 with probability 1/3
                w[key] = (rng.integers(-1, 2, size=shapes[name]).astype(np.int8), s)
    return w


# ---------------------------------------------------------------- safetensors without torch


def read_safetensors(path):
    """name -> numpy array (bfloat16 widened to float32), parsed by hand: numpy has no bf16."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    dtypes = {
        "F32": np.float32,
        "F16": np.float16,
        "U8": np.uint8,
        "I8": np.int8,
        "I32": np.int32,
        "I64": np.int64,
    }
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        buf = raw[8 + n + a : 8 + n + b]
        if info["dtype"] == "BF16":
            arr = (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(buf, dtypes[info["dtype"]])
        out[name] = arr.reshape(info["shape"])
    return out


def unpack_ternary(packed, out_features):
    """(ceil(out/4), in) uint8 -> (out, in) int8 codes; field i of row r is row r + i*rows."""
    fields = [((packed >> (2 * i)) & 3).astype(np.int8) - 1 for i in range(4)]
    return np.concatenate(fields, axis=0)[:out_features]


def pack_ternary(t):
    """Inverse of unpack_ternary: (out, in) codes -> (ceil(out/4), in) uint8."""
    rows = -(-t.shape[0] // 4)
    padded = np.zeros((4 * rows, t.shape[1]), np.uint8)  # pad fields 0, as pack_weights
    padded[: t.shape[0]] = (t + 1).astype(np.uint8)
    packed = np.zeros((rows, t.shape[1]), np.uint8)
    for i in range(4):
        packed |= padded[i * rows : (i + 1) * rows] << (2 * i)
    return packed


# ---------------------------------------------------------------- numpy twin of the forward


def act_quant(x):
    """transformers' per-token int8 absmax: integer-valued codes and scale 127/max|x|."""
    scale = np.float32(127.0) / np.maximum(np.abs(x).max(-1, keepdims=True), np.float32(1e-5))
    return np.clip(np.round(x * scale), -128, 127), scale


def rms_norm(x, w, eps):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps)))


def rope(x, theta):
    """HF rotate_half RoPE on (heads, T, hd) at positions 0..T-1."""
    hd, t = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (np.arange(0, hd, 2).astype(np.float32) / hd)
    ang = np.arange(t, dtype=np.float32)[:, None] * inv[None, :]
    emb = np.concatenate([ang, ang], -1)
    rot = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * np.cos(emb) + rot * np.sin(emb)


def quant_semantics(cfg):
    """(linear_class, online) the checkpoint runs with; no quantization_config = 1bitLLM."""
    qc = cfg.get("quantization_config") or ONLINE
    return qc.get("linear_class", "bitlinear"), qc.get("quantization_mode", "offline") == "online"


def out_features(cfg, proj):
    kv = cfg["num_key_value_heads"] * cfg["hidden_size"] // cfg["num_attention_heads"]
    return {
        "q_proj": cfg["hidden_size"],
        "k_proj": kv,
        "v_proj": kv,
        "o_proj": cfg["hidden_size"],
        "gate_proj": cfg["intermediate_size"],
        "up_proj": cfg["intermediate_size"],
        "down_proj": cfg["hidden_size"],
    }[proj]


def ternary_weights(files, cfg):
    """stem -> (t (out, in) int8, s) with effective weight s * t, read from the files."""
    linear_class, online = quant_semantics(cfg)
    res = {}
    for key, arr in files.items():
        proj = key.split(".")[-2]
        if proj not in ATTN + MLP or not key.endswith(".weight"):
            continue
        stem = key[: -len(".weight")]
        if online:
            s = np.abs(arr).mean(dtype=np.float32)
            res[stem] = (np.clip(np.round(arr / s), -1, 1).astype(np.int8), s)
        else:
            ws = files[stem + ".weight_scale"].reshape(())
            s = ws if linear_class == "autobitlinear" else np.float32(1.0) / ws
            res[stem] = (unpack_ternary(arr, out_features(cfg, proj)), s)
    return res


def numpy_forward(files, cfg, ids, margins=None):
    """Logits (T, vocab) for one sequence, following transformers' modeling_{llama,bitnet}.

    margins, if a list, receives per projection input and token the least relative
    distance of x*127/max|x| from a rounding tie (see TIE_MARGIN).
    """
    files = {k: (v.astype(np.float32) if v.dtype != np.uint8 else v) for k, v in files.items()}
    tern = ternary_weights(files, cfg)
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // nh
    eps = cfg["rms_norm_eps"]
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    act = {
        "relu2": lambda g: np.maximum(g, 0) ** 2,  # BitNet's squared ReLU
        "silu": lambda g: g * 0.5 * (1 + np.tanh(g / 2)),
    }[cfg["hidden_act"]]  # no exp overflow

    def sub_norm(x, p, names):  # HF bitnet name, or the 1bitLLM one; llama has none
        for n in names:
            if p + n in files:
                return rms_norm(x, files[p + n], eps)
        return x

    def lin(stem, x):
        t, s = tern[stem]
        xq, xs = act_quant(x)
        if margins is not None:
            v = np.abs(x * xs)
            margins.append((np.abs(v - np.floor(v) - 0.5) / np.maximum(v, 1)).min(-1))
        return (xq @ t.T.astype(np.float32)) / xs * s

    x = files["model.embed_tokens.weight"][ids]
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
        o = sub_norm(o, p, ("self_attn.attn_sub_norm.weight", "self_attn.inner_attn_ln.weight"))
        x = x + lin(p + "self_attn.o_proj", o)
        m = rms_norm(x, files[p + "post_attention_layernorm.weight"], eps)
        mid = act(lin(p + "mlp.gate_proj", m)) * lin(p + "mlp.up_proj", m)
        mid = sub_norm(mid, p, ("mlp.ffn_sub_norm.weight", "mlp.ffn_layernorm.weight"))
        x = x + lin(p + "mlp.down_proj", mid)
    x = rms_norm(x, files["model.norm.weight"], eps)
    return x @ files.get("lm_head.weight", files["model.embed_tokens.weight"]).T


def check_fixture(d):
    """Re-derive a fixture's logits with numpy alone; return (max abs diff, logit std)."""
    cfg = json.loads((d / "config.json").read_text())
    files = read_safetensors(d / "model.safetensors")
    exp = read_safetensors(d / "expected.safetensors")
    for key, arr in files.items():  # packed layout round trip, byte for byte
        if arr.dtype == np.uint8 and not np.array_equal(
            pack_ternary(unpack_ternary(arr, 4 * len(arr))), arr
        ):
            raise AssertionError(f"{d.name}: {key} does not round-trip through unpack/pack")
    got = numpy_forward(files, cfg, exp["input_ids"][0].astype(np.int64))
    return float(np.abs(got - exp["logits"][0]).max()), float(exp["logits"].std())


# ---------------------------------------------------------------- transformers side (torch)


def hf_config(spec):
    """(config.json as shipped, config.json transformers runs it with)."""
    from transformers import LlamaConfig

    if spec["arch"] == "bitnet":
        cfg = dict(BITNET_CONFIG, quantization_config=spec["quantization_config"])
        return cfg, cfg
    if spec["arch"] == "llama":
        cfg = LlamaConfig(**LLAMA_KWARGS, architectures=["LlamaForCausalLM"], dtype=spec["dtype"])
        cfg = {k: v for k, v in cfg.to_diff_dict().items() if k != "transformers_version"}
        cfg["quantization_config"] = spec["quantization_config"]
        return cfg, cfg
    shipped = dict(ONEBITLLM_CONFIG)
    run = {
        k: v for k, v in shipped.items() if k not in ("input_bits", "weight_bits", "rope_scaling")
    }
    run.update(architectures=["BitNetForCausalLM"], model_type="bitnet", quantization_config=ONLINE)
    return shipped, run


def write_checkpoint(d, cfg, weights, torch_dtype, names=None):
    """config.json + model.safetensors; (t, weight_scale) pairs are packed with pack_weights."""
    import torch
    from safetensors.torch import save_file
    from transformers.integrations.bitnet import pack_weights

    tensors = {}
    for key, val in weights.items():
        if names:
            for a, b in names.items():
                key = key.replace(a, b)
        if isinstance(val, tuple):
            t, s = val
            tensors[key] = pack_weights(torch.from_numpy(t.astype(np.int64)))  # (ceil(out/4), in)
            if not np.array_equal(tensors[key].numpy(), pack_ternary(t)):
                raise AssertionError(
                    f"{key}: numpy packing differs from transformers' pack_weights"
                )
            tensors[key + "_scale"] = torch.tensor([s], dtype=torch.bfloat16)
        else:
            tensors[key] = torch.from_numpy(val).to(torch_dtype)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def hf_logits(d, cfg, ids, codes):
    """transformers' float32 logits for the checkpoint in d; checks what it built and unpacked."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations.bitnet import (
        AutoBitLinear,
        BitLinear,
        WeightQuant,
        unpack_weights,
    )

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    # transformers 5.24 keeps embeddings and norms in the checkpoint dtype when
    # autobitlinear/offline (its deserializer claims every ".weight"), so bf16 norms would
    # meet fp32 projections. Widening is exact: every float on disk is bf16/fp16.
    model = model.to(torch.float32)
    if type(model).__name__ != cfg["architectures"][0]:
        raise AssertionError(f"{d}: transformers built {type(model).__name__}")
    theta = model.config.rope_parameters["rope_theta"]
    if theta != (cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]):
        raise AssertionError(f"{d}: transformers read rope_theta {theta}")
    linear_class, _ = quant_semantics(cfg)
    want = AutoBitLinear if linear_class == "autobitlinear" else BitLinear
    swapped = {n for n, m in model.named_modules() if isinstance(m, want)}
    if len(swapped) != len(ATTN + MLP) * cfg["num_hidden_layers"] or any(
        "lm_head" in n for n in swapped
    ):
        raise AssertionError(f"{d}: unexpected converted modules {sorted(swapped)}")
    for key, t in codes.items():  # the ternary weights transformers itself holds
        mod = model.get_submodule(key[: -len(".weight")])
        if isinstance(mod, BitLinear):
            got = unpack_weights(mod.weight, torch.float32)
        elif mod.online_quant:  # s * t with s > 0
            got = torch.sign(WeightQuant.apply(mod.weight))
        else:
            got = mod.weight
        if not np.array_equal(got.detach().float().numpy(), t.astype(np.float32)):
            raise AssertionError(f"{d}: transformers unpacked {key} differently")
    with torch.no_grad():
        return model(torch.from_numpy(ids[None].astype(np.int64))).logits.float().contiguous()


def draw_input_ids(rng, d, cfg):
    """(ids (T,) int32, margin): tokens picked one position at a time, each redrawn until
    its activations are clear of rounding ties (causal: later tokens cannot change them)."""
    files = read_safetensors(d / "model.safetensors")
    ids = []
    for pos in range(SEQ_LEN):
        for draw in range(MAX_DRAWS):
            tok = 1 if pos == draw == 0 else int(rng.integers(3, cfg["vocab_size"]))  # bos first
            margins = []
            numpy_forward(files, cfg, np.array(ids + [tok]), margins)
            if min(m[-1] for m in margins) >= TIE_MARGIN:
                ids.append(tok)
                break
        else:
            raise RuntimeError(f"{d.name}: no token at position {pos} clear of rounding ties")
    margins = []
    numpy_forward(files, cfg, np.array(ids), margins)
    return np.array(ids, np.int32), float(min(m.min() for m in margins))


def build_fixture(name, spec, rng):
    import torch
    import transformers
    from safetensors.torch import save_file

    shipped, run = hf_config(spec)
    linear_class, online = quant_semantics(run)
    torch_dtype = getattr(torch, spec["dtype"])
    rnd = bf16_round if spec["dtype"] == "bfloat16" else fp16_round
    weights = draw_model(rng, run, online, rnd)
    codes = {k: v[0] for k, v in weights.items() if isinstance(v, tuple)}
    # weight_scale as stored: mean|W| for autobitlinear, 1/mean|W| for bitlinear
    scales = {
        k: float(bf16_round(v[1] if linear_class == "autobitlinear" else 1 / v[1]))
        for k, v in weights.items()
        if isinstance(v, tuple)
    }
    weights = {k: (codes[k], scales[k]) if k in codes else v for k, v in weights.items()}

    d = OUT_ROOT / name
    names = ONEBITLLM_NAMES if spec["arch"] == "1bitllm" else None
    tensors = write_checkpoint(d, shipped, weights, torch_dtype, names)
    for key, t in codes.items():
        if not np.array_equal(unpack_ternary(tensors[key].numpy(), t.shape[0]), t):
            raise AssertionError(f"{name}: numpy unpack of {key} differs from the codes drawn")
    if online:  # codes as numpy ternarizes the latent weights on disk
        codes = {
            k + ".weight": t
            for k, (t, _) in ternary_weights(
                {
                    k: v.astype(np.float32)
                    for k, v in read_safetensors(d / "model.safetensors").items()
                },
                shipped,
            ).items()
        }
    ids, margin = draw_input_ids(rng, d, shipped)
    if run is shipped:
        logits = hf_logits(d, run, ids, codes)
        how = (
            "AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32).eval()"
            ".to(torch.float32); logits = model(input_ids.long()).logits"
        )
    else:
        with tempfile.TemporaryDirectory() as tmp:
            write_checkpoint(Path(tmp), run, weights, torch_dtype)
            logits = hf_logits(Path(tmp), run, ids, codes)
        how = (
            "the same tensors with self_attn.inner_attn_ln -> self_attn.attn_sub_norm and "
            "mlp.ffn_layernorm -> mlp.ffn_sub_norm, config model_type bitnet + "
            f"quantization_config {ONLINE}, then AutoModelForCausalLM.from_pretrained("
            "dir, dtype=torch.float32).eval().to(torch.float32)(input_ids.long()).logits"
        )
    save_file(
        {"input_ids": torch.from_numpy(ids[None].copy()), "logits": logits},
        str(d / "expected.safetensors"),
    )
    meta = {
        "about": spec["about"],
        "seed": [SEED, list(FIXTURES).index(name)],
        "rng": "numpy.random.Generator(PCG64(seed))",
        "seq_len": SEQ_LEN,
        "tie_margin": {
            "value": margin,
            "meaning": "least |frac(v) - 0.5| / max(|v|, 1) over "
            "v = x*127/max|x| at every projection input; a mismatch in activation "
            "codes moves logits by up to ~0.25, so compute x to float32 accuracy",
        },
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "produced_by": "scripts/make_hf_fixtures.py",
        "how": how,
        "tensors": TENSOR_DOCS,
        "weights": WEIGHT_DOCS["online" if online else "offline"],
        "activations": ACT_DOCS[linear_class],
    }
    (d / "fixture.json").write_text(json.dumps(meta, indent=2) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="numpy-only re-check; writes nothing")
    args = ap.parse_args()
    if not args.check:
        for i, (name, spec) in enumerate(FIXTURES.items()):
            build_fixture(name, spec, np.random.Generator(np.random.PCG64([SEED, i])))
    for name in FIXTURES:
        d = OUT_ROOT / name
        diff, std = check_fixture(d)
        size = sum(f.stat().st_size for f in d.iterdir())
        print(
            f"{name}: {size / 1024:.1f} KiB, numpy twin max|dlogit| {diff:.1e} (logit std {std:.2f})"
        )
        if diff > 1e-4:
            raise SystemExit(f"{name}: numpy twin disagrees with transformers by {diff}")


if __name__ == "__main__":
    main()
