"""The Triton kernels behind ``kvserve.service.kernels.triton`` (imported on the first
call: this module imports triton), each with its launcher. The package's ``__init__``
checks shapes and dtypes; the launchers here pick block sizes from them and launch.

Exactness. Where the reference rounds (``Tensor.to``, a bf16 op, the int8/fp8 pool's
``round`` and e4m3 casts) the kernels round alike, in integer arithmetic on the float's
bits where Triton's own casts are not round-to-nearest-even everywhere (the interpreter
truncates float32 -> bfloat16 and rounds float8 half-up; the GPU's cvt.rn is exact), so
the interpreter and the GPU write the same bytes as torch: ``_bf16`` and ``_e4m3``.
``_round_int`` rounds to nearest even by the 1.5 * 2^23 trick, its input clamped first
(a min/max between the product and the add keeps the compiler from fusing them into an
FMA, which would round once instead of twice). Divisions the pool's scales depend on are
``div_rn`` (IEEE), as torch's. The write, norm and RoPE kernels launch with FP fusion off
(no multiply-add contracted into an FMA), so they round as the reference's separate ops
on the GPU too; attention keeps it (its result is checked within a tolerance).

Block shapes. Attention tiles are BLOCK_M query rows (tokens times the q heads of one kv
head: GQA shares each K/V tile) by TILE keys, products on the tensor cores in q's dtype
(bf16 / fp16; float32 runs IEEE products on the FMA units, in 16 x 16 tiles, one
pipeline stage, which is what compiles without spills). Decode takes 16 rows (a group's
heads, padded), prefill ~128; 64 keys a tile (32 past head_dim 128).
test_triton_compile.py compiles each for sm_90 and reads the registers and spills.
"""

from __future__ import annotations

import torch
import triton

if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 4):
    raise ImportError(f"triton {triton.__version__} is older than 3.4, which these kernels need")

import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402

# Triton reads TRITON_INTERPRET when it is imported and when a kernel is defined (here: as
# this module is imported), and its launches check it again: set it before triton loads
INTERPRETED = bool(knobs.runtime.interpret)
if INTERPRETED and type(tl.max).__name__ != "InterpretedFunction":
    raise ImportError("triton was imported before TRITON_INTERPRET=1 was set: its library functions (tl.max, "
                      "tl.sum, ...) are compiled ones, which interpreted kernels cannot call")

_LOG2E = tl.constexpr(1.4426950408889634)
_RNE = tl.constexpr(12582912.0)  # 1.5 * 2^23: (y + _RNE) - _RNE rounds |y| < 2^22 to the nearest integer, ties to even


def _device(fn):
    """``triton.jit`` for a device function. Under the interpreter, the interpreted
    function's rewritten body called directly: the interpreter patches ``triton.language``
    once per launch already, and its device-function call would patch it again on every
    call (~5 ms each; most of a test's time)."""
    jitted = triton.jit(fn)
    if not INTERPRETED or not hasattr(jitted, "rewrite"):
        return jitted
    body = jitted.rewrite()
    return lambda *args, **kwargs: body(*args, **kwargs)


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


# ---- rounding helpers (device) ------------------------------------------------------------


@_device
def _bf16(x):
    """float32 -> bfloat16, to nearest even (Tensor.to's rounding), from the bits."""
    b = x.to(tl.uint32, bitcast=True)
    r = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
    r = tl.where(x != x, 0x7FC0, r)  # NaN stays NaN
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@_device
def _cast(x, DTYPE: tl.constexpr):
    """float32 x in DTYPE, rounded to nearest even (bfloat16 through ``_bf16``)."""
    if DTYPE == tl.bfloat16:
        return _bf16(x)
    else:
        return x.to(DTYPE)


@_device
def _rounded(x, DTYPE: tl.constexpr):
    """float32 x rounded to DTYPE and widened back: an intermediate the reference keeps in DTYPE."""
    if DTYPE == tl.float32:
        return x
    else:
        return _cast(x, DTYPE).to(tl.float32)


@_device
def _round_int(y, QMAX: tl.constexpr):
    """round(clamp(y, -QMAX, QMAX)) to nearest even, as float32 (torch: round_() then clamp_)."""
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    return (y + _RNE) - _RNE


@_device
def _e4m3(y):
    """float32 y (|y| <= 448) -> float8_e4m3fn bits (uint8), to nearest even as torch's cast:
    normal values round the float32 mantissa to 3 bits (the carry may step the exponent),
    below 2^-6 the value is a multiple of 2^-9 (subnormals; 8 * 2^-9 is the smallest normal)."""
    b = y.to(tl.uint32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    normal = ((a + (0x7FFFF + ((a >> 20) & 1))) >> 20) - (120 << 3)
    mag = a.to(tl.float32, bitcast=True)
    sub = ((mag * 512.0 + _RNE) - _RNE).to(tl.uint32)
    return (tl.where(a < 0x3C800000, sub, normal) | sign).to(tl.uint8)


@_device
def _quantize(y, FP8: tl.constexpr):
    """The stored value of y (already x / s): int8 round-and-clamp, or e4m3 of clamp(y, +-448) (as bytes)."""
    if FP8:
        return _e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0))
    else:
        return _round_int(y, 127.0).to(tl.int8)


@_device
def _widen(q, FP8: tl.constexpr):
    """A stored int8 / e4m3 value (int8 / uint8 bits) as float32."""
    if FP8:
        return q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return q.to(tl.float32)


@_device
def _tanh(x):
    """tanh from exp2, stable at both ends (Triton has no portable tanh)."""
    t = tl.exp2(tl.abs(x) * (-2.0 * _LOG2E))  # exp(-2|x|) in (0, 1]
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


# ---- KV write -----------------------------------------------------------------------------


@triton.jit
def _write_rows_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                       s_kt, s_kh, s_vt, s_vh,
                       s_cb, s_co, s_ch, s_vb, s_vo, s_vch,
                       NKV: tl.constexpr, HD: tl.constexpr, NKV_P: tl.constexpr, HD_P: tl.constexpr,
                       BS: tl.constexpr):
    """Exact / bf16 / fp16 pool: row r's K and V (all kv heads) stored at its slot, rounded
    to the pool's dtype."""
    r = tl.program_id(0)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    if slot >= 0:
        blk = slot // BS
        off = slot % BS
        h = tl.arange(0, NKV_P)[:, None]
        d = tl.arange(0, HD_P)[None, :]
        m = (h < NKV) & (d < HD)
        DT: tl.constexpr = kc_ptr.dtype.element_ty
        k = tl.load(k_ptr + r.to(tl.int64) * s_kt + h * s_kh + d, mask=m)
        v = tl.load(v_ptr + r.to(tl.int64) * s_vt + h * s_vh + d, mask=m)
        if k_ptr.dtype.element_ty != DT:
            k = _cast(k.to(tl.float32), DT)
            v = _cast(v.to(tl.float32), DT)
        tl.store(kc_ptr + blk * s_cb + off * s_co + h * s_ch + d, k, mask=m)
        tl.store(vc_ptr + blk * s_vb + off * s_vo + h * s_vch + d, v, mask=m)


@_device
def _quant_row(x_ptr, s_xt, s_xh, c_ptr, s_cb, s_co, s_ch, sc_ptr, s_sb, s_so, s_sh, r, h, blk, off,
               HD: tl.constexpr, HD_P: tl.constexpr, FP8: tl.constexpr):
    """Kv head h of row r in one plane (K or V): quantized at its own scale, absmax / qmax,
    stored with the scale at (blk, off) (``KVPool._write_int8``)."""
    d = tl.arange(0, HD_P)
    dm = d < HD
    x = tl.load(x_ptr + r.to(tl.int64) * s_xt + h * s_xh + d, mask=dm, other=0.0).to(tl.float32)
    QMAX: tl.constexpr = 448.0 if FP8 else 127.0
    s = tl.math.div_rn(tl.max(tl.abs(x), axis=0), QMAX)
    inv = tl.where(s > 0, tl.math.div_rn(1.0, tl.where(s > 0, s, 1.0)), 0.0)  # a row of zeros: scale 0, values 0
    tl.store(c_ptr + blk * s_cb + off * s_co + h * s_ch + d, _quantize(x * inv, FP8), mask=dm)
    tl.store(sc_ptr + blk * s_sb + off * s_so + h * s_sh, s)


@triton.jit
def _write_quant_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
                        s_kt, s_kh, s_vt, s_vh,
                        s_cb, s_co, s_ch, s_vb, s_vo, s_vch,
                        s_ksb, s_kso, s_ksh, s_vsb, s_vso, s_vsh,
                        HD: tl.constexpr, HD_P: tl.constexpr, BS: tl.constexpr, FP8: tl.constexpr):
    """Int8 / fp8 pool: program (r, h) writes kv head h of row r, K and V, each at its own
    scale: a row's bytes depend on it alone, whatever else its block holds or receives."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    if slot >= 0:
        blk = slot // BS
        off = slot % BS
        _quant_row(k_ptr, s_kt, s_kh, kc_ptr, s_cb, s_co, s_ch, ks_ptr, s_ksb, s_kso, s_ksh, r, h, blk, off,
                   HD, HD_P, FP8)
        _quant_row(v_ptr, s_vt, s_vh, vc_ptr, s_vb, s_vo, s_vch, vs_ptr, s_vsb, s_vso, s_vsh, r, h, blk, off,
                   HD, HD_P, FP8)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor as its bytes (the kernels do the float8 arithmetic themselves)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    T, nkv, hd = k.shape
    if T == 0:
        return
    bs = k_cache.shape[1]
    if k_scale is None:
        _write_rows_kernel[(T,)](
            k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            *k_cache.stride()[:3], *v_cache.stride()[:3],
            NKV=nkv, HD=hd, NKV_P=_pow2(nkv), HD_P=_pow2(hd), BS=bs, num_warps=4, enable_fp_fusion=False)
        return
    _write_quant_kernel[(T, nkv)](
        k, v, _bytes(k_cache), _bytes(v_cache), k_scale, v_scale, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        *k_scale.stride(), *v_scale.stride(),
        HD=hd, HD_P=_pow2(hd), BS=bs, FP8=k_cache.dtype == torch.float8_e4m3fn, num_warps=4,
        enable_fp_fusion=False)


# ---- attention ----------------------------------------------------------------------------


@triton.jit
def _attention_kernel(out_ptr, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, lens_ptr, qstart_ptr,
                      part_ptr, lse_ptr,
                      scale, softcap, window,
                      s_qt, s_qh, s_ot, s_oh,
                      s_kb, s_ko, s_kh, s_vb, s_vo, s_vh,
                      s_ksb, s_kso, s_ksh, s_vsb, s_vso, s_vsh, s_tb,
                      s_pt, s_ph, s_ps, s_lt, s_lh,
                      G: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr, BS: tl.constexpr,
                      TILE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr,
                      DECODE: tl.constexpr, SCALED: tl.constexpr, FP8: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                      HAS_WINDOW: tl.constexpr, BF16_IN_F32: tl.constexpr):
    """Program (sequence, query block, kv head * SPLITS + split): the BLOCK_Q new tokens
    of the query block times the G q heads of the kv head as BLOCK_M rows, over one
    split's share of the keys they may see, tile by tile from the pool (online softmax).
    One split: out written. Several: the split's normalized output and log-sum-exp go to
    the partials (every split writes its entry, an empty one too), ``_reduce_kernel``
    joins them.

    Over 80 lines: a Triton kernel is one jitted program; its variants (decode or extend, scaled, fp8, softcap, window) are branches the compiler specializes away."""
    seq = tl.program_id(0)
    qblk = tl.program_id(1)
    kvh = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    if DECODE:
        q0 = seq
        q_len = 1
    else:
        q0 = tl.load(qstart_ptr + seq)
        q_len = tl.load(qstart_ptr + seq + 1) - q0
    first = qblk * BLOCK_Q
    if first >= q_len:
        return
    seq_len = tl.load(lens_ptr + seq)
    ctx = seq_len - q_len  # positions before the first new token

    m = tl.arange(0, BLOCK_M)
    qi = first + m // G  # each row's new-token index
    head = kvh * G + m % G
    row_ok = (m < BLOCK_Q * G) & (qi < q_len)
    pos = ctx + qi
    d = tl.arange(0, HD_P)
    dm = d < HD
    q_rows = (q0 + qi).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None] & dm[None, :], other=0.0)

    # the keys this block's rows may see: [lo, hi), then this split's share of them
    hi = ctx + tl.minimum(first + BLOCK_Q, q_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx + first - window + 1, 0)
    per = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), SPLITS), TILE) * TILE
    s_lo = lo + split * per
    s_hi = tl.minimum(s_lo + per, hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HD_P], dtype=tl.float32)
    table = tables_ptr + seq.to(tl.int64) * s_tb
    # the products' operand dtype: q's (bf16 / fp16 on the tensor cores; float32 in IEEE
    # precision); BF16_IN_F32 (the interpreter, whose bf16 dot is wrong): the same bf16
    # values, multiplied in float32, which is what the tensor cores compute
    DOT: tl.constexpr = tl.float32 if BF16_IN_F32 else q_ptr.dtype.element_ty
    PREC: tl.constexpr = "ieee" if DOT == tl.float32 else "tf32"
    q = q.to(DOT)
    for start in range(s_lo, s_hi, TILE):
        c = start + tl.arange(0, TILE)
        cm = c < s_hi
        blk = tl.load(table + c // BS, mask=cm, other=0).to(tl.int64)
        off = c % BS
        k = tl.load(k_ptr + blk[None, :] * s_kb + off[None, :] * s_ko + kvh * s_kh + d[:, None],
                    mask=dm[:, None] & cm[None, :], other=0)  # (HD_P, TILE)
        v = tl.load(v_ptr + blk[:, None] * s_vb + off[:, None] * s_vo + kvh * s_vh + d[None, :],
                    mask=cm[:, None] & dm[None, :], other=0)  # (TILE, HD_P)
        if SCALED:
            k = _widen(k, FP8).to(DOT)
            v = _widen(v, FP8).to(DOT)
        else:
            k = k.to(DOT)
            v = v.to(DOT)
        s = tl.dot(q, k, input_precision=PREC)  # (BLOCK_M, TILE) float32
        if SCALED:  # each key's own K scale
            s = s * tl.load(ks_ptr + blk * s_ksb + off * s_kso + kvh * s_ksh, mask=cm, other=0.0)[None, :]
        s = s * scale
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        ok = cm[None, :] & (c[None, :] <= pos[:, None])
        if HAS_WINDOW:
            ok = ok & (c[None, :] > pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet: weights 0
        p = tl.exp2((s - m_safe[:, None]) * _LOG2E)
        alpha = tl.exp2((m_i - m_safe) * _LOG2E)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if SCALED:  # each key's own V scale, on the weights
            p = p * tl.load(vs_ptr + blk * s_vsb + off * s_vso + kvh * s_vsh, mask=cm, other=0.0)[None, :]
        if BF16_IN_F32:
            p = _rounded(p, tl.bfloat16)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v, input_precision=PREC)
        m_i = m_new

    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]  # a row that saw nothing (padding): zeros
    if SPLITS == 1:
        tl.store(out_ptr + q_rows[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
                 _cast(o, out_ptr.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])
    else:
        tl.store(part_ptr + q_rows[:, None] * s_pt + head[:, None] * s_ph + split * s_ps + d[None, :], o,
                 mask=row_ok[:, None] & dm[None, :])
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + q_rows * s_lt + head * s_lh + split, lse, mask=row_ok)


@triton.jit
def _reduce_kernel(out_ptr, part_ptr, lse_ptr, qstart_ptr, n_seqs,
                   s_ot, s_oh, s_pt, s_ph, s_ps, s_lt, s_lh,
                   HD: tl.constexpr, HD_P: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
                   DECODE: tl.constexpr):
    """Program (row, q head): the splits' outputs weighted by exp(lse - max lse)."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    if not DECODE:
        if r >= tl.load(qstart_ptr + n_seqs):  # past the packed rows: nobody wrote partials there
            return
    sp = tl.arange(0, SPLITS_P)
    spm = sp < SPLITS
    d = tl.arange(0, HD_P)
    dm = d < HD
    r64 = r.to(tl.int64)
    lse = tl.load(lse_ptr + r64 * s_lt + h * s_lh + sp, mask=spm, other=float("-inf"))
    top = tl.max(lse, axis=0)
    w = tl.exp2((lse - tl.where(top == float("-inf"), 0.0, top)) * _LOG2E)
    total = tl.sum(w, axis=0)
    parts = tl.load(part_ptr + r64 * s_pt + h * s_ph + sp[:, None] * s_ps + d[None, :],
                    mask=spm[:, None] & dm[None, :], other=0.0)
    o = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + r64 * s_ot + h * s_oh + d, _cast(o, out_ptr.dtype.element_ty), mask=dm)


def attention(out, q, k_cache, v_cache, k_scale, v_scale, tables, lens, query_start, max_query_len, workspace, *,
              scale, window, softcap, tile=None, block_q=None) -> None:
    T, nh, hd = q.shape
    if T == 0:
        return
    nkv, bs = k_cache.shape[2], k_cache.shape[1]
    G = nh // nkv
    decode = query_start is None
    B = lens.shape[0]
    splits = 1 if workspace is None else workspace[1].shape[2]
    # float32 products run on the FMA units (IEEE precision, not tf32): 16 x 16 tiles, one
    # stage, or they spill (sm_90's ptxas: test_triton_compile.py); the tensor cores' dtypes
    # take ~128 rows x 64 keys, two stages
    f32 = q.dtype == torch.float32
    if decode:
        bq = 1
    else:  # ~128 rows (tokens x the group's heads) a program for a long prefill, ~64 for a short turn
        rows = 16 if f32 else 128 if max_query_len * G >= 256 else 64
        bq = block_q or max(1, min(max_query_len, rows // G))
    block_m = _pow2(bq * G, 16)  # tl.dot wants M >= 16
    tile = tile or (16 if f32 else 64 if hd <= 128 else 32)
    warps = 8 if block_m >= 128 else 4
    stages = 1 if f32 else 2
    scaled = k_scale is not None
    part, lse = workspace if workspace is not None else (out, out)  # unused when one split
    grid = (B, 1 if decode else triton.cdiv(max_query_len, bq), nkv * splits)
    _attention_kernel[grid](
        out, q, _bytes(k_cache), _bytes(v_cache), k_scale if scaled else out, v_scale if scaled else out, tables, lens,
        query_start if not decode else lens, part, lse,
        float(scale), float(softcap or 1.0), int(window or 0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        *(k_scale.stride() if scaled else (0, 0, 0)), *(v_scale.stride() if scaled else (0, 0, 0)), tables.stride(0),
        *(part.stride()[:3] if splits > 1 else (0, 0, 0)), *(lse.stride()[:2] if splits > 1 else (0, 0)),
        G=G, HD=hd, HD_P=_pow2(hd, 16), BS=bs, TILE=tile, BLOCK_Q=bq, BLOCK_M=block_m, SPLITS=splits,
        DECODE=decode, SCALED=scaled, FP8=k_cache.dtype == torch.float8_e4m3fn, HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=window is not None, BF16_IN_F32=INTERPRETED and q.dtype == torch.bfloat16, num_warps=warps,
        num_stages=stages)
    if splits > 1:
        _reduce_kernel[(T, nh)](
            out, part, lse, query_start if not decode else lens, B,
            out.stride(0), out.stride(1), *part.stride()[:3], *lse.stride()[:2],
            HD=hd, HD_P=_pow2(hd), SPLITS=splits, SPLITS_P=_pow2(splits), DECODE=decode, num_warps=4)


# ---- RMSNorm ------------------------------------------------------------------------------


@_device
def _normed(x, w, D, eps, offset, DTYPE: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """``layers.RMSNorm`` of float32 rows x (R, D_P) (zeros past D) with weight w (1, D_P),
    rounded to DTYPE as the reference rounds, as float32."""
    var = tl.math.div_rn(tl.sum(x * x, axis=1), D.to(tl.float32)) + eps
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(var))[:, None]
    if ROUND_FIRST:  # weight * norm(x).to(dtype): bf16/fp16, offset 0
        return _rounded(_rounded(x * inv, DTYPE) * w, DTYPE)
    else:  # float32 throughout, (offset + w), then the dtype
        return _rounded((x * inv) * (w + offset), DTYPE)


@triton.jit
def _rms_norm_kernel(out_ptr, x_ptr, w_ptr, res_ptr, xw_ptr, s_o, s_x, s_r, D, eps, offset,
                     D_P: tl.constexpr, HAS_RES: tl.constexpr, HAS_XW: tl.constexpr, ROUND_FIRST: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D_P)[None, :]
    dm = d < D
    DT: tl.constexpr = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + r * s_x + d, mask=dm, other=0.0).to(tl.float32)
    if HAS_XW:
        x = _normed(x, tl.load(xw_ptr + d, mask=dm, other=0.0).to(tl.float32), D, eps, offset, DT, ROUND_FIRST)
    if HAS_RES:
        x = _rounded(tl.load(res_ptr + r * s_r + d, mask=dm, other=0.0).to(tl.float32) + x, DT)
        tl.store(res_ptr + r * s_r + d, _cast(x, DT), mask=dm)
    y = _normed(x, tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32), D, eps, offset, DT, ROUND_FIRST)
    tl.store(out_ptr + r * s_o + d, _cast(y, DT), mask=dm)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 2 else t.view(-1, t.shape[-1])


def rms_norm(out, x, weight, eps, offset, residual, x_weight) -> None:
    x2, out2 = _rows(x), _rows(out)
    res2 = _rows(residual) if residual is not None else None
    R, D = x2.shape
    if R == 0:
        return
    _rms_norm_kernel[(R,)](
        out2, x2, weight, res2 if res2 is not None else x2, x_weight if x_weight is not None else weight,
        out2.stride(0), x2.stride(0), res2.stride(0) if res2 is not None else 0, D, float(eps), float(offset),
        D_P=_pow2(D), HAS_RES=res2 is not None, HAS_XW=x_weight is not None,
        ROUND_FIRST=offset == 0.0 and x.dtype != torch.float32, num_warps=4 if D <= 4096 else 8,
        enable_fp_fusion=False)


# ---- RoPE (with the per-head q/k norms) ---------------------------------------------------


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, s_xt, s_xh, s_ct, s_st, H, NQ, eps, offset,
                 HD: tl.constexpr, ROT: tl.constexpr, HB: tl.constexpr, HD_P: tl.constexpr,
                 HAS_QN: tl.constexpr, HAS_KN: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """Row t, heads HB * j ..: each (HB, HD_P) head normed (q heads with q_norm, k heads
    with k_norm), then x * cos + roll(x) * sin on the first ROT dims, in place."""
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)[:, None]
    d = tl.arange(0, HD_P)[None, :]
    hm = h < H
    dm = d < HD
    rm = d < ROT
    rd = (d + ROT // 2) % ROT  # roll(x, rot / 2): the element rotate_half pairs with d
    DT: tl.constexpr = x_ptr.dtype.element_ty
    row = x_ptr + t * s_xt + h * s_xh
    x = tl.load(row + d, mask=hm & dm, other=0.0).to(tl.float32)
    xr = tl.load(row + rd, mask=hm & rm, other=0.0).to(tl.float32)
    if HAS_QN or HAS_KN:
        is_q = h < NQ
        var = tl.math.div_rn(tl.sum(x * x, axis=1), HD * 1.0) + eps
        inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(var))[:, None]
        wq = tl.load(qw_ptr + d, mask=dm, other=0.0).to(tl.float32)
        wk = tl.load(kw_ptr + d, mask=dm, other=0.0).to(tl.float32)
        wqr = tl.load(qw_ptr + rd, mask=rm, other=0.0).to(tl.float32)
        wkr = tl.load(kw_ptr + rd, mask=rm, other=0.0).to(tl.float32)
        normed = (is_q & HAS_QN) | ((~is_q) & HAS_KN)
        w = tl.where(is_q, wq, wk)
        wr = tl.where(is_q, wqr, wkr)
        if ROUND_FIRST:
            xn = _rounded(_rounded(x * inv, DT) * w, DT)
            xrn = _rounded(_rounded(xr * inv, DT) * wr, DT)
        else:
            xn = _rounded((x * inv) * (w + offset), DT)
            xrn = _rounded((xr * inv) * (wr + offset), DT)
        x = tl.where(normed, xn, x)
        xr = tl.where(normed, xrn, xr)
    c = tl.load(cos_ptr + p * s_ct + d, mask=rm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + p * s_st + d, mask=rm, other=0.0).to(tl.float32)
    y = _rounded(_rounded(x * c, DT) + _rounded(xr * s, DT), DT)  # the reference's three ops, each rounded
    tl.store(row + d, _cast(tl.where(rm, y, x), DT), mask=hm & dm)


def rope_(x, positions, cos, sin, n_q_heads, q_norm, k_norm, eps, norm_offset) -> None:
    T, H, hd = x.shape
    if T == 0:
        return
    w = q_norm if q_norm is not None else k_norm
    hb = min(_pow2(H), 4)  # heads a program: a decode step's few rows still spread over the SMs
    _rope_kernel[(T, triton.cdiv(H, hb))](
        x, positions, cos, sin, q_norm if q_norm is not None else (w if w is not None else cos),
        k_norm if k_norm is not None else (w if w is not None else cos),
        x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), H, n_q_heads, float(eps), float(norm_offset),
        HD=hd, ROT=cos.shape[-1], HB=hb, HD_P=_pow2(hd), HAS_QN=q_norm is not None, HAS_KN=k_norm is not None,
        ROUND_FIRST=norm_offset == 0.0 and x.dtype != torch.float32, num_warps=4,
        enable_fp_fusion=False)


# ---- block scatter ------------------------------------------------------------------------


@triton.jit
def _scatter_kernel(pool_ptr, stage_ptr, ids_ptr, WORDS, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    b = tl.load(ids_ptr + i).to(tl.int64)
    if b >= 0:
        o = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        m = o < WORDS
        vals = tl.load(stage_ptr + i.to(tl.int64) * WORDS + o, mask=m)
        tl.store(pool_ptr + b * WORDS + o, vals, mask=m)


def _words(t: torch.Tensor, n: int) -> torch.Tensor:
    """t (n, ...) contiguous as (n, words): int32 words where a block's bytes allow, else bytes."""
    flat = t.view(n, -1).view(torch.uint8)
    return flat.view(torch.int32) if flat.shape[1] % 4 == 0 else flat


def scatter_blocks(pool, staging, block_ids) -> None:
    n = staging.shape[0]
    if n == 0:
        return
    dst, src = _words(pool, pool.shape[0]), _words(staging, n)
    words = dst.shape[1]
    chunk = min(4096, _pow2(words))
    _scatter_kernel[(n, triton.cdiv(words, chunk))](dst, src, block_ids, words, CHUNK=chunk, num_warps=4)
