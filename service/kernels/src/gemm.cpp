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
// The AVX-512 library's 12 x 32 kernel ran ~1.8x the AVX2 one's GFLOP per CPU second on
// the Zen 4 host of docs/benchmarks.md (issue 29); KC 256 measured ahead of 128 and 192
// there. Packing the input rows too (BLIS's A panel, [k][MR]) measured 0-15% slower on
// AVX2 there (an extra pass over the input, and the unpacked rows already stream from
// L2), so the input stays unpacked.
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

namespace {

// The micro-kernel's tile: MR rows x NR columns of accumulators in registers.
#ifdef __AVX512F__
// 12 x 32: 24 of AVX-512's 32 registers as accumulators, 2 for the panel's row, 1 broadcast
constexpr int MR = 12, NR = 32;
constexpr int64_t KC = 256, MC = 192, NC = 128;
using vec = __m512;
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline vec vfmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vzero() { return _mm512_setzero_ps(); }
inline void vstore(float* p, vec v) { _mm512_store_ps(p, v); }
#else
// 6 x 16: 12 of AVX2's 16 registers as accumulators, 2 for the panel's row, 1 broadcast
constexpr int MR = 6, NR = 16;
constexpr int64_t KC = 256, MC = 192, NC = 128;
using vec = __m256;
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline vec vfmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vzero() { return _mm256_setzero_ps(); }
inline void vstore(float* p, vec v) { _mm256_store_ps(p, v); }
#endif
constexpr int VW = sizeof(vec) / sizeof(float);  // floats per vector: NR = 2 VW
static_assert(NR == 2 * VW && NC % NR == 0, "two vectors per panel row, whole panels per chunk");

// 8 consecutive weights widened to float32
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline __m256 widen8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline float widen1(const float* p) { return *p; }
inline float widen1(const uint16_t* p) {
  uint32_t bits = (uint32_t)(*p) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
inline float widen1(const int8_t* p) { return (float)*p; }

// r[0..7] (8 rows of 8) transposed in place: r[i][j] <- r[j][i]
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; i++) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; i++) {
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// One panel: weight rows [n, n + nr) (nr <= NR; the rest zero), k in [k0, k0 + kc),
// widened (times the row's scale) into bp[k][NR].
template <typename WT>
void pack_panel(const WT* W, int64_t K, int64_t n, int nr, int64_t k0, int64_t kc, const float* scales, float* bp) {
  if (nr == NR) {
    for (int h = 0; h < NR; h += 8) {
      const WT* w = W + (n + h) * K + k0;
      __m256 s[8];
      for (int j = 0; j < 8; j++) s[j] = _mm256_set1_ps(scales ? scales[n + h + j] : 1.0f);
      int64_t k = 0;
      for (; k + 8 <= kc; k += 8) {
        __m256 r[8];
        for (int j = 0; j < 8; j++) r[j] = _mm256_mul_ps(widen8(w + j * K + k), s[j]);
        transpose8(r);
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(bp + (k + i) * NR + h, r[i]);
      }
      for (; k < kc; k++)
        for (int j = 0; j < 8; j++) bp[k * NR + h + j] = widen1(w + j * K + k) * (scales ? scales[n + h + j] : 1.0f);
    }
    return;
  }
  for (int64_t k = 0; k < kc; k++)
    for (int j = 0; j < NR; j++)
      bp[k * NR + j] = j < nr ? widen1(W + (n + j) * K + k0 + k) * (scales ? scales[n + j] : 1.0f) : 0.0f;
}

// c[m][0..nr) (+)= sum over k < kc of a[m][k] * bp[k][0..nr) (+ bias), m < mr.
// add: c holds a partial sum (or the accumulate input) to add to; bias: null or the
// panel's NR biases (the last K block only).
// c[m][0..nr) = (add ? c : 0) + t[m] (+ bias) for the micro-kernel's mr x NR tile t.
inline void store_tile(const float* t, int mr, float* c, int64_t ldc, int nr, bool add, const float* bias) {
  for (int m = 0; m < mr; m++) {
    float* cm = c + m * ldc;
    const float* tm = t + m * NR;
    if (nr == NR) {
      for (int h = 0; h < NR; h += 8) {
        __m256 v = _mm256_load_ps(tm + h);
        if (add) v = _mm256_add_ps(_mm256_loadu_ps(cm + h), v);
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + h));
        _mm256_storeu_ps(cm + h, v);
      }
    } else {
      for (int j = 0; j < nr; j++) {
        const float v = add ? cm[j] + tm[j] : tm[j];
        cm[j] = bias ? v + bias[j] : v;
      }
    }
  }
}

template <int mr>
inline void micro(const float* a, int64_t lda, const float* bp, int64_t kc, float* c, int64_t ldc, int nr, bool add,
                  const float* bias) {
  vec c0[mr], c1[mr];
  for (int m = 0; m < mr; m++) c0[m] = c1[m] = vzero();
  for (int64_t k = 0; k < kc; k++) {
    const vec b0 = vload(bp + k * NR), b1 = vload(bp + k * NR + VW);
    for (int m = 0; m < mr; m++) {
      const vec av = vbroadcast(a + m * lda + k);
      c0[m] = vfmadd(av, b0, c0[m]);
      c1[m] = vfmadd(av, b1, c1[m]);
    }
  }
  // the tile leaves the registers once, then is added where it goes (kept out of the
  // loop above: indexing the accumulators at run time made the compiler keep them in memory)
  alignas(64) float t[mr][NR];
  for (int m = 0; m < mr; m++) {
    vstore(t[m], c0[m]);
    vstore(t[m] + VW, c1[m]);
  }
  store_tile(&t[0][0], mr, c, ldc, nr, add, bias);
}

template <int mr = MR>
inline void micro_rows(int rows, const float* a, int64_t lda, const float* bp, int64_t kc, float* c, int64_t ldc,
                       int nr, bool add, const float* bias) {
  if constexpr (mr > 1) {
    if (rows < mr) return micro_rows<mr - 1>(rows, a, lda, bp, kc, c, ldc, nr, add, bias);
  }
  micro<mr>(a, lda, bp, kc, c, ldc, nr, add, bias);
}

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
