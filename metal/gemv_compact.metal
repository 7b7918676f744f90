// Decode GEMV, compact packing (base-3, 5 trits per byte): y (M, N) = act_quant(x) (M, K) @
// (s * t).T + bias for up to 16 tokens in one launch, every packed byte read once whatever M.
//
// Thread mapping: as gemv_fast.metal. One threadgroup = NSG SIMD groups owns 64 output rows
// and every token; lane l works on word lane wl = l % WL of row group l / WL and owns RL rows.
// A step is WL 32-bit words = 64 bytes = 320 trits of each row; the threadgroup stages, per
// token and byte of the step, the byte's six decode coefficients (below) and, per word, the
// (negated) correction of each byte, then each lane decodes its word of each of its rows once
// and applies it to every token. ACTQ quantizes x while staging (one launch per call).
//
// Decode ("exact-float" fractions, after PrismML's llama.cpp PR #157, in two 16-bit lanes):
// byte q holds digits d_n = floor(3 f_n) (trit t_n = d_n - 1) of the fractions f_0 = q / 256,
// f_{n+1} = frac(3 f_n), so d_n = 3 f_n - f_{n+1} and, for the 5 columns y_0..y_4 of a byte,
//   sum_n t_n y_n = sum_{k=0..5} f_k e_k - sum_n y_n,
//   e_0 = 3 y_0, e_k = 3 y_k - y_{k-1} (k = 1..4), e_5 = -y_4.
// The fraction lives in the mantissa of a half: h_k = 2 (1 + f_k), bits 0x4000 | r_k << 2 with
// r_k = 256 f_k. Two bytes share a 32-bit register (bits 2-9 and 18-25, two halves), and one
// step k -> k + 1 of both is two full-rate integer ops: u += u << 1 (x3; the low half's
// carry stays below bit 16 and the exponent bit 14 stays set, since 3 * 0x4000 = 0xC000
// keeps bit 14 and the carry lands in bits 10-11 and 15) and u &= 0x43FC43FC (drop carry and
// sign). Since sum_k h_k e_k = 2 sum_k f_k e_k + 4 sum_n y_n, the staged coefficients are
// c_k = e_k / 2 and the correction is 3 sum_n y_n:
//   sum_n t_n y_n = sum_k h_k c_k - 3 sum_n y_n.
// Per word: 2 placements (shift, AND, OR) and 5 x 2 steps = 26 integer ops for 20 trits,
// 24 FMAs per token (docs/KERNELS.md counts both kernels). With integer activations every
// product and sum is exact (c_k is a multiple of 1/2 below 257, h_k has 9 significant bits).
//
// Blocks: with group scales (G > 0) a block is one group of G columns, BPB = ceil(G / 5)
// bytes; byte b holds columns blk * G + 5 (b - blk BPB) .. +4 of block blk = b / BPB, and a
// word's 4 bytes span at most 2 blocks (BPB > 4). A word's partial sum per token is kept in
// NCH chains of bytes that always share a block (one when 4 divides BPB, G = 256; two, bytes
// 0-1 and 2-3, when 2 does, G = 128; one per byte otherwise, G = 64), each chain's sum
// taking its block's scale in one FMA.
// Without group scales the row is one block: byte b holds columns 5b..5b+4. Pad trits are
// zero trits; bytes past the last block (row padding to 4 bytes) get zero coefficients.
//
// File convention: text above the "//// BODY ////" line is the `header`, text below the `source`.
// Inputs: x (M, K) XT; wq (N, RB) uint8; scales ST; bias (N,) BT (dummy when !HAS_BIAS);
// params int32 [M, N, K, RB, SC, VB (valid bytes per row)]. Output: y (M, N) T.
// Templates: T, XT, XS (coefficient type: half with ACTQ, else float), ST, BT, TM, RL, NSG,
// SMODE, G, ACTQ, HAS_BIAS. Geometry macros (TERNARY_*) come from runtime/metal/geometry.py.

constant constexpr uint TERNARY_LANE_MASK = 0x03FC03FCu;  // r << 2 in both halves
constant constexpr uint TERNARY_FRAC_EXP = 0x40004000u;   // fp16 exponent of 2 in both halves
constant constexpr uint TERNARY_FRAC_MASK = TERNARY_LANE_MASK | TERNARY_FRAC_EXP;

//// BODY ////
  const int M = params[0];
  const int N = params[1];
  const int K = params[2];
  const int RB = params[3];
  const int SC = params[4];
  const int VB = params[5];
  constexpr int L = TERNARY_SIMD_WIDTH;
  constexpr int WL = TERNARY_GEMV_WORD_LANES;  // lanes along K per row group
  constexpr int WB = TERNARY_WORD_BYTES;       // bytes per word
  constexpr int TB = TERNARY_BYTE_TRITS;       // trits per byte
  constexpr int NF = TB + 1;                   // fractions per byte
  constexpr int SR = (L / WL) * RL;            // rows per SIMD group
  constexpr int NT = NSG * L;
  constexpr int BPB = G > 0 ? (G + TB - 1) / TB : 1;
  // Partial sums per word and token (chains): bytes in one chain always share a block.
  // Block edges fall at multiples of BPB bytes: never inside a word when 4 divides BPB (one
  // chain: G = 0, 256), only between bytes 1 and 2 when 2 does (two: bytes 0-1 and 2-3,
  // the low and high halves of both registers; G = 128), anywhere otherwise (four; G = 64).
  constexpr int NCH = (G == 0 || BPB % WB == 0) ? 1 : (BPB % 2 == 0 ? 2 : WB);
  constexpr int CB = WB / NCH;  // bytes per chain
  const uint tid = thread_index_in_threadgroup;
  const uint lane = thread_index_in_simdgroup;
  const uint sg = simdgroup_index_in_threadgroup;
  const int wl = int(lane) % WL;
  const int row0 = int(threadgroup_position_in_grid.y) * NSG * SR + int(sg) * SR +
                   (int(lane) / WL) * RL;

  // Per token and staged word: for each of its two registers (bytes 0 and 2; bytes 1 and 3)
  // and each k, the pair (c_k of the low byte, c_k of the high byte), two k per vector.
  threadgroup vec<XS, 4> ce[TM][WL][2][NF / 2];
  // Per word: -3 sum y of each chain's bytes (chain c in component c).
  threadgroup float4 cc[TM][WL];
  // Per word (group scales): the scale column of each chain's block, staged once for the
  // threadgroup's 64 rows.
  threadgroup int4 cb[WL];
  threadgroup float tsc[TM];
  threadgroup float tinv[TM];
  threadgroup float tred[NSG * TM];
  if (ACTQ) {
    ternary_token_scales<XT, TM, NSG>(x, M, K, tid, lane, sg, tred, tsc, tinv);
  }

  int rows[RL];
  TERNARY_UNROLL
  for (int r = 0; r < RL; r++) {
    rows[r] = min(row0 + r, N - 1);  // in bounds; rows past N are skipped
  }
  float acc[RL][TM];
  TERNARY_UNROLL
  for (int r = 0; r < RL; r++) {
    TERNARY_UNROLL
    for (int m = 0; m < TM; m++) {
      acc[r][m] = 0.0f;
    }
  }
  const device uint* wwords = (const device uint*)wq;
  const int nwords = (VB + WB - 1) / WB;
  const int RW = RB / WB;
  const int steps = (nwords + WL - 1) / WL;
  for (int s = 0; s < steps; s++) {
    // The word's bytes: first column and block part (0: the word's first block, 1: the next).
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int e = int(tid); e < M * WL; e += NT) {
      const int m = e / WL;
      const int w = e % WL;
      const int b0 = (s * WL + w) * WB;
      const int blk0 = G > 0 ? b0 / BPB : 0;
      float4 corr = float4(0.0f);
      float c[WB][NF];
      TERNARY_UNROLL
      for (int i = 0; i < WB; i++) {
        const int b = b0 + i;
        int part = 0;
        int col = TB * b;
        int lim = K;
        if (G > 0) {
          int off = b - blk0 * BPB;
          part = off >= BPB ? 1 : 0;
          off -= part * BPB;
          col = (blk0 + part) * G + TB * off;
          lim = min((blk0 + part) * G + G, K);
        }
        float yv[TB];
        float sum = 0.0f;
        TERNARY_UNROLL
        for (int d = 0; d < TB; d++) {
          float f = (b < VB && col + d < lim) ? static_cast<float>(x[m * K + col + d]) : 0.0f;
          if (ACTQ) {
            f = ternary_act_quant(f, tsc[m]);
          }
          yv[d] = f;
          sum += f;
        }
        corr[i / CB] -= 3.0f * sum;
        c[i][0] = 1.5f * yv[0];
        TERNARY_UNROLL
        for (int k = 1; k < TB; k++) {
          c[i][k] = fma(yv[k], 1.5f, -0.5f * yv[k - 1]);
        }
        c[i][TB] = -0.5f * yv[TB - 1];
      }
      // Register 0 holds bytes 0 (low half) and 2 (high); register 1 bytes 1 and 3.
      TERNARY_UNROLL
      for (int g = 0; g < 2; g++) {
        TERNARY_UNROLL
        for (int k = 0; k < NF; k += 2) {
          ce[m][w][g][k / 2] = vec<XS, 4>(static_cast<XS>(c[g][k]), static_cast<XS>(c[g + 2][k]),
                                          static_cast<XS>(c[g][k + 1]),
                                          static_cast<XS>(c[g + 2][k + 1]));
        }
      }
      cc[m][w] = corr;
      if (G > 0 && m == 0) {
        int4 sv = int4(0);
        TERNARY_UNROLL
        for (int c = 0; c < NCH; c++) {
          sv[c] = min((b0 + c * CB) / BPB, SC - 1);
        }
        cb[w] = sv;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const int j = s * WL + wl;
    if (j < nwords) {
      const int4 sidx = G > 0 ? cb[wl] : int4(0);  // each chain's scale column
      TERNARY_UNROLL
      for (int r = 0; r < RL; r++) {
        if (row0 + r >= N) {
          continue;  // rows past N read nothing (and are never written)
        }
        const uint w = wwords[rows[r] * RW + j];
        // h[g][k]: fractions k of register g's two bytes.
        half2 h[2][NF];
        uint u[2];
        u[0] = ((w << 2) & TERNARY_LANE_MASK) | TERNARY_FRAC_EXP;
        u[1] = ((w >> 6) & TERNARY_LANE_MASK) | TERNARY_FRAC_EXP;
        TERNARY_UNROLL
        for (int k = 0; k < NF; k++) {
          TERNARY_UNROLL
          for (int g = 0; g < 2; g++) {
            h[g][k] = as_type<half2>(u[g]);
            u[g] = (u[g] + (u[g] << 1)) & TERNARY_FRAC_MASK;
          }
        }
        float sc[NCH];  // each chain's scale (group scales; else applied at the end)
        TERNARY_UNROLL
        for (int c = 0; c < NCH; c++) {
          sc[c] = SMODE == 2 ? static_cast<float>(scales[rows[r] * SC + sidx[c]]) : 1.0f;
        }
        TERNARY_UNROLL
        for (int m = 0; m < TM; m++) {
          if (m < M) {
            // Each chain starts at its correction, one FMA per fraction (byte g: register
            // g % 2's low half, byte g + 2 its high half), then one FMA with its block's
            // scale (group scales) or one add (kept per word: exact with integer
            // activations).
            const float4 c0 = cc[m][wl];
            float p[NCH];
            TERNARY_UNROLL
            for (int c = 0; c < NCH; c++) {
              p[c] = c0[c];
            }
            TERNARY_UNROLL
            for (int g = 0; g < 2; g++) {
              const int lo = g / CB;        // chain of byte g
              const int hi = (g + 2) / CB;  // chain of byte g + 2
              TERNARY_UNROLL
              for (int k = 0; k < NF; k += 2) {
                const vec<XS, 4> v = ce[m][wl][g][k / 2];
                p[lo] = fma(static_cast<float>(h[g][k].x), static_cast<float>(v[0]), p[lo]);
                p[hi] = fma(static_cast<float>(h[g][k].y), static_cast<float>(v[1]), p[hi]);
                p[lo] = fma(static_cast<float>(h[g][k + 1].x), static_cast<float>(v[2]), p[lo]);
                p[hi] = fma(static_cast<float>(h[g][k + 1].y), static_cast<float>(v[3]), p[hi]);
              }
            }
            TERNARY_UNROLL
            for (int c = 0; c < NCH; c++) {
              acc[r][m] = SMODE == 2 ? fma(sc[c], p[c], acc[r][m]) : acc[r][m] + p[c];
            }
          }
        }
      }
    }
  }

  TERNARY_UNROLL
  for (int r = 0; r < RL; r++) {
    const int n = row0 + r;
    TERNARY_UNROLL
    for (int m = 0; m < TM; m++) {
      if (m < M) {
        const float total = ternary_lane_sum<WL>(acc[r][m]);
        if (wl == 0 && n < N) {
          const float srow = SMODE == 0 ? static_cast<float>(scales[0])
                           : (SMODE == 1 ? static_cast<float>(scales[n]) : 1.0f);
          float out = total * srow;
          if (ACTQ) {
            out *= tinv[m];
          }
          if (HAS_BIAS) {
            out += static_cast<float>(bias[n]);
          }
          y[m * N + n] = static_cast<T>(out);
        }
      }
    }
  }
