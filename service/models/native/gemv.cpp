// Decode-sized products y = x W^T (+ bias) for 1..64 rows, read straight from the
// weights' own (out, in) row-major storage: float32, bfloat16, or int8 with one float
// scale per output row. AVX2 + FMA, output rows split over the threads of pool.h (the
// caller passes the thread count: torch's).
//
// Decode is bound by reading the weights once per step. Each output row's weights
// (in floats, <= a few KiB in the products of the models served) are loaded once per
// group of up to 4 input rows and stay in L1 across the groups, so the weights stream
// from memory once per call at any row count. Every output is the dot product of one
// input row and one weight row summed in the same order whatever the other rows are:
// a row's result does not depend on what else is in the batch.
//
//   x (rows, K) float32, row stride ldx        W (N, K): float32 | bf16 | int8
//   scales (N,) float32 or null (int8 only)    bias (N,) float32 or null
//   y (rows, N) float32, row stride ldy;  accumulate: y += result (a residual add)

#include <immintrin.h>
#include <stdint.h>

#include <vector>

#include "pool.h"

namespace {

inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const uint16_t* w) {  // bfloat16: the high half of a float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)w)), 16));
}
inline __m256 load8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)w)));
}
inline float load1(const float* w) { return *w; }
inline float load1(const uint16_t* w) {
  uint32_t bits = (uint32_t)(*w) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}
inline float load1(const int8_t* w) { return (float)(*w); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[r] = dot(w[0:K], x[r*ldx : r*ldx + K]) for r < R <= 2: four accumulators per row
// (32 weights per iteration: one chain would be bound by the multiply-add's latency),
// then 8 at a time, then the tail one by one. The summation order depends on K only, so a
// row's result is the same whichever rows it is grouped with.
template <typename WT, int R>
inline void dot_rows(const WT* w, const float* x, int64_t ldx, int64_t K, float* out) {
  __m256 a[4][R];
  for (int c = 0; c < 4; c++)
    for (int r = 0; r < R; r++) a[c][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m256 w0 = load8(w + k), w1 = load8(w + k + 8), w2 = load8(w + k + 16), w3 = load8(w + k + 24);
    for (int r = 0; r < R; r++) {
      const float* xr = x + r * ldx + k;
      a[0][r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a[0][r]);
      a[1][r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a[1][r]);
      a[2][r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), a[2][r]);
      a[3][r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), a[3][r]);
    }
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 w0 = load8(w + k);
    for (int r = 0; r < R; r++) a[0][r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + k), a[0][r]);
  }
  for (int r = 0; r < R; r++)
    out[r] = hsum(_mm256_add_ps(_mm256_add_ps(a[0][r], a[1][r]), _mm256_add_ps(a[2][r], a[3][r])));
  for (; k < K; k++) {
    const float wk = load1(w + k);
    for (int r = 0; r < R; r++) out[r] += wk * x[r * ldx + k];
  }
}

// bfloat16: 16 weights per 256-bit load, widened in two ops without a shuffle: the even
// elements are each 32-bit lane shifted left 16, the odd ones the lane with its low half
// cleared. The input is permuted once per call to match, per block of 16: its even
// elements, then its odd ones (xp below); K % 16 == 0 for this path.
template <int R>
inline void dot_rows_bf16(const uint16_t* w, const float* xp, int64_t K, float* out) {
  const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
  __m256 a[4][R];
  for (int c = 0; c < 4; c++)
    for (int r = 0; r < R; r++) a[c][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m256i v0 = _mm256_loadu_si256((const __m256i*)(w + k));
    const __m256i v1 = _mm256_loadu_si256((const __m256i*)(w + k + 16));
    const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, hi));
    const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)), o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, hi));
    for (int r = 0; r < R; r++) {
      const float* xr = xp + r * K + k;
      a[0][r] = _mm256_fmadd_ps(e0, _mm256_loadu_ps(xr), a[0][r]);
      a[1][r] = _mm256_fmadd_ps(o0, _mm256_loadu_ps(xr + 8), a[1][r]);
      a[2][r] = _mm256_fmadd_ps(e1, _mm256_loadu_ps(xr + 16), a[2][r]);
      a[3][r] = _mm256_fmadd_ps(o1, _mm256_loadu_ps(xr + 24), a[3][r]);
    }
  }
  if (k < K) {  // one block of 16 left
    const __m256i v0 = _mm256_loadu_si256((const __m256i*)(w + k));
    const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, hi));
    for (int r = 0; r < R; r++) {
      const float* xr = xp + r * K + k;
      a[0][r] = _mm256_fmadd_ps(e0, _mm256_loadu_ps(xr), a[0][r]);
      a[1][r] = _mm256_fmadd_ps(o0, _mm256_loadu_ps(xr + 8), a[1][r]);
    }
  }
  for (int r = 0; r < R; r++)
    out[r] = hsum(_mm256_add_ps(_mm256_add_ps(a[0][r], a[1][r]), _mm256_add_ps(a[2][r], a[3][r])));
}

// y[r0 + r, n] (+)= out[r] * s + b for the rr rows of a group (accumulate: a residual add).
inline void store(float* y, int64_t ldy, int64_t r0, int64_t rr, int64_t n, const float* out, float s, float b,
                  int accumulate) {
  for (int64_t r = 0; r < rr; r++) {
    float* yv = y + (r0 + r) * ldy + n;
    const float v = out[r] * s + b;
    *yv = accumulate ? *yv + v : v;
  }
}

// Output rows per chunk of the pool: about four chunks per thread (balance when a thread
// runs late), at least 16 rows (the claim costs an atomic add).
inline int64_t grain_for(int64_t N, int nthreads) {
  const int64_t g = (N + 4 * nthreads - 1) / (4 * nthreads);
  return g < 16 ? 16 : g;
}

template <typename WT>
void gemv(const float* x, int64_t rows, int64_t ldx, int64_t K, const WT* W, int64_t N, const float* scales,
          const float* bias, float* y, int64_t ldy, int accumulate, int nthreads) {
  kvpool::parallel_for(N, grain_for(N, nthreads), nthreads, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
      const WT* w = W + n * K;
      const float s = scales ? scales[n] : 1.0f;
      const float b = bias ? bias[n] : 0.0f;
      float out[2];
      for (int64_t r0 = 0; r0 < rows; r0 += 2) {  // rows in pairs: the weight row is read from L1 after the first
        const float* xr = x + r0 * ldx;
        const int64_t rr = rows - r0 < 2 ? rows - r0 : 2;
        if (rr == 1)
          dot_rows<WT, 1>(w, xr, ldx, K, out);
        else
          dot_rows<WT, 2>(w, xr, ldx, K, out);
        store(y, ldy, r0, rr, n, out, s, b, accumulate);
      }
    }
  });
}

void gemv_bf16(const float* x, int64_t rows, int64_t ldx, int64_t K, const uint16_t* W, int64_t N,
               const float* bias, float* y, int64_t ldy, int accumulate, int nthreads) {
  if (K % 16) {
    gemv<uint16_t>(x, rows, ldx, K, W, N, nullptr, bias, y, ldy, accumulate, nthreads);
    return;
  }
  thread_local std::vector<float> xp_buf;
  xp_buf.resize(rows * K);
  float* xp = xp_buf.data();
  for (int64_t r = 0; r < rows; r++)
    for (int64_t k = 0; k < K; k += 16)
      for (int j = 0; j < 8; j++) {
        xp[r * K + k + j] = x[r * ldx + k + 2 * j];
        xp[r * K + k + 8 + j] = x[r * ldx + k + 2 * j + 1];
      }
  kvpool::parallel_for(N, grain_for(N, nthreads), nthreads, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
      const uint16_t* w = W + n * K;
      const float b = bias ? bias[n] : 0.0f;
      float out[2];
      for (int64_t r0 = 0; r0 < rows; r0 += 2) {
        const int64_t rr = rows - r0 < 2 ? rows - r0 : 2;
        if (rr == 1)
          dot_rows_bf16<1>(w, xp + r0 * K, K, out);
        else
          dot_rows_bf16<2>(w, xp + r0 * K, K, out);
        store(y, ldy, r0, rr, n, out, 1.0f, b, accumulate);
      }
    }
  });
}

// ---- int8 x int8 (llama.cpp's Q8_0 dot) ---------------------------------------------
// The input quantized per block of 32 (one float scale each, symmetric, 127 steps);
// integer products of 32 weights at a time (maddubs: unsigned x signed bytes, the sign
// of the weight moved onto the input), one float multiply-add per block. K % 32 == 0.

template <int R>
inline void dot_rows_q8(const int8_t* w, const int8_t* xq, const float* xs, int64_t K, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  // two chains per row (even and odd blocks): the float multiply-add's latency, not its
  // throughput, would bound a single chain
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
  const int64_t nb = K / 32;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    const __m256i w0 = _mm256_loadu_si256((const __m256i*)(w + b * 32));
    const __m256i w1 = _mm256_loadu_si256((const __m256i*)(w + b * 32 + 32));
    const __m256i u0 = _mm256_sign_epi8(w0, w0), u1 = _mm256_sign_epi8(w1, w1);  // |w| (w >= -127)
    for (int r = 0; r < R; r++) {
      const int8_t* x = xq + r * K + b * 32;
      const __m256i x0 = _mm256_loadu_si256((const __m256i*)x), x1 = _mm256_loadu_si256((const __m256i*)(x + 32));
      const __m256 p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(x0, w0)), ones));
      const __m256 p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(x1, w1)), ones));
      a0[r] = _mm256_fmadd_ps(p0, _mm256_broadcast_ss(xs + r * nb + b), a0[r]);
      a1[r] = _mm256_fmadd_ps(p1, _mm256_broadcast_ss(xs + r * nb + b + 1), a1[r]);
    }
  }
  if (b < nb) {
    const __m256i w0 = _mm256_loadu_si256((const __m256i*)(w + b * 32));
    const __m256i u0 = _mm256_sign_epi8(w0, w0);
    for (int r = 0; r < R; r++) {
      const __m256i x0 = _mm256_loadu_si256((const __m256i*)(xq + r * K + b * 32));
      const __m256 p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(x0, w0)), ones));
      a0[r] = _mm256_fmadd_ps(p0, _mm256_broadcast_ss(xs + r * nb + b), a0[r]);
    }
  }
  for (int r = 0; r < R; r++) out[r] = hsum(_mm256_add_ps(a0[r], a1[r]));
}

void quantize_q8(const float* x, int64_t rows, int64_t ldx, int64_t K, int8_t* xq, float* xs) {
  const int64_t nb = K / 32;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t b = 0; b < nb; b++) {
      const float* src = x + r * ldx + b * 32;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(src + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
      }
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_movehdup_ps(m));
      const float mx = _mm_cvtss_f32(m);
      const float d = mx / 127.0f;
      xs[r * nb + b] = d;
      const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
      __m256i q[4];
      for (int j = 0; j < 4; j++)  // round to nearest (even), as llama.cpp's quantize_row_q8_0
        q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      // 32 int32 -> 32 int8 in order: packs interleave 128-bit lanes, the permute restores them
      __m256i a = _mm256_packs_epi32(q[0], q[1]);
      __m256i c = _mm256_packs_epi32(q[2], q[3]);
      __m256i bytes = _mm256_packs_epi16(a, c);
      bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256((__m256i*)(xq + r * K + b * 32), bytes);
    }
  }
}

void gemv_q8(const int8_t* xq, const float* xs, int64_t rows, int64_t K, const int8_t* W, int64_t N,
             const float* scales, const float* bias, float* y, int64_t ldy, int accumulate, int nthreads) {
  const int64_t nb = K / 32;
  kvpool::parallel_for(N, grain_for(N, nthreads), nthreads, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
      const int8_t* w = W + n * K;
      const float s = scales[n];
      const float b = bias ? bias[n] : 0.0f;
      float out[4];
      for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int8_t* xr = xq + r0 * K;
        const float* sr = xs + r0 * nb;
        const int64_t rr = rows - r0 < 4 ? rows - r0 : 4;
        switch (rr) {
          case 1: dot_rows_q8<1>(w, xr, sr, K, out); break;
          case 2: dot_rows_q8<2>(w, xr, sr, K, out); break;
          case 3: dot_rows_q8<3>(w, xr, sr, K, out); break;
          default: dot_rows_q8<4>(w, xr, sr, K, out); break;
        }
        store(y, ldy, r0, rr, n, out, s, b, accumulate);
      }
    }
  });
}

}  // namespace

extern "C" {

void kv_gemv_f32(const float* x, int64_t rows, int64_t ldx, int64_t K, const float* W, int64_t N,
                 const float* scales, const float* bias, float* y, int64_t ldy, int accumulate, int nthreads) {
  gemv<float>(x, rows, ldx, K, W, N, scales, bias, y, ldy, accumulate, nthreads);
}

void kv_gemv_bf16(const float* x, int64_t rows, int64_t ldx, int64_t K, const uint16_t* W, int64_t N,
                  const float* scales, const float* bias, float* y, int64_t ldy, int accumulate, int nthreads) {
  gemv_bf16(x, rows, ldx, K, W, N, bias, y, ldy, accumulate, nthreads);
}

void kv_gemv_i8(const float* x, int64_t rows, int64_t ldx, int64_t K, const int8_t* W, int64_t N,
                const float* scales, const float* bias, float* y, int64_t ldy, int accumulate, int nthreads) {
  gemv<int8_t>(x, rows, ldx, K, W, N, scales, bias, y, ldy, accumulate, nthreads);
}

// x quantized per block of 32 into xq (rows, K) int8 and xs (rows, K/32) float, then
// multiplied by the int8 weights in integers. K % 32 == 0 (the caller checks).
void kv_gemv_q8(const float* x, int64_t rows, int64_t ldx, int64_t K, const int8_t* W, int64_t N,
                const float* scales, const float* bias, float* y, int64_t ldy, int accumulate, int nthreads,
                int8_t* xq, float* xs) {
  quantize_q8(x, rows, ldx, K, xq, xs);
  gemv_q8(xq, xs, rows, K, W, N, scales, bias, y, ldy, accumulate, nthreads);
}

}  // extern "C"
