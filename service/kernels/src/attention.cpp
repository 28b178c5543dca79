// Causal attention of a forward's new tokens (a prefill, or a long returning turn) over
// their sequence's keys, float32, in one call per layer: every query attends to the keys
// at or before its position (inside a sliding window when there is one), and the work
// above the diagonal and before the window is skipped, not computed and then masked.
// torch's CPU flash attention computes whole 512-key blocks, so at a 512-token prompt
// its causal attention cost what the full one does (issue 29).
//
//   q (B, T, nh, hd) at strides (sqb, sqt, hd, 1)         k, v (B, C, nkv, hd) at (skb, skt, hd, 1)
//   kv_len (B,): sequence b's keys (its context, new tokens included)
//   n_new (B,): its new tokens: query t < n_new[b] is at position kv_len[b] - n_new[b] + t;
//               rows t >= n_new[b] are padding and get zeros
//   key c is visible to the query at position p iff c <= p and (window == 0 or c > p - window)
//   scores cap * tanh(s / cap) when softcap > 0 (Gemma 2), s = q . k * scale
//   out (B, T, nh, hd) at strides (sob, sot, hd, 1)
//
// Blocking, for each sequence b and query head h (kv head h / (nh / nkv)):
//
//   pack      each kv head's K as NR-key panels [d][NR] and its V as NR-dim panels
//             [key][NR] (tile.h's layout), once per call, shared by its query heads
//   task      BQ query rows: keys [lo, hi), hi one past the last row's position, lo the
//             window's start for the first row (rounded down to a panel)
//   scores    S (BQ, hi - lo) = Q K^T by the products' micro-kernel (tile.h), depth hd
//   softmax   each row exactly over its visible keys (the whole row is in S): max, exp,
//             sum; the keys it cannot see set to 0
//   values    O (BQ, hd) = P V by the same micro-kernel, depth hi - lo, then / sum
//
// Tasks are claimed longest first (the last query rows see the most keys), so the
// threads finish together. A row's result does not depend on the other rows or the
// batch (the same operations in the same order whatever the task).

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "kvkernels.h"
#include "pool.h"
#include "reduce.h"
#include "tile.h"

namespace {

constexpr int64_t BQ = 24;  // query rows per task: 4 AVX2 tiles, 2 AVX-512 ones
constexpr size_t kKeepFloats = (size_t)16 << 20;  // packed K/V kept between calls up to 64 MiB (a 2048-token ~110M prompt: 8 MiB)
static_assert(BQ % MR == 0, "whole tiles per task");

inline int64_t panels(int64_t n) { return (n + NR - 1) / NR; }

// 2^x for 8 floats, x <= 0 (softmax's exponents after the max is taken out): 2^round(x)
// from the exponent bits times a degree-6 polynomial for 2^f, |f| <= 1/2 (relative error
// ~2e-7), by FMAs; x below -126 gives 0.
inline __m256 exp2_neg8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// softmax over s[0, n) in place, scores at [vis0, vis1) visible and the rest set to 0:
// returns 1 / the sum of the visible exponentials. exp(a) is computed as 2^(a log2 e).
float softmax_row(float* s, int64_t n, int64_t vis0, int64_t vis1, float scale, float softcap) {
  if (softcap > 0.0f) {  // s <- cap * tanh(s * scale / cap), then plain softmax (scale 1)
    const float f = scale / softcap;
    for (int64_t j = vis0; j < vis1; j++) s[j] = softcap * tanhf(s[j] * f);
    scale = 1.0f;
  }
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t j = vis0;
  for (; j + 8 <= vis1; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
  float mx = reduce_max8(mv);
  for (; j < vis1; j++) mx = s[j] > mx ? s[j] : mx;
  const float c = scale * 1.44269504088896341f;  // exp(scale (s - mx)) = 2^(c s - c mx)
  const __m256 cv = _mm256_set1_ps(c), off = _mm256_set1_ps(-c * mx);
  __m256 acc = _mm256_setzero_ps();
  for (j = vis0; j + 8 <= vis1; j += 8) {
    const __m256 e = exp2_neg8(_mm256_fmadd_ps(_mm256_loadu_ps(s + j), cv, off));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = reduce_add8(acc);
  for (; j < vis1; j++) {
    s[j] = exp2f(s[j] * c - c * mx);
    sum += s[j];
  }
  memset(s, 0, vis0 * sizeof(float));
  if (n > vis1) memset(s + vis1, 0, (n - vis1) * sizeof(float));
  return 1.0f / sum;
}

}  // namespace

extern "C" void kv_prefill_attention(const float* q, int64_t sqb, int64_t sqt, const float* k, const float* v,
                                     int64_t skb, int64_t skt, int64_t B, int64_t T, int64_t nh, int64_t nkv,
                                     int64_t hd, const int64_t* kv_len, const int64_t* n_new, int64_t window,
                                     float scale, float softcap, float* out, int64_t sob, int64_t sot, int nthreads) {
  if (B <= 0 || T <= 0 || nh <= 0) return;
  int64_t C = 0;  // the longest context: every kv head's packed K and V are sized for it
  for (int64_t b = 0; b < B; b++) C = std::max(C, kv_len[b]);
  const int64_t kp = panels(C) * hd * NR, vp = panels(hd) * C * NR;  // floats per kv head: K's, V's panels
  thread_local std::vector<float> packed;  // the calling thread's (the workers read it during the call)
  packed.resize(B * nkv * (kp + vp));
  float* pk = packed.data();

  kvpool::parallel_for(B * nkv, 1, nthreads, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      const int64_t b = i / nkv, g = i % nkv, n = kv_len[b];
      const float* kb = k + b * skb + g * hd;
      const float* vb = v + b * skb + g * hd;
      float* kpan = pk + i * (kp + vp);
      float* vpan = kpan + kp;
      for (int64_t p = 0; p < panels(n); p++) {  // keys [p NR, p NR + NR) as [d][NR]
        const int nr = (int)std::min<int64_t>(NR, n - p * NR);
        pack_panel<float>(kb, skt, p * NR, nr, 0, hd, nullptr, kpan + p * hd * NR);
      }
      for (int64_t p = 0; p < panels(hd); p++) {  // dims [p NR, p NR + NR) as [key][NR]
        const int64_t d0 = p * NR, nr = std::min<int64_t>(NR, hd - d0);
        float* dst = vpan + p * C * NR;
        for (int64_t c = 0; c < n; c++) {
          memcpy(dst + c * NR, vb + c * skt + d0, nr * sizeof(float));
          if (nr < NR) memset(dst + c * NR + nr, 0, (NR - nr) * sizeof(float));
        }
      }
    }
  });

  const int64_t nqb = (T + BQ - 1) / BQ, G = nh / nkv, heads = B * nh;
  kvpool::parallel_for(nqb * heads, 1, nthreads, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> sbuf;
    const int64_t ld = panels(C) * NR;  // S's row stride
    sbuf.resize(BQ * ld);
    float* S = sbuf.data();
    float inv[BQ];
    for (int64_t i = i0; i < i1; i++) {
      const int64_t t0 = (nqb - 1 - i / heads) * BQ;  // the last query blocks first: they cost the most
      const int64_t b = (i % heads) / nh, h = i % nh, g = h / G;
      float* o = out + b * sob + t0 * sot + h * hd;
      const int64_t rows = std::min<int64_t>(BQ, T - t0), real = std::clamp<int64_t>(n_new[b] - t0, 0, rows);
      for (int64_t r = real; r < rows; r++) memset(o + r * sot, 0, hd * sizeof(float));  // padding
      if (real == 0) continue;
      const int64_t pos0 = kv_len[b] - n_new[b] + t0;  // the first row's position
      const int64_t hi = pos0 + real;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) / NR * NR : 0;
      const int64_t nk = hi - lo;
      const float* kpan = pk + (b * nkv + g) * (kp + vp);
      const float* vpan = kpan + kp;
      const float* qb = q + b * sqb + t0 * sqt + h * hd;
      for (int64_t p = lo / NR; p < panels(hi); p++) {  // S = Q K^T over keys [lo, hi)
        const int nr = (int)std::min<int64_t>(NR, hi - p * NR);
        for (int64_t m = 0; m < real; m += MR)
          micro_rows((int)std::min<int64_t>(MR, real - m), qb + m * sqt, sqt, kpan + p * hd * NR, hd,
                     S + m * ld + (p * NR - lo), ld, nr, false, nullptr);
      }
      for (int64_t r = 0; r < real; r++) {
        const int64_t pos = pos0 + r;
        const int64_t vis0 = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        inv[r] = softmax_row(S + r * ld, nk, vis0 - lo, pos + 1 - lo, scale, softcap);
      }
      for (int64_t p = 0; p < panels(hd); p++) {  // O = P V
        const int nr = (int)std::min<int64_t>(NR, hd - p * NR);
        for (int64_t m = 0; m < real; m += MR)
          micro_rows((int)std::min<int64_t>(MR, real - m), S + m * ld, ld, vpan + p * C * NR + lo * NR, nk,
                     o + m * sot + p * NR, sot, nr, false, nullptr);
      }
      for (int64_t r = 0; r < real; r++)
        for (int64_t d = 0; d < hd; d++) o[r * sot + d] *= inv[r];
    }
  });
  // a long context's packed K and V (2 x its float32 size) are not kept for the next call
  if (packed.size() > kKeepFloats) std::vector<float>().swap(packed);
}
