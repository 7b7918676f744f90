"""PyTorch twin of mlx-lm's `models/llama.py` with optional BitNet b1.58 quantization-aware
linears (used by train_tiny.py). Parameter names match Hugging Face LlamaForCausalLM, so the
state dict loads into mlx-lm's llama class unchanged."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TinyConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    intermediate_size: int = 704
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    ternary: bool = True  # absmean ternary weights + int8 per-token activations in decoder linears

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def ternarize(w: torch.Tensor) -> torch.Tensor:
    """Absmean ternary, as transformers' bitnet WeightQuant: s = mean|W|, s * clamp(round(W/s))."""
    scale = 1.0 / w.abs().mean().clamp(min=1e-5)
    return (w * scale).round().clamp(-1, 1) / scale


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """int8 per-token absmax, as transformers' bitnet ActQuant (quantize, then dequantize)."""
    scale = 127.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return (x * scale).round().clamp(-128, 127) / scale


class BitLinear(nn.Linear):
    """nn.Linear whose forward uses ternary weights and int8 activations; gradients reach the
    latent float weight and the unquantized input through straight-through estimators."""

    def forward(self, x):
        w = self.weight
        w = w + (ternarize(w) - w).detach()
        x = x + (quantize_activations(x) - x).detach()
        return F.linear(x, w)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(cfg: TinyConfig, length: int):
    # Non-traditional (rotate-half) RoPE, as mlx nn.RoPE(traditional=False) and HF llama.
    d = cfg.head_dim
    inv = cfg.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(length, dtype=torch.float64)[:, None] * inv[None, :]  # (L, d/2)
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x, cos, sin):
    # x: (B, H, L, D)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig, linear):
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = linear(d, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = linear(cfg.num_attention_heads * hd, d, bias=False)

    def forward(self, x, cos, sin):
        B, L, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(B, L, c.num_attention_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(B, L, c.num_key_value_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, L, c.num_key_value_heads, -1).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=c.num_key_value_heads != c.num_attention_heads
        )
        return self.o_proj(o.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig, linear):
        super().__init__()
        self.gate_proj = linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig, linear):
        super().__init__()
        self.self_attn = Attention(cfg, linear)
        self.mlp = MLP(cfg, linear)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Inner(nn.Module):
    def __init__(self, cfg: TinyConfig, linear):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, linear) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TinyLlama(nn.Module):
    """LlamaForCausalLM with tied embeddings; state_dict keys are `model.*` HF names."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Inner(cfg, BitLinear if cfg.ternary else nn.Linear)
        cos, sin = rope_tables(cfg, cfg.max_position_embeddings)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._init_weights()

    def _init_weights(self):
        # GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers).
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            s = (
                std / math.sqrt(2 * self.cfg.num_hidden_layers)
                if name.endswith(("o_proj.weight", "down_proj.weight"))
                else std
            )
            nn.init.normal_(p, 0.0, s)

    def forward(self, ids):
        L = ids.shape[1]
        x = self.model.embed_tokens(ids)
        cos, sin = self.cos[:L], self.sin[:L]
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return F.linear(self.model.norm(x), self.model.embed_tokens.weight)
