// The register tile of the prefill-sized products (gemm.cpp) and of prefill attention
// (attention.cpp): an MR x NR block of float32 accumulators, one pass over a packed
// panel of KC (or any) depth, BLIS's micro-kernel with the left operand unpacked.
//
//   pack_panel   NR rows of a row-major (N, K) matrix (float32, bf16 or int8; times a row
//                scale) widened into a panel laid out [k][NR]: rows become columns
//   micro_rows   c[m][0..nr) (+)= sum over k of a[m][k] * panel[k][0..nr) (+ bias),
//                1 <= rows <= MR rows of a at stride lda
//
// Included by each .cpp that uses it: everything here has internal linkage.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace {

// The micro-kernel's tile: MR rows x NR columns of accumulators in registers.
#ifdef __AVX512F__
// 12 x 32: 24 of AVX-512's 32 registers as accumulators, 2 for the panel's row, 1 broadcast
constexpr int MR = 12, NR = 32;
using vec = __m512;
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline vec vfmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vzero() { return _mm512_setzero_ps(); }
inline void vstore(float* p, vec v) { _mm512_store_ps(p, v); }
#else
// 6 x 16: 12 of AVX2's 16 registers as accumulators, 2 for the panel's row, 1 broadcast
constexpr int MR = 6, NR = 16;
using vec = __m256;
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline vec vfmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vzero() { return _mm256_setzero_ps(); }
inline void vstore(float* p, vec v) { _mm256_store_ps(p, v); }
#endif
constexpr int VW = sizeof(vec) / sizeof(float);  // floats per vector: NR = 2 VW
static_assert(NR == 2 * VW, "two vectors per panel row");

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

}  // namespace
