// One whole decoder layer of a decode step in one call: the pre-norm block every
// PagedAttention family shares (Llama, Mistral, Qwen2/3, Phi-3, Gemma 1/2/3), composed
// from the kernels of gemv.cpp and decode.cpp, so a layer costs one call from Python
// instead of ~10. Intermediates live in per-thread scratch buffers reused across calls.
//
//   h = norm_in(x)
//   q, k, v = split(qkv(h))             [q_norm, k_norm per head]  [RoPE on q, k]
//   a = o(attention(q, k, v))           K/V written into the pool, context read in place
//   x += post_attn_norm(a)  or  x += a  (the residual add fused into o's product)
//   h = norm_mlp(x)
//   d = down(act(gate(h)) * up(h))
//   x += post_mlp_norm(d)   or  x += d
//
// Declarations and structs: kvkernels.h (the binding, binding.py, is generated from it).
//
// Each step is the same arithmetic as the per-op path (same kernels, same order), so
// the results are the same bits, except the per-head q/k norms (torch there).

#include <stdint.h>
#include <string.h>

#include <vector>

#include "kvkernels.h"

namespace {

thread_local std::vector<int8_t> xq_buf;
thread_local std::vector<float> xs_buf;

// the product's total outputs (a mixed product: its parts')
int64_t outputs(const KvLinear& l) {
  int64_t n = 0;
  for (const KvLinear* p = &l; p; p = p->next) n += p->N;
  return n;
}

void linear(const KvLinear& l, const float* x, int64_t rows, float* y, int accumulate, int nt) {
  kv_product(&l, x, rows, l.K, y, outputs(l), accumulate, nt);
}

// x += post_norm(lin(in)), or x += lin(in) added inside the product when there is no
// post-norm; tmp (rows, D) is scratch.
void residual_add(const KvLayer& l, const KvLinear& lin, const float* post_norm, const float* in, int64_t rows,
                  int64_t D, float* x, float* tmp, int nt) {
  if (!post_norm) {
    linear(lin, in, rows, x, 1, nt);
    return;
  }
  linear(lin, in, rows, tmp, 0, nt);
  kv_rmsnorm(tmp, rows, D, D, post_norm, l.eps, l.norm_offset, tmp, D);
  for (int64_t i = 0; i < rows * D; i++) x[i] = x[i] + tmp[i];
}

}  // namespace

extern "C" void kv_product(const KvLinear* l, const float* x, int64_t rows, int64_t ldx, float* y, int64_t ldy,
                           int accumulate, int nt) {
  for (; l; y += l->N, l = l->next) {
    switch (l->fmt) {
      case KV_F32: kv_gemv_f32(x, rows, ldx, l->K, (const float*)l->w, l->N, nullptr, l->bias, y, ldy, accumulate, nt); break;
      case KV_BF16: kv_gemv_bf16(x, rows, ldx, l->K, (const uint16_t*)l->w, l->N, nullptr, l->bias, y, ldy, accumulate, nt); break;
      case KV_I8: kv_gemv_i8(x, rows, ldx, l->K, (const int8_t*)l->w, l->N, l->scales, l->bias, y, ldy, accumulate, nt); break;
      case KV_Q8:
        xq_buf.resize(rows * l->K);
        xs_buf.resize(rows * (l->K / 32));
        kv_gemv_q8(x, rows, ldx, l->K, (const int8_t*)l->w, l->N, l->scales, l->bias, y, ldy, accumulate, nt,
                   xq_buf.data(), xs_buf.data());
        break;
      default:  // ggml's block types
        kv_gemv_blocks(x, rows, ldx, l->K, (const uint8_t*)l->w, l->N, l->fmt, l->bias, y, ldy, accumulate, nt);
    }
  }
}

extern "C" void kv_decode_layer(const KvLayer* l, float* x, const KvStep* s, const float* cos, const float* sin,
                                int64_t rot) {
  thread_local std::vector<float> h, qkv, att, tmp, gu, m;
  const int64_t B = s->B, D = s->D, nt = s->nthreads;
  const int64_t nq = outputs(l->qkv), I = outputs(l->gate_up) / 2, hd = l->hd;
  h.resize(B * D);
  qkv.resize(B * nq);
  att.resize(B * l->nh * hd);
  tmp.resize(B * D);
  gu.resize(B * 2 * I);
  m.resize(B * I);

  kv_rmsnorm(x, B, D, D, l->norm_in, l->eps, l->norm_offset, h.data(), D);
  linear(l->qkv, h.data(), B, qkv.data(), 0, nt);
  if (l->q_norm) {
    for (int64_t b = 0; b < B; b++) {
      float* q = qkv.data() + b * nq;
      kv_rmsnorm(q, l->nh, hd, hd, l->q_norm, l->eps, l->norm_offset, q, hd);
      float* k = q + l->nh * hd;
      kv_rmsnorm(k, l->nkv, hd, hd, l->k_norm, l->eps, l->norm_offset, k, hd);
    }
  }
  if (rot > 0) kv_rope(qkv.data(), B, 1, l->nh + l->nkv, nq, nq, hd, rot, cos, sin);
  const float* q = qkv.data();
  kv_decode_attention(q, nq, q + l->nh * hd, q + (l->nh + l->nkv) * hd, nq, B, l->nh, l->nkv, hd, s->pool, s->kv_fmt,
                      l->layer, s->L, s->bs, s->slot_block, s->slot_off, s->tables, s->nb, s->lens, l->window, l->scale,
                      l->softcap, att.data(), nt);
  residual_add(*l, l->o, l->norm_post_attn, att.data(), B, D, x, tmp.data(), nt);
  kv_rmsnorm(x, B, D, D, l->norm_mlp, l->eps, l->norm_offset, h.data(), D);
  linear(l->gate_up, h.data(), B, gu.data(), 0, nt);
  kv_act_mul(gu.data(), B, 2 * I, I, (int)l->act, m.data(), nt);
  residual_add(*l, l->down, l->norm_post_mlp, m.data(), B, D, x, tmp.data(), nt);
}

extern "C" int64_t kv_embed(const int64_t* ids, int64_t rows, const float* table, int64_t V, int64_t D, float scale,
                            float* x) {
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; r++) {
    float* out = x + r * D;
    const int64_t id = ids[r];
    if (id < 0 || id >= V) {
      memset(out, 0, D * sizeof(float));
      bad++;
      continue;
    }
    const float* row = table + id * D;
    if (scale == 1.0f) {
      memcpy(out, row, D * sizeof(float));
    } else {
      for (int64_t i = 0; i < D; i++) out[i] = row[i] * scale;
    }
  }
  return bad;
}

extern "C" void kv_decode_head(const float* x, int64_t D, const int64_t* which, int64_t rows, const float* norm_w,
                               float eps, float offset, const KvLinear* head, float* logits, int nthreads) {
  thread_local std::vector<float> h;
  h.resize(rows * D);
  if (which) {
    for (int64_t r = 0; r < rows; r++) kv_rmsnorm(x + which[r] * D, 1, D, D, norm_w, eps, offset, h.data() + r * D, D);
  } else {
    kv_rmsnorm(x, rows, D, D, norm_w, eps, offset, h.data(), D);
  }
  linear(*head, h.data(), rows, logits, 0, nthreads);
}

extern "C" int64_t kv_decode_forward(const KvModel* m, const KvStep* pool, const int64_t* batch, int64_t B,
                                     int64_t nb, const int64_t* which, int64_t rows, float* logits, int nthreads) {
  thread_local std::vector<float> x, rope;
  const int64_t D = m->D, rot = m->rot;
  const int64_t *ids = batch, *pos = batch + B;
  int64_t bad = 0;
  for (int64_t b = 0; b < B; b++) {
    bad += ids[b] < 0 || ids[b] >= m->V;
    if (rot > 0 && (pos[b] < 0 || pos[b] >= m->table_len)) return -1;
  }
  if (bad) return bad;
  KvStep s = *pool;
  s.B = B;
  s.D = D;
  s.slot_block = batch + 2 * B;
  s.slot_off = batch + 3 * B;
  s.lens = batch + 4 * B;
  s.tables = batch + 5 * B;
  s.nb = nb;
  s.nthreads = nthreads;
  // each group's cos and sin rows (B, rot) at the rows' positions: [cos0 | sin0 | cos1 | sin1]
  rope.resize(4 * B * rot);
  const float* tables[4] = {m->cos0, m->sin0, m->cos1, m->sin1};
  for (int t = 0; t < 4 && rot > 0; t++)
    for (int64_t b = 0; b < B; b++) memcpy(rope.data() + (t * B + b) * rot, tables[t] + pos[b] * rot, rot * sizeof(float));
  x.resize(B * D);
  kv_embed(ids, B, m->embedding, m->V, D, m->scale, x.data());
  for (int64_t i = 0; i < m->n_layers; i++) {
    const float* r = rope.data() + (m->groups[i] ? 2 : 0) * B * rot;
    kv_decode_layer(m->layers + i, x.data(), &s, r, r + B * rot, rot);
  }
  kv_decode_head(x.data(), D, which, which ? rows : B, m->norm_w, m->eps, m->norm_offset, m->head, logits, nthreads);
  return 0;
}

#ifndef KV_BUILD_ID
#define KV_BUILD_ID "unknown"
#endif

extern "C" const char* kv_build_id(void) { return KV_BUILD_ID; }

extern "C" int64_t kv_struct_size(int64_t which) {
  switch (which) {
    case 0: return sizeof(KvLinear);
    case 1: return sizeof(KvLayer);
    case 2: return sizeof(KvStep);
    case 3: return sizeof(KvModel);
    default: return -1;
  }
}
