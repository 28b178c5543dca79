// The per-layer work of a decode step around the products (gemv.cpp): RMSNorm, RoPE,
// the SwiGLU/GeGLU gate, and attention of one new token per sequence over its paged KV
// context, read in place from the block pool (no gather into a contiguous copy).
// float32 throughout. Elementwise results are rounded as torch's ops round them (this
// file is built with -ffp-contract=off: a * b + c is two roundings, as in torch).
//
// Pool layout (kv/cache.py): (num_blocks, L, 2, block_size, n_kv, hd), K then V (int8 KV:
// (num_blocks, L, 2, plane) with each plane's scales after its values: decode_attention_i8).

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "kvkernels.h"
#include "pool.h"

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

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The KV pool's element types (KvStep.kv_fmt): each widens 8 stored values to float32
// exactly, and rounds a float32 to the stored type to nearest even, as torch's .to() does.
struct F32Kv {
  using T = float;
  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  static float load1(const float* p) { return *p; }
  static float store1(float x) { return x; }
};
struct Bf16Kv {  // bfloat16: the high half of a float32
  using T = uint16_t;
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

// out[j] = dot(q, k[j]) for the n <= 8 rows k[j] (hd floats each, hd % 8 == 0): one
// accumulator per row, so the eight multiply-add chains run side by side. Eight rows (all
// but a context's last block) take the unrolled form, whose accumulators and row pointers
// stay in registers; the same sums in the same order either way.
template <class E>
inline void dot8(const float* q, const typename E::T* const* k, int n, int64_t hd, float* out) {
  if (n == 8) {
    const typename E::T *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3], *k4 = k[4], *k5 = k[5], *k6 = k[6], *k7 = k[7];
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t i = 0; i < hd; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      a0 = _mm256_fmadd_ps(qv, E::load8(k0 + i), a0);
      a1 = _mm256_fmadd_ps(qv, E::load8(k1 + i), a1);
      a2 = _mm256_fmadd_ps(qv, E::load8(k2 + i), a2);
      a3 = _mm256_fmadd_ps(qv, E::load8(k3 + i), a3);
      a4 = _mm256_fmadd_ps(qv, E::load8(k4 + i), a4);
      a5 = _mm256_fmadd_ps(qv, E::load8(k5 + i), a5);
      a6 = _mm256_fmadd_ps(qv, E::load8(k6 + i), a6);
      a7 = _mm256_fmadd_ps(qv, E::load8(k7 + i), a7);
    }
    const __m256 r[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    _mm256_storeu_ps(out, hsum8(r));
    return;
  }
  __m256 a[8];
  for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < hd; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int j = 0; j < n; j++) a[j] = _mm256_fmadd_ps(qv, E::load8(k[j] + i), a[j]);
  }
  float r[8];
  _mm256_storeu_ps(r, hsum8(a));
  for (int j = 0; j < n; j++) out[j] = r[j];
}

// How far ahead (in positions) attention prefetches K and V rows: a position's rows for one
// kv head are short pieces (hd floats) at the pool's token stride, which the hardware
// prefetcher follows poorly, and eight positions' work is shorter than a memory access.
// 12 layers of ~110M's attention, 8 sequences x 1024 positions, AVX2 host, two threads,
// five alternating runs: medians 24.1 ms (8 ahead, K only) against 19.5 (24 ahead, K and V;
// 16 and 40 ahead measured within the noise of 24); one sequence unchanged.
constexpr int64_t kPrefetchRows = 24;

// The weighted sums of GN query heads over one kv head's V rows, in chunks of CH vectors
// of 8 floats: acc[g] (hd) = sum_p w[g * n + p] * v[p] for g < GN. Each V row chunk is read
// once for the GN heads (grouped-query attention shares V rows among a kv head's query
// heads); the GN * CH accumulators stay in registers across the positions. hd % 8 == 0.
// Per element the sum runs over p in order, whatever GN and CH are: the same bits.
template <class E, int GN, int CH>
inline void weighted_sum_group(const typename E::T* const* v, const float* w, int64_t n, int64_t hd, float* acc) {
  int64_t c = 0;
  for (; c + 8 * CH <= hd; c += 8 * CH) {
    __m256 a[GN][CH];
    for (int g = 0; g < GN; g++)
      for (int j = 0; j < CH; j++) a[g][j] = _mm256_setzero_ps();
    for (int64_t p = 0; p < n; p++) {
      const typename E::T* vp = v[p] + c;
      if (p + kPrefetchRows < n)  // this chunk of the row kPrefetchRows positions on
        for (int j = 0; j < CH; j += 2) _mm_prefetch((const char*)(v[p + kPrefetchRows] + c + 8 * j), _MM_HINT_T0);
      __m256 wp[GN];
      for (int g = 0; g < GN; g++) wp[g] = _mm256_broadcast_ss(w + g * n + p);
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
    for (int g = 0; g < GN; g++) a[g] = _mm256_setzero_ps();
    for (int64_t p = 0; p < n; p++) {
      const __m256 x = E::load8(v[p] + c);
      for (int g = 0; g < GN; g++) a[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + g * n + p), x, a[g]);
    }
    for (int g = 0; g < GN; g++) _mm256_storeu_ps(acc + g * hd + c, a[g]);
  }
}

// acc (G, hd) = the weighted sums of G query heads (weights w (G, n)) over the same V rows,
// taken in groups of up to 3 heads sized to the vector registers: 16 with AVX2, 32 with
// AVX-512 (its __m256 code reaches ymm16-31).
template <class E>
inline void weighted_sum_heads(const typename E::T* const* v, const float* w, int64_t G, int64_t n, int64_t hd,
                               float* acc) {
#ifdef __AVX512F__
  constexpr int C1 = 8, C2 = 8, C3 = 8;
#else
  constexpr int C1 = 8, C2 = 4, C3 = 4;
#endif
  int64_t g = 0;
  for (; g + 3 <= G; g += 3) weighted_sum_group<E, 3, C3>(v, w + g * n, n, hd, acc + g * hd);
  if (G - g == 2) weighted_sum_group<E, 2, C2>(v, w + g * n, n, hd, acc + g * hd);
  if (G - g == 1) weighted_sum_group<E, 1, C1>(v, w + g * n, n, hd, acc + g * hd);
}


// Work units of the decode attention kernels: (sequence, kv head, slice of that kv head's
// query heads). The query heads of a slice share each K and V row read from the pool
// (grouped-query attention reads the context once per slice, not once per query head); a
// group is split into slices only as far as needed to give every thread work.
struct AttnUnits {
  int64_t nkv, group, slices, per;
  AttnUnits(int64_t B, int64_t nh, int64_t nkv_, int nthreads) : nkv(nkv_), group(nh / nkv_) {
    slices = (2 * (int64_t)nthreads + B * nkv - 1) / (B * nkv);
    slices = slices < 1 ? 1 : (slices > group ? group : slices);
    per = (group + slices - 1) / slices;
  }
  int64_t count(int64_t B) const { return B * nkv * slices; }
  // unit u: its sequence b, kv head kvh and query heads [h0, h1) (empty when h1 <= h0)
  void at(int64_t u, int64_t& b, int64_t& kvh, int64_t& h0, int64_t& h1) const {
    b = u / (nkv * slices);
    kvh = (u / slices) % nkv;
    h0 = kvh * group + (u % slices) * per;
    h1 = h0 + per < (kvh + 1) * group ? h0 + per : (kvh + 1) * group;
  }
};

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
  const AttnUnits units(B, nh, nkv, nthreads);  // (sequence, kv head, slice of its query heads)
  kvpool::parallel_for(units.count(B), 1, nthreads, [&](int64_t u0, int64_t u1) {
    thread_local std::vector<float> scores, acc;
    thread_local std::vector<const T*> kps, vps;
    for (int64_t u = u0; u < u1; u++) {
      int64_t b, kvh, h0, h1;
      units.at(u, b, kvh, h0, h1);
      const int64_t G = h1 - h0;
      if (G <= 0) continue;
      const int64_t len = lens[b];
      const int64_t start = (window > 0 && len > window) ? len - window : 0;
      const int64_t n = len - start;
      scores.resize(G * n);
      acc.resize(G * hd);
      kps.resize(n);
      vps.resize(n);
      for (int64_t p = start; p < len;) {  // where each position's K and V rows are in the pool, a block at a time
        const T* row = pool + tables[b * nb + p / bs] * blk + layer * 2 * half_blk + (p % bs) * tok + kvh * hd;
        const int64_t end = std::min(len, (p / bs + 1) * bs);
        for (; p < end; p++, row += tok) {
          kps[p - start] = row;
          vps[p - start] = row + half_blk;
        }
      }
      const float* qb = q + b * sq + h0 * hd;
      // Scores, eight positions at a time for all G heads: the eight K rows are read from
      // the pool once and stay in L1 for the G dot products; rows kPrefetchRows on are prefetched.
      for (int64_t i = 0; i < n; i += 8) {
        const int m = n - i < 8 ? (int)(n - i) : 8;
        for (int64_t j = i + kPrefetchRows; j < i + kPrefetchRows + 8 && j < n; j++)
          for (int64_t o = 0; o < hd * (int64_t)sizeof(T); o += 64) _mm_prefetch((const char*)kps[j] + o, _MM_HINT_T0);
        for (int64_t g = 0; g < G; g++) {
          float* sg = scores.data() + g * n + i;
          if (hd % 8 == 0) {
            dot8<E>(qb + g * hd, kps.data() + i, m, hd, sg);
          } else {
            for (int j = 0; j < m; j++) sg[j] = dot_kv<E>(qb + g * hd, kps[i + j], hd);
          }
        }
      }
      for (int64_t g = 0; g < G; g++) {  // scale (and cap), then softmax over the context, per query head
        float* sg = scores.data() + g * n;
        float mx = -INFINITY;
        if (softcap > 0.0f) {
          for (int64_t i = 0; i < n; i++) {
            const float sc = softcap * tanhf(sg[i] * scale / softcap);
            sg[i] = sc;
            mx = sc > mx ? sc : mx;
          }
        } else {  // the same products, eight at a time (the maximum is exact in any order)
          const __m256 sv8 = _mm256_set1_ps(scale);
          __m256 mv8 = _mm256_set1_ps(-INFINITY);
          int64_t i = 0;
          for (; i + 8 <= n; i += 8) {
            const __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(sg + i), sv8);
            _mm256_storeu_ps(sg + i, sc);
            mv8 = _mm256_max_ps(mv8, sc);
          }
          float r[8];
          _mm256_storeu_ps(r, mv8);
          for (int j = 0; j < 8; j++) mx = r[j] > mx ? r[j] : mx;
          for (; i < n; i++) {
            sg[i] *= scale;
            mx = sg[i] > mx ? sg[i] : mx;
          }
        }
        const __m256 mv = _mm256_set1_ps(mx);
        __m256 sv = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), mv));
          _mm256_storeu_ps(sg + i, e);
          sv = _mm256_add_ps(sv, e);
        }
        float sum = hsum(sv);
        for (; i < n; i++) {
          sg[i] = expf(sg[i] - mx);
          sum += sg[i];
        }
        const float inv = 1.0f / sum;
        for (i = 0; i < n; i++) sg[i] *= inv;
      }
      if (hd % 8 == 0) {
        weighted_sum_heads<E>(vps.data(), scores.data(), G, n, hd, acc.data());
      } else {
        for (int64_t g = 0; g < G; g++) {
          float* ag = acc.data() + g * hd;
          for (int64_t d = 0; d < hd; d++) ag[d] = 0.0f;
          for (int64_t p = 0; p < n; p++)
            for (int64_t d = 0; d < hd; d++) ag[d] += scores[g * n + p] * E::load1(vps[p] + d);
        }
      }
      memcpy(out + b * nh * hd + h0 * hd, acc.data(), G * hd * sizeof(float));
    }
  });
}

// ---- int8 KV (KV_I8) ------------------------------------------------------------------
// Each (layer, K|V) plane of a block is kv_i8_plane(bs, nkv, hd) bytes: the bs * nkv * hd
// int8 values (bs, nkv, hd), zero padding to a multiple of 4, then nkv float32 scales, one
// per kv head (kv/cache.py's KVCacheSpec). x ~= q * s; q = round(x * (1 / s)) to nearest
// even, clamped to +-127; s = absmax / 127 of every row the block holds.

struct I8Kv {  // widened exactly; the block's scale is applied to the dot products and weights
  using T = int8_t;
  static __m256 load8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  }
  static float load1(const int8_t* p) { return (float)*p; }
};

inline int64_t kv_i8_scale_offset(int64_t bs, int64_t nkv, int64_t hd) { return (bs * nkv * hd + 3) / 4 * 4; }
inline int64_t kv_i8_plane(int64_t bs, int64_t nkv, int64_t hd) { return kv_i8_scale_offset(bs, nkv, hd) + 4 * nkv; }

inline int8_t quantize_i8(float x, float inv) {
  float r = nearbyintf(x * inv);  // the default rounding mode: to nearest even, as torch.round
  r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
  return (int8_t)r;
}

// Write one new row x (nkv, hd) at offset `off` of a block's plane: per kv head the scale
// grows to cover it (a plane written from offset 0 starts afresh: its old scale is a
// previous owner's), the rows already there requantized to the grown scale as torch's
// path does (KVPool._write_int8: round((q * s_old) * (1 / s_new))).
inline void write_row_i8(int8_t* plane, int64_t soff, int64_t off, const float* x, int64_t nkv, int64_t hd) {
  float* sc = (float*)(plane + soff);
  const int64_t tok = nkv * hd;
  for (int64_t h = 0; h < nkv; h++) {
    const float* xh = x + h * hd;
    float amax = 0.0f;
    for (int64_t i = 0; i < hd; i++) amax = fabsf(xh[i]) > amax ? fabsf(xh[i]) : amax;
    const float s_old = off == 0 ? 0.0f : sc[h];
    const float grown = amax / 127.0f;
    const float s_new = grown > s_old ? grown : s_old;
    const float inv = s_new > 0.0f ? 1.0f / s_new : 0.0f;
    if (s_new != s_old)
      for (int64_t p = 0; p < off; p++) {
        int8_t* row = plane + p * tok + h * hd;
        for (int64_t i = 0; i < hd; i++) row[i] = quantize_i8((float)row[i] * s_old, inv);
      }
    sc[h] = s_new;
    int8_t* dst = plane + off * tok + h * hd;
    for (int64_t i = 0; i < hd; i++) dst[i] = quantize_i8(xh[i], inv);
  }
}

// kv_decode_attention over an int8 pool: the same work units and order as decode_attention,
// the rows widened in registers as read, each position's dot products times its block's K
// scale and its softmax weights times its block's V scale.
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
  const AttnUnits units(B, nh, nkv, nthreads);
  kvpool::parallel_for(units.count(B), 1, nthreads, [&](int64_t u0, int64_t u1) {
    thread_local std::vector<float> scores, acc, ks, vs;
    thread_local std::vector<const int8_t*> kps, vps;
    for (int64_t u = u0; u < u1; u++) {
      int64_t b, kvh, h0, h1;
      units.at(u, b, kvh, h0, h1);
      const int64_t G = h1 - h0;
      if (G <= 0) continue;
      const int64_t len = lens[b];
      const int64_t start = (window > 0 && len > window) ? len - window : 0;
      const int64_t n = len - start;
      scores.resize(G * n);
      acc.resize(G * hd);
      kps.resize(n);
      vps.resize(n);
      ks.resize(n);
      vs.resize(n);
      for (int64_t p = start; p < len;) {  // each position's rows and its block's scales
        const int8_t* kplane = pool + tables[b * nb + p / bs] * blk + layer * 2 * plane;
        const float ksc = ((const float*)(kplane + soff))[kvh], vsc = ((const float*)(kplane + plane + soff))[kvh];
        const int8_t* row = kplane + (p % bs) * tok + kvh * hd;
        const int64_t end = std::min(len, (p / bs + 1) * bs);
        for (; p < end; p++, row += tok) {
          kps[p - start] = row;
          vps[p - start] = row + plane;
          ks[p - start] = ksc;
          vs[p - start] = vsc;
        }
      }
      const float* qb = q + b * sq + h0 * hd;
      for (int64_t i = 0; i < n; i += 8) {
        const int m = n - i < 8 ? (int)(n - i) : 8;
        for (int64_t j = i + kPrefetchRows; j < i + kPrefetchRows + 8 && j < n; j++)
          for (int64_t o = 0; o < hd; o += 64) _mm_prefetch((const char*)kps[j] + o, _MM_HINT_T0);
        for (int64_t g = 0; g < G; g++) {
          float* sg = scores.data() + g * n + i;
          if (hd % 8 == 0) {
            dot8<I8Kv>(qb + g * hd, kps.data() + i, m, hd, sg);
          } else {
            for (int j = 0; j < m; j++) sg[j] = dot_kv<I8Kv>(qb + g * hd, kps[i + j], hd);
          }
          for (int j = 0; j < m; j++) sg[j] *= ks[i + j];
        }
      }
      for (int64_t g = 0; g < G; g++) {  // scale (and cap), softmax, then each weight times its V scale
        float* sg = scores.data() + g * n;
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
          const float sc = softcap > 0.0f ? softcap * tanhf(sg[i] * scale / softcap) : sg[i] * scale;
          sg[i] = sc;
          mx = sc > mx ? sc : mx;
        }
        const __m256 mv = _mm256_set1_ps(mx);
        __m256 sv = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), mv));
          _mm256_storeu_ps(sg + i, e);
          sv = _mm256_add_ps(sv, e);
        }
        float sum = hsum(sv);
        for (; i < n; i++) {
          sg[i] = expf(sg[i] - mx);
          sum += sg[i];
        }
        const float inv = 1.0f / sum;
        for (i = 0; i < n; i++) sg[i] = (sg[i] * inv) * vs[i];
      }
      if (hd % 8 == 0) {
        weighted_sum_heads<I8Kv>(vps.data(), scores.data(), G, n, hd, acc.data());
      } else {
        for (int64_t g = 0; g < G; g++) {
          float* ag = acc.data() + g * hd;
          for (int64_t d = 0; d < hd; d++) ag[d] = 0.0f;
          for (int64_t p = 0; p < n; p++)
            for (int64_t d = 0; d < hd; d++) ag[d] += scores[g * n + p] * I8Kv::load1(vps[p] + d);
        }
      }
      memcpy(out + b * nh * hd + h0 * hd, acc.data(), G * hd * sizeof(float));
    }
  });
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
    case KV_I8:  // int8 with per-(block, layer, K|V, kv head) scales: decode_attention_i8
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
