// ggml's block types (llama.cpp's GGUF weights) in the kernels: each weight row stored as
// ggml stores it, blocks of 32 or 256 values with their own scales, byte for byte.
//
//   KV_Q8_0  34 bytes / 32:  fp16 d, int8 q[32]                            d * q
//   KV_Q4_0  18 bytes / 32:  fp16 d, nibbles[16] (value j low, j + 16 high)  d * (q - 8)
//   KV_Q4_1  20 bytes / 32:  fp16 d, fp16 m, nibbles[16]                   d * q + m
//   KV_Q5_0  22 bytes / 32:  fp16 d, uint32 fifth bits, nibbles[16]       d * (q - 16)
//   KV_Q4_K 144 bytes / 256: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) per 32,
//                            nibbles[128]                                  d * sc * q - dmin * m
//   KV_Q6_K 210 bytes / 256: low nibbles[128], high 2 bits[64], int8 scale per 16, fp16 d
//
// kv_quantize_blocks: ggml's reference quantizers (ggml-quants.c's quantize_row_*_ref, what
// llama-quantize runs without an importance matrix), the same float operations in the same
// order (this library is built with -ffp-contract=off), rows in parallel.
//
// kv_gemv_blocks: y = x W^T (+ bias) as llama.cpp's dot products compute it: each input row
// quantized per block (the 32-value types: symmetric int8 per 32 values with a float32
// scale, ggml's Q8_0 but the scale kept in float32; the K types: ggml's Q8_K, int8 per 256
// values with float32 scale and the sums of each 16), each block's integer dot product
// exact (AVX2 maddubs/madd; the AVX-512 build's VNNI dpbusd for the 32-value types, and
// its 512-bit maddubs/madd over two of a K block's runs of 32 at once), then one float
// multiply-add per block into a per-output accumulator of 8 lanes (AVX2, and the K types)
// or of 16 (the AVX-512 build's 32-value types: even blocks in the low 8 lanes, odd ones in
// the high 8, the halves added before the end), summed at the end in reduce_add8's order
// (Q4_K's min terms: 8 exact int32 lanes per block into an accumulator of their own,
// taken off at the end). A weight block is decoded once for a tile of up to 8 input rows,
// and many rows run in chunks of 16 weight rows, a tile's input kept in L1 over a chunk.
// Every output is computed by the same operations whatever the number of rows or the tile
// it is in, so a row's result never depends on the batch; decode's rows and a prompt's
// many run this one function.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "kvkernels.h"
#include "pool.h"
#include "reduce.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KV_VNNI 1
#else
#define KV_VNNI 0
#endif

namespace {

constexpr int QK = 32;    // values per block of the 32-value types
constexpr int QK_K = 256;  // values per block of the K types

inline float f16(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
inline void put_f16(uint8_t* p, float v) {
  const uint16_t h = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);  // GGML_FP32_TO_FP16 with F16C
  memcpy(p, &h, 2);
}

int block_values(int64_t fmt) { return fmt == KV_Q4_K || fmt == KV_Q6_K ? QK_K : QK; }
int block_bytes(int64_t fmt) {
  switch (fmt) {
    case KV_Q8_0: return 34;
    case KV_Q4_0: return 18;
    case KV_Q4_1: return 20;
    case KV_Q5_0: return 22;
    case KV_Q4_K: return 144;
    case KV_Q6_K: return 210;
    default: return 0;
  }
}

// ---- ggml's reference quantizers ---------------------------------------------------------

constexpr float GROUP_MAX_EPS = 1e-15f;

inline int nearest_int(float fval) {  // round half to even, |fval| <= 4194303
  float val = fval + 12582912.f;
  int i;
  memcpy(&i, &val, sizeof(int));
  return (i & 0x007fffff) - 0x00400000;
}

void quantize_q8_0(const float* x, uint8_t* y) {
  float amax = 0.0f;
  for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
  const float d = amax / ((1 << 7) - 1);
  const float id = d ? 1.0f / d : 0.0f;
  put_f16(y, d);
  for (int j = 0; j < QK; j++) y[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
}

// the signed-max of a block: the value of largest magnitude (the first such), with its sign
inline float signed_max(const float* x, int n) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < n; j++)
    if (amax < fabsf(x[j])) {
      amax = fabsf(x[j]);
      max = x[j];
    }
  return max;
}

void quantize_q4_0(const float* x, uint8_t* y) {
  const float d = signed_max(x, QK) / -8;
  const float id = d ? 1.0f / d : 0.0f;
  put_f16(y, d);
  for (int j = 0; j < QK / 2; j++) {
    const int8_t a = (int8_t)(x[j] * id + 8.5f), b = (int8_t)(x[QK / 2 + j] * id + 8.5f);
    const uint8_t xi0 = a < 15 ? a : 15, xi1 = b < 15 ? b : 15;
    y[2 + j] = xi0 | (xi1 << 4);
  }
}

void quantize_q4_1(const float* x, uint8_t* y) {
  float min = __FLT_MAX__, max = -__FLT_MAX__;
  for (int j = 0; j < QK; j++) {
    if (x[j] < min) min = x[j];
    if (x[j] > max) max = x[j];
  }
  const float d = (max - min) / ((1 << 4) - 1);
  const float id = d ? 1.0f / d : 0.0f;
  put_f16(y, d);
  put_f16(y + 2, min);
  for (int j = 0; j < QK / 2; j++) {
    const int8_t a = (int8_t)((x[j] - min) * id + 0.5f), b = (int8_t)((x[QK / 2 + j] - min) * id + 0.5f);
    const uint8_t xi0 = a < 15 ? a : 15, xi1 = b < 15 ? b : 15;
    y[4 + j] = xi0 | (xi1 << 4);
  }
}

void quantize_q5_0(const float* x, uint8_t* y) {
  const float d = signed_max(x, QK) / -16;
  const float id = d ? 1.0f / d : 0.0f;
  put_f16(y, d);
  uint32_t qh = 0;
  for (int j = 0; j < QK / 2; j++) {
    const int8_t a = (int8_t)(x[j] * id + 16.5f), b = (int8_t)(x[QK / 2 + j] * id + 16.5f);
    const uint8_t xi0 = a < 31 ? a : 31, xi1 = b < 31 ? b : 31;
    y[6 + j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4);
    qh |= ((xi0 & 0x10u) >> 4) << (j + 0);
    qh |= ((xi1 & 0x10u) >> 4) << (j + QK / 2);
  }
  memcpy(y + 2, &qh, 4);
}

// ggml's make_qkx2_quants: a (scale, min) fit of n values to 0..nmax, the weighted error
// searched over nstep + 1 scales around the range's
float make_qkx2_quants(int n, int nmax, const float* x, const float* weights, uint8_t* L, float* the_min, uint8_t* Laux,
                       float rmin, float rdelta, int nstep, bool use_mad) {
  float min = x[0], max = x[0];
  float sum_w = weights[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    float w = weights[i];
    sum_w += w;
    sum_x += w * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *the_min = -min;
    return 0.f;
  }
  float iscale = nmax / (max - min);
  float scale = 1 / iscale;
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    int l = nearest_int(iscale * (x[i] - min));
    L[i] = l < 0 ? 0 : (l > nmax ? nmax : l);
    float diff = scale * L[i] + min - x[i];
    diff = use_mad ? fabsf(diff) : diff * diff;
    best_error += weights[i] * diff;
  }
  if (nstep < 1) {
    *the_min = -min;
    return scale;
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * is + nmax) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * (x[i] - min));
      l = l < 0 ? 0 : (l > nmax ? nmax : l);
      Laux[i] = l;
      float w = weights[i];
      sum_l += w * l;
      sum_l2 += w * l * l;
      sum_xl += w * l * x[i];
    }
    float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float cur_error = 0;
      for (int i = 0; i < n; ++i) {
        float diff = this_scale * Laux[i] + this_min - x[i];
        diff = use_mad ? fabsf(diff) : diff * diff;
        cur_error += weights[i] * diff;
      }
      if (cur_error < best_error) {
        for (int i = 0; i < n; ++i) L[i] = Laux[i];
        best_error = cur_error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *the_min = -min;
  return scale;
}

// ggml's make_qx_quants with rmse_type 1 and no importance weights (Q6_K's sub-blocks):
// symmetric -nmax..nmax-1, the x^2-weighted fit searched over 19 scales
float make_qx_quants(int n, int nmax, const float* x, int8_t* L) {
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    float ax = fabsf(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < GROUP_MAX_EPS) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  auto clamp = [nmax](int l) { return l < -nmax ? -nmax : (l > nmax - 1 ? nmax - 1 : l); };
  float iscale = -nmax / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    int l = clamp(nearest_int(iscale * x[i]));
    L[i] = l + nmax;
    float w = x[i] * x[i];
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  float scale = suml2 ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(nmax + 0.1f * is) / max;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      int l = clamp(nearest_int(iscale * x[i]));
      float w = x[i] * x[i];
      sumlx += w * x[i] * l;
      suml2 += w * l * l;
    }
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      for (int i = 0; i < n; ++i) L[i] = nmax + clamp(nearest_int(iscale * x[i]));
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

inline void get_scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
  }
}

void quantize_q4_k(const float* x, uint8_t* y) {
  uint8_t L[QK_K], Laux[32];
  float weights[32], mins[QK_K / 32], scales[QK_K / 32];
  uint8_t* sc = y + 4;
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < QK_K / 32; ++j) {
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
    float av_x = sqrtf(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + fabsf(x[32 * j + l]);
    scales[j] = make_qkx2_quants(32, 15, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, -1.f, 0.1f, 20, false);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  for (int j = 0; j < QK_K / 32; ++j) {
    uint8_t ls = nearest_int(inv_scale * scales[j]);
    uint8_t lm = nearest_int(inv_min * mins[j]);
    ls = ls < 63 ? ls : 63;
    lm = lm < 63 ? lm : 63;
    if (j < 4) {
      sc[j] = ls;
      sc[j + 4] = lm;
    } else {
      sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
      sc[j - 4] |= ((ls >> 4) << 6);
      sc[j - 0] |= ((lm >> 4) << 6);
    }
  }
  put_f16(y, max_scale / 63.f);
  put_f16(y + 2, max_min / 63.f);
  for (int j = 0; j < QK_K / 32; ++j) {
    uint8_t s, m;
    get_scale_min_k4(j, sc, &s, &m);
    const float d = f16(y) * s;
    if (!d) continue;
    const float dm = f16(y + 2) * m;
    for (int ii = 0; ii < 32; ++ii) {
      int l = nearest_int((x[32 * j + ii] + dm) / d);
      L[32 * j + ii] = l < 0 ? 0 : (l > 15 ? 15 : l);
    }
  }
  uint8_t* q = y + 16;
  for (int j = 0; j < QK_K; j += 64) {
    for (int l = 0; l < 32; ++l) q[l] = L[j + l] | (L[j + l + 32] << 4);
    q += 32;
  }
}

void quantize_q6_k(const float* x, uint8_t* y) {
  int8_t L[QK_K];
  float scales[QK_K / 16];
  uint8_t *ql = y, *qh = y + 128;
  int8_t* sc = (int8_t*)(y + 192);
  float max_scale = 0, max_abs_scale = 0;
  for (int ib = 0; ib < QK_K / 16; ++ib) {
    const float scale = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib);
    scales[ib] = scale;
    if (fabsf(scale) > max_abs_scale) {
      max_abs_scale = fabsf(scale);
      max_scale = scale;
    }
  }
  if (max_abs_scale < GROUP_MAX_EPS) {
    memset(y, 0, 210);
    put_f16(y + 208, 0.f);
    return;
  }
  float iscale = -128.f / max_scale;
  put_f16(y + 208, 1 / iscale);
  for (int ib = 0; ib < QK_K / 16; ++ib) {
    const int l = nearest_int(iscale * scales[ib]);
    sc[ib] = (int8_t)(l < 127 ? l : 127);
  }
  for (int j = 0; j < QK_K / 16; ++j) {
    float d = f16(y + 208) * sc[j];
    if (!d) continue;
    for (int ii = 0; ii < 16; ++ii) {
      int l = nearest_int(x[16 * j + ii] / d);
      l = l < -32 ? -32 : (l > 31 ? 31 : l);
      L[16 * j + ii] = l + 32;
    }
  }
  for (int j = 0; j < QK_K; j += 128) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t q1 = L[j + l + 0] & 0xF, q2 = L[j + l + 32] & 0xF;
      const uint8_t q3 = L[j + l + 64] & 0xF, q4 = L[j + l + 96] & 0xF;
      ql[l + 0] = q1 | (q3 << 4);
      ql[l + 32] = q2 | (q4 << 4);
      qh[l] = (L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6);
    }
    ql += 64;
    qh += 32;
  }
}

// ---- the activations, quantized per block --------------------------------------------------

// One call's input rows, quantized: q (rows, K) int8; the 32-value types: d (rows, K/32)
// float32 scales and s (rows, K/32) = d * sum(q) (Q4_1's min term, ggml's Q8_1 s); the K
// types: d (rows, K/256) and bsums (rows, K/16), the sums of q per 16 values (ggml's Q8_K).
struct Act {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int16_t> bsums;
  std::vector<float> d8;  // the AVX-512 build's 32-value types: d with each block's scale repeated 8 times
  // and for Q4_0 / Q5_0 (their values taken unsigned, 0..15 / 0..31): per block the 8 int32
  // lanes of -8 / -16 times the sum of each 4 of its values, dpbusd's starting sums
  std::vector<int32_t> off;
};

// The Q8_0 quantization of gemv.cpp's w8a8 (amax / 127, round half to even), with s.
void quantize_act32(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / QK; b++) {
    const float* src = x + b * QK;
    __m256 v[4], amax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int j = 0; j < 4; j++) {
      v[j] = _mm256_loadu_ps(src + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    const float db = reduce_max8(amax) / 127.0f;
    const __m256 id = _mm256_set1_ps(db > 0.0f ? 1.0f / db : 0.0f);
    __m256i qi[4];
    for (int j = 0; j < 4; j++)
      qi[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)(q + b * QK), bytes);
    d[b] = db;
    s[b] = db * (float)_mm_cvtsi128_si32(s4);
  }
}

// ggml's quantize_row_q8_K_ref: per 256 values, iscale = -127 / (the signed max), q =
// nearest(iscale * x) capped at 127, d = 1 / iscale; bsums per 16.
void quantize_act256(const float* x, int64_t K, int8_t* q, float* d, int16_t* bsums) {
  for (int64_t b = 0; b < K / QK_K; b++) {
    const float* src = x + b * QK_K;
    int8_t* qb = q + b * QK_K;
    const float max = signed_max(src, QK_K);
    if (max == 0.0f) {
      d[b] = 0.0f;
      memset(qb, 0, QK_K);
      for (int j = 0; j < QK_K / 16; j++) bsums[b * 16 + j] = 0;
      continue;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < QK_K; j++) {
      const int v = nearest_int(iscale * src[j]);
      qb[j] = (int8_t)(v < 127 ? v : 127);
    }
    for (int j = 0; j < QK_K / 16; j++) {
      int sum = 0;
      for (int i = 0; i < 16; i++) sum += qb[16 * j + i];
      bsums[b * 16 + j] = (int16_t)sum;  // |sum| <= 16 * 128
    }
    d[b] = 1 / iscale;
  }
}

// ---- integer dot products of one block ----------------------------------------------------

// Per block of 32 int8 values: 8 int32 lanes, lane l = -offset * (the sum of values 4l..4l+3)
// (dpbusd's lanes), so that dpbusd from them over unsigned values q gives the dot of q - offset.
inline void input_offsets(const int8_t* q, int64_t nblocks, int offset, int32_t* out) {
  for (int64_t b = 0; b < nblocks; b++) {
    const __m256i x = _mm256_loadu_si256((const __m256i*)(q + b * QK));
    const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), x), _mm256_set1_epi16(1));
    _mm256_storeu_si256((__m256i*)(out + b * 8), _mm256_mullo_epi32(sums, _mm256_set1_epi32(-offset)));
  }
}

inline __m256i dot_u8s8(__m256i u, __m256i s) {  // 8 int32 lanes, each the sum of 4 byte products
#if KV_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
inline __m256i dot_s8s8(__m256i w, __m256i x) {  // |w| . (x signed as w): no saturation for |x| <= 127
  return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
inline __m256i nibbles32(const uint8_t* p) {  // 16 bytes -> the 32 values: low nibbles, then high
  const __m128i t = _mm_loadu_si128((const __m128i*)p);
  const __m256i b = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
  return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}
inline __m256i bits32(const uint8_t* p) {  // 32 bits -> 32 bytes, 0xFF where the bit is set
  uint32_t v;
  memcpy(&v, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32((int)v),
      _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// A K-type block's 8 runs of 32 values (v: bytes 0..63, s: each pair's int16 scale) times
// the input's: the sum over runs of madd(maddubs(v, x), s), 8 int32 lanes, exact. The
// AVX-512 build, for tiles of 2 rows or more, takes two runs per operation (v2, s2: runs 2j
// and 2j + 1) and adds the halves at the end: the same integers.
inline __m256i sub_dots(const int8_t* x, const __m256i* v, const __m256i* s) {
  __m256i sumi = _mm256_setzero_si256();
  for (int j = 0; j < 8; j++) {
    const __m256i p = _mm256_maddubs_epi16(v[j], _mm256_loadu_si256((const __m256i*)(x + 32 * j)));
    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, s[j]));
  }
  return sumi;
}
#if KV_VNNI
inline void pair_runs(const __m256i* v, const __m256i* s, __m512i* v2, __m512i* s2) {
  for (int j = 0; j < 4; j++) {
    v2[j] = _mm512_inserti64x4(_mm512_castsi256_si512(v[2 * j]), v[2 * j + 1], 1);
    s2[j] = _mm512_inserti64x4(_mm512_castsi256_si512(s[2 * j]), s[2 * j + 1], 1);
  }
}
inline __m256i sub_dots2(const int8_t* x, const __m512i* v2, const __m512i* s2) {
  __m512i sumi = _mm512_setzero_si512();
  for (int j = 0; j < 4; j++) {
    const __m512i p = _mm512_maddubs_epi16(v2[j], _mm512_loadu_si512((const void*)(x + 64 * j)));
    sumi = _mm512_add_epi32(sumi, _mm512_madd_epi16(p, s2[j]));
  }
  return _mm256_add_epi32(_mm512_castsi512_si256(sumi), _mm512_extracti64x4_epi64(sumi, 1));
}
#endif
// A K-type block's runs, filled by the tile (v, s), then ``ready()`` once per block: ``dot``
// is sub_dots, or in the AVX-512 build for tiles of 2 rows or more sub_dots2 over the runs
// paired once for all the tile's rows.
template <int RB>
struct KRuns {
  __m256i v[8], s[8];
#if KV_VNNI
  __m512i v2[4], s2[4];
#endif
  void ready() {
#if KV_VNNI
    if constexpr (RB > 1) pair_runs(v, s, v2, s2);
#endif
  }
  __m256i dot(const int8_t* x) const {
#if KV_VNNI
    if constexpr (RB > 1) return sub_dots2(x, v2, s2);
#endif
    return sub_dots(x, v, s);
  }
};

#if KV_VNNI
// One block of a 32-value type as the bytes its dot product takes: signed values (Q8_0's,
// and with OFF false Q4_0's q - 8 and Q5_0's q - 16: their sign goes onto x) or unsigned
// ones (Q4_1's 0..15; with OFF Q4_0's 0..15 and Q5_0's 0..31, the offset then coming in as
// Act::off).
template <int F, bool OFF>
inline __m256i values32(const uint8_t* wb) {
  if constexpr (F == KV_Q8_0) return _mm256_loadu_si256((const __m256i*)(wb + 2));
  if constexpr (F == KV_Q4_0)
    return OFF ? nibbles32(wb + 2) : _mm256_sub_epi8(nibbles32(wb + 2), _mm256_set1_epi8(8));
  if constexpr (F == KV_Q5_0) {  // q | fifth bit << 4, or that - 16: 0xF0 or'ed in where the bit is clear
    const __m256i bits = bits32(wb + 2);
    return _mm256_or_si256(nibbles32(wb + 6), OFF ? _mm256_and_si256(bits, _mm256_set1_epi8(0x10))
                                                  : _mm256_andnot_si256(bits, _mm256_set1_epi8((char)0xF0)));
  }
  return nibbles32(wb + 4);
}

// The AVX-512 build's tile of the 32-value types: two blocks per 512-bit operation, block 2i
// in the low 8 lanes and 2i + 1 in the high 8 (an odd count's last block with zeros above),
// each (block, row) pair's arithmetic the AVX2 tile's: the exact integer dot (dpbusd: Q8_0
// with the weight's sign moved onto x; Q4_0 and Q5_0 as their unsigned values from the
// input's -8 / -16 times its sums of 4, the same integers), then acc += dot * (d_w * d_x) in float32. The two halves
// are two accumulators (even and odd blocks), added at the end before reduce_add8; Q4_1's
// min terms likewise summed as two scalars. The same operations for any RB.
template <int F, bool PAIR, int RB>
inline void pair32(const uint8_t* wb, int64_t b, const int8_t* const* xq, const float* const* xd8,
                   const float* const* xs, const int32_t* const* xo, __m512* acc, float* m0, float* m1) {
  constexpr int bb = F == KV_Q8_0 ? 34 : F == KV_Q4_0 ? 18 : F == KV_Q4_1 ? 20 : 22;
  // Q4_0's and Q5_0's offsets from the input in tiles of up to 4 rows (fewer operations a row);
  // in tiles of 8 the sign trick (the offsets' reads would take the tile's input out of L1)
  constexpr bool OFF = (F == KV_Q4_0 || F == KV_Q5_0) && RB <= 4, SIGNED = F != KV_Q4_1 && !OFF;
  const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(values32<F, OFF>(wb)),
                                       PAIR ? values32<F, OFF>(wb + bb) : _mm256_setzero_si256(), 1);
  const __m512 dwv = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(f16(wb))),
                                        _mm256_set1_ps(PAIR ? f16(wb + bb) : 0.0f), 1);
  const __m512i u = SIGNED ? _mm512_abs_epi8(v) : v;
  const __mmask64 neg = _mm512_movepi8_mask(v);
  const float mw0 = F == KV_Q4_1 ? f16(wb + 2) : 0.0f, mw1 = F == KV_Q4_1 && PAIR ? f16(wb + bb + 2) : 0.0f;
  for (int r = 0; r < RB; r++) {
    __m512i x, p0 = _mm512_setzero_si512();
    __m512 dx;
    if constexpr (PAIR) {
      x = _mm512_loadu_si512((const void*)(xq[r] + b * QK));
      dx = _mm512_loadu_ps(xd8[r] + b * 8);
      if constexpr (OFF) p0 = _mm512_loadu_si512((const void*)(xo[r] + b * 8));
    } else {
      x = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)(xq[r] + b * QK)));
      dx = _mm512_zextps256_ps512(_mm256_loadu_ps(xd8[r] + b * 8));
      if constexpr (OFF) p0 = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)(xo[r] + b * 8)));
    }
    if constexpr (SIGNED) x = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
    const __m512i p = _mm512_dpbusd_epi32(p0, u, x);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dwv, dx), acc[r]);
    if constexpr (F == KV_Q4_1) {
      m0[r] += mw0 * xs[r][b];
      if constexpr (PAIR) m1[r] += mw1 * xs[r][b + 1];
    }
  }
}

template <int F, int RB>
inline void tile32_wide(const uint8_t* w, int64_t nblocks, const Act& a, int64_t K, int64_t r0, float* out) {
  constexpr int bb = F == KV_Q8_0 ? 34 : F == KV_Q4_0 ? 18 : F == KV_Q4_1 ? 20 : 22;
  const int64_t nd = K / QK;
  __m512 acc[RB];
  float m0[RB], m1[RB];
  const int8_t* xq[RB];
  const float *xd8[RB], *xs[RB];
  const int32_t* xo[RB];
  for (int r = 0; r < RB; r++) {
    xo[r] = F == KV_Q4_0 || F == KV_Q5_0 ? a.off.data() + (r0 + r) * nd * 8 : nullptr;
    acc[r] = _mm512_setzero_ps();
    m0[r] = m1[r] = 0.0f;
    xq[r] = a.q.data() + (r0 + r) * K;
    xd8[r] = a.d8.data() + (r0 + r) * nd * 8;
    xs[r] = a.s.data() + (r0 + r) * nd;
  }
  int64_t b = 0;
  for (; b + 2 <= nblocks; b += 2) pair32<F, true, RB>(w + b * bb, b, xq, xd8, xs, xo, acc, m0, m1);
  if (b < nblocks) pair32<F, false, RB>(w + b * bb, b, xq, xd8, xs, xo, acc, m0, m1);
  for (int r = 0; r < RB; r++)
    out[r] = reduce_add8(_mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm512_extractf32x8_ps(acc[r], 1))) +
             (m0[r] + m1[r]);
}
#endif

// The dot products of one weight row with RB input rows, block by block: each block of the
// weight decoded once (its values as bytes, its scales), then multiplied by each input row's
// block: the integer dot exact, then acc[r] += dot * d_w * d_x[r] (8 float lanes), m[r] +=
// Q4_1's min term (a float), macc[r] += Q4_K's min terms (8 int32 lanes) * dmin * d_x[r].
// The operations for one (block, row) pair are the same whatever RB, so a row's result does
// not depend on the others.
template <int F, int RB>
inline void tile(const uint8_t* w, int64_t nblocks, const Act& a, int64_t K, int64_t r0, float* out) {
  constexpr bool K_TYPE = F == KV_Q4_K || F == KV_Q6_K;
#if KV_VNNI
  if constexpr (!K_TYPE) {
    tile32_wide<F, RB>(w, nblocks, a, K, r0, out);
    return;
  }
#endif
  constexpr int bv = K_TYPE ? QK_K : QK;
  constexpr int bb = F == KV_Q8_0 ? 34 : F == KV_Q4_0 ? 18 : F == KV_Q4_1 ? 20 : F == KV_Q5_0 ? 22 : F == KV_Q4_K ? 144 : 210;
  const int64_t nd = K / bv;
  __m256 acc[RB], macc[RB];  // macc: Q4_K's min terms, taken off at the end
  float m[RB];
  const int8_t* xq[RB];
  const float *xd[RB], *xs[RB];
  const int16_t* bs[RB];
  for (int r = 0; r < RB; r++) {
    acc[r] = macc[r] = _mm256_setzero_ps();
    m[r] = 0.0f;
    xq[r] = a.q.data() + (r0 + r) * K;
    xd[r] = a.d.data() + (r0 + r) * nd;
    xs[r] = K_TYPE ? nullptr : a.s.data() + (r0 + r) * nd;
    bs[r] = K_TYPE ? a.bsums.data() + (r0 + r) * (K / 16) : nullptr;
  }
  for (int64_t b = 0; b < nblocks; b++) {
    const uint8_t* wb = w + b * bb;
    if constexpr (!K_TYPE) {
      __m256i u, sgn;  // the unsigned operand, and (signed types) the weight whose sign goes onto x
      if constexpr (F == KV_Q8_0) {
        sgn = _mm256_loadu_si256((const __m256i*)(wb + 2));
      } else if constexpr (F == KV_Q4_0) {
        sgn = _mm256_sub_epi8(nibbles32(wb + 2), _mm256_set1_epi8(8));
      } else if constexpr (F == KV_Q5_0) {  // (q | fifth bit << 4) - 16: 0xF0 or'ed in where the bit is clear
        sgn = _mm256_or_si256(nibbles32(wb + 6), _mm256_andnot_si256(bits32(wb + 2), _mm256_set1_epi8((char)0xF0)));
      } else {  // Q4_1: unsigned values 0..15
        u = nibbles32(wb + 4);
      }
      if constexpr (F != KV_Q4_1) u = _mm256_sign_epi8(sgn, sgn);
      const float dw = f16(wb);
      const __m256 dwv = _mm256_set1_ps(dw);
      for (int r = 0; r < RB; r++) {
        const __m256i x = _mm256_loadu_si256((const __m256i*)(xq[r] + b * QK));
        __m256i p;
        if constexpr (F == KV_Q4_1) {
          p = dot_u8s8(u, x);
          m[r] += f16(wb + 2) * xs[r][b];
        } else {
          p = dot_u8s8(u, _mm256_sign_epi8(x, sgn));
        }
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dwv, _mm256_broadcast_ss(xd[r] + b)), acc[r]);
      }
    } else if constexpr (F == KV_Q4_K) {
      // the 12 bytes of 6-bit (scale, min) pairs -> 8 scales then 8 mins, one byte each (ggml's utmp)
      uint32_t u[4];
      memcpy(u, wb + 4, 12);
      constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
      u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
      const uint32_t mins_lo = u[1] & k1;
      u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
      u[2] = mins_lo;
      u[0] &= k1;
      uint8_t sc[16];
      memcpy(sc, u, 16);
      // the 8 mins as 16 int16, each twice: min j beside the input's sums of 16 at 2j and 2j + 1
      const __m128i mins8 = _mm_loadl_epi64((const __m128i*)(sc + 8));
      const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins8, mins8));
      KRuns<RB> k;  // sub-block 2j: the low nibbles of bytes 32j.., 2j + 1: the high ones
      for (int j = 0; j < 4; j++) {
        const __m256i q = _mm256_loadu_si256((const __m256i*)(wb + 16 + 32 * j));
        k.v[2 * j] = _mm256_and_si256(q, _mm256_set1_epi8(0x0F));
        k.v[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm256_set1_epi8(0x0F));
      }
      for (int j = 0; j < 8; j++) k.s[j] = _mm256_set1_epi16(sc[j]);
      k.ready();
      const float dw = f16(wb), dmin = f16(wb + 2);
      for (int r = 0; r < RB; r++) {
        const __m256i sumi = k.dot(xq[r] + b * QK_K);
        // min j * (the input's sum over sub-block j) in lane j, exact; its float term in macc
        const __m256i mm = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i*)(bs[r] + b * 16)));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(dw * xd[r][b]), acc[r]);
        macc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mm), _mm256_set1_ps(dmin * xd[r][b]), macc[r]);
      }
    } else {  // KV_Q6_K: values 0..63 less 32, an int8 scale per 16
      const int8_t* sc = (const int8_t*)(wb + 192);
      KRuns<RB> k;  // run t: values 32t..32t+31, scales 2t (first 16) and 2t + 1
      for (int h = 0; h < 2; h++) {  // 128 values: 4 runs of 32 from ql[64h..], qh[32h..]
        const __m256i l0 = _mm256_loadu_si256((const __m256i*)(wb + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i*)(wb + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i*)(wb + 128 + 32 * h));
        const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
        k.v[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m2));
        k.v[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m2));
        k.v[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m2));
        k.v[4 * h + 3] =
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(hb, 2), m2));
      }
      for (int t = 0; t < 8; t++) k.s[t] = _mm256_setr_m128i(_mm_set1_epi16(sc[2 * t]), _mm_set1_epi16(sc[2 * t + 1]));
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)sc));
      const float dw = f16(wb + 208);
      k.ready();
      for (int r = 0; r < RB; r++) {
        __m256i sumi = k.dot(xq[r] + b * QK_K);
        // 32 * sum(scale_j * bsum_j), taken off in integers (8 lanes of pairs)
        const __m256i off = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i*)(bs[r] + b * 16)));
        sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(off, 5));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(dw * xd[r][b]), acc[r]);
      }
    }
  }
  for (int r = 0; r < RB; r++) {
    out[r] = reduce_add8(acc[r]) + m[r];
    if constexpr (F == KV_Q4_K) out[r] -= reduce_add8(macc[r]);
  }
}

template <int F>
void gemv_blocks(const Act& a, int64_t rows, int64_t K, const uint8_t* W, int64_t N, const float* bias, float* y,
                 int64_t ldy, int accumulate, int nthreads) {
  constexpr int RB = 8;  // input rows per pass over a weight row's blocks (decoded once for them)
  const int64_t nblocks = K / block_values(F), row_bytes = nblocks * block_bytes(F);
  int64_t grain = (N + 4 * nthreads - 1) / (4 * nthreads);
  grain = grain < 16 ? 16 : grain;
  kvpool::parallel_for(N, grain, nthreads, [&](int64_t n0, int64_t n1) {
    float out[RB];
    // NC weight rows at a time, each tile of input rows over all of them: a tile's input
    // stays in L1 while the chunk's weight rows come from L2 (not every input row's block
    // streamed from L2 again for each weight row); one tile: the whole range
    constexpr int64_t NC = 16;
    const int64_t nc = rows <= RB ? n1 - n0 : NC;
    for (int64_t c0 = n0; c0 < n1; c0 += nc) {
      const int64_t c1 = c0 + nc < n1 ? c0 + nc : n1;
      for (int64_t r0 = 0, rb; r0 < rows; r0 += rb) {
        const int64_t left = rows - r0;  // a tile of 8, 4, 3, 2 or 1 rows
        rb = left >= 8 ? 8 : left >= 4 ? 4 : left;
        for (int64_t n = c0; n < c1; n++) {
          const uint8_t* w = W + n * row_bytes;
          switch (rb) {
            case 8: tile<F, 8>(w, nblocks, a, K, r0, out); break;
            case 4: tile<F, 4>(w, nblocks, a, K, r0, out); break;
            case 3: tile<F, 3>(w, nblocks, a, K, r0, out); break;
            case 2: tile<F, 2>(w, nblocks, a, K, r0, out); break;
            default: tile<F, 1>(w, nblocks, a, K, r0, out);
          }
          for (int r = 0; r < rb; r++) {
            float* yv = y + (r0 + r) * ldy + n;
            const float v = bias ? out[r] + bias[n] : out[r];
            *yv = accumulate ? *yv + v : v;
          }
        }
      }
    }
  });
}

}  // namespace

extern "C" {

int64_t kv_quantize_blocks(const float* x, int64_t rows, int64_t K, int64_t fmt, uint8_t* out, int nthreads) {
  const int bv = block_values(fmt), bb = block_bytes(fmt);
  if (!bb || K <= 0 || K % bv) return -1;
  const int64_t nblocks = K / bv, row_bytes = nblocks * bb;
  void (*q)(const float*, uint8_t*) = fmt == KV_Q8_0   ? quantize_q8_0
                                      : fmt == KV_Q4_0 ? quantize_q4_0
                                      : fmt == KV_Q4_1 ? quantize_q4_1
                                      : fmt == KV_Q5_0 ? quantize_q5_0
                                      : fmt == KV_Q4_K ? quantize_q4_k
                                                       : quantize_q6_k;
  kvpool::parallel_for(rows, 1, nthreads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
      for (int64_t b = 0; b < nblocks; b++) q(x + r * K + b * bv, out + r * row_bytes + b * bb);
  });
  return 0;
}

void kv_gemv_blocks(const float* x, int64_t rows, int64_t ldx, int64_t K, const uint8_t* W, int64_t N, int64_t fmt,
                    const float* bias, float* y, int64_t ldy, int accumulate, int nthreads) {
  thread_local Act a;
  const bool k = fmt == KV_Q4_K || fmt == KV_Q6_K;
  const int64_t nd = K / (k ? QK_K : QK);
  a.q.resize(rows * K);
  a.d.resize(rows * nd);
  if (k)
    a.bsums.resize(rows * (K / 16));
  else
    a.s.resize(rows * nd);
  const int offset = !KV_VNNI ? 0 : fmt == KV_Q4_0 ? 8 : fmt == KV_Q5_0 ? 16 : 0;
  if (KV_VNNI && !k) a.d8.resize(rows * nd * 8);
  if (offset) a.off.resize(rows * nd * 8);
  Act* ap = &a;  // the caller's thread_local, filled by the pool's threads
  kvpool::parallel_for(rows, 8, nthreads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      if (k)
        quantize_act256(x + r * ldx, K, ap->q.data() + r * K, ap->d.data() + r * nd, ap->bsums.data() + r * (K / 16));
      else
        quantize_act32(x + r * ldx, K, ap->q.data() + r * K, ap->d.data() + r * nd, ap->s.data() + r * nd);
      if (KV_VNNI && !k)
        for (int64_t b = 0; b < nd; b++) _mm256_storeu_ps(ap->d8.data() + (r * nd + b) * 8, _mm256_set1_ps(ap->d[r * nd + b]));
      if (offset) input_offsets(ap->q.data() + r * K, nd, offset, ap->off.data() + r * nd * 8);
    }
  });
  switch (fmt) {
    case KV_Q8_0: gemv_blocks<KV_Q8_0>(a, rows, K, W, N, bias, y, ldy, accumulate, nthreads); break;
    case KV_Q4_0: gemv_blocks<KV_Q4_0>(a, rows, K, W, N, bias, y, ldy, accumulate, nthreads); break;
    case KV_Q4_1: gemv_blocks<KV_Q4_1>(a, rows, K, W, N, bias, y, ldy, accumulate, nthreads); break;
    case KV_Q5_0: gemv_blocks<KV_Q5_0>(a, rows, K, W, N, bias, y, ldy, accumulate, nthreads); break;
    case KV_Q4_K: gemv_blocks<KV_Q4_K>(a, rows, K, W, N, bias, y, ldy, accumulate, nthreads); break;
    case KV_Q6_K: gemv_blocks<KV_Q6_K>(a, rows, K, W, N, bias, y, ldy, accumulate, nthreads); break;
    default: break;
  }
}

}  // extern "C"
