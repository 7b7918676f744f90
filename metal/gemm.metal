// Prefill GEMM, both packings: y (M, N) = act_quant(x) (M, K) @ (s * t).T + bias, any M.
//
// Thread mapping: one threadgroup = 256 threads (8 SIMD groups) owns a tile of 64 tokens x
// 32 output rows (grid = (256, ceil(N / 32), ceil(M / 64))). K is walked in steps; per step
// the threadgroup decodes its 32 rows' packed weights for the step ONCE into threadgroup
// memory (as float t * group scale) and stages 64 tokens of x beside them. MMA 1: SIMD group
// s multiplies tokens 16(s/2)..+15 by rows 16(s%2)..+15 as 2x2 simdgroup 8x8 float matrices
// (columns padded to a multiple of 8 with zeros); MMA 0: every thread computes 2 tokens x 4
// rows (rows tx, tx+8, tx+16, tx+24; tokens 2ty, 2ty+1) with plain FMA.
// Each packed word/byte is read once per threadgroup, so at M tokens the weights are read
// ceil(M / 64) times in all: 1/64 of the packed size per token at 64 tokens.
//   fast (PACKING 1):    a step is 32 columns = 2 words per row; threads 0..63 decode one
//                        word (16 codes) each.
//   compact (PACKING 0): a step is up to 8 bytes (40 columns) of one block (a scale group,
//                        or the whole row); thread i decodes byte i % 8 of row i / 8.
//
// File convention: text above "//// BODY ////" is the `header`, text below the `source`.
// Inputs: x (M, K) T; wq (N, KW) uint32 | (N, RB) uint8; scales ST; bias (N,) BT (dummy when
// !HAS_BIAS); params int32 [M, N, K, W (words or bytes per row), SC, B, BPB, NB].
// Output: y (M, N) T. Templates: T, ST, BT, PACKING, SMODE, G, ACTQ, HAS_BIAS, MMA.

inline float ternary_act_quant(float v, float scale) {
  return clamp(rint(v * scale), -128.0f, 127.0f);
}

//// BODY ////
  const int M = params[0];
  const int N = params[1];
  const int K = params[2];
  const int W = params[3];
  const int SC = params[4];
  const int B = params[5];
  const int BPB = params[6];
  const int NB = params[7];
  const int tid = int(thread_index_in_threadgroup);
  const int n0 = int(threadgroup_position_in_grid.y) * 32;
  const int m0 = int(threadgroup_position_in_grid.z) * 64;
  const int ty = tid / 8;
  const int tx = tid % 8;

  threadgroup float ws[32][41];
  threadgroup float xs[64][41];
  threadgroup float tg_red[256];
  threadgroup float tg_scale[64];

  // Per-token activation scales (127 / absmax over K), 4 threads per token.
  if (ACTQ) {
    const int mt = m0 + tid / 4;
    float a = 0.0f;
    if (mt < M) {
      for (int k = tid % 4; k < K; k += 4) {
        a = max(a, fabs(static_cast<float>(x[mt * K + k])));
      }
    }
    tg_red[tid] = a;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid < 64) {
      const float amax = max(max(tg_red[4 * tid], tg_red[4 * tid + 1]),
                             max(tg_red[4 * tid + 2], tg_red[4 * tid + 3]));
      tg_scale[tid] = 127.0f / max(amax, 1e-5f);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  float acc[2][4];
  for (int i = 0; i < 2; i++) {
    for (int r = 0; r < 4; r++) {
      acc[i][r] = 0.0f;
    }
  }
  const int sg = int(simdgroup_index_in_threadgroup);
  const int tb = 16 * (sg / 2);
  const int rb = 16 * (sg % 2);
  simdgroup_float8x8 macc[2][2];
  for (int i = 0; i < 2; i++) {
    for (int j = 0; j < 2; j++) {
      macc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }

  // Steps: fast walks words two at a time; compact walks (block, byte chunk) pairs.
  const int chunks = PACKING == 1 ? (W + 1) / 2 : NB * ((BPB + 7) / 8);
  const int per_blk = (BPB + 7) / 8;
  for (int step = 0; step < chunks; step++) {
    int kbase;   // first column of the step
    int kc;      // columns in the step
    int klimit;  // columns at or past this are padding (zero trits, x = 0)
    int blk = 0;
    int c0 = 0;
    if (PACKING == 1) {
      kbase = step * 32;
      kc = 32;
      klimit = K;
    } else {
      blk = step / per_blk;
      c0 = (step % per_blk) * 8;
      kbase = blk * B + 5 * c0;
      kc = 5 * min(8, BPB - c0);
      klimit = min(blk * B + B, K);
    }
    // Columns staged: kc rounded up to the 8 of a matrix tile (zeros past kc).
    const int kc8 = MMA ? (kc + 7) / 8 * 8 : kc;

    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Decode the weight tile once: ws[row][col] = t * (group scale).
    if (PACKING == 1) {
      if (tid < 64) {
        const int r = tid / 2;
        const int j = 2 * step + tid % 2;
        const int n = min(n0 + r, N - 1);
        const bool live = j < W && n0 + r < N;
        const uint w = live ? ((const device uint*)wq)[n * W + j] : 0x55555555u;
        const float s = SMODE == 2
            ? static_cast<float>(scales[n * SC + min(16 * j / max(G, 1), SC - 1)]) : 1.0f;
        for (int c = 0; c < 16; c++) {
          const int code = int((w >> (2 * c)) & 3u);
          ws[r][16 * (tid % 2) + c] = float(code - 1) * s;
        }
      }
    } else {
      const int r = tid / 8;
      const int b = tid % 8;
      const int n = min(n0 + r, N - 1);
      if (c0 + b < BPB) {
        // Rows past N read nothing: byte 128 is five zero trits.
        uint q = n0 + r < N ? uint(((const device uchar*)wq)[n * W + blk * BPB + c0 + b]) : 128u;
        const float s = SMODE == 2 ? static_cast<float>(scales[n * SC + blk]) : 1.0f;
        for (int d = 0; d < 5; d++) {
          const int digit = int(((q & 0xFFu) * 3u) >> 8);
          ws[r][5 * b + d] = float(digit - 1) * s;
          q = q * 3u;
        }
      }
    }
    if (kc8 > kc) {
      for (int e = tid; e < 32 * (kc8 - kc); e += 256) {
        ws[e / (kc8 - kc)][kc + e % (kc8 - kc)] = 0.0f;
      }
    }
    // Stage 64 tokens x kc8 columns of x.
    for (int e = tid; e < 64 * kc8; e += 256) {
      const int mi = e / kc8;
      const int c = e % kc8;
      const int k = kbase + c;
      const int m = m0 + mi;
      float v = 0.0f;
      if (m < M && c < kc && k < klimit) {
        v = static_cast<float>(x[m * K + k]);
        if (ACTQ) {
          v = ternary_act_quant(v, tg_scale[mi]);
        }
      }
      xs[mi][c] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    if (MMA) {
      for (int kk = 0; kk < kc8; kk += 8) {
        simdgroup_float8x8 a[2];
        simdgroup_float8x8 b[2];
        for (int i = 0; i < 2; i++) {
          simdgroup_load(a[i], &xs[tb + 8 * i][kk], 41);
          // b[j] (k, n) = ws[n][k]: the weight tile read transposed.
          simdgroup_load(b[i], &ws[rb + 8 * i][kk], 41, ulong2(0, 0), true);
        }
        for (int i = 0; i < 2; i++) {
          for (int j = 0; j < 2; j++) {
            simdgroup_multiply_accumulate(macc[i][j], a[i], b[j], macc[i][j]);
          }
        }
      }
    } else {
      for (int c = 0; c < kc; c++) {
        const float x0 = xs[2 * ty][c];
        const float x1 = xs[2 * ty + 1][c];
        for (int r = 0; r < 4; r++) {
          const float wv = ws[tx + 8 * r][c];
          acc[0][r] = fma(x0, wv, acc[0][r]);
          acc[1][r] = fma(x1, wv, acc[1][r]);
        }
      }
    }
  }

  if (MMA) {
    // Matrix tiles -> threadgroup memory (xs is free now) -> the FMA path's register layout.
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = 0; i < 2; i++) {
      for (int j = 0; j < 2; j++) {
        simdgroup_store(macc[i][j], &xs[tb + 8 * i][rb + 8 * j], 41);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = 0; i < 2; i++) {
      for (int r = 0; r < 4; r++) {
        acc[i][r] = xs[2 * ty + i][tx + 8 * r];
      }
    }
  }

  for (int i = 0; i < 2; i++) {
    const int m = m0 + 2 * ty + i;
    if (m >= M) {
      continue;
    }
    for (int r = 0; r < 4; r++) {
      const int n = n0 + tx + 8 * r;
      if (n >= N) {
        continue;
      }
      float out = acc[i][r];
      if (SMODE == 0) {
        out *= static_cast<float>(scales[0]);
      } else if (SMODE == 1) {
        out *= static_cast<float>(scales[n]);
      }
      if (ACTQ) {
        out = out / tg_scale[2 * ty + i];
      }
      if (HAS_BIAS) {
        out += static_cast<float>(bias[n]);
      }
      y[m * N + n] = static_cast<T>(out);
    }
  }
