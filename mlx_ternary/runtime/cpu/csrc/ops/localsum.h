// LocalSum: the sum of two ranks' float32 arrays over a shared-memory segment both map
// (runtime/samehost.py creates it), on the calling stream thread: no ring threads, no sockets.
//
// Segment: two 128-byte headers {seq, ack} then two data slots of `cap` bytes. A sum goes in
// chunks of at most `cap` bytes; for chunk n a rank waits until the peer has acked n - 1 (done
// reading this rank's slot), writes its part, publishes seq = n, waits for the peer's seq >= n,
// writes out = slot0 + slot1 (rank order: both ranks get the same bits, MLX's ring's a0 + a1)
// and publishes ack = n. A wait spins with a pause a while, then yields, then sleeps; past the
// timeout it raises rather than hang.

#pragma once

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#if defined(__linux__)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

#include "../arch/select.h"  // native::cpu_pause
#include "primitive.h"

namespace mlxt {

struct alignas(64) LsHeader {
  std::atomic<uint64_t> seq{0};
  char pad0[56];
  std::atomic<uint64_t> ack{0};
  char pad1[56];
};

struct LocalSumState {
  char* base = nullptr;
  size_t bytes = 0, cap = 0;
  int rank = -1;
  uint64_t n = 0;          // chunks exchanged (stream thread only)
  double timeout_s = 30.0;
  std::string advice;  // what the timeout error tells the user to do (samehost.py's words)
  std::atomic<uint64_t> calls{0};
  LsHeader* hdr(int r) const { return reinterpret_cast<LsHeader*>(base) + r; }
  float* slot(int r) const { return reinterpret_cast<float*>(base + 2 * sizeof(LsHeader) + r * cap); }
};

LocalSumState& local_state() {
  static LocalSumState s;
  return s;
}

size_t local_sum_bytes(size_t cap) { return 2 * sizeof(LsHeader) + 2 * cap; }

void local_wait(const std::atomic<uint64_t>& v, uint64_t want, double timeout_s, const char* what,
                const std::string& advice) {
  if (v.load(std::memory_order_acquire) >= want) return;
  using clk = std::chrono::steady_clock;
  const auto t0 = clk::now();
  for (uint64_t i = 1;; i++) {
    if (v.load(std::memory_order_acquire) >= want) return;
    if ((i & 255) == 0) {
      const double s = std::chrono::duration<double>(clk::now() - t0).count();
      if (s > timeout_s) {
        fail(std::string("local_sum: the other rank did not ") + what + " within " +
             std::to_string(timeout_s) + " s (did it exit, or take another path?)" +
             (advice.empty() ? "" : "; " + advice));
      }
      if (s > 0.01) std::this_thread::sleep_for(std::chrono::microseconds(50));
      else if (s > 0.0002) std::this_thread::yield();
      else tk::native::cpu_pause();
    } else {
      tk::native::cpu_pause();
    }
  }
}

void local_sum_run(const float* src, float* dst, int64_t count) {
  auto& st = local_state();
  const int me = st.rank, peer = 1 - st.rank;
  const int64_t per = (int64_t)(st.cap / sizeof(float));
  for (int64_t i0 = 0; i0 < count || (count == 0 && i0 == 0); i0 += per) {
    const int64_t len = std::min(per, count - i0);
    const uint64_t n = ++st.n;
    local_wait(st.hdr(peer)->ack, n - 1, st.timeout_s, "read its share", st.advice);
    if (len > 0) std::memcpy(st.slot(me), src + i0, len * sizeof(float));
    st.hdr(me)->seq.store(n, std::memory_order_release);
    local_wait(st.hdr(peer)->seq, n, st.timeout_s, "write its share", st.advice);
    const float* a0 = st.slot(0);
    const float* a1 = st.slot(1);
    for (int64_t i = 0; i < len; i++) dst[i0 + i] = a0[i] + a1[i];
    st.hdr(me)->ack.store(n, std::memory_order_release);
    if (count == 0) break;
  }
}

class LocalSum : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = enqueue(stream(), in, out);
    enc.dispatch([x = in[0], outp = out.data<float>()]() {
      std::vector<uint8_t> keep;
      const float* xp = (const float*)row_major(x, keep);
      local_sum_run(xp, outp, (int64_t)x.size());
      local_state().calls.fetch_add(1, std::memory_order_relaxed);
    });
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }
  const char* name() const override { return "NativeLocalSum"; }
  // never merged: two sums of equal inputs are two exchanges both ranks count
  bool is_equivalent(const mx::Primitive&) const override { return false; }
};

mx::array local_sum(const mx::array& x) {
  if (x.dtype() != mx::float32) bad("local_sum takes a float32 array, got another dtype");
  if (local_state().base == nullptr) bad("local_sum: no segment attached (local_sum_attach)");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<LocalSum>(s), std::vector<mx::array>{x});
}

// Map the segment at `path` (created and sized by the caller to local_sum_bytes(cap)).
void local_sum_attach(const std::string& path, int rank, int64_t cap, double timeout_s,
                      const std::string& advice) {
#if defined(__linux__)
  auto& st = local_state();
  if (st.base != nullptr) bad("local_sum: a segment is attached already");
  if (rank < 0 || rank > 1 || cap <= 0 || cap % 64) bad("local_sum: rank 0 or 1, cap a multiple of 64");
  const size_t bytes = local_sum_bytes((size_t)cap);
  int fd = ::open(path.c_str(), O_RDWR);
  if (fd < 0) bad("local_sum: cannot open " + path + ": " + std::strerror(errno));
  struct stat sb;
  if (::fstat(fd, &sb) != 0 || (size_t)sb.st_size != bytes) {
    ::close(fd);
    bad("local_sum: " + path + " is not " + std::to_string(bytes) + " bytes");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) bad("local_sum: cannot map " + path + ": " + std::strerror(errno));
  st.base = (char*)p, st.bytes = bytes, st.cap = (size_t)cap, st.rank = rank, st.n = 0;
  st.timeout_s = timeout_s, st.advice = advice;
#else
  bad("local_sum needs Linux");
#endif
}


}  // namespace mlxt
