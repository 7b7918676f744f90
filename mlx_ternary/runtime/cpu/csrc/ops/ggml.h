// The MLX primitives of llama.cpp's quantized tables (kernels/kquants.h):
//
//   GgmlDequantize  (..., row_bytes) uint8 blocks -> (..., K) float32 (the embedding lookup)
//   GgmlMatmul      y = x @ W.T, W (N, row_bytes) blocks, float or llama numerics
//
// The vjp of GgmlMatmul with respect to x is g @ W (W dequantized): straight-through for the
// activation quantization of the llama numerics.

#pragma once

#include "../arch/select.h"
#include "../kernels/kquants.h"
#include "primitive.h"

namespace mlxt {

mx::array ggml_dequantize(const mx::array& blocks, int type, int k);

class GgmlDequantize : public CpuPrimitive {
 public:
  GgmlDequantize(mx::Stream s, int type, int64_t k) : CpuPrimitive(s), type_(type), k_(k) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = enqueue(stream(), in, out);
    enc.dispatch([w = in[0], type = type_, k = k_, outp = out.data<float>()]() {
      std::vector<uint8_t> kw;
      const uint8_t* wp = (const uint8_t*)row_major(w, kw);
      const int64_t rb = w.shape(-1), rows = (int64_t)(w.size() / rb);
      parallel_rows(rows, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) tk::dequantize_row(type, wp + r * rb, k, outp + r * k);
      });
    });
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    auto shape = in[0].shape();
    shape.back() = (int)k_;
    return {shape};
  }
  const char* name() const override { return "GgmlDequantize"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const GgmlDequantize&>(other);
    return type_ == o.type_ && k_ == o.k_;
  }

 private:
  int type_;
  int64_t k_;
};

class GgmlMatmul : public CpuPrimitive {
 public:
  GgmlMatmul(mx::Stream s, int type, int64_t k, bool llama)
      : CpuPrimitive(s), type_(type), k_(k), llama_(llama) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = enqueue(stream(), in, out);
    enc.dispatch([x = in[0], w = in[1], type = type_, k = k_, llama = llama_,
                  outp = out.data<float>()]() {
      std::vector<uint8_t> kx, kw;
      tk::GgmlLayer L;
      L.type = type, L.k = k, L.n = w.shape(0), L.out = outp;
      L.w = (const uint8_t*)row_major(w, kw);
      L.x = (const float*)row_major(x, kx);
      const int64_t M = (int64_t)(x.size() / k);
      thread_local tk::KActs acts_buffer;  // reused across calls on this stream thread
      tk::KActs& acts = acts_buffer;        // (a thread_local named in a lambda is per thread)
      if (llama) {
        tk::size_acts(type, M, k, acts);
        parallel_rows(M, 8, [&](int64_t m0, int64_t m1) {
          for (int64_t m = m0; m < m1; m++) tk::quantize_token_ggml(type, L.x, k, m, acts);
        });
        L.acts = &acts;
      }
      parallel_rows(L.n, 16, [&](int64_t n0, int64_t n1) {
        tk::ggml_rows<tk::KqNative>(L, llama, M, n0, n1);
      });
    });
  }
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums,
                             const std::vector<mx::array>&) override {
    const auto s = stream();
    const auto& x = primals[0];
    const auto& w = primals[1];
    std::vector<mx::array> out;
    for (int arg : argnums) {
      if (arg != 0) bad("no gradient with respect to a quantized table's blocks");
      auto g2 = mx::reshape(cotangents[0], {-1, w.shape(0)}, s);
      auto wf = ggml_dequantize(w, type_, (int)k_);
      out.push_back(mx::reshape(mx::matmul(g2, wf, s), x.shape(), s));
    }
    return out;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    auto shape = in[0].shape();
    shape.back() = in[1].shape(0);
    return {shape};
  }
  const char* name() const override { return "GgmlMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const GgmlMatmul&>(other);
    return type_ == o.type_ && k_ == o.k_ && llama_ == o.llama_;
  }

 private:
  int type_;
  int64_t k_;
  bool llama_;
};

// The row bytes of blocks for `k` columns of `type`, or an error naming what is wrong.
int64_t check_ggml(const mx::array& blocks, int type, int k, int min_ndim) {
  if (!tk::ggml_known(type)) bad("unknown ggml table type code " + std::to_string(type));
  const tk::GgmlGeom g = tk::ggml_geom(type);
  if (k < 1 || k % g.block) bad("in_features " + std::to_string(k) + " is not a multiple of " +
                                std::to_string(g.block) + " (the block of this table type)");
  const int64_t rb = (int64_t)k / g.block * g.bytes;
  if (blocks.dtype() != mx::uint8 || blocks.ndim() < min_ndim || blocks.shape(-1) != rb)
    bad("blocks " + shape_str(blocks) + " are not uint8 rows of " + std::to_string(rb) +
        " bytes (" + std::to_string(k) + " columns of this table type)");
  return rb;
}

mx::array ggml_dequantize(const mx::array& blocks, int type, int k) {
  check_ggml(blocks, type, k, 1);
  auto shape = blocks.shape();
  shape.back() = k;
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::float32, std::make_shared<GgmlDequantize>(s, type, k),
                   std::vector<mx::array>{blocks});
}

mx::array ggml_matmul(const mx::array& x, const mx::array& w, int type, int k, bool llama) {
  check_ggml(w, type, k, 2);
  if (w.ndim() != 2) bad("the table must be 2-D, got " + shape_str(w));
  if (x.ndim() < 1 || x.shape(-1) != k)
    bad("x of shape " + shape_str(x) + " does not end in in_features " + std::to_string(k));
  tk_dtype(x.dtype(), "x");
  auto s = mx::default_stream(mx::Device::cpu);
  auto xf = x.dtype() == mx::float32 ? x : mx::astype(x, mx::float32, s);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(shape, mx::float32, std::make_shared<GgmlMatmul>(s, type, k, llama),
                   std::vector<mx::array>{xf, w});
}


}  // namespace mlxt
