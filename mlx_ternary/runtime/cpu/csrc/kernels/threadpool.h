// A small pool for the kernels: parallel_for(n, f) runs f(0..n-1) on the calling thread (MLX's
// CPU stream thread) and any workers that wake in time. The n indices are cut into one
// contiguous range per thread of the pool; each thread that arrives takes a range of its own
// and runs it in order, then claims what is left of the others' ranges, one index at a time.
// So a thread streams one contiguous span of a layer's rows (two threads taking alternate
// chunks of the same rows read 15-20 % slower from memory on a Zen 4: docs/NATIVE.md), and the
// caller waits only for claimed indices to finish, never for a worker to wake up: on shared or
// oversubscribed cores a descheduled worker just claims nothing, its range run by the others,
// instead of stalling every layer (the failure mode of fork-join barriers there). Workers spin
// for a while after a job (kWorkerSpinNs: a decode step's layers come tens of microseconds
// apart), then sleep on a futex (std::atomic::wait); the caller waits for the last claimed
// indices the same way.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
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
    auto job = std::make_shared<Job>(f, n, size());
    {
      std::lock_guard<std::mutex> jl(job_mu_);
      job_ = job;
    }
    gen_.fetch_add(1, std::memory_order_release);
    gen_.notify_all();
    work(*job);
    Spin spin(kCallerSpinNs);
    for (;;) {
      int64_t d = job->done.load(std::memory_order_acquire);
      if (d == n) break;
      if (spin()) native::cpu_pause();
      else job->done.wait(d, std::memory_order_acquire);
    }
    std::lock_guard<std::mutex> jl(job_mu_);
    job_.reset();
  }

 private:
  // How long a worker waits for the next job spinning before it sleeps, and the caller for
  // the chunks the workers claimed. A decode step runs its ternary layers 10-100 us apart
  // (norms, attention, MLX's other ops in between), and a futex wake-up costs tens of
  // microseconds on a virtual machine: a worker that slept joins a layer late or not at all,
  // and the caller runs most of it alone. 300 pauses (8 us on Zen 4, where a pause takes
  // 27 ns) let the worker of a 2-thread BitNet 2B4T decode step sleep between most layers:
  // with 20-100 us between the layers it did a third of the chunks instead of half, and the
  // layers read 20-29 GB/s instead of 36-38 (2026-12-04, Zen 4, weights in cache). The caller
  // waits for chunks a worker is running, at most a chunk's time unless the worker was
  // descheduled - then its spinning would only take the worker's core - so it spins less.
  // Between decode steps (Python builds the next step's graph for milliseconds) a worker
  // spinning longer only takes a core from it where the machine has no free one: 200 us.
  static constexpr int64_t kWorkerSpinNs = 200'000, kCallerSpinNs = 100'000;
  // true while `ns` since its construction have not passed and the thread keeps its core:
  // every 32 calls (about 1 us) it yields and reads the clock, and a gap of more than
  // kPreemptedNs since the last reading - another thread ran on this core: more threads
  // than free cores - ends the spin (the thread sleeps, as it did after 300 pauses)
  static constexpr int64_t kPreemptedNs = 50'000;
  struct Spin {
    using Clock = std::chrono::steady_clock;
    explicit Spin(int64_t ns) : end(Clock::now() + std::chrono::nanoseconds(ns)), last(Clock::now()) {}
    const Clock::time_point end;
    Clock::time_point last;
    int calls = 0;
    bool operator()() {
      if (++calls % 32) return true;
      std::this_thread::yield();
      const Clock::time_point now = Clock::now();
      if (now - last > std::chrono::nanoseconds(kPreemptedNs)) return false;
      last = now;
      return now < end;
    }
  };

  // Ranges a job is cut into at most (a pool of more threads shares them)
  static constexpr int kMaxRanges = 64;
  struct alignas(64) Range {  // a cache line each: threads claim from their own
    std::atomic<int64_t> next;  // the next unclaimed index
    int64_t end;
  };
  struct Job {
    Job(const std::function<void(int64_t)>& f, int64_t n, int threads)
        : f(f), n(n), ranges((int)std::min<int64_t>({threads, kMaxRanges, n})) {
      for (int r = 0; r < ranges; r++) {
        range[r].next.store(n * r / ranges, std::memory_order_relaxed);
        range[r].end = n * (r + 1) / ranges;
      }
    }
    std::function<void(int64_t)> f;  // called only for a claimed index: the caller still waits
    const int64_t n;
    const int ranges;
    std::atomic<int> arrivals{0};  // the order threads come in: which range is their own
    std::atomic<int64_t> done{0};
    Range range[kMaxRanges];
  };

  static void work(Job& job) {
    const int own = job.arrivals.fetch_add(1, std::memory_order_relaxed) % job.ranges;
    for (int k = 0; k < job.ranges; k++) {
      const int r = (own + k) % job.ranges;
      Range& rg = job.range[r];
      for (int64_t i; (i = rg.next.fetch_add(1, std::memory_order_relaxed)) < rg.end;) {
        job.f(i);
        if (job.done.fetch_add(1, std::memory_order_acq_rel) + 1 == job.n) job.done.notify_all();
      }
    }
  }

  void loop(uint32_t seen) {
    for (;;) {
      for (Spin spin(kWorkerSpinNs); gen_.load(std::memory_order_acquire) == seen;) {
        if (spin()) native::cpu_pause();
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
