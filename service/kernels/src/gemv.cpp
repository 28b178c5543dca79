// Decode-sized products y = x W^T (+ bias) for 1..64 rows, read straight from the
// weights' own (out, in) row-major storage: float32, bfloat16, or int8 with one float
// scale per output row (its input float32, or quantized per block of 32: w8a8). Output
// rows are split over the threads of pool.h (the caller passes torch's thread count).
//
// The library is built at one of two ISA levels (kernels/__init__.py picks the best the
// CPU has): AVX2 + FMA with 256-bit vectors, or AVX-512 (F, BW, VL, DQ, VNNI) with
// 512-bit vectors and VNNI's byte dot product for w8a8. The code is the same, written
// over the vector type V (V8 or V16 below).
//
// Register blocking: a tile of NB weight rows x RB input rows is computed at once, so
// each weight vector loaded feeds RB multiply-adds and each input vector NB: one stream
// (decode) reads the weights once at memory speed, a batch (8 streams) is bound by the
// multiply-adds instead of by loads. Every output is still the dot product of one input
// row and one weight row with its own accumulator, summed in an order that depends on K
// only: a row's result does not depend on the tile it was in, nor on what else is in
// the batch (bit for bit; tested).
//
//   x (rows, K) float32, row stride ldx        W (N, K): float32 | bf16 | int8
//   scales (N,) float32 or null (int8 only)    bias (N,) float32 or null
//   y (rows, N) float32, row stride ldy;  accumulate: y += result (a residual add)

#include <immintrin.h>
#include <stdint.h>

#include <vector>

#include "kvkernels.h"
#include "pool.h"
#include "reduce.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define KV_AVX512 1
#else
#define KV_AVX512 0
#endif

namespace {

inline float load1(const float* w) { return *w; }
inline float load1(const uint16_t* w) {
  uint32_t bits = (uint32_t)(*w) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}
inline float load1(const int8_t* w) { return (float)(*w); }

#if KV_AVX512
struct V {  // 16 floats
  using T = __m512;
  static constexpr int W = 16;
  static constexpr int NB = 4, RB = 4;  // 16 accumulators + 4 weight vectors of 32 registers
  // each format's tile (weight rows x input rows) from three input rows on (run_tiles): 4 x 4
  static constexpr int NB_F32 = 4, RB_F32 = 4, NB_BF16 = 4, RB_BF16 = 4, NB_Q8 = 4, RB_Q8 = 4;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_store_ps(p, v); }  // p 64-byte aligned
  static T load(const uint16_t* p) {  // bfloat16: the high half of a float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  }
  static T load(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
  // 2W bfloat16 widened in two ops without a shuffle: the even elements are each 32-bit
  // lane shifted left 16, the odd ones the lane with its low half cleared
  static void load_bf16_pair(const uint16_t* p, T& even, T& odd) {
    const __m512i v = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
  }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(T v) { return _mm512_reduce_add_ps(v); }  // the same order, one vector
  // The lane sums of up to 16 vectors at once, each summed in _mm512_reduce_add_ps's order
  // (the 256-bit halves, then the 128-bit quarters, then element pairs 0,1 + 2,3, then
  // 0 + 1), four levels of two shuffles and an add per pair of vectors instead of a
  // reduction of its own per vector. Vector v's sum lands in lane 4 (v % 4) + v / 4.
  static constexpr int LANES = 16;
  static int slot(int v) { return 4 * (v % 4) + v / 4; }
  static T reduce(T (&a)[16]) {
    T t[8], u[4], w[2];
    for (int p = 0; p < 8; p++)  // [lo8 | lo8] + [hi8 | hi8]: each vector's 8 pair sums
      t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                           _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
    for (int q = 0; q < 4; q++)  // quarters 0 + 1 and 2 + 3 of each: 4 sums per vector
      u[q] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * q], t[2 * q + 1], 0x88),
                           _mm512_shuffle_f32x4(t[2 * q], t[2 * q + 1], 0xDD));
    for (int r = 0; r < 2; r++)  // elements 0,1 + 2,3 of each quarter
      w[r] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * r], u[2 * r + 1], 0x44), _mm512_shuffle_ps(u[2 * r], u[2 * r + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));  // 0 + 1
  }
};
#else
struct V {  // 8 floats
  using T = __m256;
  static constexpr int W = 8;
  static constexpr int NB = 4, RB = 4;  // the largest tile (the buffers' size)
  // Each format's tile from three input rows on (run_tiles), sized to AVX2's 16 registers.
  // float32 and int8 4 x 2: 8 accumulators + 4 weight vectors + the input. bfloat16 2 x 4:
  // its 4 x 2 tile needs 8 accumulators + 8 widened weight vectors + the input and the mask,
  // and the compiler kept three accumulators on the stack (a store and a load per step);
  // 2 x 4 fits (8 + 4 + 2 + 1). w8a8 keeps 4 x 2 (other shapes measured within the noise:
  // docs/benchmarks-log.md, "Measurement notes").
  static constexpr int NB_F32 = 4, RB_F32 = 2, NB_BF16 = 2, RB_BF16 = 4, NB_Q8 = 4, RB_Q8 = 2;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_store_ps(p, v); }  // p 32-byte aligned
  static T load(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  }
  static T load(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
  static void load_bf16_pair(const uint16_t* p, T& even, T& odd) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)p);
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
  }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(T v) { return reduce_add8(v); }  // the same order, one vector
  // The lane sums of up to 8 vectors at once, each summed in reduce_add8's order (the
  // 128-bit halves, then element pairs 0,1 + 2,3, then 0 + 1), three levels of two
  // shuffles and an add per pair of vectors. Vector v's sum lands in lane 4 (v % 2) + v / 2.
  static constexpr int LANES = 8;
  static int slot(int v) { return 4 * (v % 2) + v / 2; }
  static T reduce(T (&a)[8]) {
    T t[4], u[2];
    for (int p = 0; p < 4; p++)  // [lo | lo] + [hi | hi]: each vector's 4 sums
      t[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20),
                           _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31));
    for (int q = 0; q < 2; q++)  // elements 0,1 + 2,3 of each half
      u[q] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * q], t[2 * q + 1], 0x44), _mm256_shuffle_ps(t[2 * q], t[2 * q + 1], 0xEE));
    return _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xDD));  // 0 + 1
  }
};
#endif

// out[r][i] = the lane sum of a[i][r] for a tile's NB x RB accumulators, reduced together
// (V::reduce, the unused vectors zero; one or two vectors alone, V::hsum). Each sum's order
// is that of one vector's own reduction, whatever the tile, so a row's result does not
// depend on the tile it was in.
template <int NB, int RB>
inline void hsum_tile(typename V::T (&a)[NB][RB], float (*out)[V::NB]) {
  static_assert(NB * RB <= V::LANES, "a tile's accumulators fit one reduction");
  if constexpr (NB * RB <= 2) {
    for (int i = 0; i < NB; i++)
      for (int r = 0; r < RB; r++) out[r][i] = V::hsum(a[i][r]);
    return;
  }
  typename V::T v[V::LANES];
  for (int j = 0; j < V::LANES; j++) v[j] = V::zero();
  for (int i = 0; i < NB; i++)
    for (int r = 0; r < RB; r++) v[i * RB + r] = a[i][r];
  alignas(64) float s[V::LANES];
  V::store(s, V::reduce(v));
  for (int i = 0; i < NB; i++)
    for (int r = 0; r < RB; r++) out[r][i] = s[V::slot(i * RB + r)];
}

// A tile's NB weight rows are NB short streams (K values each) that the hardware
// prefetcher does not follow well; each step of a tile prefetches the same share of the
// next tile (the NB rows after it, contiguous), so the next tile streams in while this
// one is computed. [k, k + step) of each row: this step's values. int8 tiles (a few KiB)
// are fetched into L1; float tiles (up to 32 KiB at K = 2048) into L2, where they do not
// evict the tile being read. Not for float32 on AVX2, where the hardware prefetchers do
// better alone (measured: docs/benchmarks-log.md, "Measurement notes").
template <int NB, typename WT>
inline void prefetch_next(const WT* w, int64_t K, int64_t k, int64_t step) {
  if constexpr (!KV_AVX512 && sizeof(WT) == 4) return;
  constexpr _mm_hint hint = sizeof(WT) == 1 ? _MM_HINT_T0 : _MM_HINT_T1;
  const char* next = (const char*)(w + NB * K);
  const int64_t b0 = k * (int64_t)sizeof(WT) * NB, b1 = (k + step) * (int64_t)sizeof(WT) * NB;
  for (int64_t off = (b0 + 63) & ~(int64_t)63; off < b1; off += 64) _mm_prefetch(next + off, hint);
}

// out[r][i] = dot(w[i*K : i*K + K], x[r*ldx : r*ldx + K]), i < NB, r < RB: one W-wide
// accumulator per output, W weights at a time, the tail one by one.
template <typename WT, int NB, int RB>
inline void tile(const WT* w, int64_t K, const float* x, int64_t ldx, float (*out)[V::NB]) {
  typename V::T a[NB][RB];
  for (int i = 0; i < NB; i++)
    for (int r = 0; r < RB; r++) a[i][r] = V::zero();
  int64_t k = 0;
  for (; k + V::W <= K; k += V::W) {
    typename V::T wv[NB];
    prefetch_next<NB>(w, K, k, V::W);
    for (int i = 0; i < NB; i++) wv[i] = V::load(w + i * K + k);
    for (int r = 0; r < RB; r++) {
      const typename V::T xv = V::load(x + r * ldx + k);
      for (int i = 0; i < NB; i++) a[i][r] = V::fmadd(wv[i], xv, a[i][r]);
    }
  }
  hsum_tile<NB, RB>(a, out);
  for (; k < K; k++)
    for (int i = 0; i < NB; i++) {
      const float wk = load1(w + i * K + k);
      for (int r = 0; r < RB; r++) out[r][i] += wk * x[r * ldx + k];
    }
}

// bfloat16 with K % (2W) == 0: 2W weights per load, widened in two ops (V::load_bf16_pair);
// the input is permuted once per call to match, per block of 2W: its even elements, then
// its odd ones (xp, row stride K).
template <int NB, int RB>
inline void tile_bf16(const uint16_t* w, int64_t K, const float* xp, float (*out)[V::NB]) {
  typename V::T a[NB][RB];
  for (int i = 0; i < NB; i++)
    for (int r = 0; r < RB; r++) a[i][r] = V::zero();
  for (int64_t k = 0; k < K; k += 2 * V::W) {
    typename V::T e[NB], o[NB];
    prefetch_next<NB>(w, K, k, 2 * V::W);
    for (int i = 0; i < NB; i++) V::load_bf16_pair(w + i * K + k, e[i], o[i]);
    for (int r = 0; r < RB; r++) {
      const typename V::T xe = V::load(xp + r * K + k), xo = V::load(xp + r * K + k + V::W);
      for (int i = 0; i < NB; i++) a[i][r] = V::fmadd(o[i], xo, V::fmadd(e[i], xe, a[i][r]));
    }
  }
  hsum_tile<NB, RB>(a, out);
}

// ---- int8 x int8 (llama.cpp's Q8_0 dot) ---------------------------------------------
// The input quantized per block of 32 (one float scale each, symmetric, 127 steps); the
// integer products of a block summed exactly, then one float multiply-add per block
// with the input's block scale. The weights are signed and the byte products take an
// unsigned operand, so the weight's sign is moved onto the input (|w| * (x sign w)).

#if KV_AVX512
// dpbusd sums four byte products per 32-bit lane: a 512-bit register holds two blocks'
// dot products (lanes 0-7: block b, 8-15: block b + 1). xs holds each block scale 8
// times (one per lane), so one load scales two blocks; K % 64 == 32 masks the last half.
// The unsigned operand is the input offset by 128 (x ^ 0x80, once per input vector), and
// each lane's sum starts at -128 * (its four weights' sum), computed once per weight
// vector: (x + 128) . w - 128 * sum(w) = x . w, exactly, in one dpbusd per pair (the
// sign trick of the AVX2 kernel costs a second op per pair).
constexpr int64_t XS_REPEAT = 8;
template <int NB, int RB>
inline void tile_q8(const int8_t* w, int64_t K, const int8_t* xq, const float* xs, float (*out)[V::NB]) {
  const __m512i zero = _mm512_setzero_si512(), off = _mm512_set1_epi8((char)0x80);
  __m512 a[NB][RB];
  for (int i = 0; i < NB; i++)
    for (int r = 0; r < RB; r++) a[i][r] = _mm512_setzero_ps();
  const int64_t nb = K / 32, ls = nb * XS_REPEAT;
  for (int64_t b = 0; b < nb; b += 2) {
    const __mmask64 m = b + 2 <= nb ? ~0ull : 0xFFFFFFFFull;
    const __mmask16 ms = b + 2 <= nb ? 0xFFFF : 0x00FF;
    __m512i wv[NB], c[NB];
    prefetch_next<NB>(w, K, b * 32, 64);
    for (int i = 0; i < NB; i++) {
      wv[i] = _mm512_maskz_loadu_epi8(m, w + i * K + b * 32);
      c[i] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, off, wv[i]));
    }
    for (int r = 0; r < RB; r++) {
      const __m512i xu = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, xq + r * K + b * 32), off);
      const __m512 sc = _mm512_maskz_loadu_ps(ms, xs + r * ls + b * XS_REPEAT);
      for (int i = 0; i < NB; i++) {
        const __m512i d = _mm512_dpbusd_epi32(c[i], xu, wv[i]);
        a[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sc, a[i][r]);
      }
    }
  }
  hsum_tile<NB, RB>(a, out);
}
#else
// maddubs: pairs of byte products to int16 (|w| <= 127: no saturation), madd with ones
// to int32 lanes; one block of 32 per 256-bit register.
constexpr int64_t XS_REPEAT = 1;
template <int NB, int RB>
inline void tile_q8(const int8_t* w, int64_t K, const int8_t* xq, const float* xs, float (*out)[V::NB]) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 a[NB][RB];
  for (int i = 0; i < NB; i++)
    for (int r = 0; r < RB; r++) a[i][r] = _mm256_setzero_ps();
  const int64_t nb = K / 32;
  for (int64_t b = 0; b < nb; b++) {
    __m256i wv[NB], u[NB];
    prefetch_next<NB>(w, K, b * 32, 32);
    for (int i = 0; i < NB; i++) {
      wv[i] = _mm256_loadu_si256((const __m256i*)(w + i * K + b * 32));
      u[i] = _mm256_sign_epi8(wv[i], wv[i]);
    }
    for (int r = 0; r < RB; r++) {
      const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + r * K + b * 32));
      const __m256 sc = _mm256_broadcast_ss(xs + r * nb + b);
      for (int i = 0; i < NB; i++) {
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u[i], _mm256_sign_epi8(xv, wv[i])), ones);
        a[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, a[i][r]);
      }
    }
  }
  hsum_tile<NB, RB>(a, out);
}
#endif

// y[r0 + r, n0 + i] (+)= out[r][i] * scale + bias for the tile's nb x rb outputs: a whole
// tile's row of V::NB = 4 outputs as one 4-wide multiply, add (and add to y), the same
// two roundings per output as one at a time (this file is built with -ffp-contract=off;
// no scales multiply by 1 and no bias adds 0, as the scalar path does).
inline void store(float* y, int64_t ldy, int64_t r0, int rb, int64_t n0, int nb, const float (*out)[V::NB],
                  const float* scales, const float* bias, int accumulate) {
  static_assert(V::NB == 4, "a tile row is one 4-wide vector");
  if (nb == 4) {
    const __m128 s = scales ? _mm_loadu_ps(scales + n0) : _mm_set1_ps(1.0f);
    const __m128 b = bias ? _mm_loadu_ps(bias + n0) : _mm_setzero_ps();
    for (int r = 0; r < rb; r++) {
      float* yv = y + (r0 + r) * ldy + n0;
      __m128 v = _mm_add_ps(_mm_mul_ps(_mm_load_ps(out[r]), s), b);
      if (accumulate) v = _mm_add_ps(_mm_loadu_ps(yv), v);
      _mm_storeu_ps(yv, v);
    }
    return;
  }
  for (int i = 0; i < nb; i++) {
    const float s = scales ? scales[n0 + i] : 1.0f;
    const float b = bias ? bias[n0 + i] : 0.0f;
    for (int r = 0; r < rb; r++) {
      float* yv = y + (r0 + r) * ldy + n0 + i;
      const float v = out[r][i] * s + b;
      *yv = accumulate ? *yv + v : v;
    }
  }
}

// Dispatch a tile of nb <= NB weight rows x rb <= RB input rows to its instantiation.
template <int NB, int RB, typename F>
inline void dispatch_rb(int rb, const F& f) {
  if constexpr (RB > 1) {
    if (rb < RB) return dispatch_rb<NB, RB - 1>(rb, f);
  }
  f.template operator()<NB, RB>();
}
template <int NB, int RB, typename F>
inline void dispatch(int nb, int rb, const F& f) {
  if constexpr (NB > 1) {
    if (nb < NB) return dispatch<NB - 1, RB>(nb, rb, f);
  }
  dispatch_rb<NB, RB>(rb, f);
}

// Output rows per chunk of the pool: about four chunks per thread (balance when a thread
// runs late), at least 16 rows (the claim costs an atomic add), a multiple of V::NB.
inline int64_t grain_for(int64_t N, int nthreads) {
  int64_t g = (N + 4 * nthreads - 1) / (4 * nthreads);
  g = g < 16 ? 16 : g;
  return (g + V::NB - 1) / V::NB * V::NB;
}

// The products' loop: chunks of output rows over the threads; in a chunk, tiles of NB
// weight rows, each over the input rows RB at a time (a weight tile is read from memory
// by the first and from cache by the rest), at most NBM x RBM (the format's shape).
// tile_fn<nb, rb>(w, x_row0, r0, out).
template <int NBM, int RBM, typename WT, typename TileFn>
void run_tiles(int64_t rows, int64_t K, const WT* W, int64_t N, const float* scales, const float* bias, float* y,
               int64_t ldy, int accumulate, int nthreads, const TileFn& tile_fn) {
  // One bfloat16 input row on AVX-512: one weight row at a time (it read faster that way;
  // float32 and int8 did not). On AVX2 the tiles: one row's chain of multiply-adds (two per
  // 16 weights, 4-cycle latency) bounds it below the memory's speed. The summation order
  // does not depend on the tile, so no result changes.
  // One or two input rows: tiles of V::NB weight rows for every format, which read the
  // weights faster; the formats' shapes from three rows on. Figures: docs/benchmarks-log.md, "Measurement notes".
  const bool few = rows <= 2;
  const int nbmax = few ? ((KV_AVX512 && rows == 1 && sizeof(WT) == 2) ? 1 : V::NB) : NBM;
  kvpool::parallel_for(N, grain_for(N, nthreads), nthreads, [&](int64_t n0, int64_t n1) {
    alignas(16) float out[V::RB][V::NB];
    // weight rows [n, n + nb) over every input row, RB_ at a time in tiles of at most NB_ x RB_
    auto rows_of = [&]<int NB_, int RB_>(int64_t n, int nb) {
      for (int64_t r0 = 0; r0 < rows; r0 += RB_) {
        const int rb = rows - r0 < RB_ ? (int)(rows - r0) : RB_;
        dispatch<NB_, RB_>(nb, rb, [&]<int nb_, int rb_>() { tile_fn.template operator()<nb_, rb_>(W + n * K, r0, out); });
        store(y, ldy, r0, rb, n, nb, out, scales, bias, accumulate);
      }
    };
    for (int64_t n = n0; n < n1; n += nbmax) {
      const int nb = n1 - n < nbmax ? (int)(n1 - n) : nbmax;
      if (few)
        rows_of.template operator()<V::NB, 2>(n, nb);
      else
        rows_of.template operator()<NBM, RBM>(n, nb);
    }
  });
}

template <typename WT>
void gemv(const float* x, int64_t rows, int64_t ldx, int64_t K, const WT* W, int64_t N, const float* scales,
          const float* bias, float* y, int64_t ldy, int accumulate, int nthreads) {
  run_tiles<V::NB_F32, V::RB_F32>(rows, K, W, N, scales, bias, y, ldy, accumulate, nthreads,
                                  [&]<int NB, int RB>(const WT* w, int64_t r0, float (*out)[V::NB]) {
                                    tile<WT, NB, RB>(w, K, x + r0 * ldx, ldx, out);
                                  });
}

void gemv_bf16(const float* x, int64_t rows, int64_t ldx, int64_t K, const uint16_t* W, int64_t N,
               const float* bias, float* y, int64_t ldy, int accumulate, int nthreads) {
  constexpr int64_t block = 2 * V::W;
  if (K % block) {
    gemv<uint16_t>(x, rows, ldx, K, W, N, nullptr, bias, y, ldy, accumulate, nthreads);
    return;
  }
  thread_local std::vector<float> xp_buf;
  xp_buf.resize(rows * K);
  float* xp = xp_buf.data();
  for (int64_t r = 0; r < rows; r++)
    for (int64_t k = 0; k < K; k += block)
      for (int j = 0; j < V::W; j++) {
        xp[r * K + k + j] = x[r * ldx + k + 2 * j];
        xp[r * K + k + V::W + j] = x[r * ldx + k + 2 * j + 1];
      }
  run_tiles<V::NB_BF16, V::RB_BF16>(rows, K, W, N, nullptr, bias, y, ldy, accumulate, nthreads,
                                    [&]<int NB, int RB>(const uint16_t* w, int64_t r0, float (*out)[V::NB]) {
                                      tile_bf16<NB, RB>(w, K, xp + r0 * K, out);
                                    });
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
  thread_local std::vector<float> xsr_buf;  // each block scale XS_REPEAT times (tile_q8)
  if (XS_REPEAT > 1) {
    xsr_buf.resize(rows * nb * XS_REPEAT);
    for (int64_t i = 0; i < rows * nb; i++)
      for (int j = 0; j < XS_REPEAT; j++) xsr_buf[i * XS_REPEAT + j] = xs[i];
    xs = xsr_buf.data();
  }
  const int64_t ls = nb * XS_REPEAT;
  run_tiles<V::NB_Q8, V::RB_Q8>(rows, K, W, N, scales, bias, y, ldy, accumulate, nthreads,
                                [&]<int NB, int RB>(const int8_t* w, int64_t r0, float (*out)[V::NB]) {
                                  tile_q8<NB, RB>(w, K, xq + r0 * K, xs + r0 * ls, out);
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
