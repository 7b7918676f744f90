// SwiGLU          silu(g) * x, float32                   (kernels/activation.h)
#pragma once

#include "../kernels/activation.h"
#include "primitive.h"

namespace mlxt {

// ---------------------------------------------------------------------------------------------
// SwiGLU: silu(g) * x for float32 arrays of one shape; gradients from the Python wrapper
// ---------------------------------------------------------------------------------------------

class SwiGLU : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = enqueue(stream(), in, out);
    enc.dispatch([g = in[0], x = in[1], outp = out.data<float>()]() {
      std::vector<uint8_t> kg, kx;
      const float* gp = (const float*)row_major(g, kg);
      const float* xp = (const float*)row_major(x, kx);
      parallel_rows((int64_t)g.size(), 1 << 14, [&](int64_t i0, int64_t i1) {
        tk::silu_mul(gp, xp, outp, i0, i1);
      });
    });
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }
  const char* name() const override { return "NativeSwiGLU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};


mx::array swiglu(const mx::array& g, const mx::array& x) {
  if (g.dtype() != mx::float32 || x.dtype() != mx::float32 || g.shape() != x.shape())
    bad("swiglu takes two float32 arrays of one shape, got " + shape_str(g) + " and " +
        shape_str(x));
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(g.shape(), mx::float32, std::make_shared<SwiGLU>(s), std::vector<mx::array>{g, x});
}


}  // namespace mlxt
