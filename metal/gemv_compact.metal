// Decode GEMV, compact packing (base-3, 5 trits per byte): y (M, N) = act_quant(x) (M, K) @
// (s * t).T + bias for up to 16 tokens in one launch, every packed byte read once whatever M.
//
// Thread mapping: one threadgroup = NSG = 2 WL SIMD groups owns 64 output rows (grid.y =
// ceil(N / 64)) and every token; in a SIMD group, lane l works on unit lane wl = l % WL of
// row l / WL (one row per lane). A row is cut into units of UB = 52 bytes (13 words, 260
// trits: TERNARY_UNIT_BYTES, the smallest span that is whole words and whole blocks of every
// group size; blocks are 13, 26 or 52 bytes). The threadgroup walks K in super-steps of WL
// units per row; lane wl holds unit s * WL + wl of its row in 13 registers (52 contiguous
// bytes) and decodes word i = 0..12 of it in sub-step i. So where a block edge falls inside
// a word is the same for every lane and known at compile time (the sub-steps are unrolled):
// a word's bytes sum into at most 2 chains (block parts), each taking its block's scale in
// one FMA per token, with no per-lane routing. Sub-steps run in phases of PH; per phase the
// threadgroup stages, for every token and each of the WL units' words of the phase (<= 16
// words, as many as before), the bytes' six decode coefficients (below) and each chain's
// (negated) correction. WL (2, 4 or 8) is chosen per layer so that the last super-step
// leaves few lanes idle (geometry.compact_unit_lanes). ACTQ quantizes x while staging (one
// launch per call).
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
// product and sum is exact (c_k is a multiple of 1/2 below 257, h_k has 9 significant bits,
// a word's chain sums at most 24 products), hence the bit-identical twin.
//
// Blocks: with group scales (G > 0) a block is one group of G columns, BPB = ceil(G / 5)
// bytes; byte b holds columns blk * G + 5 (b - blk BPB) .. +4 of block blk = b / BPB. BPB
// divides UB, so a unit holds UB / BPB whole blocks. Without group scales the row is one
// block (byte b holds columns 5b..5b+4) and a unit one chain per word. Pad trits are zero
// trits; bytes past the last block (row padding to 4 bytes) get zero coefficients.
//
// File convention: text above the "//// BODY ////" line is the `header`, text below the `source`.
// Inputs: x (M, K) XT; wq (N, RB) uint8; scales ST; bias (N,) BT (dummy when !HAS_BIAS);
// params int32 [M, N, K, RB, SC, VB (valid bytes per row)]. Output: y (M, N) T.
// Templates: T, XT, XS (coefficient type: half with ACTQ, else float), ST, BT, TM, WL, NSG,
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
  constexpr int WB = TERNARY_WORD_BYTES;    // bytes per word
  constexpr int TB = TERNARY_BYTE_TRITS;    // trits per byte
  constexpr int UB = TERNARY_UNIT_BYTES;    // bytes per unit
  constexpr int UW = UB / WB;               // words per unit (sub-steps per super-step)
  constexpr int NF = TB + 1;                // fractions per byte
  constexpr int NT = NSG * L;
  constexpr int BU = G > 0 ? (G + TB - 1) / TB : UB;  // bytes per block (a unit without groups)
  constexpr int NBU = UB / BU;                        // blocks per unit
  // Phases: PH sub-steps (words of each of the WL units) staged together, <= 16 words.
  constexpr int NPH = (UW * WL + TERNARY_GEMV_STAGE_WORDS - 1) / TERNARY_GEMV_STAGE_WORDS;
  constexpr int PH = (UW + NPH - 1) / NPH;
  constexpr int SW = WL * PH;  // staged words per phase
  const uint tid = thread_index_in_threadgroup;
  const uint lane = thread_index_in_simdgroup;
  const uint sg = simdgroup_index_in_threadgroup;
  const int wl = int(lane) % WL;
  const int row = int(threadgroup_position_in_grid.y) * (NSG * L / WL) + int(sg) * (L / WL) +
                  int(lane) / WL;
  const int rowc = min(row, N - 1);  // in bounds; a row past N is skipped

  // Per token and staged word: for each of its two registers (bytes 0 and 2; bytes 1 and 3)
  // and each k, the pair (c_k of the low byte, c_k of the high byte), two k per vector.
  threadgroup vec<XS, 4> ce[TM][SW][2][NF / 2];
  // Per token and staged word: -3 sum y of each chain's bytes (chain c in component c).
  threadgroup float2 cc[TM][SW];
  threadgroup float tsc[TM];
  threadgroup float tinv[TM];
  threadgroup float tred[NSG * TM];
  if (ACTQ) {
    ternary_token_scales<XT, TM, NSG>(x, M, K, tid, lane, sg, tred, tsc, tinv);
  }

  float acc[TM];
  TERNARY_UNROLL
  for (int m = 0; m < TM; m++) {
    acc[m] = 0.0f;
  }
  const device uint* wwords = (const device uint*)wq;
  const int RW = RB / WB;
  const int units = (VB + UB - 1) / UB;
  const int steps = (units + WL - 1) / WL;
  for (int s = 0; s < steps; s++) {
    const int u = s * WL + wl;
    const bool active = row < N && u < units;
    // The unit's 13 words (words past the row read as 0: their coefficients are 0).
    uint w[UW];
    const int j0 = u * UW;
    const device uint* src = wwords + rowc * RW + j0;
    if (active && j0 + UW <= RW) {
      TERNARY_UNROLL
      for (int i = 0; i < UW; i++) {
        w[i] = src[i];
      }
    } else {
      TERNARY_UNROLL
      for (int i = 0; i < UW; i++) {
        w[i] = active && j0 + i < RW ? src[i] : 0u;
      }
    }
    float sc[NBU];  // each block's scale (group scales; else applied at the end)
    TERNARY_UNROLL
    for (int b = 0; b < NBU; b++) {
      sc[b] = SMODE == 2 ? static_cast<float>(scales[rowc * SC + min(u * NBU + b, SC - 1)])
                         : 1.0f;
    }

    TERNARY_UNROLL
    for (int ph = 0; ph < NPH; ph++) {
      const int i0 = ph * PH;
      const int nw = min(PH, UW - i0);  // sub-steps of this phase
      threadgroup_barrier(mem_flags::mem_threadgroup);
      // Stage: item e = (token m, unit lane v, sub-step ii): the word's 4 bytes.
      for (int e = int(tid); e < M * WL * nw; e += NT) {
        const int m = e / (WL * nw);
        const int v = (e / nw) % WL;
        const int ii = e % nw;
        const int ub = i0 * WB + ii * WB;           // the word's first byte in its unit
        const int b0 = (s * WL + v) * UB + ub;      // ... in the row
        float2 corr = float2(0.0f);
        float c[WB][NF];
        TERNARY_UNROLL
        for (int t = 0; t < WB; t++) {
          const int b = b0 + t;
          int col = TB * b;
          int lim = K;
          if (G > 0) {
            const int blk = b / BU;
            col = blk * G + TB * (b - blk * BU);
            lim = min(blk * G + G, K);
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
          corr[(ub + t) / BU == ub / BU ? 0 : 1] -= 3.0f * sum;
          c[t][0] = 1.5f * yv[0];
          TERNARY_UNROLL
          for (int k = 1; k < TB; k++) {
            c[t][k] = fma(yv[k], 1.5f, -0.5f * yv[k - 1]);
          }
          c[t][TB] = -0.5f * yv[TB - 1];
        }
        // Register 0 holds bytes 0 (low half) and 2 (high); register 1 bytes 1 and 3.
        const int sw = v * PH + ii;
        TERNARY_UNROLL
        for (int g = 0; g < 2; g++) {
          TERNARY_UNROLL
          for (int k = 0; k < NF; k += 2) {
            ce[m][sw][g][k / 2] = vec<XS, 4>(static_cast<XS>(c[g][k]), static_cast<XS>(c[g + 2][k]),
                                             static_cast<XS>(c[g][k + 1]),
                                             static_cast<XS>(c[g + 2][k + 1]));
          }
        }
        cc[m][sw] = corr;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);

      if (active) {
        TERNARY_UNROLL
        for (int ii = 0; ii < PH; ii++) {
          const int i = i0 + ii;  // the word of the unit: a compile-time constant once unrolled
          if (i < UW) {
            // Chains: the block of the word's first byte (0) and, where a block edge falls
            // inside the word, the next one (1); byte t's chain and each chain's block.
            const int blo = (i * WB) / BU;
            const int bhi = (i * WB + WB - 1) / BU;
            const int sw = wl * PH + ii;
            // h[g][k]: fractions k of register g's two bytes.
            half2 h[2][NF];
            uint r[2];
            r[0] = ((w[i] << 2) & TERNARY_LANE_MASK) | TERNARY_FRAC_EXP;
            r[1] = ((w[i] >> 6) & TERNARY_LANE_MASK) | TERNARY_FRAC_EXP;
            TERNARY_UNROLL
            for (int k = 0; k < NF; k++) {
              TERNARY_UNROLL
              for (int g = 0; g < 2; g++) {
                h[g][k] = as_type<half2>(r[g]);
                r[g] = (r[g] + (r[g] << 1)) & TERNARY_FRAC_MASK;
              }
            }
            TERNARY_UNROLL
            for (int m = 0; m < TM; m++) {
              if (m < M) {
                // Each chain starts at its correction, one FMA per fraction (byte g: register
                // g % 2's low half, byte g + 2 its high half), then one FMA with its block's
                // scale (group scales) or one add (per word: exact with integer activations).
                const float2 c0 = cc[m][sw];
                float p[2] = {c0.x, c0.y};
                TERNARY_UNROLL
                for (int g = 0; g < 2; g++) {
                  const int lo = (i * WB + g) / BU == blo ? 0 : 1;      // chain of byte g
                  const int hi = (i * WB + g + 2) / BU == blo ? 0 : 1;  // chain of byte g + 2
                  TERNARY_UNROLL
                  for (int k = 0; k < NF; k += 2) {
                    const vec<XS, 4> cv = ce[m][sw][g][k / 2];
                    p[lo] = fma(static_cast<float>(h[g][k].x), static_cast<float>(cv[0]), p[lo]);
                    p[hi] = fma(static_cast<float>(h[g][k].y), static_cast<float>(cv[1]), p[hi]);
                    p[lo] = fma(static_cast<float>(h[g][k + 1].x), static_cast<float>(cv[2]),
                                p[lo]);
                    p[hi] = fma(static_cast<float>(h[g][k + 1].y), static_cast<float>(cv[3]),
                                p[hi]);
                  }
                }
                acc[m] = SMODE == 2 ? fma(sc[blo], p[0], acc[m]) : acc[m] + p[0];
                if (bhi != blo) {
                  acc[m] = SMODE == 2 ? fma(sc[bhi], p[1], acc[m]) : acc[m] + p[1];
                }
              }
            }
          }
        }
      }
    }
  }

  TERNARY_UNROLL
  for (int m = 0; m < TM; m++) {
    if (m < M) {
      const float total = ternary_lane_sum<WL>(acc[m]);
      if (wl == 0 && row < N) {
        const float srow = SMODE == 0 ? static_cast<float>(scales[0])
                         : (SMODE == 1 ? static_cast<float>(scales[row]) : 1.0f);
        float out = total * srow;
        if (ACTQ) {
          out *= tinv[m];
        }
        if (HAS_BIAS) {
          out += static_cast<float>(bias[row]);
        }
        y[m * N + row] = static_cast<T>(out);
      }
    }
  }
