"""Rotary position embeddings, the one implementation every family uses.

    inv_freq(dim, theta, scaling)        -> (dim/2,) float32 inverse frequencies
    Rotary(dim, theta, scaling)          -> module: positions -> (cos, signed sin) of width dim
    apply_rope_(x, cos, sin)             -> x rotated in place on its first cos.shape[-1] dims

The sin is signed ([-sin f, sin f]): the sign of the reference's ``rotate_half`` folded
in once per step, so rotating is ``x * cos + roll(x) * sin``, bit for bit the
reference's ``x * cos + rotate_half(x) * sin`` ((-a) * b == a * (-b)). The native
kernels' RoPE takes the same rows.

``scaling`` is the normalized ``ModelConfig.rope_scaling`` (None: plain RoPE):
``linear`` and ``llama3`` rescale the frequencies (``freq_factors``: divided by a factor per
pair, as a GGUF file stores Llama 3's); ``longrope`` (Phi-3's "su") has two
sets, short and long factors, and a cos/sin scale (``attention_factor``). Which set a
sequence uses is a per-sequence choice made by the engine (see phi3.py), passed here as
a (B,) bool tensor.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn


def inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None, long: bool = False) -> Tensor:
    """Inverse frequencies (dim/2,) in float32, with ``scaling`` applied.

    Computed on the CPU even while the model is built on the meta device (math on meta
    tensors pulls in torch's compiler stack: seconds at every server start)."""
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    if scaling is not None and scaling["rope_type"] == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device="cpu")
        return 1.0 / (factors * theta**steps)
    freqs = 1.0 / (theta**steps)
    if scaling is None:
        return freqs
    if scaling["rope_type"] == "freq_factors":  # a GGUF file's per-pair factors (llama.cpp's freq_factors)
        return freqs / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return freqs / factor
    # llama3: leave high frequencies, divide low ones by factor, interpolate in between
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / factor, freqs)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def doubled(freq: Tensor) -> tuple[Tensor, Tensor]:
    """([f, f], [-1 .. -1, 1 .. 1]) for inverse frequencies f (dim/2,): position * [f, f]
    is the angle row ``cat((freqs, freqs))`` elementwise (the same products, bit for bit),
    and the sign row turns its sin into the signed [-sin f, sin f] with one multiply.
    Plain tensors (not inference ones): usable with autograd too."""
    with torch.inference_mode(False):
        f2 = torch.cat((freq, freq), dim=-1)
        sign = torch.ones_like(f2)
        sign[..., : freq.shape[-1]] = -1.0
    return f2, sign


# Elements up to which cos/sin run on the calling thread alone. torch runs them in parallel
# from ~100 elements, so a decode step of 2+ rows woke its other OpenMP threads for two tiny
# ops: ~20 us on an idle 2-core host, and up to ms when the native kernels' threads or the
# host's other work hold the cores (a speculative step of the default model: ~0.85 ms of its
# ~3.4 ms in one cos). One thread computes the same values, bit for bit.
SERIAL_MAX = 1 << 15


def cos_sin(emb: Tensor, serial: bool = False) -> tuple[Tensor, Tensor]:
    """(emb.cos(), emb.sin()); a small CPU tensor's (``SERIAL_MAX``), or any with ``serial``,
    on this thread alone."""
    n = torch.get_num_threads()
    if n == 1 or (emb.numel() > SERIAL_MAX and not serial) or emb.device.type != "cpu":
        return emb.cos(), emb.sin()
    torch.set_num_threads(1)
    try:
        return emb.cos(), emb.sin()
    finally:
        torch.set_num_threads(n)


# Positions a cos/sin table covers when first made; it doubles when a longer context needs it.
TABLE_MIN = 256


class Rotary(nn.Module):
    """cos/sin (B, T, 1, dim) for given positions. Given the forward's length (every
    position below it), the rows are taken from a table of every position up to a power of
    two past it (``TABLE_MIN`` at least), made once per dtype and device and doubled as
    contexts grow: a decode step's RoPE is two row gathers, not eight small ops. Each table
    row is computed by the same ops on the same angle as a forward's own (one thread, so
    every element takes torch's vectorized cos and sin), so the values are the same either
    way. Without a length (and for LongRoPE's per-sequence factor sets), computed for the
    positions given."""

    _rows: tuple[Tensor, ...] | None = None  # (inv_freq, long_inv_freq, their ``doubled`` rows): remade when they change
    _table: tuple[Tensor, Tensor, Tensor] | None = None  # (inv_freq it was made from, cos (n, dim), sin (n, dim))
    _long_table: tuple[Tensor, Tensor, Tensor] | None = None  # LongRoPE: (the short table's cos, cos, sin (2n, dim))

    def __init__(self, dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.dim, self.theta, self.scaling = dim, theta, scaling
        self.longrope = scaling is not None and scaling["rope_type"] == "longrope"
        self.attention_factor = float(scaling.get("attention_factor", 1.0)) if self.longrope else 1.0
        self.register_buffer("inv_freq", inv_freq(dim, theta, scaling), persistent=False)
        self.register_buffer("long_inv_freq", inv_freq(dim, theta, scaling, long=True), persistent=False)

    def reset_buffers(self) -> None:
        device = self.inv_freq.device
        self.inv_freq = inv_freq(self.dim, self.theta, self.scaling).to(device)
        self.long_inv_freq = inv_freq(self.dim, self.theta, self.scaling, long=True).to(device)

    def forward(self, positions: Tensor, dtype: torch.dtype, long: Tensor | None = None,
                span: tuple[int, int | None] | None = None) -> tuple[Tensor, Tensor]:
        """positions (B, T) -> (cos, sin) (B, T, 1, dim), sin signed [-sin f, sin f];
        ``long`` (B,) bool: which sequences use longrope's long factors; ``span``
        (length, first): every position is below length, and when first is not None the
        positions in order are first, first + 1, ... (one run: the rows are a slice of the
        table, a view); the rows then come from the table."""
        if span is None or (self.longrope and long is not None):
            return self._compute(positions, dtype, long)
        length, first = span
        cos, sin = self._rows_upto(length, dtype, positions.device)
        shape = (*positions.shape, 1, cos.shape[-1])
        if first is not None:
            n = positions.numel()
            return cos[first : first + n].view(shape), sin[first : first + n].view(shape)
        flat = positions.reshape(-1)
        return cos.index_select(0, flat).view(shape), sin.index_select(0, flat).view(shape)

    def table(self, length: int, dtype: torch.dtype = torch.float32,
              device: torch.device = torch.device("cpu")) -> tuple[Tensor, Tensor]:
        """The (cos, sin) (n, dim) table in ``dtype`` on ``device``, n >= length: what
        ``forward`` slices its rows from (the decode step backends read it directly).
        LongRoPE: (2n, dim), the short factors' n rows (``forward``'s table), then the
        long factors' n rows."""
        cos, sin = self._rows_upto(length, dtype, device)
        if not self.longrope:
            return cos, sin
        n, t = cos.shape[0], self._long_table
        if t is None or t[0] is not cos:
            with torch.inference_mode(False):
                lc, ls = self._compute(torch.arange(n, device=device)[None, :], dtype,
                                       torch.ones(1, dtype=torch.bool, device=device), serial=True)
                t = self._long_table = (cos, torch.cat((cos, lc.reshape(n, -1))), torch.cat((sin, ls.reshape(n, -1))))
        return t[1], t[2]

    def _rows_upto(self, length: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """The table's (cos, sin) (n, dim) in ``dtype`` on ``device``, n >= length."""
        t = self._table
        if t is None or t[0] is not self.inv_freq or t[1].shape[0] < length or t[1].dtype != dtype or t[1].device != device:
            n = max(TABLE_MIN, 1 << max(length - 1, 1).bit_length(), t[1].shape[0] if t is not None else 0)
            with torch.inference_mode(False):  # plain tensors: usable outside inference mode too
                cos, sin = self._compute(torch.arange(n, device=device)[None, :], dtype, None, serial=True)
            t = self._table = (self.inv_freq, cos.reshape(n, -1), sin.reshape(n, -1))
        return t[1], t[2]

    def _compute(self, positions: Tensor, dtype: torch.dtype, long: Tensor | None,
                 serial: bool = False) -> tuple[Tensor, Tensor]:
        inv, long_inv = self.inv_freq, self.long_inv_freq
        rows = self._rows
        if rows is None or rows[0] is not inv or rows[1] is not long_inv:
            rows = self._rows = (inv, long_inv, *doubled(inv), doubled(long_inv)[0])
        freq, sign = rows[2], rows[3]  # (hd,): [f, f]; [-1.., 1..]
        if self.longrope and long is not None:
            freq = torch.where(long[:, None], rows[4], freq)[:, None, :]  # (B, 1, hd)
        emb = positions[..., None].float() * freq  # (B, T, hd): [freqs, freqs]
        cos, sin = cos_sin(emb, serial)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        sin = sin.mul_(sign)  # [-sin f, sin f]
        return cos.to(dtype)[:, :, None, :], sin.to(dtype)[:, :, None, :]  # (B, T, 1, hd): broadcast over heads


def apply_rope_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, T, heads, hd) rotated in place on its first rot = cos.shape[-1] dims (partial
    rotary: the rest pass) with ``Rotary``'s signed sin: roll(x) = [x2, x1] times
    [-sin, sin] is rotate_half(x) * sin bit for bit, so 4 kernels (the roll's copy, two
    multiplies, an add) and no new tensor. x may be a view (fused q/k heads)."""
    rot = cos.shape[-1]
    x_rot = x if rot == x.shape[-1] else x[..., :rot]
    r = x_rot.roll(rot // 2, -1).mul_(sin)
    x_rot.mul_(cos).add_(r)
    return x
