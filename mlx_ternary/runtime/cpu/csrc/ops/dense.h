// DenseMatmul     y = x @ W.T, W float16/bfloat16/float32 (kernels/dense.h)
#pragma once

#include "../kernels/dense.h"
#include "primitive.h"

namespace mlxt {

class DenseMatmul : public CpuPrimitive {
 public:
  explicit DenseMatmul(mx::Stream s) : CpuPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = enqueue(stream(), in, out);
    enc.dispatch([x = in[0], w = in[1], outp = out.data<float>()]() {
      std::vector<uint8_t> kx, kw;
      tk::DenseLayer L;
      L.n = w.shape(0), L.k = w.shape(1);
      L.w = row_major(w, kw);
      L.w_dtype = tk_dtype(w.dtype(), "the weight");
      L.x = (const float*)row_major(x, kx);
      L.out = outp;
      const int64_t M = (int64_t)(x.size() / L.k);
      // chunks of 120 rows: whole tiles of every height arch/x86.h uses (4, 3, 2 rows)
      parallel_rows(L.n, 120, [&](int64_t n0, int64_t n1) { tk::dense_rows(L, M, n0, n1); });
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>&) override {
    const auto s = stream();
    const auto& x = primals[0];
    const auto& w = primals[1];
    auto g2 = mx::reshape(cotangents[0], {-1, w.shape(0)}, s);
    std::vector<mx::array> out;
    for (int arg : argnums) {
      if (arg == 0) {
        out.push_back(mx::reshape(mx::matmul(g2, mx::astype(w, mx::float32, s), s), x.shape(), s));
      } else {
        auto x2 = mx::reshape(x, {-1, w.shape(1)}, s);
        out.push_back(mx::astype(mx::matmul(mx::transpose(g2, s), x2, s), w.dtype(), s));
      }
    }
    return out;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    auto shape = in[0].shape();
    shape.back() = in[1].shape(0);
    return {shape};
  }
  const char* name() const override { return "DenseMatmul"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};


mx::array dense_matmul(const mx::array& x, const mx::array& w) {
  if (w.ndim() != 2) bad("the weight must be 2-D, got " + shape_str(w));
  tk_dtype(w.dtype(), "the weight");
  if (x.ndim() < 1 || x.shape(-1) != w.shape(1))
    bad("x of shape " + shape_str(x) + " does not match a weight of shape " + shape_str(w));
  auto s = mx::default_stream(mx::Device::cpu);
  auto xf = x.dtype() == mx::float32 ? x : mx::astype(x, mx::float32, s);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::float32, std::make_shared<DenseMatmul>(s),
                   std::vector<mx::array>{xf, w});
}


}  // namespace mlxt
