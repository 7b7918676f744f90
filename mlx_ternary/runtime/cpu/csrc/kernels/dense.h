// Dense float rows on the CPU: y (M, N) = x (M, K) @ W (N, K).T with W kept in the dtype the
// checkpoint stores (float16, bfloat16 or float32) and float32 accumulation. This is the
// embedding-as-output-layer and lm_head matvec: MLX's CPU float16 matmul is many times slower
// than float32, and a float32 copy would double the memory of those tables.
// Each weight vector is converted once and used for up to DENSE_TOKENS tokens. A token's sum
// runs in the same order whatever tokens share the call (x86: one chain per row and token on
// AVX-512, two on AVX2, arch/x86.h `dense_tile`; arm64 and the portable path: DENSE_CHAINS
// chains, their sum, then the tail), so a row of y does not depend on how many tokens share
// the call: batched decoding gives the single sequence's logits bit for bit (mlx-lm's batch
// tests compare them).
#pragma once

#include <cstdint>

#include "../arch/select.h"
#include "layer.h"

namespace tk {

struct DenseLayer {
  const void* w = nullptr;  // (N, K)
  int w_dtype = F32;
  int64_t n = 0, k = 0;
  const float* x = nullptr;  // (M, K) float32
  void* out = nullptr;       // (M, N)
  int out_dtype = F32;
  int rows_one = 0;  // x86: rows a one-token pass reads side by side (1, 2, 4; 0: the CPU's)
};

inline const char* dense_isa() { return native::DENSE_ISA; }

// Tokens a row's pass serves (arch/: their accumulators must fit the vector registers).
constexpr int DENSE_TOKENS = native::DENSE_TOKENS;


template <int WD, int T>
void dense_rows_tt(const DenseLayer& L, int64_t n0, int64_t n1, int64_t m0) {
  native::dense_block<WD, T>(L, n0, n1, m0);
}

// The last M % DENSE_TOKENS tokens: the block of exactly that many (1 .. DENSE_TOKENS - 1).
template <int WD, int T = DENSE_TOKENS - 1>
void dense_rows_rest(const DenseLayer& L, int64_t rest, int64_t n0, int64_t n1, int64_t m) {
  if constexpr (T >= 1) {
    if (rest == T) return dense_rows_tt<WD, T>(L, n0, n1, m);
    dense_rows_rest<WD, T - 1>(L, rest, n0, n1, m);
  }
}

// Blocks of DENSE_TOKENS tokens, then the rest; DENSE_TOKENS + 1 left go as DENSE_TOKENS - 1 and
// 2 (a pass of the rows for one token alone streams its activations for every row alone: 4
// tokens of a 32000 x 2048 float16 table on AVX2, 2 threads, 6.2-6.5 ms as 2 + 2, 7.8-7.9 as 3
// + 1)
template <int WD>
void dense_rows_w(const DenseLayer& L, int64_t M, int64_t n0, int64_t n1) {
  constexpr int D = DENSE_TOKENS;
  int64_t m = 0;
  for (; M - m >= D && (M - m != D + 1 || D <= 2); m += D) dense_rows_tt<WD, D>(L, n0, n1, m);
  if (M - m == D + 1) {
    dense_rows_rest<WD>(L, D - 1, n0, n1, m);
    m += D - 1;
  }
  dense_rows_rest<WD>(L, M - m, n0, n1, m);
}

inline void dense_rows(const DenseLayer& L, int64_t M, int64_t n0, int64_t n1) {
  switch (L.w_dtype) {
    case F16: dense_rows_w<F16>(L, M, n0, n1); break;
    case BF16: dense_rows_w<BF16>(L, M, n0, n1); break;
    default: dense_rows_w<F32>(L, M, n0, n1);
  }
}

}  // namespace tk
