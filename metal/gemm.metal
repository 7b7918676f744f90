// Prefill GEMM, both packings: y (M, N) = x (M, K) @ (s * t).T + bias for many tokens.
//
// Thread mapping: one threadgroup = 256 threads (8 SIMD groups) owns a tile of 64 tokens x
// 32 output rows (grid = (256, ceil(N / 32), ceil(M / 64))). K is walked in steps of 8
// packed bytes per row; per step every thread decodes one byte (thread i: row i / 8, byte
// i % 8; 4 codes for fast, 5 trits for compact) into the threadgroup's weight tile as t *
// group scale, and the tokens' x columns are staged beside it. MMA 1: SIMD group s
// multiplies tokens 16 (s / 2)..+15 by rows 16 (s % 2)..+15 as 2 x 2 simdgroup 8x8 matrices
// (step columns padded to a multiple of 8 with zeros), accumulating in float, and writes its
// results from the matrices' own lanes; a SIMD group whose 16 tokens lie past M does no
// matrix work, and only the tokens' 16-row sub-tiles that hold some token are staged. MMA 0:
// every thread computes 2 tokens x 4 rows (rows tx, tx + 8, tx + 16, tx + 24; tokens 2 ty,
// 2 ty + 1) with plain FMA. Tiles are half (TT) where that is exact: x in half or integer
// activations, and weights t or t * an fp16 scale.
// Each packed byte is read once per threadgroup, so at M tokens the weights are read
// ceil(M / 64) times in all: 1/64 of the packed size per token at 64 tokens.
//   fast (PACKING 1):    a step is 8 bytes = 2 words = 32 columns of a row.
//   compact (PACKING 0): a step is up to 8 bytes (40 columns) of one block (a scale group,
//                        or the whole row).
//
// File convention: text above "//// BODY ////" is the `header`, text below the `source`.
// Inputs: x (M, K) XT; aux (M, AW) float (ACTQ: aux[m][0] = 1 / scale from the pre-pass; a
// 1-element dummy otherwise); wq (N, W) uint32 (fast) | (N, W) uint8 (compact); scales ST;
// bias (N,) BT (dummy when !HAS_BIAS); params int32 [M, N, K, W, SC, B, BPB, NB, AW].
// Output: y (M, N) T. Templates: T, ST, BT, TT, PACKING, SMODE, G, ACTQ, HAS_BIAS, MMA.
// Geometry macros (TERNARY_*: the tile, thread count, step, TERNARY_UNROLL) come from the
// prelude runtime/metal/geometry.py generates; the numbers above are their values today.

//// BODY ////
  const int M = params[0];
  const int N = params[1];
  const int K = params[2];
  const int W = params[3];
  const int SC = params[4];
  const int B = params[5];
  const int BPB = params[6];
  const int NB = params[7];
  const int AW = params[8];
  constexpr int TN = TERNARY_GEMM_TOKENS;        // tokens per tile
  constexpr int TR = TERNARY_GEMM_ROWS;          // rows per tile
  constexpr int NT = TERNARY_GEMM_THREADS;
  constexpr int SB = TERNARY_GEMM_STEP_BYTES;    // bytes of a row per K step
  constexpr int LD = TERNARY_GEMM_TILE_STRIDE;   // elements per tile row
  constexpr int SGT = TERNARY_GEMM_SG_TILE;      // a SIMD group's tokens and rows
  constexpr int MT = TERNARY_MMA_TILE;           // simdgroup matrix side
  constexpr int SF = SGT / MT;                    // matrices per side of a SIMD group's tile
  constexpr int CB = TERNARY_WORD_CODES / TERNARY_WORD_BYTES;  // codes per byte (fast)
  constexpr int TB = TERNARY_BYTE_TRITS;         // trits per byte (compact)
  constexpr int FR = TERNARY_GEMM_FMA_ROWS;      // FMA: rows per thread
  constexpr int FX = TR / FR;                    // FMA: threads along the rows
  constexpr int FT = TN * FX / NT;               // FMA: tokens per thread
  static_assert(NT == TR * SB, "one packed byte per thread per step");
  static_assert(FT * NT == TN * FX, "the FMA threads cover the tile");
  static_assert(CB * SB <= LD && TB * SB < LD, "a step's columns fit a tile row");
  const int tid = int(thread_index_in_threadgroup);
  const int lane = int(thread_index_in_simdgroup);
  const int n0 = int(threadgroup_position_in_grid.y) * TR;
  const int m0 = int(threadgroup_position_in_grid.z) * TN;
  const int mc = min(TN, M - m0);         // tokens of this tile
  const int mc16 = (mc + SGT - 1) / SGT * SGT;  // staged token rows (whole SGT-token sub-tiles)
  const int ty = tid / FX;
  const int tx = tid % FX;

  threadgroup TT ws[TR][LD];
  threadgroup TT xs[TN][LD];

  const int sg = int(simdgroup_index_in_threadgroup);
  const int tb = SGT * (sg / (TR / SGT));
  const int rb = SGT * (sg % (TR / SGT));
  const bool live = tb < mc;  // uniform per SIMD group
  simdgroup_matrix<float, MT, MT> macc[SF][SF];
  TERNARY_UNROLL
  for (int i = 0; i < SF; i++) {
    TERNARY_UNROLL
    for (int j = 0; j < SF; j++) {
      macc[i][j] = make_filled_simdgroup_matrix<float, MT, MT>(0.0f);
    }
  }
  float acc[FT][FR];
  TERNARY_UNROLL
  for (int i = 0; i < FT; i++) {
    TERNARY_UNROLL
    for (int r = 0; r < FR; r++) {
      acc[i][r] = 0.0f;
    }
  }

  // This thread's weight byte in every step: row dr of the tile, byte db of the step.
  const int dr = tid / SB;
  const int db = tid % SB;
  const int dn = min(n0 + dr, N - 1);
  const bool drow = n0 + dr < N;
  const device uchar* wbytes = (const device uchar*)wq;
  const int RBY = PACKING == 1 ? TERNARY_WORD_BYTES * W : W;  // bytes per row

  // Steps: fast walks SB bytes at a time; compact walks (block, SB-byte chunk) pairs.
  const int per_blk = (BPB + SB - 1) / SB;
  const int steps = PACKING == 1 ? (RBY + SB - 1) / SB : NB * per_blk;
  for (int step = 0; step < steps; step++) {
    int kbase;   // first column of the step
    int kc;      // columns in the step
    int klimit;  // columns at or past this are padding (zero trits, x = 0)
    int byte;    // this thread's byte in the row, or -1 when the step has none
    int blk;
    if (PACKING == 1) {
      kbase = step * SB * CB;
      kc = SB * CB;
      klimit = K;
      byte = SB * step + db < RBY ? SB * step + db : -1;
      blk = 0;
    } else {
      blk = step / per_blk;
      const int c0 = (step % per_blk) * SB;
      kbase = blk * B + TB * c0;
      kc = TB * min(SB, BPB - c0);
      klimit = min(blk * B + B, K);
      byte = c0 + db < BPB ? blk * BPB + c0 + db : -1;
    }
    // Columns staged: kc rounded up to the MT of a matrix tile (zeros past kc).
    const int kc8 = MMA ? (kc + MT - 1) / MT * MT : kc;

    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Decode the weight tile once, every thread one byte: ws[row][col] = t * (group scale).
    // Rows past N and bytes past the step read nothing: 0x55 is four zero codes, 128 five
    // zero trits.
    {
      const bool read = drow && byte >= 0;
      uint q = read ? uint(wbytes[dn * RBY + byte]) : (PACKING == 1 ? 0x55u : 128u);
      const int g = PACKING == 1 ? (kbase / max(G, 1)) : blk;
      const float s = SMODE == 2 ? static_cast<float>(scales[dn * SC + min(g, SC - 1)]) : 1.0f;
      if (PACKING == 1) {
        TERNARY_UNROLL
        for (int c = 0; c < CB; c++) {
          ws[dr][CB * db + c] = static_cast<TT>(float(int((q >> (2 * c)) & 3u) - 1) * s);
        }
      } else {
        TERNARY_UNROLL
        for (int d = 0; d < TB; d++) {
          const int digit = int(((q & 0xFFu) * 3u) >> 8);
          ws[dr][TB * db + d] = static_cast<TT>(float(digit - 1) * s);
          q = q * 3u;
        }
      }
    }
    if (kc8 > kc) {
      for (int e = tid; e < TR * (kc8 - kc); e += NT) {
        ws[e / (kc8 - kc)][kc + e % (kc8 - kc)] = static_cast<TT>(0.0f);
      }
    }
    // Stage the tile's tokens (whole 16-token sub-tiles; zeros past M) x kc8 columns.
    for (int e = tid; e < mc16 * kc8; e += NT) {
      const int mi = e / kc8;
      const int c = e % kc8;
      const int k = kbase + c;
      float v = 0.0f;
      if (mi < mc && c < kc && k < klimit) {
        v = static_cast<float>(x[(m0 + mi) * K + k]);
      }
      xs[mi][c] = static_cast<TT>(v);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    if (MMA) {
      if (live) {
        for (int kk = 0; kk < kc8; kk += MT) {
          simdgroup_matrix<TT, MT, MT> a[SF];
          simdgroup_matrix<TT, MT, MT> b[SF];
          TERNARY_UNROLL
          for (int i = 0; i < SF; i++) {
            simdgroup_load(a[i], &xs[tb + MT * i][kk], LD);
            // b[j] (k, n) = ws[n][k]: the weight tile read transposed.
            simdgroup_load(b[i], &ws[rb + MT * i][kk], LD, ulong2(0, 0), true);
          }
          TERNARY_UNROLL
          for (int i = 0; i < SF; i++) {
            TERNARY_UNROLL
            for (int j = 0; j < SF; j++) {
              simdgroup_multiply_accumulate(macc[i][j], a[i], b[j], macc[i][j]);
            }
          }
        }
      }
    } else if (FT * ty < mc) {
      for (int c = 0; c < kc; c++) {
        float xv[FT];
        TERNARY_UNROLL
        for (int i = 0; i < FT; i++) {
          xv[i] = static_cast<float>(xs[FT * ty + i][c]);
        }
        TERNARY_UNROLL
        for (int r = 0; r < FR; r++) {
          const float wv = static_cast<float>(ws[tx + FX * r][c]);
          TERNARY_UNROLL
          for (int i = 0; i < FT; i++) {
            acc[i][r] = fma(xv[i], wv, acc[i][r]);
          }
        }
      }
    }
  }

  // Epilogue per element: row scale, 1 / activation scale, bias.
  if (MMA) {
    if (live) {
      // Lane layout of an 8x8 simdgroup matrix (fixed by the hardware): row fm, columns fn
      // and fn + 1.
      const int qid = lane / 4;
      const int fm = (qid & 4) + (lane / 2) % 4;
      const int fn = (qid & 2) * 2 + (lane % 2) * 2;
      TERNARY_UNROLL
      for (int i = 0; i < SF; i++) {
        const int m = m0 + tb + MT * i + fm;
        TERNARY_UNROLL
        for (int j = 0; j < SF; j++) {
          const auto e = macc[i][j].thread_elements();
          TERNARY_UNROLL
          for (int c = 0; c < MT * MT / TERNARY_SIMD_WIDTH; c++) {
            const int n = n0 + rb + MT * j + fn + c;
            if (m < M && n < N) {
              float out = e[c];
              if (SMODE == 0) {
                out *= static_cast<float>(scales[0]);
              } else if (SMODE == 1) {
                out *= static_cast<float>(scales[n]);
              }
              if (ACTQ) {
                out *= aux[m * AW];
              }
              if (HAS_BIAS) {
                out += static_cast<float>(bias[n]);
              }
              y[m * N + n] = static_cast<T>(out);
            }
          }
        }
      }
    }
  } else {
    TERNARY_UNROLL
    for (int i = 0; i < FT; i++) {
      const int m = m0 + FT * ty + i;
      TERNARY_UNROLL
      for (int r = 0; r < FR; r++) {
        const int n = n0 + tx + FX * r;
        if (m < M && n < N) {
          float out = acc[i][r];
          if (SMODE == 0) {
            out *= static_cast<float>(scales[0]);
          } else if (SMODE == 1) {
            out *= static_cast<float>(scales[n]);
          }
          if (ACTQ) {
            out *= aux[m * AW];
          }
          if (HAS_BIAS) {
            out += static_cast<float>(bias[n]);
          }
          y[m * N + n] = static_cast<T>(out);
        }
      }
    }
  }
