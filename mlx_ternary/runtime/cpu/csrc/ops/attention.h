// Attention       softmax(scale q k^T [causal]) v        (kernels/attention.h)
#pragma once

#include "../arch/select.h"
#include "../kernels/attention.h"
#include "primitive.h"

namespace mlxt {

// ---------------------------------------------------------------------------------------------
// Attention: float32 q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D); gradients come from the Python
// wrapper (the vjp of MLX's own attention), so this primitive has none.
// ---------------------------------------------------------------------------------------------

class Attention : public CpuPrimitive {
 public:
  Attention(mx::Stream s, float scale, bool causal) : CpuPrimitive(s), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = enqueue(stream(), in, out);
    const bool masked = in.size() > 3;
    enc.dispatch([q = in[0], k = in[1], v = in[2], mask = masked ? in[3] : in[0], masked,
                  outp = out.data<float>(), scale = scale_, causal = causal_]() {
      std::vector<uint8_t> kq, kk, kv;
      tk::AttnShape sh{q.shape(0), q.shape(1), k.shape(1), q.shape(2), k.shape(2), q.shape(3),
                       {}, {}, {}, scale, causal};
      if (masked) {  // a bool (B, Hq, Lq, Lk) view, broadcast dimensions at stride 0
        sh.mask = mask.data<bool>();
        for (int d = 0; d < 4; d++) sh.ms[d] = mask.shape(d) == 1 ? 0 : mask.strides()[d];
      }
      auto view = [](const mx::array& a, std::vector<uint8_t>& keep, int64_t* st) {
        const bool last = a.strides()[3] == 1;
        const float* p = last ? a.data<float>() : (const float*)row_major(a, keep);
        for (int d = 0; d < 3; d++) {
          int64_t contiguous = 1;
          for (int e = d + 1; e < 4; e++) contiguous *= a.shape(e);
          st[d] = last ? a.strides()[d] : contiguous;
        }
        return p;
      };
      const float* qp = view(q, kq, sh.qs);
      const float* kp = view(k, kk, sh.ks);
      const float* vp = view(v, kv, sh.vs);
      const int64_t qb = 8, blocks = tk::ceil_div(sh.Lq, qb);
      pool().parallel_for(sh.B * sh.Hq * blocks, [&](int64_t t) {
        thread_local std::vector<float> scores;
        scores.resize(sh.Lk);
        const int64_t bh = t / blocks, i0 = (t % blocks) * qb;
        tk::attention_rows<tk::NativeOps>(sh, qp, kp, vp, outp, bh / sh.Hq, bh % sh.Hq, i0,
                                          std::min(sh.Lq, i0 + qb), scores.data());
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
  for (auto* a : {&q, &k, &v})
    if (a->ndim() != 4 || a->dtype() != mx::float32)
      bad("attention takes float32 (B, H, L, D) arrays, got " + shape_str(*a));
  if (k.shape() != v.shape() || q.shape(0) != k.shape(0) || q.shape(3) != k.shape(3) ||
      k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0)
    bad("attention: q " + shape_str(q) + " does not fit k/v " + shape_str(k) + ", " +
        shape_str(v) + " (same batch and head size, query heads a multiple of kv heads)");
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
