// Prefill-sized products y = x W^T * scales + bias for any number of rows, the weights
// read in their stored format (float32, bfloat16, int8 with per-row scales) and widened
// to float32 once per call, in cache-sized panels that every input row then reuses:
// a bfloat16 weight is read from memory at half float32's bytes and never widened into
// a whole float32 copy (what torch's path does on CPUs without AVX-512 BF16: a new
// (N, K) float32 tensor per call, then MKL's SGEMM).
//
// Blocking (BLIS's, with the input left unpacked):
//
//   threads     chunks of NC output columns (weight rows) each, claimed from pool.h
//   pc          K in blocks of KC: the chunk's KC x NC weights widened (times the row
//               scale for int8) into a thread's panel buffer, NR columns per panel,
//               laid out [k][NR] (~128 KiB: L2)
//   ic          input rows in blocks of MC (MC x KC float32, ~192 KiB: L2)
//   panel       one NR-column panel (KC x NR: 16 KiB on AVX2, 32 KiB on AVX-512: L1)
//   ir          MR input rows: the micro-kernel, MR x NR accumulators in registers
//               (6 x 16 on AVX2: 12 of the 16 vector registers, 2 for the panel's row,
//               1 for the broadcast input; 12 x 32 on AVX-512: 24 of 32), one pass
//               over the panel's KC values
//
// KC 256 measured ahead of 128 and 192. Packing the input rows too (BLIS's A panel,
// [k][MR]) measured slower on AVX2 (an extra pass over the input, and the unpacked rows
// already stream from L2), so the input stays unpacked. Figures: docs/benchmarks-log.md, "Measurement notes".
//
// Each output's sum runs over K in blocks of KC, in order, so a row's result does not
// depend on the other rows (bit for bit: each row is computed with the same operations
// whatever the batch; tested). It differs in the last bits from torch's GEMM and from
// gemv.cpp's decode products (another summation order).
//
//   x (M, K) float32, row stride ldx        W (N, K) float32 | bf16 | int8, row-major
//   scales (N,) float32 or null (int8)      bias (N,) float32 or null
//   y (M, N) float32, row stride ldy;  accumulate: y += result

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "kvkernels.h"
#include "pool.h"
#include "tile.h"

namespace {

constexpr int64_t KC = 256, MC = 192, NC = 128;
static_assert(NC % NR == 0, "whole panels per chunk");

template <typename WT>
void gemm(const float* x, int64_t M, int64_t ldx, int64_t K, const WT* W, int64_t N, const float* scales,
          const float* bias, float* y, int64_t ldy, int accumulate, int nthreads) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // an empty sum: the bias (or nothing) is the result
    for (int64_t m = 0; m < M; m++)
      for (int64_t n = 0; n < N; n++) y[m * ldy + n] = (accumulate ? y[m * ldy + n] : 0.0f) + (bias ? bias[n] : 0.0f);
    return;
  }
  kvpool::parallel_for(N, NC, nthreads, [&](int64_t n0, int64_t n1) {
    thread_local std::vector<float> buf;
    buf.resize(NC * KC);  // n1 - n0 <= NC: one chunk per call (grain NC)
    float* bp = buf.data();
    for (int64_t cn0 = n0; cn0 < n1; cn0 += NC) {
      const int64_t cn1 = n1 - cn0 < NC ? n1 : cn0 + NC;
      float bias_pad[NC];
      if (bias) {
        for (int64_t j = 0; j < NC; j++) bias_pad[j] = cn0 + j < cn1 ? bias[cn0 + j] : 0.0f;
      }
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        const bool last = k0 + kc == K, add = k0 > 0 || accumulate;
        for (int64_t n = cn0, p = 0; n < cn1; n += NR, p++) {
          const int nr = cn1 - n < NR ? (int)(cn1 - n) : NR;
          pack_panel(W, K, n, nr, k0, kc, scales, bp + p * kc * NR);
        }
        for (int64_t m0 = 0; m0 < M; m0 += MC) {
          const int64_t m1 = M - m0 < MC ? M : m0 + MC;
          for (int64_t n = cn0, p = 0; n < cn1; n += NR, p++) {
            const int nr = cn1 - n < NR ? (int)(cn1 - n) : NR;
            const float* pb = bp + p * kc * NR;
            const float* bb = bias && last ? bias_pad + (n - cn0) : nullptr;
            for (int64_t m = m0; m < m1; m += MR) {
              const int rows = m1 - m < MR ? (int)(m1 - m) : MR;
              micro_rows(rows, x + m * ldx + k0, ldx, pb, kc, y + m * ldy + n, ldy, nr, add, bb);
            }
          }
        }
      }
    }
  });
}

}  // namespace

extern "C" {

void kv_gemm_f32(const float* x, int64_t rows, int64_t ldx, int64_t K, const float* W, int64_t N, const float* scales,
                 const float* bias, float* y, int64_t ldy, int accumulate, int nthreads) {
  gemm<float>(x, rows, ldx, K, W, N, scales, bias, y, ldy, accumulate, nthreads);
}

void kv_gemm_bf16(const float* x, int64_t rows, int64_t ldx, int64_t K, const uint16_t* W, int64_t N,
                  const float* scales, const float* bias, float* y, int64_t ldy, int accumulate, int nthreads) {
  gemm<uint16_t>(x, rows, ldx, K, W, N, scales, bias, y, ldy, accumulate, nthreads);
}

void kv_gemm_i8(const float* x, int64_t rows, int64_t ldx, int64_t K, const int8_t* W, int64_t N, const float* scales,
                const float* bias, float* y, int64_t ldy, int accumulate, int nthreads) {
  gemm<int8_t>(x, rows, ldx, K, W, N, scales, bias, y, ldy, accumulate, nthreads);
}

}  // extern "C"
