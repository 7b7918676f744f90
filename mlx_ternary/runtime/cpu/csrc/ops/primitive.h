// The MLX plumbing every primitive of ops/ shares: the pool the kernels fork on, the geometry
// cache, dtype codes, row-major views, the one error prefix, the shape and dtype checks, the
// CPU-only bases and the one eval_cpu prologue (enqueue).
//
// eval_cpu allocates the outputs and enqueues the work on the stream's CPU command encoder, as
// MLX's own CPU primitives do; MLX keeps the inputs alive until the task has run. Inside the
// task the rows (and, for long prompts, the activation preparation) fork across tk::Pool.
//
// The ops/ headers are parts of one translation unit (bindings.cpp includes each once).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

#include "../kernels/layer.h"
#include "../kernels/threadpool.h"

namespace mx = mlx::core;

namespace mlxt {

// The prefix of every error the extension raises (Python sees it in the message).
constexpr const char* ERROR_PREFIX = "[mlx_ternary.native] ";

[[noreturn]] inline void bad(const std::string& msg) {
  throw std::invalid_argument(ERROR_PREFIX + msg);
}

[[noreturn]] inline void fail(const std::string& msg) {
  throw std::runtime_error(ERROR_PREFIX + msg);
}

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
  bad(std::string(what) + " must be float32, float16 or bfloat16");
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

// Row chunks across the pool: each thread a contiguous span of them, what a late or
// descheduled thread leaves claimed by the others (kernels/threadpool.h).
template <class F>
void parallel_rows(int64_t n, int64_t chunk, const F& f) {
  const int64_t nchunks = tk::ceil_div(n, chunk);
  pool().parallel_for(nchunks, [&](int64_t c) { f(c * chunk, std::min(n, (c + 1) * chunk)); });
}
std::string shape_str(const mx::array& a) {
  std::ostringstream s;
  s << "(";
  for (int i = 0; i < a.ndim(); i++) s << (i ? ", " : "") << a.shape(i);
  s << (a.ndim() == 1 ? ",)" : ")");
  return s.str();
}

// ---------------------------------------------------------------------------------------------
// The primitives' bases and their eval_cpu prologue
// ---------------------------------------------------------------------------------------------

// The primitives run on the CPU only (the Metal and reference paths serve GPUs).
class CpuPrimitive : public mx::UnaryPrimitive {
 public:
  using mx::UnaryPrimitive::UnaryPrimitive;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    fail(std::string(name()) + " runs on the CPU only");
  }
};

class CpuMultiPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    fail(std::string(name()) + " runs on the CPU only");
  }
};

// The eval_cpu prologue: `outs` allocated, `in` and `outs` registered with the stream's CPU
// command encoder, which is returned for the primitive to dispatch its task on.
inline mx::cpu::CommandEncoder& enqueue(mx::Stream s, const std::vector<mx::array>& in,
                                        mx::array* outs, size_t nout) {
  auto& enc = mx::cpu::get_command_encoder(s);
  for (auto& a : in) enc.set_input_array(a);
  for (size_t i = 0; i < nout; i++) {
    outs[i].set_data(mx::allocator::malloc(outs[i].nbytes()));
    enc.set_output_array(outs[i]);
  }
  return enc;
}

inline mx::cpu::CommandEncoder& enqueue(mx::Stream s, const std::vector<mx::array>& in,
                                        mx::array& out) {
  return enqueue(s, in, &out, 1);
}

inline mx::cpu::CommandEncoder& enqueue(mx::Stream s, const std::vector<mx::array>& in,
                                        std::vector<mx::array>& outs) {
  return enqueue(s, in, outs.data(), outs.size());
}

}  // namespace mlxt
