// One q8k layer (fast packing, row scales) running REPS calls of M tokens (M = 1: a decoded
// token; M > 1: a prefill batch): the program that scripts/bench/q8k_decode_insns.sh runs
// under qemu-user, counting guest instructions, to report instructions per token on arm64
// (qemu cannot time; docs/NATIVE.md). Usage: q8k_decode_insns N K REPS [M]. Prints a checksum
// of the outputs (the same on every build).
#include <cstdio>
#include <cstdlib>

#include "selfcheck.h"

int main(int argc, char** argv) {
  using namespace tk;
  if (argc != 4 && argc != 5) return 2;
  const int64_t N = std::atoll(argv[1]), K = std::atoll(argv[2]), reps = std::atoll(argv[3]);
  const int64_t M = argc == 5 ? std::atoll(argv[4]) : 1;
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> trit(-1, 1);
  std::normal_distribution<float> normal(0.f, 1.f);
  Geometry g = make_geometry(FAST, N, K, 0);
  if (!g.q8k_ok || M < 1) return 2;
  std::vector<int8_t> t(N * K);
  for (auto& v : t) v = (int8_t)trit(rng);
  std::vector<uint8_t> w = pack_rows(t, g);
  std::vector<float> s(N), x(M * K), y(M * N);
  for (auto& v : s) v = 0.5f + (rng() % 1000) / 1000.f;
  for (auto& v : x) v = normal(rng);
  Layer L(g);
  L.w = w.data(), L.scales = s.data(), L.scale_kind = 1, L.out = y.data();
  L.act_quant = L.q8k = true;
  Acts a;
  a.q.assign(M * g.xlen(), 0), a.d8.assign(M * g.nblocks8, 0.f), a.ssum.assign(M * g.nseg, 0);
  std::vector<float> tmp(q8k_tmp_floats(K));
  for (int64_t m = 0; m < M; m++) quantize_token_q8k(g, x.data(), F32, m, a, tmp.data());
  double sum = 0;
  for (int64_t r = 0; r < reps; r++) {
    run_rows<NativeOps>(L, a, M);
    sum += y[r % (M * N)];
  }
  std::printf("%s: %.9g\n", NativeOps::name, sum);
  return 0;
}
