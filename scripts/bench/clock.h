// The clock the csrc benchmark programs (decode_pool, q8k_decode_sweep, q8k_prefill_gemm)
// read: seconds on clock `id` (CLOCK_MONOTONIC: wall time; CLOCK_THREAD_CPUTIME_ID: the
// calling thread's CPU time, what one thread on a shared machine compares).
#pragma once
#include <time.h>

inline double clock_seconds(clockid_t id) {
  timespec ts;
  clock_gettime(id, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}
