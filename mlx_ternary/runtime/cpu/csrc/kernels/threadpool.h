// A small pool for the kernels: parallel_for(n, f) runs f(0..n-1) on the calling thread (MLX's
// CPU stream thread) and any workers that wake in time. Chunks are claimed one at a time, and
// the caller waits only for claimed chunks to finish, never for a worker to wake up: on shared
// or oversubscribed cores a descheduled worker just claims nothing, instead of stalling every
// layer (the failure mode of fork-join barriers there). Workers spin briefly after a job (a
// decode step launches layers back to back), then sleep on a futex (std::atomic::wait).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "../arch/select.h"  // native::cpu_pause

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
    const uint32_t start = gen_.load(std::memory_order_acquire);
    for (int i = 1; i < (n < 1 ? 1 : n); i++) workers_.emplace_back([this, start] { loop(start); });
  }

  // f(i) for i in [0, n); returns when all n calls have returned.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& f) {
    if (n <= 0) return;
    std::lock_guard<std::mutex> lock(run_mu_);
    if (n == 1 || workers_.empty()) {
      for (int64_t i = 0; i < n; i++) f(i);
      return;
    }
    auto job = std::make_shared<Job>(f, n);
    {
      std::lock_guard<std::mutex> jl(job_mu_);
      job_ = job;
    }
    gen_.fetch_add(1, std::memory_order_release);
    gen_.notify_all();
    work(*job);
    for (int spins = 0;; spins++) {
      int64_t d = job->done.load(std::memory_order_acquire);
      if (d == n) break;
      if (spins < kSpin) native::cpu_pause();
      else job->done.wait(d, std::memory_order_acquire);
    }
    std::lock_guard<std::mutex> jl(job_mu_);
    job_.reset();
  }

 private:
  static constexpr int kSpin = 300;  // ~20-80 us: catches the next layer of a decode step

  struct Job {
    Job(const std::function<void(int64_t)>& f, int64_t n) : f(f), n(n) {}
    std::function<void(int64_t)> f;  // called only for a claimed index: the caller still waits
    const int64_t n;
    std::atomic<int64_t> next{0}, done{0};
  };

  static void work(Job& job) {
    for (int64_t i; (i = job.next.fetch_add(1, std::memory_order_relaxed)) < job.n;) {
      job.f(i);
      if (job.done.fetch_add(1, std::memory_order_acq_rel) + 1 == job.n) job.done.notify_all();
    }
  }

  void loop(uint32_t seen) {
    for (;;) {
      for (int spins = 0; gen_.load(std::memory_order_acquire) == seen; spins++) {
        if (spins < kSpin) native::cpu_pause();
        else gen_.wait(seen, std::memory_order_acquire);
      }
      seen = gen_.load(std::memory_order_acquire);
      if (stop_.load(std::memory_order_acquire)) return;
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> jl(job_mu_);
        job = job_;
      }
      if (job) work(*job);
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
  std::atomic<bool> stop_{false};
  std::shared_ptr<Job> job_;
  std::mutex job_mu_, run_mu_;
};

}  // namespace tk
