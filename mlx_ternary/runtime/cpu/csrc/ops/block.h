// A llama-family decoder block in three native ops (runtime/cpu/block.py routes mlx-lm's
// blocks here), over ops/ternary.h's layers:
//
//   AttnIn   x -> q, k, v in (B, H, L, D), RoPE applied: RMSNorm, one activation preparation
//            shared by the three projections, their rows in one parallel_for, [qwen3's
//            per-head q/k RMSNorm], RoPE
//   AttnOut  q, keys, values -> [residual +] o_proj(attention): the native attention, the
//            (B, H, L, D) -> (B, L, H D) transpose, o_proj's activations, its rows
//   Mlp      h -> [residual +] down(silu(gate(n)) * up(n)), n = RMSNorm(h): gate and up share
//            one activation preparation and one parallel_for
//
// The KV cache update stays mlx-lm's (between AttnIn and AttnOut), so every cache it has
// keeps working. Each step computes what MLX's CPU ops compute, in their order and float32
// rounding: RMSNorm as MLX's fallback (x * (1 / sqrt(sum(x * x) * (1 / K) + eps))) * w with a
// sequential sum, RoPE as mx.fast.rope's fallback with MLX's own sin/cos/exp (its simd
// header), the projections, the attention and SwiGLU as the native ops of the unfused path -
// so a fused block gives the unfused one's bits. Float32 only. The vjps are those of MLX's own
// ops composing the same function (`reference_vjp`; the layers' straight-through vjp), so a
// gradient through a fused block is the unfused block's; block.py keeps training on mlx-lm's
// path anyway.
#pragma once

#include <functional>

#include "mlx/backend/cpu/simd/simd.h"  // MLX's own sin/cos/exp (the RoPE)

#include "../arch/select.h"
#include "../kernels/activation.h"
#include "../kernels/attention.h"
#include "../kernels/ternary.h"
#include "attention.h"
#include "primitive.h"
#include "ternary.h"

namespace mlxt {

// ---- shared pieces ---------------------------------------------------------------------------

// MLX's CPU RMSNorm (the fallback of mx.fast.rms_norm): rows [m0, m1) of (M, K) x. Each row's
// sum of squares is one sequential float32 chain (MLX's order); RMS_ROWS rows run their chains
// side by side (the adds' latency, not their throughput, bounds one chain: a 6912-wide
// sub-norm is ~21 k cycles a row alone), each row's operations and their order unchanged.
constexpr int RMS_ROWS = 8;  // rms_norm_rows' switch names each count below it
inline void rms_norm_rows(const float* x, const float* w, float eps, int64_t K, float* out,
                          int64_t m0, int64_t m1) {
  const float inv_n = (float)(1.0 / (double)K);
  for (int64_t m = m0; m < m1; m += RMS_ROWS) {
    const int rows = (int)std::min<int64_t>(RMS_ROWS, m1 - m);
    float s[RMS_ROWS] = {};
    auto sums = [&](auto nrows) {
      for (int64_t i = 0; i < K; i++)
        for (int j = 0; j < (int)nrows; j++) {
          const float v = x[(m + j) * K + i];
          s[j] = s[j] + v * v;
        }
    };
    // a constant count for every group, so the sums stay in registers: a runtime count kept
    // them in memory, a store-to-load round trip per add (a decode token's 1 row: ~3x slower)
    switch (rows) {
      case 1: sums(std::integral_constant<int, 1>{}); break;
      case 2: sums(std::integral_constant<int, 2>{}); break;
      case 3: sums(std::integral_constant<int, 3>{}); break;
      case 4: sums(std::integral_constant<int, 4>{}); break;
      case 5: sums(std::integral_constant<int, 5>{}); break;
      case 6: sums(std::integral_constant<int, 6>{}); break;
      case 7: sums(std::integral_constant<int, 7>{}); break;
      default: sums(std::integral_constant<int, RMS_ROWS>{});
    }
    for (int j = 0; j < rows; j++) {
      const float* xr = x + (m + j) * K;
      float* o = out + (m + j) * K;
      const float r = 1.f / std::sqrt(s[j] * inv_n + eps);
      for (int64_t i = 0; i < K; i++) o[i] = (xr[i] * r) * w[i];
    }
  }
}

// One ternary projection of a fused op: its parameters and where its arrays are in `in`.
struct Proj {
  TernaryParams p;
  int packed = -1, scales = -1, bias = -1;
};

// The arrays a projection reads, row-major (copied only if strided), as a tk::Layer.
struct BoundLayer {
  std::shared_ptr<const tk::Geometry> g;
  std::vector<uint8_t> kw, ks, kb;
  std::unique_ptr<tk::Layer> L;
  void bind(const Proj& pr, const std::vector<mx::array>& in, float* out) {
    g = geometry(pr.p.packing, pr.p.n, pr.p.k, pr.p.group);
    L = std::make_unique<tk::Layer>(*g);
    L->w = (const uint8_t*)row_major(in[pr.packed], kw);
    L->scales = row_major(in[pr.scales], ks);
    L->scale_dtype = tk_dtype(in[pr.scales].dtype(), "scales");
    L->scale_kind = pr.p.scale_kind;
    if (pr.bias >= 0)
      L->bias = row_major(in[pr.bias], kb), L->bias_dtype = tk_dtype(in[pr.bias].dtype(), "bias");
    L->act_quant = pr.p.act_quant;
    L->q8k = pr.p.q8k;
    L->out = out;
    L->out_dtype = tk::F32;
  }
};

// The rows of several layers sharing one activation preparation, in one parallel_for:
// each layer's rows in the chunks of a layer alone (row_chunk), the layers in turn.
inline void rows_of_layers(const std::vector<BoundLayer*>& ls, const tk::Acts& a, int64_t M) {
  std::vector<int64_t> start{0}, chunk;
  for (auto* l : ls) {
    chunk.push_back(row_chunk(*l->g, l->L->q8k, M));
    start.push_back(start.back() + tk::ceil_div(l->g->n, chunk.back()));
  }
  pool().parallel_for(start.back(), [&](int64_t c) {
    size_t i = 0;
    while (c >= start[i + 1]) i++;
    const int64_t n0 = (c - start[i]) * chunk[i], n1 = std::min(ls[i]->g->n, n0 + chunk[i]);
    tk::rows_dispatch<tk::NativeOps>(*ls[i]->L, a, M, n0, n1);
  });
}

// Tokens [0, M) of a per-token step, across the pool when there are enough of them.
template <class F>
void per_token(int64_t M, const F& f) {
  if (M < 8) return f(0, M);
  parallel_rows(M, RMS_ROWS, f);  // whole groups of rms_norm_rows' rows
}

// Projections given as lists (packed, scales, bias) with shared geometry settings; appends
// their arrays to `inputs` and returns their descriptions.
std::vector<Proj> check_projs(const std::vector<mx::array>& packed,
                              const std::vector<mx::array>& scales,
                              const std::vector<std::optional<mx::array>>& bias, int packing,
                              int in_features, int group_size, int activation_bits,
                              std::vector<mx::array>& inputs, const char* what) {
  if (packed.size() != scales.size() || packed.size() != bias.size())
    bad(std::string(what) + ": packed, scales and bias must be lists of one length");
  if (activation_bits != 0 && activation_bits != 8 && activation_bits != ACT_Q8K)
    bad("activation_bits must be 0, 8 or ACT_Q8K (" + std::to_string(ACT_Q8K) + ")");
  std::vector<Proj> out;
  for (size_t i = 0; i < packed.size(); i++) {
    Proj pr;
    pr.p = check_layer(packed[i], scales[i], packing, in_features, group_size);
    pr.p.act_quant = activation_bits != 0;
    pr.p.q8k = activation_bits == ACT_Q8K;
    if (pr.p.q8k && !geometry(packing, pr.p.n, pr.p.k, pr.p.group)->q8k_ok)
      bad("q8k activations need steps inside one 256-column block (see q8k_supported)");
    if (i > 0 && pr.p.group != out[0].p.group)
      bad(std::string(what) + ": the projections must share one scale group size");
    pr.packed = (int)inputs.size(), inputs.push_back(packed[i]);
    pr.scales = (int)inputs.size(), inputs.push_back(scales[i]);
    if (bias[i]) {
      tk_dtype(bias[i]->dtype(), "bias");
      if (bias[i]->ndim() != 1 || bias[i]->shape(0) != pr.p.n)
        bad("bias " + shape_str(*bias[i]) + " must have shape (" + std::to_string(pr.p.n) + ",)");
      pr.p.has_bias = true;
      pr.bias = (int)inputs.size(), inputs.push_back(*bias[i]);
    }
    out.push_back(pr);
  }
  return out;
}

void check_f32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32) bad(std::string(what) + " must be float32");
}

// A projection as the (differentiable) TernaryMatmul primitive, for the reference graphs.
mx::array ternary_ref(const mx::array& x, const Proj& pr, const std::vector<mx::array>& in,
                      mx::Stream s) {
  std::vector<mx::array> li{x, in[pr.packed], in[pr.scales]};
  if (pr.bias >= 0) li.push_back(in[pr.bias]);
  auto shape = x.shape();
  shape.back() = (int)pr.p.n;
  return mx::array(shape, mx::float32, std::make_shared<TernaryMatmul>(s, pr.p), std::move(li));
}

// The vjp of a fused op: that of `reference` (MLX ops computing the same outputs from the
// same inputs) with respect to the float inputs in argnums; integer inputs (packed trits,
// offsets) and the inputs in `fixed` get zeros.
std::vector<mx::array> reference_vjp(
    const std::function<std::vector<mx::array>(const std::vector<mx::array>&)>& reference,
    const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums, const std::vector<int>& fixed = {}) {
  std::vector<int> vary;
  std::vector<mx::array> args;
  for (int a : argnums)
    if (mx::issubdtype(primals[a].dtype(), mx::floating) &&
        std::find(fixed.begin(), fixed.end(), a) == fixed.end())
      vary.push_back(a), args.push_back(primals[a]);
  std::vector<mx::array> grads;
  if (!args.empty()) {
    auto fn = [&](const std::vector<mx::array>& v) {
      std::vector<mx::array> in = primals;
      for (size_t i = 0; i < vary.size(); i++) in[vary[i]] = v[i];
      return reference(in);
    };
    grads = mx::vjp(fn, args, cotangents).second;
  }
  std::vector<mx::array> out;
  for (int a : argnums) {
    auto it = std::find(vary.begin(), vary.end(), a);
    out.push_back(it == vary.end() ? mx::zeros_like(primals[a]) : grads[it - vary.begin()]);
  }
  return out;
}


// ---- AttnIn ------------------------------------------------------------------------------------

struct RopeParams {
  int dims = 0;
  bool traditional = false;
  float base = 10000.f, scale = 1.f;
  bool has_freqs = false;
  int offset = 0;           // when there is no offsets array
  bool has_offsets = false;
};

struct AttnInParams {
  float eps, qk_eps = 0.f;
  int64_t hq, hkv, d;
  RopeParams rope;
  int x = 0, w = 1, freqs = -1, offsets = -1, q_norm = -1, k_norm = -1;  // qwen3: per-head norms
  bool kv_half = false;     // k and v out as float16 (rounded to nearest even, as astype)
  std::vector<Proj> projs;  // q, k, v
};

// mx.fast.rope's fallback: inverse frequencies 1 / freqs, or exp(-j * (log(base) / half)).
inline void rope_inv_freqs(const RopeParams& r, const float* freqs, float* inv) {
  const int half = r.dims / 2;
  const float c = std::log(r.base) / half;
  for (int j = 0; j < half; j++) {
    if (freqs) inv[j] = 1.f / freqs[j];
    else inv[j] = mx::simd::exp(mx::simd::Simd<float, 1>((float)(-j) * c)).value;
  }
}

// Head row `src` (D floats) -> `dst`, rotated at position `pos` (theta_j = pos * inv[j]).
inline void rope_row(const RopeParams& r, const float* cs, const float* sn, const float* src,
                     float* dst, int64_t D) {
  const int half = r.dims / 2;
  for (int j = 0; j < half; j++) {
    const int i1 = r.traditional ? 2 * j : j, i2 = r.traditional ? 2 * j + 1 : j + half;
    const float x1 = src[i1], x2 = src[i2];
    dst[i1] = x1 * cs[j] - x2 * sn[j];
    dst[i2] = x1 * sn[j] + x2 * cs[j];
  }
  for (int64_t i = r.dims; i < D; i++) dst[i] = src[i];
}

class AttnIn : public CpuMultiPrimitive {
 public:
  AttnIn(mx::Stream s, AttnInParams p) : CpuMultiPrimitive(s), p_(std::move(p)) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    auto& enc = enqueue(stream(), in, outs);
    std::vector<void*> op;
    for (auto& o : outs) op.push_back(o.data<void>());
    enc.dispatch([p = p_, in, op]() {
      std::vector<uint8_t> kx, kw, kf, ko, kqn, kkn;
      const mx::array& x = in[p.x];
      const float* xp = (const float*)row_major(x, kx);
      const float* wp = (const float*)row_major(in[p.w], kw);
      const int64_t B = x.shape(0), L = x.shape(1), K = x.shape(2), M = B * L, D = p.d;
      // per-thread scratch, named through references: a thread_local named inside a lambda
      // that a worker runs would be the worker's own
      thread_local std::vector<float> normed_tl, buf_tl[3];
      thread_local tk::Acts acts_tl;
      auto& normed = normed_tl;
      auto* buf = buf_tl;
      tk::Acts& acts = acts_tl;
      normed.resize(M * K);
      per_token(M, [&](int64_t m0, int64_t m1) { rms_norm_rows(xp, wp, p.eps, K, normed.data(), m0, m1); });
      BoundLayer ls[3];
      for (int i = 0; i < 3; i++) {
        buf[i].resize(M * p.projs[i].p.n);
        ls[i].bind(p.projs[i], in, buf[i].data());
      }
      prepare_acts(*ls[0].g, p.projs[0].p, normed.data(), tk::F32, M, acts);
      rows_of_layers({&ls[0], &ls[1], &ls[2]}, acts, M);
      // RoPE (q, k) and the (B, L, H, D) -> (B, H, L, D) layout (q, k, v)
      const RopeParams& r = p.rope;
      const int half = r.dims / 2;
      std::vector<float> inv(half);
      rope_inv_freqs(r, p.freqs >= 0 ? (const float*)row_major(in[p.freqs], kf) : nullptr,
                     inv.data());
      const int32_t* offs = p.offsets >= 0 ? (const int32_t*)row_major(in[p.offsets], ko) : nullptr;
      const int64_t noffs = p.offsets >= 0 ? (int64_t)in[p.offsets].size() : 0;
      const float* qk_norm[2] = {
          p.q_norm >= 0 ? (const float*)row_major(in[p.q_norm], kqn) : nullptr,
          p.k_norm >= 0 ? (const float*)row_major(in[p.k_norm], kkn) : nullptr};
      per_token(M, [&](int64_t m0, int64_t m1) {
        std::vector<float> cs(half), sn(half), head(D), row(D);
        for (int64_t m = m0; m < m1; m++) {
          const int64_t b = m / L, l = m % L;
          const int32_t off = offs ? offs[noffs == 1 ? 0 : b] : r.offset;
          const float pos = ((float)l + (float)off) * r.scale;
          for (int j = 0; j < half; j++) {
            const float theta = pos * inv[j];
            cs[j] = mx::simd::cos(mx::simd::Simd<float, 1>(theta)).value;
            sn[j] = mx::simd::sin(mx::simd::Simd<float, 1>(theta)).value;
          }
          for (int i = 0; i < 3; i++) {
            const int64_t H = i == 0 ? p.hq : p.hkv;
            for (int64_t h = 0; h < H; h++) {
              const float* src = buf[i].data() + m * H * D + h * D;
              const int64_t at = ((b * H + h) * L + l) * D;
              const bool half_out = i > 0 && p.kv_half;
              float* dst = half_out ? row.data() : (float*)op[i] + at;
              if (i < 2 && qk_norm[i]) {  // qwen3's q_norm / k_norm: RMSNorm of each head
                rms_norm_rows(src, qk_norm[i], p.qk_eps, D, head.data(), 0, 1);
                src = head.data();
              }
              if (i < 2) rope_row(r, cs.data(), sn.data(), src, dst, D);
              else std::memcpy(dst, src, D * sizeof(float));
              if (half_out)
                for (int64_t d = 0; d < D; d++) ((uint16_t*)op[i])[at + d] = tk::f32_to_f16(row[d]);
            }
          }
        }
      });
    });
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    const auto& x = in[p_.x];
    const int B = x.shape(0), L = x.shape(1), D = (int)p_.d;
    return {{B, (int)p_.hq, L, D}, {B, (int)p_.hkv, L, D}, {B, (int)p_.hkv, L, D}};
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>&) override {
    auto s = stream();
    auto reference = [p = p_, s](const std::vector<mx::array>& in) {
      const auto& x = in[p.x];
      const int B = x.shape(0), L = x.shape(1);
      auto n = mx::fast::rms_norm(x, in[p.w], p.eps, s);
      std::optional<float> base;
      std::optional<mx::array> freqs;
      if (p.freqs >= 0) freqs = in[p.freqs];
      else base = p.rope.base;
      std::vector<mx::array> outs;
      for (int i = 0; i < 3; i++) {
        const int H = (int)(i == 0 ? p.hq : p.hkv);
        auto y = mx::reshape(ternary_ref(n, p.projs[i], in, s), {B, L, H, (int)p.d}, s);
        if (i < 2 && p.q_norm >= 0)
          y = mx::fast::rms_norm(y, in[i == 0 ? p.q_norm : p.k_norm], p.qk_eps, s);
        y = mx::transpose(y, {0, 2, 1, 3}, s);
        if (i < 2)
          y = p.offsets >= 0 ? mx::fast::rope(y, p.rope.dims, p.rope.traditional, base,
                                              p.rope.scale, in[p.offsets], freqs, s)
                             : mx::fast::rope(y, p.rope.dims, p.rope.traditional, base,
                                              p.rope.scale, p.rope.offset, freqs, s);
        if (i > 0 && p.kv_half) y = mx::astype(y, mx::float16, s);
        outs.push_back(y);
      }
      return outs;
    };
    return reference_vjp(reference, primals, cotangents, argnums, {p_.freqs});
  }
  const char* name() const override { return "FusedAttnIn"; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }

 private:
  AttnInParams p_;
};

// ---- AttnOut -----------------------------------------------------------------------------------

// How attn_out and mlp end: x (M x K) through bitnet's sub-norm in place (sub_norm >= 0:
// attn_sub_norm, ffn_sub_norm), then `proj`'s rows into out, plus the residual if any.
inline void project_out(const std::vector<mx::array>& in, float* x, int64_t M, int64_t K,
                        int sub_norm, float sub_eps, const Proj& proj, int residual, float* out,
                        tk::Acts& acts) {
  std::vector<uint8_t> ksn, kr;
  if (sub_norm >= 0) {
    const float* w = (const float*)row_major(in[sub_norm], ksn);
    per_token(M, [&](int64_t m0, int64_t m1) { rms_norm_rows(x, w, sub_eps, K, x, m0, m1); });
  }
  BoundLayer l;
  l.bind(proj, in, out);
  prepare_acts(*l.g, proj.p, x, tk::F32, M, acts);
  rows_of_layers({&l}, acts, M);
  if (residual >= 0) {
    const float* rp = (const float*)row_major(in[residual], kr);
    const int64_t n = M * proj.p.n;
    for (int64_t i = 0; i < n; i++) out[i] = rp[i] + out[i];
  }
}

struct AttnOutParams {
  float scale;
  bool causal;
  float sub_eps = 0.f;
  int q = 0, k = 1, v = 2, mask = -1, residual = -1, sub_norm = -1;  // bitnet: attn_sub_norm
  Proj o;
};

class AttnOut : public CpuPrimitive {
 public:
  AttnOut(mx::Stream s, AttnOutParams p) : CpuPrimitive(s), p_(std::move(p)) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = enqueue(stream(), in, out);
    enc.dispatch([p = p_, in, outp = out.data<float>()]() {
      const mx::array &q = in[p.q], &k = in[p.k], &v = in[p.v];
      std::vector<uint8_t> kq, kk, kv;
      const int64_t B = q.shape(0), H = q.shape(1), L = q.shape(2), D = q.shape(3);
      const int64_t M = B * L, HD = H * D;
      // the attention straight into the token layout (B, L, H D) o_proj reads
      tk::AttnShape sh = attn_shape(q, k, p.scale, p.causal, {L * HD, D, HD});
      if (p.mask >= 0) mask_view(in[p.mask], sh);
      const float* qp = (const float*)attn_view(q, kq, sh.qs);
      const void* kp = attn_view(k, kk, sh.ks);
      const void* vp = attn_view(v, kv, sh.vs);
      thread_local std::vector<float> tok_tl;
      thread_local tk::Acts acts_tl;
      auto& tok = tok_tl;
      tk::Acts& acts = acts_tl;
      tok.resize(M * HD);
      tk::attention<tk::NativeOps>(sh, qp, kp, vp, tok.data(), [](int64_t n, const auto& f) {
        pool().parallel_for(n, f);
      });
      project_out(in, tok.data(), M, HD, p.sub_norm, p.sub_eps, p.o, p.residual, outp, acts);
    });
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    const auto& q = in[p_.q];
    return {{q.shape(0), q.shape(2), (int)p_.o.p.n}};
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>&) override {
    auto s = stream();
    auto reference = [p = p_, s](const std::vector<mx::array>& in) {
      const auto& q = in[p.q];
      auto att = p.mask >= 0 ? mx::fast::scaled_dot_product_attention(
                                   q, in[p.k], in[p.v], p.scale, "array", in[p.mask], {}, false, s)
                             : mx::fast::scaled_dot_product_attention(
                                   q, in[p.k], in[p.v], p.scale, p.causal ? "causal" : "", {},
                                   {}, false, s);
      att = mx::reshape(mx::transpose(att, {0, 2, 1, 3}, s), {q.shape(0), q.shape(2), -1}, s);
      if (p.sub_norm >= 0) att = mx::fast::rms_norm(att, in[p.sub_norm], p.sub_eps, s);
      auto y = ternary_ref(att, p.o, in, s);
      if (p.residual >= 0) y = mx::add(in[p.residual], y, s);
      return std::vector<mx::array>{y};
    };
    return reference_vjp(reference, primals, cotangents, argnums, {p_.mask});
  }
  const char* name() const override { return "FusedAttnOut"; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }

 private:
  AttnOutParams p_;
};

// ---- Mlp ---------------------------------------------------------------------------------------

// The gated MLP's activation: silu(gate) * up (llama) or relu(gate)^2 * up (bitnet's relu2)
enum MlpAct { ACT_SILU = 0, ACT_RELU2 = 1 };

struct MlpParams {
  float eps, sub_eps = 0.f;
  int act = ACT_SILU;
  int h = 0, w = 1, residual = -1, sub_norm = -1;  // bitnet: ffn_sub_norm before down
  std::vector<Proj> gate_up;  // gate, up
  Proj down;
};

class Mlp : public CpuPrimitive {
 public:
  Mlp(mx::Stream s, MlpParams p) : CpuPrimitive(s), p_(std::move(p)) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = enqueue(stream(), in, out);
    enc.dispatch([p = p_, in, outp = out.data<float>()]() {
      std::vector<uint8_t> kh, kw;
      const mx::array& h = in[p.h];
      const float* hp = (const float*)row_major(h, kh);
      const float* wp = (const float*)row_major(in[p.w], kw);
      const int64_t K = h.shape(-1), M = (int64_t)(h.size() / K), F = p.gate_up[0].p.n;
      thread_local std::vector<float> normed_tl, g_tl, u_tl;
      thread_local tk::Acts acts_tl;
      auto& normed = normed_tl;
      auto& g = g_tl;
      auto& u = u_tl;
      tk::Acts& acts = acts_tl;
      normed.resize(M * K);
      g.resize(M * F);
      u.resize(M * F);
      per_token(M, [&](int64_t m0, int64_t m1) { rms_norm_rows(hp, wp, p.eps, K, normed.data(), m0, m1); });
      BoundLayer lg, lu;
      lg.bind(p.gate_up[0], in, g.data());
      lu.bind(p.gate_up[1], in, u.data());
      prepare_acts(*lg.g, p.gate_up[0].p, normed.data(), tk::F32, M, acts);
      rows_of_layers({&lg, &lu}, acts, M);
      // act(gate) * up, in place into g (the native SwiGLU's chunks); relu2 as mlx-lm's
      // bitnet MLP: square(maximum(g, 0)) * up
      parallel_rows(M * F, 1 << 14, [&](int64_t i0, int64_t i1) {
        if (p.act == ACT_SILU) return tk::silu_mul(g.data(), u.data(), g.data(), i0, i1);
        float *gp = g.data(), *up = u.data();
        for (int64_t i = i0; i < i1; i++) {
          const float r = std::max(gp[i], 0.f);
          gp[i] = (r * r) * up[i];
        }
      });
      project_out(in, g.data(), M, F, p.sub_norm, p.sub_eps, p.down, p.residual, outp, acts);
    });
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    auto shape = in[p_.h].shape();
    shape.back() = (int)p_.down.p.n;
    return {shape};
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>&) override {
    auto s = stream();
    auto reference = [p = p_, s](const std::vector<mx::array>& in) {
      auto n = mx::fast::rms_norm(in[p.h], in[p.w], p.eps, s);
      auto g = ternary_ref(n, p.gate_up[0], in, s), u = ternary_ref(n, p.gate_up[1], in, s);
      auto a = p.act == ACT_SILU ? mx::multiply(g, mx::sigmoid(g, s), s)
                                 : mx::square(mx::maximum(g, mx::array(0.f), s), s);
      a = mx::multiply(a, u, s);
      if (p.sub_norm >= 0) a = mx::fast::rms_norm(a, in[p.sub_norm], p.sub_eps, s);
      auto y = ternary_ref(a, p.down, in, s);
      if (p.residual >= 0) y = mx::add(in[p.residual], y, s);
      return std::vector<mx::array>{y};
    };
    return reference_vjp(reference, primals, cotangents, argnums);
  }
  const char* name() const override { return "FusedMlp"; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }

 private:
  MlpParams p_;
};

// ---- ops ---------------------------------------------------------------------------------------

std::vector<mx::array> attn_in(const mx::array& x, const mx::array& norm_w, float eps,
                               const std::vector<mx::array>& packed,
                               const std::vector<mx::array>& scales,
                               const std::vector<std::optional<mx::array>>& bias, int packing,
                               int in_features, int group_size, int activation_bits, int n_heads,
                               int n_kv_heads, int head_dim, int rope_dims, bool traditional,
                               std::optional<float> base, float rope_scale,
                               std::optional<mx::array> freqs, int offset,
                               std::optional<mx::array> offsets,
                               std::optional<mx::array> q_norm_w,
                               std::optional<mx::array> k_norm_w, float qk_eps, bool kv_half) {
  if (x.ndim() != 3 || x.shape(2) != in_features) bad("attn_in: x must be (B, L, in_features)");
  check_f32(x, "attn_in: x");
  check_f32(norm_w, "attn_in: the norm weight");
  if (norm_w.ndim() != 1 || norm_w.shape(0) != in_features)
    bad("attn_in: the norm weight must have shape (in_features,)");
  if (packed.size() != 3) bad("attn_in takes three projections (q, k, v)");
  AttnInParams p;
  p.eps = eps, p.hq = n_heads, p.hkv = n_kv_heads, p.d = head_dim;
  std::vector<mx::array> inputs{x, norm_w};
  p.projs = check_projs(packed, scales, bias, packing, in_features, group_size, activation_bits,
                        inputs, "attn_in");
  if (p.projs[0].p.n != (int64_t)n_heads * head_dim ||
      p.projs[1].p.n != (int64_t)n_kv_heads * head_dim ||
      p.projs[2].p.n != (int64_t)n_kv_heads * head_dim)
    bad("attn_in: the projections do not give n_heads / n_kv_heads heads of head_dim");
  if (rope_dims <= 0 || rope_dims % 2 || rope_dims > head_dim)
    bad("attn_in: rope dims must be even, positive and at most head_dim");
  auto s = mx::default_stream(mx::Device::cpu);
  p.rope.dims = rope_dims, p.rope.traditional = traditional, p.rope.scale = rope_scale;
  if (freqs.has_value() == base.has_value()) bad("attn_in: give one of base and freqs");
  if (freqs) {
    if (freqs->ndim() != 1 || freqs->shape(0) != rope_dims / 2)
      bad("attn_in: freqs must have shape (rope_dims / 2,)");
    p.rope.has_freqs = true;
    p.freqs = (int)inputs.size(), inputs.push_back(mx::astype(*freqs, mx::float32, s));
  } else {
    p.rope.base = *base;
  }
  p.rope.offset = offset;
  if (offsets) {
    if (offsets->ndim() > 1 || (offsets->size() != 1 && offsets->size() != (size_t)x.shape(0)))
      bad("attn_in: offsets must be a scalar or have one entry per batch row");
    p.rope.has_offsets = true;
    p.offsets = (int)inputs.size(), inputs.push_back(mx::astype(*offsets, mx::int32, s));
  }
  if (q_norm_w.has_value() != k_norm_w.has_value())
    bad("attn_in: give both or neither of q_norm_w and k_norm_w");
  if (q_norm_w) {
    for (auto* w : {&*q_norm_w, &*k_norm_w}) {
      check_f32(*w, "attn_in: a head norm weight");
      if (w->ndim() != 1 || w->shape(0) != head_dim)
        bad("attn_in: the head norm weights must have shape (head_dim,)");
    }
    p.qk_eps = qk_eps;
    p.q_norm = (int)inputs.size(), inputs.push_back(*q_norm_w);
    p.k_norm = (int)inputs.size(), inputs.push_back(*k_norm_w);
  }
  const int B = x.shape(0), L = x.shape(1);
  std::vector<mx::Shape> shapes{{B, n_heads, L, head_dim}, {B, n_kv_heads, L, head_dim},
                                {B, n_kv_heads, L, head_dim}};
  p.kv_half = kv_half;
  const mx::Dtype kvt = kv_half ? mx::float16 : mx::float32;
  return mx::array::make_arrays(std::move(shapes), {mx::float32, kvt, kvt},
                                std::make_shared<AttnIn>(s, std::move(p)), inputs);
}

mx::array attn_out(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                   bool causal, std::optional<mx::array> mask, const mx::array& packed,
                   const mx::array& scales, std::optional<mx::array> bias, int packing,
                   int in_features, int group_size, int activation_bits,
                   std::optional<mx::array> residual, std::optional<mx::array> sub_norm_w,
                   float sub_eps) {
  check_attention_inputs(q, k, v, "attn_out");
  if ((int64_t)q.shape(1) * q.shape(3) != in_features)
    bad("attn_out: o_proj's in_features must be heads * head_dim");
  auto s = mx::default_stream(mx::Device::cpu);
  AttnOutParams p;
  p.scale = scale, p.causal = causal;
  std::vector<mx::array> inputs{q, k, v};
  if (mask) {
    if (mask->dtype() != mx::bool_ || mask->ndim() > 4)
      bad("attn_out: the mask must be a bool array of at most 4 dimensions");
    mx::Shape full{q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
    p.mask = (int)inputs.size(), inputs.push_back(mx::broadcast_to(*mask, full, s));
  }
  p.o = check_projs({packed}, {scales}, {bias}, packing, in_features, group_size, activation_bits,
                    inputs, "attn_out")[0];
  mx::Shape shape{q.shape(0), q.shape(2), (int)p.o.p.n};
  if (residual) {
    check_f32(*residual, "attn_out: the residual");
    if (residual->shape() != shape) bad("attn_out: the residual must have shape (B, L, out)");
    p.residual = (int)inputs.size(), inputs.push_back(*residual);
  }
  if (sub_norm_w) {
    check_f32(*sub_norm_w, "attn_out: the sub-norm weight");
    if (sub_norm_w->ndim() != 1 || sub_norm_w->shape(0) != in_features)
      bad("attn_out: the sub-norm weight must have shape (in_features,)");
    p.sub_eps = sub_eps;
    p.sub_norm = (int)inputs.size(), inputs.push_back(*sub_norm_w);
  }
  return mx::array(shape, mx::float32, std::make_shared<AttnOut>(s, std::move(p)),
                   std::move(inputs));
}

mx::array mlp(const mx::array& h, const mx::array& norm_w, float eps,
              const std::vector<mx::array>& packed, const std::vector<mx::array>& scales,
              const std::vector<std::optional<mx::array>>& bias, int packing, int in_features,
              int group_size, int activation_bits, const mx::array& down_packed,
              const mx::array& down_scales, std::optional<mx::array> down_bias,
              int down_packing, int down_in_features, int down_group_size,
              int down_activation_bits, std::optional<mx::array> residual, int act,
              std::optional<mx::array> sub_norm_w, float sub_eps) {
  if (h.ndim() < 1 || h.shape(-1) != in_features) bad("mlp: h must end in in_features");
  if (act != ACT_SILU && act != ACT_RELU2) bad("mlp: act must be MLP_SILU or MLP_RELU2");
  check_f32(h, "mlp: h");
  check_f32(norm_w, "mlp: the norm weight");
  if (norm_w.ndim() != 1 || norm_w.shape(0) != in_features)
    bad("mlp: the norm weight must have shape (in_features,)");
  if (packed.size() != 2) bad("mlp takes two projections (gate, up) and down");
  MlpParams p;
  p.eps = eps;
  std::vector<mx::array> inputs{h, norm_w};
  p.gate_up = check_projs(packed, scales, bias, packing, in_features, group_size,
                          activation_bits, inputs, "mlp");
  if (p.gate_up[0].p.n != p.gate_up[1].p.n || p.gate_up[0].p.n != down_in_features)
    bad("mlp: gate and up must give down's in_features");
  p.down = check_projs({down_packed}, {down_scales}, {down_bias}, down_packing, down_in_features,
                       down_group_size, down_activation_bits, inputs, "mlp down")[0];
  auto shape = h.shape();
  shape.back() = (int)p.down.p.n;
  if (residual) {
    check_f32(*residual, "mlp: the residual");
    if (residual->shape() != shape) bad("mlp: the residual must have h's shape with down's out");
    p.residual = (int)inputs.size(), inputs.push_back(*residual);
  }
  p.act = act;
  if (sub_norm_w) {
    check_f32(*sub_norm_w, "mlp: the sub-norm weight");
    if (sub_norm_w->ndim() != 1 || sub_norm_w->shape(0) != down_in_features)
      bad("mlp: the sub-norm weight must have shape (down_in_features,)");
    p.sub_eps = sub_eps;
    p.sub_norm = (int)inputs.size(), inputs.push_back(*sub_norm_w);
  }
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::float32, std::make_shared<Mlp>(s, std::move(p)), std::move(inputs));
}


}  // namespace mlxt
