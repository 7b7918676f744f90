// The native CPU backend as MLX primitives (an MLX C++ extension, bound with nanobind in MLX's
// own nanobind domain so arguments and results are mlx.core.array objects).
//
//   TernaryMatmul   y = act_quant(x) @ (s * t).T + b       (ops/ternary.h)
//   DenseMatmul     y = x @ W.T, W float16/bfloat16/float32 (ops/dense.h)
//   TernaryWeight   W = s * t as float32 (N, K)            (the backward pass)
//   Attention       softmax(scale q k^T [causal]) v        (ops/attention.h)
//   SwiGLU          silu(g) * x, float32                   (ops/activation.h)
//   GgmlDequantize, GgmlMatmul  llama.cpp's quantized tables (ops/ggml.h)
//   AttnIn, AttnOut, Mlp  a llama-family decoder block in three ops (ops/block.h)
//   LocalSum        two local ranks' all_sum over shared memory (ops/localsum.h)
//
// This file is the Python module only: the primitives live in ops/ (over ops/primitive.h),
// the kernels in kernels/, the ISA-specific bodies in arch/ (arch/select.h chooses them). It is
// the one file build.py compiles: one translation unit, as before the split.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "arch/select.h"
#include "kernels/dense.h"
#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/block.h"
#include "ops/dense.h"
#include "ops/ggml.h"
#include "ops/localsum.h"
#include "ops/primitive.h"
#include "ops/ternary.h"
#include "selfcheck.h"

namespace nb = nanobind;
using namespace mlxt;

#ifndef MLXT_MLX_VERSION
#error "MLXT_MLX_VERSION (the mlx version this extension is compiled against) must be defined"
#endif

NB_MODULE(_mlx_ternary_native, m) {
  m.doc() = "mlx-ternary's native CPU kernels (an MLX C++ extension)";
  m.def("ternary_matmul", &ternary_matmul, nb::arg("x"), nb::arg("packed"), nb::arg("scales"),
        nb::arg("bias").none(), nb::arg("packing"), nb::arg("in_features"),
        nb::arg("group_size"), nb::arg("activation_bits"),
        "y = act_quant(x) @ (s * t).T + bias for a packed ternary weight (packing 0 compact, "
        "1 fast; group_size 0 unless scales are per group; activation_bits 0, 8 or ACT_Q8K).");
  m.def("q8k_supported", &q8k_supported, nb::arg("packing"), nb::arg("in_features"),
        nb::arg("group_size"),
        "Whether the kernel runs q8k activations for this layout (else the reference twin).");
  m.attr("ACT_Q8K") = ACT_Q8K;
  m.def("dense_matmul", &dense_matmul, nb::arg("x"), nb::arg("w"),
        "x @ w.T in float32 for w float16/bfloat16/float32 of shape (N, K).");
  m.def("ternary_weight", &ternary_weight_op, nb::arg("packed"), nb::arg("scales"),
        nb::arg("packing"), nb::arg("in_features"), nb::arg("group_size"),
        "The (N, K) float32 weight s * t of a packed ternary layer.");
  m.def("attention", &attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"),
        nb::arg("causal"), nb::arg("mask").none() = nb::none(),
        "softmax(scale * q @ k.T [+ causal mask]) @ v for float32 (B, H, L, D) arrays; k/v may "
        "have fewer heads (grouped-query attention); `mask` (bool, broadcast to (B, H, Lq, Lk)) "
        "drops the keys it marks false.");
  m.def("swiglu", &swiglu, nb::arg("g"), nb::arg("x"),
        "silu(g) * x for float32 arrays of one shape (a vectorized exp, within 2 ulp).");
  m.def("set_num_threads", [](int n) { pool().resize(n < 1 ? default_threads() : n); },
        nb::arg("n"), "Threads the kernels use (n < 1: all the cores this process may use).");
  m.def("num_threads", []() { return pool().size(); });
  m.def("isa", []() { return std::string(tk::NativeOps::name) + " / " + tk::dense_isa(); });
  m.def("ggml_dequantize", &ggml_dequantize, nb::arg("blocks"), nb::arg("type"), nb::arg("k"),
        "(..., row_bytes) uint8 ggml blocks -> (..., k) float32, as ggml dequantizes them.");
  m.def("ggml_matmul", &ggml_matmul, nb::arg("x"), nb::arg("w"), nb::arg("type"), nb::arg("k"),
        nb::arg("llama"),
        "x @ W.T for W (N, row_bytes) ggml blocks; llama: activations quantized and summed as "
        "ggml's generic dot products, else float32.");
  m.def("attn_in", &attn_in, nb::arg("x"), nb::arg("norm_w"), nb::arg("eps"), nb::arg("packed"),
        nb::arg("scales"), nb::arg("bias"), nb::arg("packing"), nb::arg("in_features"),
        nb::arg("group_size"), nb::arg("activation_bits"), nb::arg("n_heads"),
        nb::arg("n_kv_heads"), nb::arg("head_dim"), nb::arg("rope_dims"),
        nb::arg("traditional"), nb::arg("base").none(), nb::arg("rope_scale"),
        nb::arg("freqs").none(), nb::arg("offset"), nb::arg("offsets").none(),
        nb::arg("q_norm_w").none() = nb::none(), nb::arg("k_norm_w").none() = nb::none(),
        nb::arg("qk_eps") = 0.f, nb::arg("kv_half") = false,
        "RMSNorm(x) -> q, k, v (B, H, L, D) with RoPE applied (a fused llama attention input; "
        "q_norm_w / k_norm_w: qwen3's RMSNorm of each q and k head before RoPE; kv_half: k and "
        "v as float16, the 16-bit KV cache).");
  m.def("attn_out", &attn_out, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"),
        nb::arg("causal"), nb::arg("mask").none(), nb::arg("packed"), nb::arg("scales"),
        nb::arg("bias").none(), nb::arg("packing"), nb::arg("in_features"),
        nb::arg("group_size"), nb::arg("activation_bits"), nb::arg("residual").none(),
        nb::arg("sub_norm_w").none() = nb::none(), nb::arg("sub_eps") = 0.f,
        "[residual +] o_proj([RMSNorm](attention(q, k, v))) in (B, L, out); k/v float32 or "
        "float16; sub_norm_w: bitnet's attn_sub_norm.");
  m.def("mlp", &mlp, nb::arg("h"), nb::arg("norm_w"), nb::arg("eps"), nb::arg("packed"),
        nb::arg("scales"), nb::arg("bias"), nb::arg("packing"), nb::arg("in_features"),
        nb::arg("group_size"), nb::arg("activation_bits"), nb::arg("down_packed"),
        nb::arg("down_scales"), nb::arg("down_bias").none(), nb::arg("down_packing"),
        nb::arg("down_in_features"), nb::arg("down_group_size"),
        nb::arg("down_activation_bits"), nb::arg("residual").none(), nb::arg("act") = int(ACT_SILU),
        nb::arg("sub_norm_w").none() = nb::none(), nb::arg("sub_eps") = 0.f,
        "[residual +] down([RMSNorm](act(gate(n)) * up(n))), n = RMSNorm(h): act MLP_SILU (a "
        "fused llama MLP) or MLP_RELU2 (bitnet's; sub_norm_w its ffn_sub_norm).");
  m.def("local_sum", &local_sum, nb::arg("x"),
        "The sum of this rank's float32 `x` and the other local rank's, over the attached "
        "segment (slot 0 + slot 1: the same bits on both ranks).");
  m.def("local_sum_attach", &local_sum_attach, nb::arg("path"), nb::arg("rank"), nb::arg("cap"),
        nb::arg("timeout_s"), nb::arg("advice") = "",
        "Map the shared segment of two local ranks (samehost.py makes it); `advice` ends the "
        "timeout's error.");
  m.def("local_sum_bytes", [](int64_t cap) { return (int64_t)local_sum_bytes((size_t)cap); },
        nb::arg("cap"), "The segment's size for data slots of `cap` bytes.");
  m.def("local_sum_calls", []() { return (int64_t)local_state().calls.load(); },
        "How many local sums this process has run.");
  m.def("is_tracer", [](const mx::array& a) { return a.is_tracer(); }, nb::arg("a"),
        "Whether `a` is (or is computed from) an input of a transform being traced now "
        "(mx.grad, vjp, jvp, compile): a graph it is part of may be differentiated.");
  m.def("selfcheck", []() {
          std::string e = tk::selfcheck();
          return e.empty() ? tk::kq_selfcheck() : e;
        },
        "Compare this build's SIMD kernels with the portable ones; '' when they agree.");
  m.attr("MLP_SILU") = int(ACT_SILU);
  m.attr("MLP_RELU2") = int(ACT_RELU2);
  m.attr("PACKING_COMPACT") = int(tk::COMPACT);
  m.attr("PACKING_FAST") = int(tk::FAST);
  m.def("built_for_mlx", []() { return std::string(MLXT_MLX_VERSION); });
  m.def("linked_mlx", []() { return std::string(mx::version()); });
}
