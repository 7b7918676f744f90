// The native CPU backend as MLX primitives (an MLX C++ extension, bound with nanobind in MLX's
// own nanobind domain so arguments and results are mlx.core.array objects).
//
//   TernaryMatmul   y = act_quant(x) @ (s * t).T + b       (tkernels.h)
//   DenseMatmul     y = x @ W.T, W float16/bfloat16/float32 (dense.h)
//   TernaryWeight   W = s * t as float32 (N, K)            (the backward pass)
//   Attention       softmax(scale q k^T [causal]) v        (attention.h)
//   SwiGLU          silu(g) * x, float32                   (activation.h)
//   GgmlDequantize, GgmlMatmul  llama.cpp's quantized tables (ggml_ops.h, kquants.h)
//   AttnIn, AttnOut, Mlp  a llama-family decoder block in three ops (block.h)
//   LocalSum        two local ranks' all_sum over shared memory (localsum.h)
//
// eval_cpu allocates the output and enqueues the work on the stream's CPU command encoder, as
// MLX's own CPU primitives do; MLX keeps the inputs alive until the task has run. Inside the task
// the rows (and, for long prompts, the activation preparation) fork across tk::Pool.
// The vjp with respect to x is the straight-through estimator of BitNet: g @ (s * t).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <tuple>

#if defined(__linux__)
#include <sched.h>
#endif

// localsum.h
#include <chrono>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <thread>

#if defined(__linux__)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MLXT_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define MLXT_PAUSE() asm volatile("yield")
#else
#define MLXT_PAUSE() ((void)0)
#endif


#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/backend/cpu/simd/simd.h"  // MLX's own sin/cos/exp (block.h's RoPE)

#include "activation.h"
#include "attention.h"
#include "check.h"
#include "dense.h"
#include "kquants.h"
#include "threadpool.h"
#include "tkernels.h"

namespace nb = nanobind;
namespace mx = mlx::core;

#ifndef MLXT_MLX_VERSION
#error "MLXT_MLX_VERSION (the mlx version this extension is compiled against) must be defined"
#endif

namespace {

// ---------------------------------------------------------------------------------------------
// Threads, geometry cache, dtypes
// ---------------------------------------------------------------------------------------------

int default_threads() {
  if (const char* env = std::getenv("MLX_TERNARY_NUM_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

tk::Pool& pool() {
  static tk::Pool p(default_threads());
  return p;
}

std::shared_ptr<const tk::Geometry> geometry(int packing, int64_t n, int64_t k, int group) {
  static std::mutex mu;
  static std::map<std::tuple<int, int64_t, int64_t, int>, std::shared_ptr<const tk::Geometry>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_tuple(packing, n, k, group);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  auto g = std::make_shared<const tk::Geometry>(tk::make_geometry(packing, n, k, group));
  cache.emplace(key, g);
  return g;
}

int tk_dtype(mx::Dtype d, const char* what) {
  if (d == mx::float32) return tk::F32;
  if (d == mx::float16) return tk::F16;
  if (d == mx::bfloat16) return tk::BF16;
  throw std::invalid_argument(std::string("[mlx_ternary.native] ") + what +
                              " must be float32, float16 or bfloat16");
}

// A pointer to the row-major data of `a`, copying it into `keep` when `a` is strided.
const void* row_major(const mx::array& a, std::vector<uint8_t>& keep) {
  if (a.flags().row_contiguous) return a.data<uint8_t>();
  const size_t item = a.itemsize();
  keep.resize(a.size() * item);
  const uint8_t* src = a.data<uint8_t>();
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  for (size_t i = 0; i < a.size(); i++) {
    int64_t rem = (int64_t)i, loc = 0;
    for (int d = (int)shape.size() - 1; d >= 0; d--) {
      loc += (rem % shape[d]) * strides[d];
      rem /= shape[d];
    }
    std::memcpy(keep.data() + i * item, src + loc * item, item);
  }
  return keep.data();
}

// Row chunks across the pool, claimed dynamically: noisy shared cores balance themselves.
template <class F>
void parallel_rows(int64_t n, int64_t chunk, const F& f) {
  const int64_t nchunks = tk::ceil_div(n, chunk);
  pool().parallel_for(nchunks, [&](int64_t c) { f(c * chunk, std::min(n, (c + 1) * chunk)); });
}

// Rows per chunk of a ternary layer: 16 from TOKEN_TILE tokens on (the token tiles pass over
// a chunk's rows while they sit in L1); for decode, about 8 chunks per thread in multiples of
// 16: fewer claims, and the row kernels prefetch the next rows of their own chunk.
int64_t row_chunk(int64_t n, int64_t M) {
  if (M >= tk::TOKEN_TILE) return 16;
  const int64_t want = tk::ceil_div(n, 8 * (int64_t)pool().size());
  return std::max<int64_t>(16, tk::ceil_div(want, 16) * 16);
}

// ---------------------------------------------------------------------------------------------
// TernaryMatmul
// ---------------------------------------------------------------------------------------------

// The primitives run on the CPU only (the Metal and reference paths serve GPUs).
class CpuPrimitive : public mx::UnaryPrimitive {
 public:
  using mx::UnaryPrimitive::UnaryPrimitive;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(std::string("[mlx_ternary.native] ") + name() +
                             " runs on the CPU only");
  }
};

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
      std::vector<float> tmp(tk::q8k_tmp_floats(p.k));
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
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
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
      parallel_rows(p.n, row_chunk(p.n, M), [&](int64_t n0, int64_t n1) {
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
        if (p_.q8k)
          throw std::invalid_argument(
              "[mlx_ternary.native] no gradient with respect to the scales with q8k activations");
        out.push_back(scale_grad(primals, g2, s));
      } else {
        throw std::invalid_argument(
            "[mlx_ternary.native] no gradient with respect to the packed trits");
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
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(in[0]);
    enc.set_input_array(in[1]);
    enc.set_output_array(out);
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

// ---------------------------------------------------------------------------------------------
// DenseMatmul: y = x @ W.T, W (N, K) float16/bfloat16/float32, x float32
// ---------------------------------------------------------------------------------------------

class DenseMatmul : public CpuPrimitive {
 public:
  explicit DenseMatmul(mx::Stream s) : CpuPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(in[0]);
    enc.set_input_array(in[1]);
    enc.set_output_array(out);
    enc.dispatch([x = in[0], w = in[1], outp = out.data<float>()]() {
      std::vector<uint8_t> kx, kw;
      tk::DenseLayer L;
      L.n = w.shape(0), L.k = w.shape(1);
      L.w = row_major(w, kw);
      L.w_dtype = tk_dtype(w.dtype(), "the weight");
      L.x = (const float*)row_major(x, kx);
      L.out = outp;
      const int64_t M = (int64_t)(x.size() / L.k);
      parallel_rows(L.n, 64, [&](int64_t n0, int64_t n1) { tk::dense_rows(L, M, n0, n1); });
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

// ---------------------------------------------------------------------------------------------
// Attention: float32 q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D); gradients come from the Python
// wrapper (the vjp of MLX's own attention), so this primitive has none.
// ---------------------------------------------------------------------------------------------

class Attention : public CpuPrimitive {
 public:
  Attention(mx::Stream s, float scale, bool causal) : CpuPrimitive(s), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
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

// ---------------------------------------------------------------------------------------------
// SwiGLU: silu(g) * x for float32 arrays of one shape; gradients from the Python wrapper
// ---------------------------------------------------------------------------------------------

class SwiGLU : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
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

// ---------------------------------------------------------------------------------------------
// Ops (validation happens here, once per call, where errors can name the argument)
// ---------------------------------------------------------------------------------------------

[[noreturn]] void bad(const std::string& msg) {
  throw std::invalid_argument("[mlx_ternary.native] " + msg);
}

std::string shape_str(const mx::array& a) {
  std::ostringstream s;
  s << "(";
  for (int i = 0; i < a.ndim(); i++) s << (i ? ", " : "") << a.shape(i);
  s << (a.ndim() == 1 ? ",)" : ")");
  return s.str();
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

mx::array swiglu(const mx::array& g, const mx::array& x) {
  if (g.dtype() != mx::float32 || x.dtype() != mx::float32 || g.shape() != x.shape())
    bad("swiglu takes two float32 arrays of one shape, got " + shape_str(g) + " and " +
        shape_str(x));
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(g.shape(), mx::float32, std::make_shared<SwiGLU>(s), std::vector<mx::array>{g, x});
}

mx::array ternary_weight_op(const mx::array& packed, const mx::array& scales, int packing,
                            int in_features, int group_size) {
  TernaryParams p = check_layer(packed, scales, packing, in_features, group_size);
  return ternary_weight(packed, scales, p, false, mx::default_stream(mx::Device::cpu));
}

#include "ggml_ops.h"  // llama.cpp's quantized tables (kquants.h)
#include "block.h"     // the fused decoder block
#include "localsum.h"  // two local ranks' sum over shared memory

}  // namespace

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
  register_ggml(m);
  register_block(m);
  register_localsum(m);
  m.def("is_tracer", [](const mx::array& a) { return a.is_tracer(); }, nb::arg("a"),
        "Whether `a` is (or is computed from) an input of a transform being traced now "
        "(mx.grad, vjp, jvp, compile): a graph it is part of may be differentiated.");
  m.def("selfcheck", []() {
          std::string e = tk::selfcheck();
          return e.empty() ? tk::kq_selfcheck() : e;
        },
        "Compare this build's SIMD kernels with the portable ones; '' when they agree.");
  m.attr("PACKING_COMPACT") = int(tk::COMPACT);
  m.attr("PACKING_FAST") = int(tk::FAST);
  m.def("built_for_mlx", []() { return std::string(MLXT_MLX_VERSION); });
  m.def("linked_mlx", []() { return std::string(mx::version()); });
}
