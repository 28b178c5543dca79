// The native kernels' one interface: every entry point and every struct passed across
// it. Every source includes this header (so the compiler checks each definition against
// its declaration) and the Python binding (binding.py) is generated from it at load, so
// nothing is declared twice. Keep to the style binding.py parses: one declaration per
// statement, `struct Name { type field; ... };`, the types used below.
//
// float32 throughout unless named; element strides, not byte strides; every pointer
// may be null only where its comment says so.
#pragma once
#include <stdint.h>

// KvLinear.fmt: the weight's stored format
#define KV_F32 0
#define KV_BF16 1
#define KV_I8 2
#define KV_Q8 3
// ggml's block types (qblocks.cpp): each row K / 32 or K / 256 blocks as ggml stores them, the
// input quantized per block as llama.cpp's dot products do
#define KV_Q8_0 5
#define KV_Q4_0 6
#define KV_Q4_1 7
#define KV_Q5_0 8
#define KV_Q4_K 9
#define KV_Q6_K 10
// KvStep.kv_fmt and kv_decode_attention's kv_fmt: the KV pool's element type (KV_F32, KV_BF16 or KV_F16;
// KV_I8: int8 with per-(block, layer, K|V, row, kv head) float32 scales in each block, decode.cpp)
#define KV_F16 4
// kv_act_mul's act and KvLayer.act: the gate's activation
#define KV_SILU 0
#define KV_GELU_TANH 1
#define KV_GELU 2

#ifdef __cplusplus
extern "C" {
#endif

// One product's weight in its stored format (layer.py's ProductWeights).
struct KvLinear {
  const void* w;         // (N, K) row-major: float32 | bf16 | int8; block types: N rows of ggml's blocks
  const float* scales;   // (N,) int8 formats only, else null
  const float* bias;     // (N,) or null
  int64_t N;
  int64_t K;
  int64_t fmt;           // KV_F32, KV_BF16, KV_I8 (float32 input), KV_Q8 (input quantized per 32: w8a8), KV_Q8_0..KV_Q6_K
  const KvLinear* next;  // null, or the product's next rows (outputs N.. on), in their own format: a mixed product
};

// One decoder layer (layer.py's LayerWeights): the pre-norm block of every paged-attention family.
struct KvLayer {
  const float* norm_in;
  const float* norm_post_attn;  // null: none (the residual add rides on o's product)
  const float* norm_mlp;
  const float* norm_post_mlp;   // null: none
  const float* q_norm;          // (hd,) per-head norms or null
  const float* k_norm;
  KvLinear qkv;
  KvLinear o;
  KvLinear gate_up;
  KvLinear down;
  float eps;
  float norm_offset;            // 1: Gemma's (1 + w) norms
  float scale;
  float softcap;                // 0: none
  int64_t nh;
  int64_t nkv;
  int64_t hd;
  int64_t window;               // 0: full attention
  int64_t layer;
  int64_t act;                  // KV_SILU, KV_GELU_TANH, KV_GELU
};

// One decode step's batch (layer.py's DecodeStep): one new token per sequence.
struct KvStep {
  int64_t B;
  int64_t D;
  void* pool;                   // (num_blocks, L, 2, bs, n_kv, hd) of kv_fmt elements
  int64_t kv_fmt;               // KV_F32, KV_BF16, KV_F16: read widened, written rounded to nearest even; KV_I8: quantized
  int64_t L;
  int64_t bs;
  const int64_t* slot_block;    // (B,) where each new token's K/V goes
  const int64_t* slot_off;
  const int64_t* tables;        // (B, nb) block ids
  int64_t nb;
  const int64_t* lens;          // (B,) context length including the new token
  int64_t nthreads;
};

// A model's decode step whole (layer.py's NativeStep), what stays from step to step: its
// layers in order, each rotating with RoPE table groups[i] (0 or 1), the embedding and the
// final norm and head around them (kv_embed's and kv_decode_head's), and the RoPE tables:
// cos and signed sin (table_len, rot) per group, rows by position (replaced when they grow;
// rot 0: no RoPE).
struct KvModel {
  const KvLayer* layers;        // (n_layers,)
  const int64_t* groups;        // (n_layers,)
  int64_t n_layers;
  const float* embedding;       // (V, D)
  int64_t V;
  int64_t D;
  float scale;
  float eps;
  float norm_offset;
  const float* norm_w;          // (D,)
  const KvLinear* head;
  const float* cos0;
  const float* sin0;
  const float* cos1;            // group 1's tables (group 0's where the model has one group)
  const float* sin1;
  int64_t rot;
  int64_t table_len;
};

// y (rows, N) = x (rows, K) W^T * scales + bias (y += ... when accumulate); 1..64 rows.
void kv_gemv_f32(const float* x, int64_t rows, int64_t ldx, int64_t K, const float* W, int64_t N, const float* scales,
                 const float* bias, float* y, int64_t ldy, int accumulate, int nthreads);
void kv_gemv_bf16(const float* x, int64_t rows, int64_t ldx, int64_t K, const uint16_t* W, int64_t N,
                  const float* scales, const float* bias, float* y, int64_t ldy, int accumulate, int nthreads);
void kv_gemv_i8(const float* x, int64_t rows, int64_t ldx, int64_t K, const int8_t* W, int64_t N, const float* scales,
                const float* bias, float* y, int64_t ldy, int accumulate, int nthreads);
// x quantized per block of 32 into xq (rows, K) int8 and xs (rows, K/32), then integer products; K % 32 == 0.
void kv_gemv_q8(const float* x, int64_t rows, int64_t ldx, int64_t K, const int8_t* W, int64_t N, const float* scales,
                const float* bias, float* y, int64_t ldy, int accumulate, int nthreads, int8_t* xq, float* xs);

// ggml's block types (qblocks.cpp), any number of rows: y (rows, N) = x (rows, K) W^T + bias (y += ...
// when accumulate), W (N, K / values per block * bytes per block) in format fmt (KV_Q8_0..KV_Q6_K),
// the input quantized per block (Q8_0 for the 32-value types, Q8_K for Q4_K and Q6_K) and the
// products in integers; a row's result does not depend on the other rows. K a whole number of blocks.
void kv_gemv_blocks(const float* x, int64_t rows, int64_t ldx, int64_t K, const uint8_t* W, int64_t N, int64_t fmt,
                    const float* bias, float* y, int64_t ldy, int accumulate, int nthreads);
// ggml's reference quantizers (quantize_row_*_ref): x (rows, K) -> out (rows, K / values * bytes) in
// format fmt (KV_Q8_0..KV_Q6_K), rows in parallel; returns 0, or -1 for a format or K that does not fit.
int64_t kv_quantize_blocks(const float* x, int64_t rows, int64_t K, int64_t fmt, uint8_t* out, int nthreads);
// One product of any format (a KvLinear and the ones chained after it, side by side in y's columns),
// as the decode step runs it (layer.cpp): y (rows, all N) at row stride ldy.
void kv_product(const KvLinear* l, const float* x, int64_t rows, int64_t ldx, float* y, int64_t ldy, int accumulate,
                int nthreads);

// Prefill-sized products (gemm.cpp), any number of rows: y (rows, N) = x (rows, K) W^T * scales + bias
// (y += ... when accumulate), the weight widened to float32 in cache-sized panels once per call
// and reused across every row. scales: int8 only, else null.
void kv_gemm_f32(const float* x, int64_t rows, int64_t ldx, int64_t K, const float* W, int64_t N, const float* scales,
                 const float* bias, float* y, int64_t ldy, int accumulate, int nthreads);
void kv_gemm_bf16(const float* x, int64_t rows, int64_t ldx, int64_t K, const uint16_t* W, int64_t N,
                  const float* scales, const float* bias, float* y, int64_t ldy, int accumulate, int nthreads);
void kv_gemm_i8(const float* x, int64_t rows, int64_t ldx, int64_t K, const int8_t* W, int64_t N, const float* scales,
                const float* bias, float* y, int64_t ldy, int accumulate, int nthreads);

// Causal attention of T new queries per sequence over its kv_len[b] keys (attention.cpp):
// q (B, T, nh, hd) at strides (sqb, sqt, hd, 1), k and v (B, C, nkv, hd) at (skb, skt, hd, 1),
// query t < n_new[b] at position kv_len[b] - n_new[b] + t (later rows: padding, zeros);
// window 0: no window; softcap 0: none. out (B, T, nh, hd) at (sob, sot, hd, 1).
void kv_prefill_attention(const float* q, int64_t sqb, int64_t sqt, const float* k, const float* v, int64_t skb,
                          int64_t skt, int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, const int64_t* kv_len,
                          const int64_t* n_new, int64_t window, float scale, float softcap, float* out, int64_t sob,
                          int64_t sot, int nthreads);

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * (w + offset); out may be x.
void kv_rmsnorm(const float* x, int64_t rows, int64_t ldx, int64_t D, const float* w, float eps, float offset,
                float* out, int64_t ldo);
// RoPE in place on x (B, T, H, hd) at strides sB, sT, sH, the first rot dims, cos and signed sin (B, T, rot).
void kv_rope(float* x, int64_t B, int64_t T, int64_t H, int64_t sB, int64_t sT, int64_t sH, int64_t rot,
             const float* cos, const float* sin);
// out (rows, I) = act(gate) * up from gu (rows, 2I) = [gate | up].
void kv_act_mul(const float* gu, int64_t rows, int64_t ldg, int64_t I, int act, float* out, int nthreads);
// One new token per sequence: its K/V written into the pool (rounded to its kv_fmt), q attended over the
// context read in place (widened to float32 as read).
void kv_decode_attention(const float* q, int64_t sq, const float* k, const float* v, int64_t skv, int64_t B,
                         int64_t nh, int64_t nkv, int64_t hd, void* pool, int64_t kv_fmt, int64_t layer, int64_t L, int64_t bs,
                         const int64_t* slot_block, const int64_t* slot_off, const int64_t* tables, int64_t nb,
                         const int64_t* lens, int64_t window, float scale, float softcap, float* out, int nthreads);
// x (B, D) through one decoder layer, in place.
void kv_decode_layer(const KvLayer* l, float* x, const KvStep* s, const float* cos, const float* sin, int64_t rot);
// The decode step's ends (layer.cpp), around the layers: x (rows, D) = table (V, D)[ids[r]] * scale (scale 1:
// the rows as stored); returns how many ids were outside 0..V-1 (their rows zero).
int64_t kv_embed(const int64_t* ids, int64_t rows, const float* table, int64_t V, int64_t D, float scale, float* x);
// logits (rows, head.N) = head(norm(x[which[r]])) for x (B, D), norm's weight (D,) with eps and offset
// (kv_rmsnorm's); which null: rows = B, every row in order.
void kv_decode_head(const float* x, int64_t D, const int64_t* which, int64_t rows, const float* norm_w, float eps,
                    float offset, const KvLinear* head, float* logits, int nthreads);

// A whole decode step in one call (layer.cpp): batch (B * (5 + nb),) int64 = ids (B), positions (B),
// slot_block (B), slot_off (B), lens (B), tables (B, nb); the pool and its layout from `pool` (its
// B, D, slot/table/lens pointers, nb and nthreads unread). x (B, D) = kv_embed's rows, then every
// layer (kv_decode_layer, the RoPE rows of each position from the model's tables), then logits (rows,
// head.N) = kv_decode_head's of rows `which` (null: every row in order). Returns 0; n > 0: n ids
// outside 0..V-1, -1: a position outside the RoPE tables (nothing computed or written either way).
int64_t kv_decode_forward(const KvModel* m, const KvStep* pool, const int64_t* batch, int64_t B, int64_t nb,
                          const int64_t* which, int64_t rows, float* logits, int nthreads);

// What the library was built from: "<source digest> <compiler>" (build.py), and the
// sizes of the structs above in the order declared, for the binding's check.
const char* kv_build_id(void);
int64_t kv_struct_size(int64_t which);

#ifdef __cplusplus
}
#endif
