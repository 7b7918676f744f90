// TernaryMatmul   y = act_quant(x) @ (s * t).T + b       (kernels/ternary.h)
// TernaryWeight   W = s * t as float32 (N, K)            (the backward pass)
//
// The vjp with respect to x is the straight-through estimator of BitNet: g @ (s * t).
#pragma once

#include "../arch/select.h"
#include "../kernels/q8k.h"
#include "../kernels/ternary.h"
#include "primitive.h"

namespace mlxt {

// Rows per chunk of a ternary layer: 16 from TOKEN_TILE tokens on (the token tiles pass over
// a chunk's rows while they sit in L1); for decode, about 8 chunks per thread in multiples of
// 16: fewer claims, and the row kernels prefetch the next rows of their own chunk. Prefill
// through q8k's row panels takes q8k_panel_chunk's.
int64_t row_chunk(const tk::Geometry& g, bool q8k, int64_t M) {
  const int64_t n = g.n;
  if (tk::HasQ8kPanel<tk::NativeOps>::value && tk::q8k_panels_apply(g, q8k, M))
    return tk::q8k_panel_chunk(n, pool().size());
  if (M >= tk::TOKEN_TILE) return 16;
  const int64_t want = tk::ceil_div(n, 8 * (int64_t)pool().size());
  return std::max<int64_t>(16, tk::ceil_div(want, 16) * 16);
}


struct TernaryParams {
  int packing, group, scale_kind;
  int64_t n, k;
  bool act_quant, has_bias, q8k = false;
  bool operator==(const TernaryParams& o) const {
    return std::tie(packing, group, scale_kind, n, k, act_quant, has_bias, q8k) ==
           std::tie(o.packing, o.group, o.scale_kind, o.n, o.k, o.act_quant, o.has_bias, o.q8k);
  }
};

mx::array ternary_weight(const mx::array& packed, const mx::array& scales,
                         const TernaryParams& p, bool unit_scales, mx::Stream s);

// The activations of M tokens of x (row-major (M, K), dtype xd) for layers of geometry g and
// activation mode p: Q8_K blocks, BitNet's int8 or permuted floats; long prompts in parallel.
void prepare_acts(const tk::Geometry& g, const TernaryParams& p, const void* xp, int xd,
                  int64_t M, tk::Acts& a) {
  const int64_t xlen = g.xlen();
  if (p.q8k) {
    a.q.resize(M * xlen), a.d8.resize(M * g.nblocks8), a.ssum.resize(M * g.nseg);
    parallel_rows(M, 8, [&](int64_t m0, int64_t m1) {
      // one buffer a thread, not an allocation a call; the codes' part zeroed as a new one was
      thread_local std::vector<float> tmp;
      const int64_t nt = tk::q8k_tmp_floats(p.k);
      if ((int64_t)tmp.size() < nt) tmp.resize(nt);
      std::fill(tmp.begin() + p.k, tmp.begin() + nt, 0.f);
      for (int64_t m = m0; m < m1; m++) tk::quantize_token_q8k(g, xp, xd, m, a, tmp.data());
    });
  } else if (p.act_quant) {
    a.q.resize(M * xlen), a.xs.resize(M), a.gsum.resize(M * g.ngroups);
    parallel_rows(M, 8, [&](int64_t m0, int64_t m1) {
      std::vector<float> tmp(p.k);
      for (int64_t m = m0; m < m1; m++) tk::quantize_token(g, xp, xd, m, a, tmp.data());
    });
  } else {
    a.f.resize(M * xlen);
    parallel_rows(M, 8, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; m++) tk::permute_token(g, xp, xd, m, a);
    });
  }
}

class TernaryMatmul : public CpuPrimitive {
 public:
  TernaryMatmul(mx::Stream s, TernaryParams p) : CpuPrimitive(s), p_(p) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = enqueue(stream(), in, out);
    const mx::array& x = in[0];
    auto g = geometry(p_.packing, p_.n, p_.k, p_.group);
    enc.dispatch([g, p = p_, x, packed = in[1], scales = in[2],
                  bias = p_.has_bias ? std::optional<mx::array>(in[3]) : std::nullopt,
                  outp = out.data<void>(), out_dtype = tk_dtype(out.dtype(), "x")]() {
      std::vector<uint8_t> kx, kw, ks, kb;
      tk::Layer L(*g);
      L.w = (const uint8_t*)row_major(packed, kw);
      L.scales = row_major(scales, ks);
      L.scale_dtype = tk_dtype(scales.dtype(), "scales");
      L.scale_kind = p.scale_kind;
      if (bias) L.bias = row_major(*bias, kb), L.bias_dtype = tk_dtype(bias->dtype(), "bias");
      L.act_quant = p.act_quant;
      L.q8k = p.q8k;
      L.out = outp;
      L.out_dtype = out_dtype;
      const void* xp = row_major(x, kx);
      const int xd = tk_dtype(x.dtype(), "x");
      const int64_t M = (int64_t)(x.size() / p.k);
      thread_local tk::Acts acts_buffer;  // reused across calls on this stream thread
      tk::Acts& a = acts_buffer;           // (a thread_local named in a lambda is per thread)
      prepare_acts(*g, p, xp, xd, M, a);
      parallel_rows(p.n, row_chunk(*g, p.q8k, M), [&](int64_t n0, int64_t n1) {
        tk::rows_dispatch<tk::NativeOps>(L, a, M, n0, n1);
      });
    });
  }


  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>&) override {
    const auto& x = primals[0];
    const auto s = stream();
    auto g2 = mx::reshape(mx::astype(cotangents[0], mx::float32, s), {-1, (int)p_.n}, s);
    std::vector<mx::array> out;
    for (int arg : argnums) {
      if (arg == 0) {  // straight-through: d act_quant(x) / dx = identity
        auto w = ternary_weight(primals[1], primals[2], p_, false, s);
        out.push_back(mx::astype(mx::reshape(mx::matmul(g2, w, s), x.shape(), s), x.dtype(), s));
      } else if (arg == 3) {
        out.push_back(mx::astype(mx::sum(g2, 0, false, s), primals[3].dtype(), s));
      } else if (arg == 2) {
        if (p_.q8k) bad("no gradient with respect to the scales with q8k activations");
        out.push_back(scale_grad(primals, g2, s));
      } else {
        bad("no gradient with respect to the packed trits");
      }
    }
    return out;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    auto shape = in[0].shape();
    shape.back() = (int)p_.n;
    return {shape};
  }

  const char* name() const override { return "TernaryMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return p_ == static_cast<const TernaryMatmul&>(other).p_;
  }

 private:
  // d/ds of y = xhat @ (s t).T with xhat the (straight-through) activations the layer used:
  // dW = g.T @ xhat, summed against the trits over each scale's columns.
  mx::array scale_grad(const std::vector<mx::array>& primals, const mx::array& g2,
                       mx::Stream s) const {
    auto x2 = mx::reshape(mx::astype(primals[0], mx::float32, s), {-1, (int)p_.k}, s);
    if (p_.act_quant) {
      auto amax = mx::maximum(mx::max(mx::abs(x2, s), -1, true, s), mx::array(1e-5f), s);
      auto sc = mx::divide(mx::array(127.f), amax, s);
      auto q = mx::clip(mx::round(mx::multiply(x2, sc, s), 0, s), mx::array(-128.f),
                        mx::array(127.f), s);
      x2 = mx::multiply(q, mx::divide(mx::array(1.f), sc, s), s);
    }
    auto dw = mx::multiply(mx::matmul(mx::transpose(g2, s), x2, s),
                           ternary_weight(primals[1], primals[2], p_, true, s), s);
    const auto& scales = primals[2];
    mx::array r = dw;
    if (p_.scale_kind == 0) {
      r = mx::reshape(mx::sum(dw, s), {1, 1}, s);
    } else if (p_.scale_kind == 1) {
      r = mx::sum(dw, -1, true, s);
    } else {
      int ng = scales.shape(1), pad = ng * p_.group - (int)p_.k;
      if (pad) dw = mx::pad(dw, {{0, 0}, {0, pad}}, mx::array(0.f), "constant", s);
      r = mx::sum(mx::reshape(dw, {(int)p_.n, ng, p_.group}, s), -1, false, s);
    }
    return mx::astype(r, scales.dtype(), s);
  }

  TernaryParams p_;
};

// ---------------------------------------------------------------------------------------------
// TernaryWeight: (N, K) float32 = s * t (or t with unit_scales)
// ---------------------------------------------------------------------------------------------

class TernaryWeight : public CpuPrimitive {
 public:
  TernaryWeight(mx::Stream s, TernaryParams p, bool unit) : CpuPrimitive(s), p_(p), unit_(unit) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = enqueue(stream(), in, out);
    auto g = geometry(p_.packing, p_.n, p_.k, p_.group);
    enc.dispatch([g, p = p_, unit = unit_, packed = in[0], scales = in[1],
                  outp = out.data<float>()]() {
      std::vector<uint8_t> kw, ks;
      const float one = 1.f;
      tk::Layer L(*g);
      L.w = (const uint8_t*)row_major(packed, kw);
      L.scales = unit ? (const void*)&one : row_major(scales, ks);
      L.scale_dtype = unit ? tk::F32 : tk_dtype(scales.dtype(), "scales");
      L.scale_kind = unit ? 0 : p.scale_kind;
      parallel_rows(p.n, 64, [&](int64_t n0, int64_t n1) { tk::dequantize_rows(L, outp, n0, n1); });
    });
  }
  const char* name() const override { return "TernaryWeight"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const TernaryWeight&>(other);
    return p_ == o.p_ && unit_ == o.unit_;
  }

 private:
  TernaryParams p_;
  bool unit_;
};

mx::array ternary_weight(const mx::array& packed, const mx::array& scales,
                         const TernaryParams& p, bool unit_scales, mx::Stream s) {
  return mx::array({(int)p.n, (int)p.k}, mx::float32,
                   std::make_shared<TernaryWeight>(s, p, unit_scales), {packed, scales});
}


// The layer's parameters from its packed trits and scales, or an error naming what is wrong.
TernaryParams check_layer(const mx::array& packed, const mx::array& scales, int packing,
                          int in_features, int group_size) {
  if (packing != tk::FAST && packing != tk::COMPACT) bad("packing must be 0 (compact) or 1 (fast)");
  if (in_features < 1) bad("in_features must be positive");
  if (packed.ndim() != 2) bad("packed must be 2-D, got " + shape_str(packed));
  TernaryParams p{packing, 0, 0, packed.shape(0), in_features, false, false};
  tk_dtype(scales.dtype(), "scales");
  if (scales.ndim() != 2) bad("scales must be 2-D, got " + shape_str(scales));
  if (scales.shape(0) == 1 && scales.shape(1) == 1 && p.n != 1) {
    p.scale_kind = 0;
  } else if (scales.shape(0) == p.n && scales.shape(1) == 1) {
    p.scale_kind = 1;
  } else {
    if (group_size != 64 && group_size != 128 && group_size != 256)
      bad("scales " + shape_str(scales) + " are group scales but group_size is " +
          std::to_string(group_size) + " (expected 64, 128 or 256)");
    if (scales.shape(0) != p.n || scales.shape(1) != tk::ceil_div(in_features, group_size))
      bad("scales " + shape_str(scales) + " do not fit a (" + std::to_string(p.n) + ", " +
          std::to_string(in_features) + ") weight with group_size " + std::to_string(group_size));
    p.scale_kind = 2;
    p.group = group_size;
  }
  auto g = geometry(packing, p.n, p.k, p.group);
  const mx::Dtype want = packing == tk::FAST ? mx::uint32 : mx::uint8;
  const int64_t cols = packing == tk::FAST ? g->row_bytes / 4 : g->row_bytes;
  if (packed.dtype() != want || packed.shape(1) != cols)
    bad("packed " + shape_str(packed) + " is not the " +
        std::string(packing == tk::FAST ? "fast (N, Kp/16) uint32" : "compact (N, row_bytes) uint8") +
        " layout of in_features " + std::to_string(in_features) + " (expected " +
        std::to_string(cols) + " columns)");
  return p;
}

constexpr int ACT_Q8K = -1;  // activation_bits code of llama.cpp's Q8_K blocks (q8k.h)

bool q8k_supported(int packing, int in_features, int group_size) {
  if (packing != tk::FAST && packing != tk::COMPACT) bad("packing must be 0 or 1");
  if (in_features < 1) bad("in_features must be positive");
  return geometry(packing, 1, in_features, group_size)->q8k_ok;
}

mx::array ternary_matmul(const mx::array& x, const mx::array& packed, const mx::array& scales,
                         const std::optional<mx::array>& bias, int packing, int in_features,
                         int group_size, int activation_bits) {
  TernaryParams p = check_layer(packed, scales, packing, in_features, group_size);
  if (activation_bits != 0 && activation_bits != 8 && activation_bits != ACT_Q8K)
    bad("activation_bits must be 0, 8 or ACT_Q8K (" + std::to_string(ACT_Q8K) + ")");
  p.act_quant = activation_bits != 0;
  p.q8k = activation_bits == ACT_Q8K;
  if (p.q8k && !geometry(packing, p.n, p.k, p.group)->q8k_ok)
    bad("q8k activations need steps inside one 256-column block (see q8k_supported)");
  if (x.ndim() < 1 || x.shape(-1) != in_features)
    bad("x of shape " + shape_str(x) + " does not end in in_features " + std::to_string(in_features));
  tk_dtype(x.dtype(), "x");
  std::vector<mx::array> inputs{x, packed, scales};
  if (bias) {
    tk_dtype(bias->dtype(), "bias");
    if (bias->ndim() != 1 || bias->shape(0) != p.n)
      bad("bias " + shape_str(*bias) + " must have shape (" + std::to_string(p.n) + ",)");
    p.has_bias = true;
    inputs.push_back(*bias);
  }
  auto shape = x.shape();
  shape.back() = (int)p.n;
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, x.dtype(), std::make_shared<TernaryMatmul>(s, p), std::move(inputs));
}

mx::array ternary_weight_op(const mx::array& packed, const mx::array& scales, int packing,
                            int in_features, int group_size) {
  TernaryParams p = check_layer(packed, scales, packing, in_features, group_size);
  return ternary_weight(packed, scales, p, false, mx::default_stream(mx::Device::cpu));
}


}  // namespace mlxt
