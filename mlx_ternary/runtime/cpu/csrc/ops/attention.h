// Attention       softmax(scale q k^T [causal]) v        (kernels/attention.h)
#pragma once

#include "../arch/select.h"
#include "../kernels/attention.h"
#include <array>

#include "primitive.h"

namespace mlxt {

// ---------------------------------------------------------------------------------------------
// Attention: float32 q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D) float32 or float16; gradients come from the Python
// wrapper (the vjp of MLX's own attention), so this primitive has none.
// ---------------------------------------------------------------------------------------------

// The kernel's shape of q (B, Hq, Lq, D) against k (B, Hkv, Lk, D), output strides `os`.
inline tk::AttnShape attn_shape(const mx::array& q, const mx::array& k, float scale, bool causal,
                                std::array<int64_t, 3> os) {
  tk::AttnShape sh{q.shape(0), q.shape(1), k.shape(1), q.shape(2), k.shape(2), q.shape(3),
                   {}, {}, {}, {os[0], os[1], os[2]}, scale, causal};
  sh.kv_half = k.dtype() == mx::float16;
  return sh;
}

// A bool (B, Hq, Lq, Lk) mask as the kernel's view, broadcast dimensions at stride 0.
inline void mask_view(const mx::array& mask, tk::AttnShape& sh) {
  sh.mask = mask.data<bool>();
  for (int d = 0; d < 4; d++) sh.ms[d] = mask.shape(d) == 1 ? 0 : mask.strides()[d];
}

// A (B, H, L, D) array's data with rows of D contiguous (copied only if they are not), and
// its element strides of dims 0..2.
inline const void* attn_view(const mx::array& a, std::vector<uint8_t>& keep, int64_t* st) {
  const bool last = a.strides()[3] == 1;
  const void* p = last ? a.data<void>() : row_major(a, keep);
  for (int d = 0; d < 3; d++) {
    int64_t contiguous = 1;
    for (int e = d + 1; e < 4; e++) contiguous *= a.shape(e);
    st[d] = last ? a.strides()[d] : contiguous;
  }
  return p;
}

// Float32 queries; keys and values float32, or both float16 (the fused block's cache).
inline void check_attention_inputs(const mx::array& q, const mx::array& k, const mx::array& v,
                                   const char* what) {
  for (auto* a : {&q, &k, &v})
    if (a->ndim() != 4) bad(std::string(what) + " takes (B, H, L, D) arrays, got " + shape_str(*a));
  if (q.dtype() != mx::float32) bad(std::string(what) + ": q must be float32");
  if (k.dtype() != v.dtype() || (k.dtype() != mx::float32 && k.dtype() != mx::float16))
    bad(std::string(what) + ": k and v must be both float32 or both float16");
  if (k.shape() != v.shape() || q.shape(0) != k.shape(0) || q.shape(3) != k.shape(3) ||
      k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0)
    bad(std::string(what) + ": q " + shape_str(q) + " does not fit k/v " + shape_str(k) + ", " +
        shape_str(v) + " (same batch and head size, query heads a multiple of kv heads)");
}

class Attention : public CpuPrimitive {
 public:
  Attention(mx::Stream s, float scale, bool causal) : CpuPrimitive(s), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = enqueue(stream(), in, out);
    const bool masked = in.size() > 3;
    enc.dispatch([q = in[0], k = in[1], v = in[2], mask = masked ? in[3] : in[0], masked,
                  outp = out.data<float>(), scale = scale_, causal = causal_]() {
      const int64_t H = q.shape(1), L = q.shape(2), D = q.shape(3);
      tk::AttnShape sh = attn_shape(q, k, scale, causal, {H * L * D, L * D, D});
      if (masked) mask_view(mask, sh);
      std::vector<uint8_t> kq, kk, kv;
      const float* qp = (const float*)attn_view(q, kq, sh.qs);
      const void* kp = attn_view(k, kk, sh.ks);
      const void* vp = attn_view(v, kv, sh.vs);
      tk::attention<tk::NativeOps>(sh, qp, kp, vp, outp, [](int64_t n, const auto& f) {
        pool().parallel_for(n, f);
      });
    });
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }
  const char* name() const override { return "NativeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Attention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_;
  }

 private:
  float scale_;
  bool causal_;
};


mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    bool causal, std::optional<mx::array> mask) {
  check_attention_inputs(q, k, v, "attention");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{q, k, v};
  if (mask) {
    if (mask->dtype() != mx::bool_ || mask->ndim() > 4)
      bad("attention: the mask must be a bool array of at most 4 dimensions, got " +
          shape_str(*mask));
    mx::Shape full{q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
    inputs.push_back(mx::broadcast_to(*mask, full, s));  // raises if it does not broadcast
  }
  return mx::array(q.shape(), mx::float32, std::make_shared<Attention>(s, scale, causal),
                   std::move(inputs));
}


}  // namespace mlxt
