// A small fork-join pool for the kernels: the calling thread (MLX's CPU stream thread) works as
// index 0 and `size() - 1` workers join it. Workers spin briefly after a job (a decode step
// launches ~7 layers back to back) and then sleep on a futex (std::atomic::wait).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TK_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define TK_PAUSE() asm volatile("yield")
#else
#define TK_PAUSE() std::this_thread::yield()
#endif

namespace tk {

class Pool {
 public:
  explicit Pool(int n) { resize(n); }
  ~Pool() { stop(); }

  int size() const { return (int)workers_.size() + 1; }

  void resize(int n) {
    std::lock_guard<std::mutex> lock(run_mu_);
    stop();
    stop_.store(false);
    // Workers start from the current generation: one that starts late must still see the
    // first job posted after this point.
    const uint32_t start = gen_.load(std::memory_order_acquire);
    for (int i = 1; i < (n < 1 ? 1 : n); i++)
      workers_.emplace_back([this, i, start] { loop(i, start); });
  }

  // fn(index) on min(n, size()) threads; returns when every thread is done.
  void run(int n, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> lock(run_mu_);
    if (n <= 1 || workers_.empty()) {
      fn(0);
      return;
    }
    job_ = &fn;
    active_ = n;
    remaining_.store((int)workers_.size(), std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_release);
    gen_.notify_all();
    fn(0);
    for (int spins = 0;; spins++) {
      int r = remaining_.load(std::memory_order_acquire);
      if (r == 0) break;
      if (spins < kSpin) TK_PAUSE();
      else remaining_.wait(r, std::memory_order_acquire);
    }
    job_ = nullptr;
  }

 private:
  static constexpr int kSpin = 20000;

  void loop(int index, uint32_t seen) {
    for (;;) {
      for (int spins = 0; gen_.load(std::memory_order_acquire) == seen; spins++) {
        if (spins < kSpin) TK_PAUSE();
        else gen_.wait(seen, std::memory_order_acquire);
      }
      seen = gen_.load(std::memory_order_acquire);
      if (stop_.load(std::memory_order_acquire)) return;
      if (index < active_) (*job_)(index);
      if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) remaining_.notify_one();
    }
  }

  void stop() {
    if (workers_.empty()) return;
    stop_.store(true, std::memory_order_release);
    gen_.fetch_add(1, std::memory_order_release);
    gen_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  std::vector<std::thread> workers_;
  std::atomic<uint32_t> gen_{0};
  std::atomic<int> remaining_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* job_ = nullptr;
  int active_ = 0;
  std::mutex run_mu_;
};

}  // namespace tk
