"""The reference quantization math, in pure torch. Every kernel, op and pass is tested against this.

Notation (all schemes share it):
    a group's range is stored as (center c, half-width h); a code k indexes a level l[k] in [-1, 1]:
        x_hat = l[k] * h + c
    asymmetric: c = (max + min) / 2, h = (max - min) / 2      symmetric: c = 0, h = max |x|
    uniform levels: l[k] = -1 + 2k / (2^B - 1)  (so asymmetric uniform is the usual
        min + k * (max - min) / (2^B - 1) with scale s = 2h / (2^B - 1) and zero-point z = min).
    XQuant's calibration z' = z + eta*s*(2^B-1), s' = (1-2*eta)*s keeps c and shrinks h by (1 - 2*eta).

Layouts: a block of tokens is `[..., T, D]` (tokens, channels). Group statistics have the shape
    TOKEN axis, group g:           [..., T, D // g]
    CHANNEL axis, group G tokens:  [..., T // G, D]
    CHANNEL axis, static ranges:   [..., 1, D]      (given, not computed per block)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import Axis, Levels, QuantizerSpec, Symmetry

EPS = 1e-6
HYBRID_MARGIN = 1e-5  # hybrid groups go symmetric only when err_sym < err_asym * (1 - HYBRID_MARGIN)


# ---------------------------------------------------------------------------------------------
# Levels
# ---------------------------------------------------------------------------------------------
def uniform_levels(n: int, device=None) -> torch.Tensor:
    """n evenly spaced levels from -1 to 1."""
    return torch.linspace(-1.0, 1.0, n, dtype=torch.float32, device=device)


def level_count(bits: int, symmetric: bool) -> int:
    """Uniform levels of a `bits`-bit code. Asymmetric: 2^B from -1 to 1 (KIVI's min..max). Symmetric: one bit
    is the sign, as in InnerQ's `quantize_sym` (and int8's -127..127): 2^B - 1 levels k / (2^(B-1) - 1) for
    k in [-(2^(B-1) - 1), 2^(B-1) - 1], zero included, the top code unused; at 1 bit the sign alone {-1, 1}."""
    return 2 ** bits - 1 if symmetric and bits > 1 else 2 ** bits


def normal_float_levels(bits: int, device=None) -> torch.Tensor:
    """NormalFloat-style levels: 2^bits quantiles of N(0, 1) at evenly spaced probabilities, scaled to [-1, 1]."""
    n = 2 ** bits
    p = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    q = torch.distributions.Normal(0.0, 1.0).icdf(p)
    return (q / q.abs().max()).to(torch.float32).to(device)


def levels_for(spec: QuantizerSpec, codebook=None, device=None) -> torch.Tensor:
    """The level table of a quantizer: a calibrated codebook if given, else its default levels."""
    if codebook is not None:
        return torch.as_tensor(codebook, dtype=torch.float32, device=device)
    if spec.levels is Levels.NORMAL_FLOAT:
        return normal_float_levels(spec.bits, device)
    return uniform_levels(level_count(spec.bits, spec.symmetry is Symmetry.SYMMETRIC), device)


def nearest_level(xn: torch.Tensor, levels: torch.Tensor, uniform: bool) -> torch.Tensor:
    """Index of the level nearest to each normalized value (ties go to the lower level for codebooks)."""
    n = levels.numel()
    if uniform:
        return torch.round((xn.clamp(-1, 1) + 1) * ((n - 1) / 2)).to(torch.int32)
    mid = (levels[1:] + levels[:-1]) / 2
    return torch.bucketize(xn.contiguous(), mid).to(torch.int32)


# ---------------------------------------------------------------------------------------------
# Bit packing (CalibQuant App. A.1): N-bit codes packed along the contiguous dimension into int32 words
# ---------------------------------------------------------------------------------------------
def codes_per_word(bits: int) -> int:
    """Codes held by one 32-bit word: 32 // bits (3-bit codes: 10 per word, 2 bits unused)."""
    return 32 // bits


def packed_width(n: int, bits: int) -> int:
    return -(-n // codes_per_word(bits))


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., N] integer codes in [0, 2^bits) -> [..., ceil(N / (32 // bits))] int32; code i sits in word
    i // cpw at bit offset (i % cpw) * bits."""
    cpw = codes_per_word(bits)
    n = codes.shape[-1]
    w = packed_width(n, bits)
    c = torch.nn.functional.pad(codes.to(torch.int64), (0, w * cpw - n)).view(*codes.shape[:-1], w, cpw)
    shifts = torch.arange(cpw, device=codes.device, dtype=torch.int64) * bits
    words = (c << shifts).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_bits(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`: [..., W] int32 -> [..., n] int32 codes."""
    cpw = codes_per_word(bits)
    shifts = torch.arange(cpw, device=words.device, dtype=torch.int64) * bits
    c = (words.to(torch.int64)[..., None] >> shifts) & ((1 << bits) - 1)
    return c.reshape(*words.shape[:-1], -1)[..., :n].to(torch.int32)


# ---------------------------------------------------------------------------------------------
# Group views
# ---------------------------------------------------------------------------------------------
def to_groups(x: torch.Tensor, spec: QuantizerSpec) -> torch.Tensor:
    """[..., T, D] -> [..., groups..., members]: the last dimension holds one group's members."""
    *lead, t, d = x.shape
    if spec.axis is Axis.TOKEN:
        g = spec.group_size or d
        return x.reshape(*lead, t, d // g, g)
    if spec.group_size is None:  # static per-channel ranges: every element is its own "group" member
        return x.unsqueeze(-1)
    g = spec.group_size
    return x.reshape(*lead, t // g, g, d).transpose(-1, -2)


def from_groups(xg: torch.Tensor, spec: QuantizerSpec, shape) -> torch.Tensor:
    if spec.axis is Axis.CHANNEL and spec.group_size is not None:
        xg = xg.transpose(-1, -2)
    return xg.reshape(shape)


def expand_stats(stat: torch.Tensor, spec: QuantizerSpec, t: int, d: int) -> torch.Tensor:
    """Group statistics -> one value per element of a [..., t, d] block."""
    if spec.axis is Axis.TOKEN:
        return stat.repeat_interleave(d // stat.shape[-1], dim=-1)
    if spec.group_size is None:
        return stat.expand(*stat.shape[:-2], t, d)
    return stat.repeat_interleave(spec.group_size, dim=-2)


# ---------------------------------------------------------------------------------------------
# Quantize / dequantize a block
# ---------------------------------------------------------------------------------------------
@dataclass
class QuantizedBlock:
    """A quantized [..., T, D] block. codes are unpacked int32 [..., T, D]; center/half are group
    statistics in the storage dtype; mask (hybrid) is True where a group chose symmetric levels;
    outlier_values/outlier_index are [..., T, k] (exact values and their channels)."""

    codes: torch.Tensor
    center: torch.Tensor
    half: torch.Tensor
    mask: torch.Tensor | None = None
    outlier_values: torch.Tensor | None = None
    outlier_index: torch.Tensor | None = None


def outliers_per_token(spec: QuantizerSpec, head_dim: int) -> int:
    if spec.outlier_fraction <= 0:
        return 0
    return max(1, round(spec.outlier_fraction * head_dim))


def _extent(xg: torch.Tensor, valid: torch.Tensor | None):
    """(max, min) [..., 1] over the last dim of the members where valid is not False; (0, 0) for a group without
    valid members (see _range for groups holding inf or NaN)."""
    hi = xg if valid is None else torch.where(valid, xg, -math.inf)
    lo = xg if valid is None else torch.where(valid, xg, math.inf)
    mx, mn = hi.amax(-1, keepdim=True), lo.amin(-1, keepdim=True)
    empty = ~torch.isfinite(mx)
    return torch.where(empty, 0.0, mx), torch.where(empty, 0.0, mn)


def _range(xg: torch.Tensor, symmetric: bool, valid: torch.Tensor | None):
    """(center, half) over the last dim, ignoring members where valid is False; (0, 0) for a group without valid
    members. A group holding inf or NaN has no defined quantization: here its max is not finite and it is taken as
    empty too, while the Triton append (`templates/quantize_append.py`) takes the range its max and min give (an
    inf stays in it; the GPU's max and min skip NaN). Tests compare only groups whose members are finite."""
    mx, mn = _extent(xg, valid)
    if symmetric:
        return torch.zeros_like(mx), torch.maximum(mx.abs(), mn.abs())
    return (mx + mn) / 2, (mx - mn) / 2


def key_norm(x: torch.Tensor) -> torch.Tensor:
    """InnerQ's per-channel Key normalization [..., 1, D]: sqrt of each channel's absolute maximum over the
    tokens of x [..., T, D] (Keys are divided by it before quantization and multiplied after)."""
    return x.float().abs().amax(-2, keepdim=True).sqrt().clamp_min(EPS)


def static_channel_range(x: torch.Tensor, spec: QuantizerSpec, storage_dtype: torch.dtype, eta: float = 0.0,
                         valid: torch.Tensor | None = None):
    """Per-channel (center, half) [..., 1, D] of a chunk [..., T, D] for CHANNEL-axis static ranges, the
    half-width scaled by spec.range_scale (and XQuant's 1 - 2 eta). With outliers, the top and bottom
    outlier_fraction/2 of each channel are left out (KVQuant's per-vector percentile thresholds). valid (bool,
    broadcastable to [..., T, 1]): the tokens the range is taken over (a padded chunk's real ones: its pads hold
    copies of real tokens, `store.neutralized`, which leave a minimum or maximum as it is but move a percentile); a
    row with none takes all of its tokens, as without valid."""
    xf = x.float()
    f = spec.outlier_fraction
    if valid is not None:
        valid = valid.expand(*xf.shape[:-1], 1)
        valid = valid | ~valid.any(-2, keepdim=True)   # a row of pads only: all of them
        if bool(valid.all()):
            valid = None
    if f > 0 and xf.shape[-2] > 1:
        if valid is None:
            mx = torch.quantile(xf, 1 - f / 2, dim=-2, keepdim=True)
            mn = torch.quantile(xf, f / 2, dim=-2, keepdim=True)
        else:   # the pads as NaN, which nanquantile leaves out
            xn = torch.where(valid, xf, math.nan)
            mx = torch.nanquantile(xn, 1 - f / 2, dim=-2, keepdim=True)
            mn = torch.nanquantile(xn, f / 2, dim=-2, keepdim=True)
    elif valid is None:
        mx, mn = xf.amax(-2, keepdim=True), xf.amin(-2, keepdim=True)
    else:
        mx = torch.where(valid, xf, -math.inf).amax(-2, keepdim=True)
        mn = torch.where(valid, xf, math.inf).amin(-2, keepdim=True)
    if spec.symmetry is Symmetry.SYMMETRIC:
        c, h = torch.zeros_like(mx), torch.maximum(mx.abs(), mn.abs())
    else:
        c, h = (mx + mn) / 2, (mx - mn) / 2
    h = h * (1 - 2 * eta) * spec.range_scale
    return c.to(storage_dtype), h.clamp_min(EPS).to(storage_dtype)


def select_outliers(xf: torch.Tensor, spec: QuantizerSpec, static_range=None):
    """KVQuant's dense-and-sparse outliers of a float32 block [..., T, D]: (index [..., T, k], valid
    [..., T, D] with False at the outliers), or (None, None) without outliers. Per token vector, the k entries
    farthest from their range's center in units of its half-width: the static per-channel range (c, h) when
    given, scored |x - c| / h, else the full (outliers included) range [mn, mx] of their group, scored
    max(x - mn, mx - x) / max(mx - mn, 2 EPS): (1 + |x - c| / h) / 2 where h >= EPS, so it orders a group's members
    as |x - c| / h does, and scores a group's max and min exactly 1 both (|x - c| / h leaves them an ulp apart as c
    rounds, so eager and compiled K, 3e-7 apart, chose opposite extremes: session 49); a group narrower than 2 EPS
    scores (h + |x - c|) / (2 EPS), below wider groups' extremes. Ties go to the larger |x|, then the lower channel;
    NaN scores come first, the lower channel first among them."""
    k = outliers_per_token(spec, xf.shape[-1])
    if not k:
        return None, None
    if static_range is not None:
        c0, h0 = (s.float() for s in static_range)
        score = (xf - c0).abs() / h0.clamp_min(EPS)
    else:
        xg = to_groups(xf, spec)
        mx, mn = (from_groups(m.expand(xg.shape), spec, xf.shape) for m in _extent(xg, None))
        score = torch.maximum(xf - mn, mx - xf) / (mx - mn).clamp_min(2 * EPS)
    # the k largest by (score, |x|, -channel): stable sorts, not topk, whose tie order is the implementation's
    # (CPU and CUDA differ); the Triton append takes the lowest channel among the largest |x| among the highest
    # scores, k times
    by_mag = torch.where(score.isnan(), 0.0, xf.abs()).sort(dim=-1, descending=True, stable=True).indices
    order = score.gather(-1, by_mag).sort(dim=-1, descending=True, stable=True).indices[..., :k]
    idx = by_mag.gather(-1, order)  # [..., T, k]
    return idx, torch.ones_like(xf, dtype=torch.bool).scatter(-1, idx, False)


def group_range(xg: torch.Tensor, spec: QuantizerSpec, valid_g, storage_dtype: torch.dtype, eta: float = 0.0):
    """(center, half) [..., 1] of each group of xg (uniform or codebook levels, not hybrid) over its valid
    members, the half-width shrunk by XQuant's 1 - 2 eta, both rounded to the storage dtype."""
    c, h = _range(xg, spec.symmetry is Symmetry.SYMMETRIC, valid_g)
    h = h * (1 - 2 * eta)
    return c.to(storage_dtype), h.clamp_min(EPS).to(storage_dtype)


def quantize_block(x: torch.Tensor, spec: QuantizerSpec, levels: torch.Tensor, storage_dtype: torch.dtype,
                   eta: float = 0.0, static_range=None) -> QuantizedBlock:
    """Quantize a [..., T, D] block (T a multiple of the token group). `static_range` = (center, half)
    [..., 1, D] for CHANNEL-axis static ranges. A layer sharing codes (XQuant) keeps only the returned
    (center, half) and dequantizes the source layer's codes with them."""
    shape = x.shape
    d = shape[-1]
    xf = x.float()
    out_val = None
    out_idx, valid = select_outliers(xf, spec, static_range)
    if out_idx is not None:
        out_val = torch.gather(x, -1, out_idx)
        out_idx = out_idx.to(torch.uint8 if d <= 256 else torch.int16)

    uniform = spec.levels is Levels.UNIFORM
    xg = to_groups(xf, spec)
    vg = None if valid is None else to_groups(valid, spec)
    mask = None
    if static_range is not None:
        center, half = static_range
        cg, hg = (to_groups(s.float().expand(shape), spec) for s in (center, half))
        codes_g = nearest_level((xg - cg) / hg, levels, uniform)
    elif spec.symmetry is Symmetry.HYBRID:
        # InnerQ's quantize_hybrid: symmetric B-bit levels (sign + B-1 magnitude bits) vs asymmetric B-1 bit
        # levels; the symmetric ones only where their L1 error is lower by more than float32 rounding (ties stay
        # asymmetric). Exact ties are common (|x| + |max| = |x - max| for x < 0 < max: a 4-token group often
        # ties), and the order of a float sum would decide them differently in each kernel: HYBRID_MARGIN.
        cs, hs = _range(xg, True, vg)
        ca, ha = _range(xg, False, vg)
        cs, hs = cs.to(storage_dtype).float(), hs.clamp_min(EPS).to(storage_dtype).float()
        ca, ha = ca.to(storage_dtype).float(), ha.clamp_min(EPS).to(storage_dtype).float()
        lev_s = uniform_levels(level_count(spec.bits, True), x.device)
        lev_a = uniform_levels(level_count(spec.bits - 1, False), x.device)
        ks = nearest_level((xg - cs) / hs, lev_s, True)
        ka = nearest_level((xg - ca) / ha, lev_a, True)
        err_s = ((lev_s[ks] * hs + cs - xg).abs() * (1 if vg is None else vg)).sum(-1, keepdim=True)
        err_a = ((lev_a[ka] * ha + ca - xg).abs() * (1 if vg is None else vg)).sum(-1, keepdim=True)
        m = err_s < err_a * (1 - HYBRID_MARGIN)
        codes_g = torch.where(m, ks, ka)
        center = torch.where(m, cs, ca).squeeze(-1).to(storage_dtype)
        half = torch.where(m, hs, ha).squeeze(-1).to(storage_dtype)
        mask = m.squeeze(-1)
    else:
        c, h = group_range(xg, spec, vg, storage_dtype, eta)
        codes_g = nearest_level((xg - c.float()) / h.float(), levels, uniform)
        center, half = c.squeeze(-1), h.squeeze(-1)
    codes = from_groups(codes_g, spec, shape)
    if static_range is not None:
        center, half = static_range
    return QuantizedBlock(codes, center, half, mask, out_val, out_idx)


def dequantize_block(qb: QuantizedBlock, spec: QuantizerSpec, levels: torch.Tensor) -> torch.Tensor:
    """QuantizedBlock -> float32 [..., T, D]."""
    t, d = qb.codes.shape[-2:]
    c = expand_stats(qb.center.float(), spec, t, d)
    h = expand_stats(qb.half.float(), spec, t, d)
    codes = qb.codes.long()
    if qb.mask is not None:
        m = expand_stats(qb.mask, spec, t, d)
        lev_s = uniform_levels(level_count(spec.bits, True), codes.device)
        lev_a = uniform_levels(level_count(spec.bits - 1, False), codes.device)
        lv = torch.where(m, lev_s[codes.clamp_max(lev_s.numel() - 1)], lev_a[codes.clamp_max(lev_a.numel() - 1)])
    else:
        lv = levels.to(codes.device)[codes]
    x = lv * h + c
    if qb.outlier_values is not None:
        x = x.scatter(-1, qb.outlier_index.long(), qb.outlier_values.float())
    return x


def quantize_dequantize(x: torch.Tensor, spec: QuantizerSpec, storage_dtype=None, eta: float = 0.0) -> torch.Tensor:
    """Round trip of a block through `quantize_block` and `dequantize_block` (float32 result)."""
    levels = levels_for(spec, device=x.device)
    storage_dtype = storage_dtype or x.dtype
    static = static_channel_range(x, spec, storage_dtype, eta) if (
        spec.axis is Axis.CHANNEL and spec.group_size is None) else None
    return dequantize_block(quantize_block(x, spec, levels, storage_dtype, eta, static), spec, levels)


# ---------------------------------------------------------------------------------------------
# Attention-side identities
# ---------------------------------------------------------------------------------------------
def post_scaled_logits(q: torch.Tensor, qb: QuantizedBlock, spec: QuantizerSpec, levels: torch.Tensor) -> torch.Tensor:
    """CalibQuant post-scaling: q . k_hat = (q * h) . l[codes] + q . c, without forming k_hat.
    q: [..., D]; qb holds [..., T, D] codes -> logits [..., T]."""
    t, d = qb.codes.shape[-2:]
    h = expand_stats(qb.half.float(), spec, t, d)
    c = expand_stats(qb.center.float(), spec, t, d)
    lv = levels.to(q.device)[qb.codes.long()]
    qf = q.float().unsqueeze(-2)
    return ((qf * h) * lv).sum(-1) + (qf * c).sum(-1)


def calibrated_softmax(logits: torch.Tensor, allowed: torch.Tensor, tau) -> torch.Tensor:
    """CalibQuant's pre-softmax calibration g, then softmax over the allowed entries of each row.

    g maps a row's range [gamma, delta] (over allowed entries) linearly onto [gamma + tau1, delta - tau2];
    because softmax is shift invariant this equals softmax(t * logits) with t = 1 - (tau1 + tau2) / (delta - gamma)
    (t = 1 when the row has a single distinct value). tau=None is plain softmax. A row with no allowed entry
    gives zeros (as torch's SDPA does for a fully masked row, e.g. a left-padding query)."""
    x = logits.float()
    if tau is not None:
        hi = torch.where(allowed, x, -math.inf).amax(-1, keepdim=True)
        lo = torch.where(allowed, x, math.inf).amin(-1, keepdim=True)
        width = hi - lo
        ok = torch.isfinite(width) & (width > 0)
        t = torch.where(ok, 1 - (tau[0] + tau[1]) / torch.where(ok, width, 1.0), 1.0)
        x = x * t
    probs = torch.softmax(torch.where(allowed, x, -math.inf), dim=-1)
    return torch.where(allowed.any(-1, keepdim=True), probs, 0.0)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (HuggingFace / Llama convention), x [B, H, T, D], cos/sin [B, T, D]."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rot * sin.unsqueeze(1)


def rope_unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of `rope_rotate` (cos^2 + sin^2 absorbs any attention scaling folded into cos and sin)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * c - rot * s) / (c * c + s * s)
