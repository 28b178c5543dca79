// The per-layer work of a decode step around the products (gemv.cpp): RMSNorm, RoPE,
// the SwiGLU/GeGLU gate, and attention of one new token per sequence over its paged KV
// context, read in place from the block pool (no gather into a contiguous copy).
// float32 throughout. Elementwise results are rounded as torch's ops round them (this
// file is built with -ffp-contract=off: a * b + c is two roundings, as in torch).
//
// Pool layout (kv/cache.py): (num_blocks, L, 2, block_size, n_kv, hd), K then V (int8 KV:
// (num_blocks, L, 2, plane) with each plane's per-row scales after its values: decode_attention_i8).

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "kvkernels.h"
#include "pool.h"
#include "reduce.h"

namespace {

// exp(x) for 8 floats: Cephes' polynomial after range reduction by ln 2 (relative error
// ~1e-7 over the float range; under/overflow clamped as expf).
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
  const __m256 x2 = _mm256_mul_ps(x, x);
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, x2), x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float hsum(__m256 v) { return reduce_add8(v); }

// The KV pool's element types (KvStep.kv_fmt): each widens 8 stored values to float32
// exactly, and rounds a float32 to the stored type to nearest even, as torch's .to() does.
struct F32Kv {
  using T = float;
  static constexpr bool scaled = false;
  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  static float load1(const float* p) { return *p; }
  static float store1(float x) { return x; }
};
struct Bf16Kv {  // bfloat16: the high half of a float32
  using T = uint16_t;
  static constexpr bool scaled = false;
  static __m256 load8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  }
  static float load1(const uint16_t* p) {
    const uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
  static uint16_t store1(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays a (quiet) NaN
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};
struct F16Kv {  // IEEE half (F16C)
  using T = uint16_t;
  static constexpr bool scaled = false;
  static __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  static float load1(const uint16_t* p) { return _cvtsh_ss(*p); }
  static uint16_t store1(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
};

// dot(a, b) with b stored as E::T (the fallback for hd % 8 != 0: the same order as dot).
template <class E>
inline float dot_kv(const float* a, const typename E::T* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), E::load8(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), E::load8(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), E::load8(b + i), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; i++) s += a[i] * E::load1(b + i);
  return s;
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

// The 8 lane sums of a[0..7] as one vector: out[j] = hsum(a[j]).
inline __m256 hsum8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // s0123 lanes: [0 1 2 3 | 0 1 2 3] (low and high 128-bit halves), s4567 the same for 4..7
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}


}  // namespace

extern "C" {

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * (w + offset)   (offset 1: Gemma's (1 + w))
// x rows at stride ldx, out rows at stride ldo (out may be x: in place).
void kv_rmsnorm(const float* x, int64_t rows, int64_t ldx, int64_t D, const float* w, float eps, float offset,
                float* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * ldx;
    float* o = out + r * ldo;
    const float ss = dot(xr, xr, D);
    const float inv = 1.0f / sqrtf(ss / (float)D + eps);
    int64_t i = 0;
    const __m256 iv = _mm256_set1_ps(inv), off = _mm256_set1_ps(offset);
    for (; i + 8 <= D; i += 8) {
      const __m256 wv = _mm256_add_ps(_mm256_loadu_ps(w + i), off);
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), iv), wv));
    }
    for (; i < D; i++) o[i] = (xr[i] * inv) * (w[i] + offset);
  }
}

// RoPE in place on x (B, T, H, hd) with element strides sB, sT, sH (last dim contiguous):
// the first `rot` dims of each head, with cos and signed sin (B, T, rot) contiguous as
// rope.Rotary(signed=True) makes them: x_i' = x_i cos_i + x_{(i + rot/2) mod rot} sin_i.
void kv_rope(float* x, int64_t B, int64_t T, int64_t H, int64_t sB, int64_t sT, int64_t sH, int64_t rot,
             const float* cos, const float* sin) {
  const int64_t half = rot / 2;
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < T; t++) {
      const float* c = cos + (b * T + t) * rot;
      const float* s = sin + (b * T + t) * rot;
      for (int64_t h = 0; h < H; h++) {
        float* v = x + b * sB + t * sT + h * sH;
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
          const __m256 a = _mm256_loadu_ps(v + i), d = _mm256_loadu_ps(v + half + i);
          const __m256 lo = _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)), _mm256_mul_ps(d, _mm256_loadu_ps(s + i)));
          const __m256 hi = _mm256_add_ps(_mm256_mul_ps(d, _mm256_loadu_ps(c + half + i)),
                                          _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i)));
          _mm256_storeu_ps(v + i, lo);
          _mm256_storeu_ps(v + half + i, hi);
        }
        for (; i < half; i++) {
          const float a = v[i], d = v[half + i];
          v[i] = a * c[i] + d * s[i];
          v[half + i] = d * c[half + i] + a * s[half + i];
        }
      }
    }
}

// out (rows, I) = act(gate) * up from gu (rows, 2I) = [gate | up] (row stride ldg).
// act KV_SILU: silu(g) = g / (1 + exp(-g)); KV_GELU_TANH: gelu's tanh approximation; KV_GELU: exact gelu.
void kv_act_mul(const float* gu, int64_t rows, int64_t ldg, int64_t I, int act, float* out, int nthreads) {
  kvpool::parallel_for(rows, 1, rows * I >= 32768 ? nthreads : 1, [&](int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; r++) {
    const float* g = gu + r * ldg;
    const float* u = g + I;
    float* o = out + r * I;
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    if (act == KV_SILU) {
      for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(sg, _mm256_loadu_ps(u + i)));
      }
      for (; i < I; i++) o[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    } else if (act == KV_GELU) {  // exact: 0.5 x (1 + erf(x / sqrt 2)), as torch's gelu
      for (; i < I; i++) o[i] = (0.5f * g[i] * (1.0f + erff(g[i] * 0.7071067811865476f))) * u[i];
    } else {
      const __m256 k0 = _mm256_set1_ps(0.7978845608028654f), k1 = _mm256_set1_ps(0.044715f), half = _mm256_set1_ps(0.5f);
      const __m256 two = _mm256_set1_ps(2.0f);
      for (; i + 8 <= I; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 inner = _mm256_mul_ps(k0, _mm256_add_ps(x, _mm256_mul_ps(k1, _mm256_mul_ps(x, _mm256_mul_ps(x, x)))));
        // tanh(y) = 1 - 2 / (exp(2y) + 1)
        const __m256 th = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(exp8(_mm256_mul_ps(two, inner)), one)));
        const __m256 ge = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, th));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(ge, _mm256_loadu_ps(u + i)));
      }
      for (; i < I; i++) {
        const float x = g[i];
        const float ge = 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
        o[i] = ge * u[i];
      }
    }
  }
  });
}

}  // extern "C"


namespace {

// ---- decode attention over the block pool ------------------------------------------------
// One work unit is a span of one sequence's context positions, all its kv heads and query
// heads, read block by block from the block's base: a block's K plane (bs, nkv, hd) of this
// layer and its V plane right after it are one contiguous run of the pool, read in order
// (no per-position pointer table; the next block's planes are prefetched while this one's
// are used). Per kv head and tile of up to kTile positions of a block, the G query heads
// sharing it take their scores at once (a small GEMM: each K row chunk widened once for the
// G heads' accumulators, one horizontal reduction per kScoreRows positions), then one
// online-softmax step (running max and sum per head, the accumulator rescaled when the max
// grows) and the V rows of the tile added into the G accumulators, each V row chunk widened
// once: one pass over the context. A sequence split into several spans (to give every
// thread work when the batch is small) has its spans' partial (max, sum, accumulator)
// merged after.

// The int8 pool's element (KV_I8): widened exactly; each row's per-kv-head K scale multiplies
// its score, its V scale its softmax weight (the float pools' Kv types have scaled = false).
struct I8Kv {
  using T = int8_t;
  static constexpr bool scaled = true;
  static __m256 load8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  }
  static float load1(const int8_t* p) { return (float)*p; }
};

#ifdef __AVX512F__
constexpr int kScoreRows = 8;  // K rows per pass of score_rows: GN * 8 <= 24 accumulators of 32 vector registers
constexpr int kVChunk1 = 8, kVChunk2 = 8, kVChunk3 = 8;  // accumulate_v's vectors per head: GN * CH <= 24
#else
constexpr int kScoreRows = 4;  // GN * 4 <= 12 accumulators of 16
constexpr int kVChunk1 = 8, kVChunk2 = 4, kVChunk3 = 4;
#endif
constexpr int kTile = 16;          // positions per online-softmax step (a block of the default size)
constexpr int64_t kMinSpan = 128;  // positions: a sequence is split into spans of about this many or more
constexpr int64_t kPrefetchBlocks = 1;  // how far ahead (in blocks) a span's planes are prefetched

// The 4 lane sums of a[0..3]: out[j] = hsum(a[j]).
inline __m128 hsum4(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s = _mm256_hadd_ps(s01, s23);  // [a0 a1 a2 a3 | a0 a1 a2 a3]: each half's partial sums
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// s[g * ls + j] = dot(q[g], k[j]) for GN query heads (q rows at stride hd) and the m <= P
// K rows k + j * stride (hd % 8 == 0): each 8-value chunk of a row widened once for the GN
// heads, GN * P accumulators, one horizontal reduction per head and P rows. Rows past m
// repeat the last (computed, not stored).
template <class E, int GN, int P>
inline void score_rows(const float* q, int64_t hd, const typename E::T* k, int64_t stride, int m, float* s,
                       int64_t ls) {
  const typename E::T* r[P];
  for (int j = 0; j < P; j++) r[j] = k + (j < m ? j : m - 1) * stride;
  __m256 a[GN][P];
  for (int g = 0; g < GN; g++)
    for (int j = 0; j < P; j++) a[g][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < hd; i += 8) {
    __m256 qv[GN];
    for (int g = 0; g < GN; g++) qv[g] = _mm256_loadu_ps(q + g * hd + i);
    for (int j = 0; j < P; j++) {
      const __m256 x = E::load8(r[j] + i);
      for (int g = 0; g < GN; g++) a[g][j] = _mm256_fmadd_ps(qv[g], x, a[g][j]);
    }
  }
  for (int g = 0; g < GN; g++) {
    float t[8];
    if constexpr (P == 8) {
      _mm256_storeu_ps(t, hsum8(a[g]));
    } else {
      _mm_storeu_ps(t, hsum4(a[g]));
    }
    for (int j = 0; j < m; j++) s[g * ls + j] = t[j];
  }
}

// acc[g] (hd) = acc[g] * alpha[g] + sum_p w[g * ls + p] * v[p] over the m V rows
// v + p * stride, for GN heads, in chunks of CH vectors (hd % 8 == 0): GN * CH accumulators
// in registers across the rows, each row chunk widened once for the GN heads.
template <class E, int GN, int CH>
inline void accumulate_v(const typename E::T* v, int64_t stride, int m, const float* w, int64_t ls, int64_t hd,
                         const float* alpha, float* acc) {
  int64_t c = 0;
  for (; c + 8 * CH <= hd; c += 8 * CH) {
    __m256 a[GN][CH];
    for (int g = 0; g < GN; g++) {
      const __m256 al = _mm256_set1_ps(alpha[g]);
      for (int j = 0; j < CH; j++) a[g][j] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * hd + c + 8 * j), al);
    }
    for (int p = 0; p < m; p++) {
      const typename E::T* vp = v + p * stride + c;
      __m256 wp[GN];
      for (int g = 0; g < GN; g++) wp[g] = _mm256_broadcast_ss(w + g * ls + p);
      for (int j = 0; j < CH; j++) {
        const __m256 x = E::load8(vp + 8 * j);
        for (int g = 0; g < GN; g++) a[g][j] = _mm256_fmadd_ps(wp[g], x, a[g][j]);
      }
    }
    for (int g = 0; g < GN; g++)
      for (int j = 0; j < CH; j++) _mm256_storeu_ps(acc + g * hd + c + 8 * j, a[g][j]);
  }
  for (; c < hd; c += 8) {  // the last hd % (8 * CH) floats, one vector at a time
    __m256 a[GN];
    for (int g = 0; g < GN; g++) a[g] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * hd + c), _mm256_set1_ps(alpha[g]));
    for (int p = 0; p < m; p++) {
      const __m256 x = E::load8(v + p * stride + c);
      for (int g = 0; g < GN; g++) a[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + g * ls + p), x, a[g]);
    }
    for (int g = 0; g < GN; g++) _mm256_storeu_ps(acc + g * hd + c, a[g]);
  }
}

// One online-softmax step of one query head over its scores sg[0..m) of a tile: scaled by
// kscale (the softmax scale; int8: each row's own, ks[j], the softmax scale times the row's K
// scale) and capped when softcap > 0, the running max *mrun and sum *lrun updated; sg becomes
// the weights exp(score - max) (int8: times vs[j], the row's V scale). Returns the factor
// exp(old max - new max) the head's accumulator is rescaled by (0 at its first tile).
template <class E>
inline float softmax_step(float* sg, int m, float kscale, const float* ks, const float* vs, float softcap,
                          float* mrun, float* lrun) {
  float mx = -INFINITY;
  int j = 0;
  if (softcap > 0.0f) {
    for (; j < m; j++) {
      sg[j] = softcap * tanhf(sg[j] * (E::scaled ? ks[j] : kscale) / softcap);
      mx = sg[j] > mx ? sg[j] : mx;
    }
  } else {
    const __m256 kv = _mm256_set1_ps(kscale);
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= m; j += 8) {
      const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(sg + j), E::scaled ? _mm256_loadu_ps(ks + j) : kv);
      _mm256_storeu_ps(sg + j, x);
      mv = _mm256_max_ps(mv, x);
    }
    float r[8];
    _mm256_storeu_ps(r, mv);
    for (int i = 0; i < 8; i++) mx = r[i] > mx ? r[i] : mx;
    for (; j < m; j++) {
      sg[j] *= E::scaled ? ks[j] : kscale;
      mx = sg[j] > mx ? sg[j] : mx;
    }
  }
  const float mnew = mx > *mrun ? mx : *mrun;
  const float alpha = mnew == *mrun ? 1.0f : expf(*mrun - mnew);
  *mrun = mnew;
  const __m256 mv = _mm256_set1_ps(mnew);
  __m256 sv = _mm256_setzero_ps();
  j = 0;
  for (; j + 8 <= m; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), mv));
    sv = _mm256_add_ps(sv, e);
    _mm256_storeu_ps(sg + j, E::scaled ? _mm256_mul_ps(e, _mm256_loadu_ps(vs + j)) : e);
  }
  float sum = hsum(sv);
  for (; j < m; j++) {
    const float e = expf(sg[j] - mnew);
    sum += e;
    sg[j] = E::scaled ? e * vs[j] : e;
  }
  *lrun = *lrun * alpha + sum;
  return alpha;
}

// The scores (GN query heads, rows of s at stride kTile) of the m K rows k + j * stride.
template <class E, int GN>
inline void score_tile(const float* q, int64_t hd, const typename E::T* k, int64_t stride, int m, float* s) {
  if (hd % 8 == 0) {
    score_rows<E, GN, kScoreRows>(q, hd, k, stride, m, s, kTile);
  } else {
    for (int g = 0; g < GN; g++)
      for (int j = 0; j < m; j++) s[g * kTile + j] = dot_kv<E>(q + g * hd, k + j * stride, hd);
  }
}

// acc (GN, hd) rescaled by alpha (GN) plus the weights w (GN rows at stride kTile) times
// the m V rows v + p * stride.
template <class E, int GN, int CH>
inline void value_tile(const typename E::T* v, int64_t stride, int m, const float* w, int64_t hd, const float* alpha,
                       float* acc) {
  if (hd % 8 == 0) {
    accumulate_v<E, GN, CH>(v, stride, m, w, kTile, hd, alpha, acc);
  } else {
    for (int g = 0; g < GN; g++)
      for (int64_t d = 0; d < hd; d++) {
        float a = acc[g * hd + d] * alpha[g];
        for (int p = 0; p < m; p++) a += w[g * kTile + p] * E::load1(v + p * stride + d);
        acc[g * hd + d] = a;
      }
  }
}

// f(h, GN) over one kv head's G query heads [h0, h0 + G) in groups of 3, then 2 or 1
// (GN a compile-time constant: the register blocking of the score and value kernels).
template <class F>
inline void head_groups(int64_t h0, int64_t G, const F& f) {
  int64_t h = h0;
  for (; h + 3 <= h0 + G; h += 3) f.template operator()<3, kVChunk3>(h);
  if (h0 + G - h == 2) f.template operator()<2, kVChunk2>(h);
  if (h0 + G - h == 1) f.template operator()<1, kVChunk1>(h);
}

// Where one layer's planes of a block are: K at k(id), V vplane elements on, rows of
// tok = nkv * hd elements (kv head h's hd at h * hd); int8: each plane's float32 scales
// soff bytes into it, srow (nkv) per row, row p's kv head h's at p * srow + h.
template <class E>
struct PoolView {
  using T = typename E::T;
  const T* base;
  int64_t blk, layer_off, vplane, tok, soff, srow;
  const T* k(int64_t id) const { return base + id * blk + layer_off; }
  // the view of kv heads [h, ...) alone: their rows start h * hd elements in (the row
  // stride tok unchanged), their int8 scales 4 h bytes after the plane's first (at the
  // same stride srow)
  PoolView heads_from(int64_t h, int64_t hd) const {
    return {base, blk, layer_off + h * hd, vplane, tok, soff + 4 * h - h * hd * (int64_t)sizeof(T), srow};
  }
};

// Attention of one sequence's query q (nh, hd) over its positions [p0, p1) (its block
// table `table`): the unnormalized state, mrun and lrun (nh) and acc (nh, hd), from scratch.
// Per tile of up to kTile rows of a block: the scores of every head, kScoreRows rows at a
// time for every kv head in turn (the K plane read in address order), one softmax step per
// head, then the V rows the same way.
template <class E>
void attend_span(const PoolView<E>& pv, const int64_t* table, int64_t bs, int64_t p0, int64_t p1, const float* q,
                 int64_t nh, int64_t nkv, int64_t hd, float scale, float softcap, float* mrun, float* lrun,
                 float* acc) {
  using T = typename E::T;
  const int64_t G = nh / nkv, tok = pv.tok;
  thread_local std::vector<float> s_, alpha_, ones_;
  s_.resize(nh * kTile), alpha_.resize(nh), ones_.assign(nh, 1.0f);
  float *s = s_.data(), *alpha = alpha_.data();
  float ks[kTile], vs[kTile];  // int8: a tile's rows' K scales (times the softmax scale) and V scales, of one kv head
  const float* ones = ones_.data();
  for (int64_t h = 0; h < nh; h++) mrun[h] = -INFINITY, lrun[h] = 0.0f;
  memset(acc, 0, nh * hd * sizeof(float));
  const int64_t plane_bytes = pv.vplane * (int64_t)sizeof(T);
  for (int64_t bi = p0 / bs; bi * bs < p1; bi++) {
    const int64_t j0 = p0 > bi * bs ? p0 - bi * bs : 0, j1 = p1 < (bi + 1) * bs ? p1 - bi * bs : bs;
    const T* kp = pv.k(table[bi]);
    const T* vp = kp + pv.vplane;
    // a later block's K and V planes of this layer, prefetched a kv head's share of the rows
    // in hand at a time (its rows at the same offsets), spread over the work on these
    const char* next = (bi + kPrefetchBlocks) * bs < p1 ? (const char*)pv.k(table[bi + kPrefetchBlocks]) : nullptr;
    for (int64_t t0 = j0; t0 < j1; t0 += kTile) {
      const int m = j1 - t0 < kTile ? (int)(j1 - t0) : kTile;
      for (int j = 0; j < m; j += kScoreRows) {
        const int r = m - j < kScoreRows ? m - j : kScoreRows;
        const int64_t piece = (r * tok * (int64_t)sizeof(T) + nkv - 1) / nkv, at = (t0 + j) * tok * (int64_t)sizeof(T);
        for (int64_t kvh = 0; kvh < nkv; kvh++) {
          if (next)
            for (int64_t o = kvh * piece; o < (kvh + 1) * piece; o += 64) _mm_prefetch(next + at + o, _MM_HINT_T0);
          const T* kr = kp + (t0 + j) * tok + kvh * hd;
          head_groups(kvh * G, G, [&]<int GN, int CH>(int64_t h) {
            score_tile<E, GN>(q + h * hd, hd, kr, tok, r, s + h * kTile + j);
          });
        }
      }
      for (int64_t kvh = 0; kvh < nkv; kvh++) {
        if constexpr (E::scaled) {
          const float* kr = (const float*)((const char*)kp + pv.soff) + t0 * pv.srow + kvh;
          const float* vr = (const float*)((const char*)vp + pv.soff) + t0 * pv.srow + kvh;
          for (int j = 0; j < m; j++) ks[j] = kr[j * pv.srow] * scale, vs[j] = vr[j * pv.srow];
        }
        for (int64_t h = kvh * G; h < (kvh + 1) * G; h++)
          alpha[h] = softmax_step<E>(s + h * kTile, m, scale, ks, vs, softcap, mrun + h, lrun + h);
      }
      for (int j = 0; j < m; j += kScoreRows) {
        const int r = m - j < kScoreRows ? m - j : kScoreRows;
        const int64_t piece = (r * tok * (int64_t)sizeof(T) + nkv - 1) / nkv, at = (t0 + j) * tok * (int64_t)sizeof(T);
        for (int64_t kvh = 0; kvh < nkv; kvh++) {
          if (next)
            for (int64_t o = kvh * piece; o < (kvh + 1) * piece; o += 64)
              _mm_prefetch(next + plane_bytes + at + o, _MM_HINT_T0);
          const T* vr = vp + (t0 + j) * tok + kvh * hd;
          head_groups(kvh * G, G, [&]<int GN, int CH>(int64_t h) {
            value_tile<E, GN, CH>(vr, tok, r, s + h * kTile + j, hd, (j == 0 ? alpha : ones) + h, acc + h * hd);
          });
        }
      }
    }
  }
}

// The decode attention of B rows (after their new K/V are in the pool). A row is one new
// token of a sequence; the rows of one sequence's speculative verification (the same block
// table, consecutive context lengths: its pending token and its drafts, kv/cache.py's
// decode layout) are one unit that reads its context once: over the positions every one
// of its R rows sees, [0, len of its first row), its R x nh query heads are one sequence's
// heads (the R rows' G query heads of a kv head side by side), so each K and V row is
// widened once for all of them instead of once per row; row i then adds its last i
// positions alone, and the two states are merged. Any other row is a unit of its own, its
// context [start, len) (start: len - window with a window shorter than it). Units are cut
// into spans only to give nthreads threads work (about two spans per thread over the
// batch's positions, a unit into at most len / kMinSpan, of whole blocks but the first and
// last); a group's common context too short to split by position is split by kv head
// instead (each kv head's R x G query heads are independent of the others': the same
// arithmetic per head, so the same bits, on as many threads as there are kv heads, where
// it would run on one). Not both: two threads reading one span's kv heads side by side
// ran no faster than one, where spans by position did (measured: docs/benchmarks-log.md, "Measurement notes").
// A unit's spans' states are merged into its rows' outputs.
template <class E>
void attend_batch(const PoolView<E>& pv, const float* q, int64_t sq, int64_t B, int64_t nh, int64_t nkv, int64_t hd,
                  int64_t bs, const int64_t* tables, int64_t nb, const int64_t* lens, int64_t window, float scale,
                  float softcap, float* out, int nthreads) {
  auto first = [&](int64_t b) { return (window > 0 && lens[b] > window) ? lens[b] - window : 0; };
  struct Unit {
    int64_t b, R, qoff;  // rows [b, b + R); qoff: a group's query heads in qv (R > 1)
  };
  std::vector<Unit> units;
  int64_t qv_size = 0;
  for (int64_t b = 0; b < B;) {
    int64_t R = 1;
    while (b + R < B && lens[b + R] == lens[b] + R && first(b + R) == 0 &&
           memcmp(tables + (b + R) * nb, tables + b * nb, nb * sizeof(int64_t)) == 0)
      R++;
    units.push_back({b, R, R > 1 ? qv_size : -1});
    if (R > 1) qv_size += R * nh * hd;
    b += R;
  }
  const int64_t G = nh / nkv;
  std::vector<float> qv(qv_size);  // a group's heads: kv head by kv head, row by row, its G query heads
  for (const Unit& u : units) {
    if (u.R == 1) continue;
    for (int64_t kvh = 0; kvh < nkv; kvh++)
      for (int64_t i = 0; i < u.R; i++)
        memcpy(qv.data() + u.qoff + ((kvh * u.R + i) * G) * hd, q + (u.b + i) * sq + kvh * G * hd, G * hd * sizeof(float));
  }
  struct Span {
    int64_t b, p0, p1, part, nhs;  // part: its state's first head in pm/pl/pacc; -1: a lone row's whole context
    const float* qs;               // its nhs query heads
    int64_t kvh0 = 0, nkvs = 0;    // the kv heads it reads: [kvh0, kvh0 + nkvs) (nkvs 0: all nkv)
  };
  int64_t total = 0;
  for (const Unit& u : units) total += lens[u.b] - first(u.b) + (u.R - 1) * u.R / 2;
  const int64_t target = (total + 2 * nthreads - 1) / (2 * nthreads);  // positions per span for ~2 spans a thread
  std::vector<Span> spans;
  std::vector<int64_t> part0(units.size(), -1), parts(units.size(), 0), tail0(units.size(), -1);
  int64_t nheads = 0;  // heads of all partial states
  for (size_t ui = 0; ui < units.size(); ui++) {
    const Unit& u = units[ui];
    const int64_t b = u.b, start = first(b), len = lens[b], n = len - start, nhu = u.R * nh;
    const float* qu = u.R > 1 ? qv.data() + u.qoff : q + b * sq;
    const int64_t pieces = nthreads > 1 ? std::min((n + target - 1) / target, n / kMinSpan) : 1;
    if (pieces <= 1 && u.R == 1) {
      spans.push_back({b, start, len, -1, nh, qu});
      continue;
    }
    part0[ui] = nheads;
    // a group's span [p, e): one per kv head (its R x G heads, qu's kv-head-major layout)
    // where its context is too short to split by position; else every head at once
    auto common = [&](int64_t p, int64_t e) {
      if (u.R == 1 || nthreads <= 1 || nkv == 1 || pieces > 1) {
        spans.push_back({b, p, e, nheads, nhu, qu});
      } else {
        for (int64_t kvh = 0; kvh < nkv; kvh++)
          spans.push_back({b, p, e, nheads + kvh * u.R * G, u.R * G, qu + kvh * u.R * G * hd, kvh, 1});
      }
      nheads += nhu, parts[ui]++;
    };
    if (pieces <= 1) {
      common(start, len);
    } else {
      const int64_t fb = start / bs, per = ((len - 1) / bs - fb + pieces) / pieces;  // blocks per span
      for (int64_t p = start; p < len;) {
        const int64_t e = std::min(len, (fb + (parts[ui] + 1) * per) * bs);
        common(p, e);
        p = e;
      }
    }
    if (u.R > 1) {  // row i's own last i positions [len, len + i)
      tail0[ui] = nheads;
      for (int64_t i = 1; i < u.R; i++) {
        spans.push_back({b, len, len + i, nheads, nh, q + (b + i) * sq});
        nheads += nh;
      }
    }
  }
  std::vector<float> pm(nheads), pl(nheads), pacc(nheads * hd);
  kvpool::parallel_for((int64_t)spans.size(), 1, nthreads, [&](int64_t u0, int64_t u1) {
    thread_local std::vector<float> m_, l_, a_;
    for (int64_t u = u0; u < u1; u++) {
      const Span& sp = spans[u];
      float *mr, *lr, *ac;
      if (sp.part < 0) {
        m_.resize(nh), l_.resize(nh), a_.resize(nh * hd);
        mr = m_.data(), lr = l_.data(), ac = a_.data();
      } else {
        mr = pm.data() + sp.part, lr = pl.data() + sp.part, ac = pacc.data() + sp.part * hd;
      }
      attend_span<E>(pv.heads_from(sp.kvh0, hd), tables + sp.b * nb, bs, sp.p0, sp.p1, sp.qs, sp.nhs,
                     sp.nkvs ? sp.nkvs : nkv, hd, scale, softcap, mr, lr, ac);
      if (sp.part < 0) {
        float* o = out + sp.b * nh * hd;
        for (int64_t h = 0; h < nh; h++) {
          const float inv = 1.0f / lr[h];
          for (int64_t d = 0; d < hd; d++) o[h * hd + d] = ac[h * hd + d] * inv;
        }
      }
    }
  });
  // merge: out = sum_i acc_i e^(m_i - m) / sum_i l_i e^(m_i - m) over a head's states
  std::vector<int64_t> at;  // the states' heads in pm/pl/pacc
  auto merge = [&](float* o) {
    float mx = -INFINITY;
    for (int64_t s : at) mx = std::max(mx, pm[s]);
    float sum = 0.0f;
    for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
    for (int64_t s : at) {
      const float f = expf(pm[s] - mx);
      sum += pl[s] * f;
      const float* a = pacc.data() + s * hd;
      for (int64_t d = 0; d < hd; d++) o[d] += a[d] * f;
    }
    const float inv = 1.0f / sum;
    for (int64_t d = 0; d < hd; d++) o[d] *= inv;
  };
  for (size_t ui = 0; ui < units.size(); ui++) {
    if (part0[ui] < 0) continue;
    const Unit& u = units[ui];
    const int64_t nhu = u.R * nh;
    for (int64_t i = 0; i < u.R; i++)
      for (int64_t h = 0; h < nh; h++) {
        const int64_t vh = u.R == 1 ? h : ((h / G) * u.R + i) * G + h % G;  // its head among the unit's
        at.clear();
        for (int64_t p = 0; p < parts[ui]; p++) at.push_back(part0[ui] + p * nhu + vh);
        if (i > 0) at.push_back(tail0[ui] + (i - 1) * nh + h);
        merge(out + (u.b + i) * nh * hd + h * hd);
      }
  }
}

// kv_decode_attention over a pool of E::T elements (float32, bfloat16 or float16): the
// new K/V rounded into it, the context widened 8 values at a time as it is read.
template <class E>
void decode_attention(const float* q, int64_t sq, const float* k, const float* v, int64_t skv, int64_t B,
                      int64_t nh, int64_t nkv, int64_t hd, typename E::T* pool, int64_t layer, int64_t L, int64_t bs,
                      const int64_t* slot_block, const int64_t* slot_off, const int64_t* tables, int64_t nb,
                      const int64_t* lens, int64_t window, float scale, float softcap, float* out, int nthreads) {
  using T = typename E::T;
  const int64_t tok = nkv * hd;            // one token's K (or V) of all kv heads
  const int64_t half_blk = bs * tok;       // K or V of one block in one layer
  const int64_t blk = L * 2 * half_blk;    // one block, all layers
  for (int64_t b = 0; b < B; b++) {
    T* dst = pool + slot_block[b] * blk + layer * 2 * half_blk + slot_off[b] * tok;
    if constexpr (sizeof(T) == sizeof(float)) {
      memcpy(dst, k + b * skv, tok * sizeof(float));
      memcpy(dst + half_blk, v + b * skv, tok * sizeof(float));
    } else {
      for (int64_t i = 0; i < tok; i++) dst[i] = E::store1(k[b * skv + i]);
      for (int64_t i = 0; i < tok; i++) dst[half_blk + i] = E::store1(v[b * skv + i]);
    }
  }
  const PoolView<E> pv{pool, blk, layer * 2 * half_blk, half_blk, tok, 0, 0};
  attend_batch<E>(pv, q, sq, B, nh, nkv, hd, bs, tables, nb, lens, window, scale, softcap, out, nthreads);
}


// ---- int8 KV (KV_I8) ------------------------------------------------------------------
// Each (layer, K|V) plane of a block is kv_i8_plane(bs, nkv, hd) bytes: the bs * nkv * hd
// int8 values (bs, nkv, hd), zero padding to a multiple of 4, then bs * nkv float32 scales
// (bs, nkv), one per row and kv head (kv/cache.py's KVCacheSpec). x ~= q * s; q = round(x *
// (1 / s)) to nearest even, clamped to +-127; s = absmax / 127 of the row's kv head alone,
// so a row's bytes depend on nothing else (a rejected draft's row beside it, how the
// block was filled).

inline int64_t kv_i8_scale_offset(int64_t bs, int64_t nkv, int64_t hd) { return (bs * nkv * hd + 3) / 4 * 4; }
inline int64_t kv_i8_plane(int64_t bs, int64_t nkv, int64_t hd) {
  return kv_i8_scale_offset(bs, nkv, hd) + 4 * bs * nkv;
}

inline int8_t quantize_i8(float x, float inv) {
  float r = nearbyintf(x * inv);  // the default rounding mode: to nearest even, as torch.round
  r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
  return (int8_t)r;
}

// Write one new row x (nkv, hd) at offset `off` of a block's plane: per kv head its own
// scale absmax / 127 and its values at it, as torch's path does (KVPool._write_int8:
// round(x * (1 / s))). Nothing else in the plane changes.
inline void write_row_i8(int8_t* plane, int64_t soff, int64_t off, const float* x, int64_t nkv, int64_t hd) {
  float* sc = (float*)(plane + soff) + off * nkv;
  int8_t* dst = plane + off * nkv * hd;
  for (int64_t h = 0; h < nkv; h++) {
    const float* xh = x + h * hd;
    float amax = 0.0f;
    for (int64_t i = 0; i < hd; i++) amax = fabsf(xh[i]) > amax ? fabsf(xh[i]) : amax;
    const float s = amax / 127.0f;
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;  // a row of zeros: scale 0, values 0
    sc[h] = s;
    for (int64_t i = 0; i < hd; i++) dst[h * hd + i] = quantize_i8(xh[i], inv);
  }
}

// kv_decode_attention over an int8 pool: the new rows quantized into their blocks, then the
// same spans and tiles as decode_attention, the rows widened in registers as read, each
// row's score times its K scale and its softmax weight times its V scale.
void decode_attention_i8(const float* q, int64_t sq, const float* k, const float* v, int64_t skv, int64_t B,
                         int64_t nh, int64_t nkv, int64_t hd, int8_t* pool, int64_t layer, int64_t L, int64_t bs,
                         const int64_t* slot_block, const int64_t* slot_off, const int64_t* tables, int64_t nb,
                         const int64_t* lens, int64_t window, float scale, float softcap, float* out, int nthreads) {
  const int64_t tok = nkv * hd;
  const int64_t plane = kv_i8_plane(bs, nkv, hd), soff = kv_i8_scale_offset(bs, nkv, hd);
  const int64_t blk = L * 2 * plane;
  for (int64_t b = 0; b < B; b++) {
    int8_t* kp = pool + slot_block[b] * blk + layer * 2 * plane;
    write_row_i8(kp, soff, slot_off[b], k + b * skv, nkv, hd);
    write_row_i8(kp + plane, soff, slot_off[b], v + b * skv, nkv, hd);
  }
  const PoolView<I8Kv> pv{pool, blk, layer * 2 * plane, plane, tok, soff, nkv};
  attend_batch<I8Kv>(pv, q, sq, B, nh, nkv, hd, bs, tables, nb, lens, window, scale, softcap, out, nthreads);
}

}  // namespace


extern "C" {

// One decode token per sequence: write its K and V into the pool, then attend its query
// over the sequence's context read in place from the pool.
//   q (B, nh, hd), k and v (B, n_kv, hd): heads contiguous, rows at element stride sq / skv
//   pool: the whole block pool, of kv_fmt elements (KV_F32, KV_BF16, KV_F16; KV_I8: int8 planes with
//   their scales, decode_attention_i8); layer, L, bs: this layer, layers, block size
//   slot_block, slot_off (B,): where this token's K/V go; tables (B, nb) block ids, lens (B,)
//   context lengths including the new token; window 0: full, else the last `window` positions
//   scale; softcap 0: none, else cap * tanh(s / cap)
//   out (B, nh * hd) contiguous
void kv_decode_attention(const float* q, int64_t sq, const float* k, const float* v, int64_t skv, int64_t B,
                         int64_t nh, int64_t nkv, int64_t hd, void* pool, int64_t kv_fmt, int64_t layer, int64_t L, int64_t bs,
                         const int64_t* slot_block, const int64_t* slot_off, const int64_t* tables, int64_t nb,
                         const int64_t* lens, int64_t window, float scale, float softcap, float* out,
                         int nthreads) {
  switch (kv_fmt) {
    case KV_I8:  // int8 with per-(block, layer, K|V, row, kv head) scales: decode_attention_i8
      decode_attention_i8(q, sq, k, v, skv, B, nh, nkv, hd, (int8_t*)pool, layer, L, bs, slot_block, slot_off, tables,
                          nb, lens, window, scale, softcap, out, nthreads);
      break;
    case KV_BF16:
      decode_attention<Bf16Kv>(q, sq, k, v, skv, B, nh, nkv, hd, (uint16_t*)pool, layer, L, bs, slot_block, slot_off,
                               tables, nb, lens, window, scale, softcap, out, nthreads);
      break;
    case KV_F16:
      decode_attention<F16Kv>(q, sq, k, v, skv, B, nh, nkv, hd, (uint16_t*)pool, layer, L, bs, slot_block, slot_off,
                              tables, nb, lens, window, scale, softcap, out, nthreads);
      break;
    default:
      decode_attention<F32Kv>(q, sq, k, v, skv, B, nh, nkv, hd, (float*)pool, layer, L, bs, slot_block, slot_off,
                              tables, nb, lens, window, scale, softcap, out, nthreads);
  }
}

}  // extern "C"
