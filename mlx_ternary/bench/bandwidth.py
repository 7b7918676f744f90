"""This machine's memory bandwidth, measured: a streaming read on 1 and on N threads.

A CPU has no published figure the way an Apple chip has, and the decode ceiling of a
memory-bound engine is bytes per token / bandwidth (ceiling.py). The measurement sums a
buffer many times the size of the caches, in slices, one slice per thread, and keeps the
best pass: a tiny C++ program built here with the native kernels' compiler and flags
(-O3 -march=native, vectorised loads), or numpy's sum over threads when no compiler runs
(numpy's integer sum is compute bound on some CPUs, so that figure is a lower bound and
says so).
"""

import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, Sequence

import numpy as np

from ..errors import TernaryError

DEFAULT_MB = 1024
PASSES = 5

_SOURCE = r"""
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
// argv: megabytes threads passes; prints the best pass's GB/s (1e9 bytes/s)
static uint64_t sum(const uint64_t* p, size_t n) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  for (size_t i = 0; i + 4 <= n; i += 4) { a += p[i]; b += p[i + 1]; c += p[i + 2]; d += p[i + 3]; }
  return a ^ b ^ c ^ d;
}
int main(int argc, char** argv) {
  size_t mb = std::atoll(argv[1]), nt = std::atoi(argv[2]), passes = std::atoi(argv[3]);
  size_t n = mb * (1u << 20) / 8;
  std::vector<uint64_t> buf(n);
  for (size_t i = 0; i < n; ++i) buf[i] = i;
  double best = 0;
  volatile uint64_t sink = 0;
  for (size_t r = 0; r < passes; ++r) {
    std::vector<uint64_t> out(nt);
    std::vector<std::thread> th;
    auto t0 = std::chrono::steady_clock::now();
    for (size_t t = 0; t < nt; ++t)
      th.emplace_back([&, t] { out[t] = sum(buf.data() + n / nt * t, n / nt); });
    for (auto& x : th) x.join();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (auto v : out) sink = sink + v;
    if (n * 8 / s / 1e9 > best) best = n * 8 / s / 1e9;
  }
  std::printf("%.3f\n", best);
  return sink == 1;  // never: keeps the sums
}
"""


def _build(where: Path) -> Path:
    from ..runtime.cpu import build

    cxx = build.compiler()
    if shutil.which(cxx) is None:
        raise TernaryError(f"no C++ compiler {cxx!r} for the bandwidth probe")
    src, exe = where / "stream.cpp", where / "stream"
    src.write_text(_SOURCE)
    cmd = [cxx, "-std=c++17", "-O3", *build.arch_flags(), "-pthread", str(src), "-o", str(exe)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise TernaryError(f"building the bandwidth probe failed: {out.stderr.strip()[-500:]}")
    return exe


def numpy_bandwidth(mb: int, threads: int, passes: int) -> float:
    a = np.arange(mb * 2**20 // 8, dtype=np.uint64)
    parts, best = np.array_split(a, threads), 0.0
    for _ in range(passes):
        pool = [threading.Thread(target=np.sum, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        best = max(best, a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def measure(threads: Sequence[int] = (1, 2), mb: int = DEFAULT_MB, passes: int = PASSES) -> Dict:
    """Streaming-read GB/s on each thread count.

    Returns:
        {"gbs": {threads: GB/s}, "method": "c++ stream" | "numpy sum (lower bound)",
         "buffer_mb": mb, "passes": passes}
    """
    gbs, method = {}, "c++ stream (best pass)"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            exe = _build(Path(tmp))
        except TernaryError:
            exe, method = None, "numpy sum over threads (a lower bound: no C++ compiler)"
        for t in threads:
            if exe is None:
                gbs[int(t)] = numpy_bandwidth(mb, int(t), passes)
                continue
            out = subprocess.run(
                [str(exe), str(mb), str(int(t)), str(passes)],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if out.returncode:
                raise TernaryError(f"the bandwidth probe failed: {out.stderr.strip()[-300:]}")
            gbs[int(t)] = float(out.stdout.strip())
    return {"gbs": gbs, "method": method, "buffer_mb": mb, "passes": passes}
