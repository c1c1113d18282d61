"""Decode attention over the packed kvq store, in Triton: one query token per sequence.

Math (per sequence b, KV head h, the REP = Hq / H query heads of its GQA group, written length L = p0 + 1):

    k_t = dequant_K(t)   v_t = dequant_V(t)    for t in [0, L), each from where the store keeps it:
          t < S              -> sink (exact)              S <= t < Q_side(L) -> codes (quantized)
          Q_side(L) <= t < p0 -> ring slot t % Wr (exact)   t == p0            -> the appended chunk (exact)
    dequant(t, d) = (lev[code(t, d)] * half(g) + center(g)) [outliers replace their channels] [* norm(d)]
          lev = uniform -1 + 2k/(2^B - 1) (symmetric: 2k/(2^B - 2), zero a level) | codebook LUT |
          hybrid: sym(g) ? symmetric(B) : uniform(2^(B-1)), sym(g) the sign of the stored half (`store.signed_half`)
          g = (t, d // gsize) for TOKEN-axis groups (inner grouping of Keys), ((t - S) // G, d) for
          CHANNEL-axis token groups (KIVI Keys), (0, d) for static per-channel ranges (KVQuant, CalibQuant)
    keys stored before RoPE: k_t <- k_t * cos_t + rotate_half(k_t) * sin_t  (RoPE after dequantization)
    s_r,t = scale * q_r . k_t + bias_r,t  over allowed t (attention mask, is_causal);  CalibQuant: s *= temp_r
    out_r = sum_t softmax(s_r)_t v_t   (a row with no allowed t gives 0, as torch's SDPA)

Work split (flash-decoding): launch 1, programs (b*H + h, j < NSPLIT), each covers one slice of the region [S,
min(Q_K(L), Q_V(L), p0)) where both sides are quantized, with unpacking fused into the tile loads and each K/V
tile loaded once for all REP query heads (a [REP_PAD, D] x [D, BLOCK_T] dot); launch 2 (WINDOW, programs (b*H + h,
j < NWIN), slots NSPLIT + j) covers the exact windows (sink, ring, chunk), one tile each (a tile starting below S
holds valid positions below S only: the sink's tiles, and the appended token's when p0 < S), and the stretch where
only one side is quantized; its tiles unpack codes only where they meet them. Each writes its running (max, sum,
acc); `_combine_kernel` merges them. On sm_90+ the window launch and the merge are programmatic dependent launches
(PDL): the window launch may start while launch 1 runs, since it reads nothing launch 1 writes (its slots are its
own), and its last program waits for launch 1 before it ends (`WINDOW_ONE_WAIT`: the others end at once and free
their slots); the merge waits for the window launch's end, hence launch 1's, before it reads (TRIGGER lets the merge
launch at once where the SMs hold its programs beside the others: `_window_triggers`). A step's append handed to
the call (`append`, `kvq::append_attend`) goes out between the window launch and the merge, as the window launch's
dependent, where the attention reads nothing it writes (`APPEND_BESIDE`). CalibQuant's
temperature needs each row's logit range first: TAU_PHASE 1 runs both launches without V (with its own split count
and max / min buffers), `_temperature_kernel` turns each row's range into its temperature, then TAU_PHASE 2
attends (the Gluon launch's range pass also keeps its logits, which its attention pass reads instead of the Keys).
calibquant's Gluon launches attend the exact windows themselves, into the same slots, so that no window launch
follows them, and its attention pass turns the ranges into temperatures itself (no `_temperature_kernel`; on sm_90+
it is the range pass's programmatic dependent, and the merge the attention pass's): three launches in all
(`decode_attention_gluon.window_inside`). One launch (`_fused_decode`, what the Inductor template of
`kvq_compile.lowering` runs; `decode_attention(fused=True)`): the window tiles and the slices in one grid, the last
program of each KV head merging the slots (no calibrated softmax). Every length is read from `positions` on the
device: no host synchronization, fixed launch shapes (CUDA-graph safe).

Glossary of constants: PDL programmatic dependent launch (above), TRIGGER the window launch's early trigger; D
head_dim; REP query heads per KV head (REP_PAD: padded to >= 16 for tl.dot); BITS_* code width (16: unquantized
`data` buffer); CPW codes per int32 word = 32 // BITS; AXIS_* 0 TOKEN / 1 CHANNEL; GS_* group size (TOKEN: channels
per group; CHANNEL: tokens per group, 0 = static ranges); SYM_* 0 asymmetric / 1 symmetric / 2 hybrid; LUT_* levels
from a table; NOUT_* outliers per token; NORM_K InnerQ key normalization; S sink tokens, R recent tokens, WR_* ring
slots; T max cache length; NG_* channel-group rows; NWIN programs of the window launch (slots per row: NSPLIT +
NWIN); MASK_KIND 0 none / 1 bool / 2 additive (MASK_SHARED: one mask row serves every head); TAU_PHASE 0 plain
softmax / 1 range pass (max, min of s) / 2 calibrated pass (s *= temp).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from kvq_compile import compat
from kvq_compile import store as st
from kvq_compile.templates import decode_attention_gluon as dag

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a triton without grid dependency control: PDL stays off
    gdc_launch_dependents = gdc_wait = None

compat.fix_triton_interpreter()
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _trace_now():
    """Debug (`TRACE`): the GPU's global nanosecond timer (`%globaltimer`), comparable across SMs and launches."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _trace_store(P, t0, t1, t2, t3):
    """Debug (`TRACE`): one program's record, 8 int64 at P (the KIVI-layout kernel's format, `decode_attention_gluon.
    _trace_store`): t0, t1, t2, t2, t3, its SM (`%smid`), 0, 0."""
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(P, t0)
    tl.store(P + 1, t1)
    tl.store(P + 2, t2)
    tl.store(P + 3, t2)
    tl.store(P + 4, t3)
    tl.store(P + 5, smid.to(tl.int64))
    tl.store(P + 6, t3 * 0)
    tl.store(P + 7, t3 * 0)


@triton.jit
def _fill_boundary(L, S: tl.constexpr, R: tl.constexpr, TPG: tl.constexpr):
    """Q(L) = S + floor(max(0, L - S - R) / TPG) * TPG (store.fill_boundary)."""
    return S + tl.maximum(L - S - R, 0) // TPG * TPG


@triton.jit
def _quantized_end(L, S: tl.constexpr, R: tl.constexpr, TPG: tl.constexpr, BITS: tl.constexpr):
    """Q_side(L): positions below it (and from S on) are codes; L itself for an unquantized (16-bit) side."""
    if BITS == 16:
        return L
    return _fill_boundary(L, S, R, TPG)


@triton.jit
def _window_t(it, n_sink, sink_hi, win_lo, win_hi, BLOCK_T: tl.constexpr):
    """(t, valid, t[0]) of window tile `it`: tiles [0, n_sink) cover [0, sink_hi), the rest [win_lo, win_hi)."""
    in_sink = it < n_sink
    t0 = tl.where(in_sink, it * BLOCK_T, win_lo + (it - n_sink) * BLOCK_T)
    t = t0 + tl.arange(0, BLOCK_T)
    return t, t < tl.where(in_sink, sink_hi, win_hi), t0


@triton.jit
def _softmax_step(s, m_i, l_i):
    """One tile of the running softmax over scores s (-inf where not allowed): (p, alpha, new max, new sum); the
    caller rescales its accumulator by alpha and adds p @ v. A row with nothing allowed yet keeps p = 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_use[:, None])
    alpha = tl.exp(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _apply_mask(s, allowed, AMASK, moff, lmask, MASK_KIND: tl.constexpr):
    """(s, allowed) under the attention mask at offsets moff (loaded where lmask; moff may cover one row that
    every query row shares): MASK_KIND 1 bool (False masks), 2 additive (added to s; -inf masks), 0 none."""
    if MASK_KIND != 0:
        mv = tl.load(AMASK + moff, mask=lmask, other=0)
        if MASK_KIND == 1:
            allowed = allowed & (mv != 0)
        else:
            s = s + mv.to(tl.float32)
            allowed = allowed & (mv.to(tl.float32) > float("-inf"))
    return s, allowed


@triton.jit
def _step(BITS: tl.constexpr, SYM: tl.constexpr):
    """Spacing a of uniform levels -1 + a * code (reference.level_count): 2 / (2^B - 1); symmetric codes of
    2+ bits have 2^B - 1 levels (zero among them), a = 2 / (2^B - 2)."""
    den = (1 << BITS) - 1
    if SYM == 1:
        if BITS > 1:
            den = (1 << BITS) - 2
    return 2.0 / den


@triton.jit
def _levels(code, sym, BITS: tl.constexpr, SYM: tl.constexpr, LUT: tl.constexpr, lev_ptr):
    """Level in [-1, 1] of each code: LUT, hybrid (sym ? 2^B - 1 symmetric : 2^(B-1) uniform), or uniform."""
    N: tl.constexpr = 1 << BITS
    if LUT:
        lev = tl.load(lev_ptr + code)
    elif SYM == 2:
        HN: tl.constexpr = N // 2
        lev_s = -1.0 + code.to(tl.float32) * (2.0 / (N - 2))
        if HN > 1:
            lev_a = -1.0 + tl.minimum(code, HN - 1).to(tl.float32) * (2.0 / (HN - 1))
        else:
            lev_a = lev_s * 0.0 - 1.0
        lev = tl.where(sym, lev_s, lev_a)
    else:
        lev = -1.0 + code.to(tl.float32) * _step(BITS, SYM)
    return lev


@triton.jit
def _affine(code, half, center, BITS: tl.constexpr, SYM: tl.constexpr, LUT: tl.constexpr, lev_ptr):
    """lev(code) * half + center (center unused when symmetric) for uniform or codebook levels, the statistics
    broadcastable against code. Uniform levels l = a*code - 1 take one multiply-add per element,
    code * (a * half) + (center - half), both factors formed on the statistics' own shape (smaller than code's
    where they broadcast over a group; per-element statistics pay the two extra operations per element)."""
    if LUT:
        x = tl.load(lev_ptr + code) * half
        if SYM != 1:
            x += center
    elif SYM == 1:
        x = code.to(tl.float32) * (half * _step(BITS, SYM)) - half
    else:
        x = code.to(tl.float32) * (half * _step(BITS, SYM)) + (center - half)
    return x


@triton.jit
def _values(code, sym, half, center, BITS: tl.constexpr, SYM: tl.constexpr, LUT: tl.constexpr, lev_ptr):
    """lev(code) * half + center with the statistics broadcastable against code (center unused when symmetric):
    hybrid groups pick their levels by `sym` (`_levels`), the others take `_affine`'s one multiply-add."""
    if SYM == 2:
        return _levels(code, sym, BITS, SYM, LUT, lev_ptr) * half + center
    return _affine(code, half, center, BITS, SYM, LUT, lev_ptr)


@triton.jit
def _split_join(x, NB: tl.constexpr):
    """[..] -> [.., 2]: the low and the high NB bits of each 2*NB-bit field (a new in-thread minor dim)."""
    m: tl.constexpr = (1 << NB) - 1
    return tl.join(x & m, (x >> NB) & m)


@triton.jit
def _unpack(cbase, t, tmask, D: tl.constexpr, BITS: tl.constexpr, BT: tl.constexpr, JOIN: tl.constexpr):
    """int32 codes [BT, D] of positions t: channel d is code d % CPW of word d // CPW (CPW = 32 // BITS).

    JOIN: whole words are loaded ([BT, W], contiguous) and split in halves repeatedly (32 -> 16 -> ... ->
    BITS bits) with tl.join, which keeps the channel order w * CPW + j; ~10x faster on an H200 than the
    per-element gather (bench/RESULTS.md). Hybrid groups use it in tiles of 32+ tokens only (see `_dequant`).
    Otherwise (and for 3-bit words, 10 codes each) every code gathers its word (L1 hits)."""
    CPW: tl.constexpr = 32 // BITS
    W: tl.constexpr = (D + CPW - 1) // CPW
    if JOIN and (CPW & (CPW - 1)) == 0:
        x = tl.load(cbase + (t[:, None] * W + tl.arange(0, W)[None, :]), mask=tmask[:, None], other=0)
        if BITS <= 16:
            x = _split_join(x, 16)
        if BITS <= 8:
            x = _split_join(x, 8)
        if BITS <= 4:
            x = _split_join(x, 4)
        if BITS <= 2:
            x = _split_join(x, 2)
        if BITS <= 1:
            x = _split_join(x, 1)
        return tl.reshape(x, [BT, D])
    else:
        d = tl.arange(0, D)
        words = tl.load(cbase + (t[:, None] * W + (d // CPW)[None, :]), mask=tmask[:, None], other=0)
        return (words >> ((d % CPW) * BITS)[None, :]) & ((1 << BITS) - 1)


@triton.jit
def _dequant(codes_ptr, cen_ptr, half_ptr, oval_ptr, oidx_ptr, lev_ptr, norm_ptr, bh, t, t0, d, tmask,
             T, D: tl.constexpr, S: tl.constexpr, BITS: tl.constexpr, AXIS: tl.constexpr,
             GS: tl.constexpr, NG, SYM: tl.constexpr, LUT: tl.constexpr, NOUT: tl.constexpr,
             NORM: tl.constexpr, ALIGNED: tl.constexpr, BT: tl.constexpr):
    """float32 [BT, D] values of positions t (quantized region), channels d = arange(D). ALIGNED: t = t0 +
    arange(BT) with t0 - S a multiple of BT (the callers' codes-only tiles).

    Codes come in as whole words ([BT, W] contiguous loads) and are unpacked with a broadcast shift into
    [BT, W, CPW] -> [BT, D] when 32 // BITS is a power of two (1, 2, 4, 8 bits); 3-bit words (10 codes)
    fall back to a per-element gather. Per-token group statistics ([BT, D // GS]) are broadcast over
    their group in a [BT, D // GS, GS] view; per-channel ones are rows of length D. Hybrid groups in tiles
    shorter than 32 tokens gather their words: unpacked from whole words they give wrong results on H100/H200 with
    triton 3.6 at fp16 16-token tiles (right under the interpreter; test_hybrid_groups_half_precision_tiles,
    test_gqa_head_dim_masks on the GPU), as outliers do (`decode_attention` refuses those tiles); 32 tokens and
    more unpack whole words (session 13, checked on an H100)."""
    CPW: tl.constexpr = 32 // BITS
    W: tl.constexpr = (D + CPW - 1) // CPW
    bh64 = bh.to(tl.int64)
    m2 = tmask[:, None]
    code = _unpack(codes_ptr + bh64 * T * W, t, tmask, D, BITS, BT, (SYM != 2) or (BT >= 32))
    if AXIS == 0:  # per-token groups of GS channels: statistics [BT, NGRP]
        NGRP: tl.constexpr = D // GS
        gb = bh64 * T * NGRP
        gi = t[:, None] * NGRP + tl.arange(0, NGRP)[None, :]
        half = tl.load(half_ptr + gb + gi, mask=m2, other=0.0).to(tl.float32)
        code3 = tl.reshape(code, [BT, NGRP, GS])
        if SYM != 1:
            cen = tl.load(cen_ptr + gb + gi, mask=m2, other=0.0).to(tl.float32)
        else:
            cen = half
        sym = None
        if SYM == 2:   # the group's choice is the sign of its half-range (`store.signed_half`)
            sym = (half < 0)[:, :, None]
            half = tl.abs(half)
        x = tl.reshape(_values(code3, sym, half[:, :, None], cen[:, :, None], BITS, SYM, LUT, lev_ptr), [BT, D])
    else:
        if GS == 0:  # static per-channel ranges: one row
            gb = bh64 * D
            gi = d[None, :]
            gm = d[None, :] < D
        else:  # groups of GS tokens per channel: row (t - S) // GS
            gb = bh64 * NG * D
            gi = ((t - S) // GS)[:, None] * D + d[None, :]
            gm = m2
        if ALIGNED and GS > 0 and BT % GS == 0:
            # an aligned tile covers NR whole groups: load their NR statistics rows, broadcast over GS tokens each
            # (kivi-2 decode 1.3x faster on an H100 than statistics loaded per element: bench/RESULTS.md, session 7)
            NR: tl.constexpr = BT // GS
            rows = (t0 - S) // GS + tl.arange(0, NR)
            ro = bh64 * NG * D + rows[:, None] * D + d[None, :]
            h3 = tl.load(half_ptr + ro, mask=(rows < NG)[:, None], other=0.0).to(tl.float32)[:, None, :]
            if SYM != 1:
                c3 = tl.load(cen_ptr + ro, mask=(rows < NG)[:, None], other=0.0).to(tl.float32)[:, None, :]
            else:
                c3 = h3
            sym3 = None
            if SYM == 2:   # hybrid groups: the choice is the sign of the half-range (`store.signed_half`)
                sym3 = h3 < 0
                h3 = tl.abs(h3)
            x = tl.reshape(_values(tl.reshape(code, [NR, GS, D]), sym3, h3, c3, BITS, SYM, LUT, lev_ptr), [BT, D])
        else:  # statistics loaded per element
            half = tl.load(half_ptr + gb + gi, mask=gm, other=0.0).to(tl.float32)
            sym = None
            if SYM == 2:
                sym = half < 0
                half = tl.abs(half)
            cen = half
            if SYM != 1:
                cen = tl.load(cen_ptr + gb + gi, mask=gm, other=0.0).to(tl.float32)
            x = _values(code, sym, half, cen, BITS, SYM, LUT, lev_ptr)
    for j in tl.static_range(NOUT):
        oi = t * NOUT + j
        idx = tl.load(oidx_ptr + bh64 * T * NOUT + oi, mask=tmask, other=0).to(tl.int32)
        val = tl.load(oval_ptr + bh64 * T * NOUT + oi, mask=tmask, other=0.0).to(tl.float32)
        x = tl.where(d[None, :] == idx[:, None], val[:, None], x)
    if NORM:
        x = x * tl.load(norm_ptr + bh64 * D + d)[None, :]
    return x


@triton.jit
def _load_side(codes_ptr, cen_ptr, half_ptr, oval_ptr, oidx_ptr, lev_ptr, norm_ptr,
               data_ptr, sink_ptr, ring_ptr, chunk_ptr, stride_cb, stride_ch, stride_cn, nch, b, h, bh, t, t0, d,
               tvalid, p0, bnd, T, D: tl.constexpr, S: tl.constexpr, WR: tl.constexpr, BITS: tl.constexpr,
               AXIS: tl.constexpr, GS: tl.constexpr, NG, SYM: tl.constexpr, LUT: tl.constexpr,
               NOUT: tl.constexpr, NORM: tl.constexpr, ONLY_CODES: tl.constexpr, BT: tl.constexpr,
               WINDOW_CODES: tl.constexpr = True):
    """float32 [BT, D] of one side (K or V) at positions t, from wherever the store keeps each position:
    t < p0 from the store (written length L, quantized below bnd = Q_side(L)), t in [p0, p0 + nch) from the
    chunk (row t - p0, token stride stride_cn; decode: nch = 1). t = t0 + arange(BT). ONLY_CODES: t0 - S a
    multiple of BT (the codes-only tiles of both templates), every valid t in the quantized region; otherwise (the
    window tiles: a tile that starts below S has its valid t below S) codes are unpacked only if
    S <= t0 < min(bnd, p0), and not at all where WINDOW_CODES is False (the caller knows that no window tile holds
    this side's codes: their unpacking is not compiled). The values of masked positions (not tvalid) are finite
    garbage that the caller masks (scores to -inf, p to 0)."""
    bh64 = bh.to(tl.int64)
    if BITS == 16:
        x = tl.load(data_ptr + bh64 * T * D + (t[:, None] * D + d[None, :]),
                    mask=(tvalid & (t < p0))[:, None], other=0.0).to(tl.float32)
        if ONLY_CODES:
            return x
    elif ONLY_CODES:
        x = _dequant(codes_ptr, cen_ptr, half_ptr, oval_ptr, oidx_ptr, lev_ptr, norm_ptr, bh, t, t0, d,
                     tvalid, T, D, S, BITS, AXIS, GS, NG, SYM, LUT, NOUT, NORM, True, BT)
        return x
    else:  # a window tile, t = t0 + arange(BT): most hold no codes at all, and skip their unpacking
        inq = tvalid & (t >= S) & (t < bnd) & (t < p0)
        if not WINDOW_CODES:
            x = tl.zeros([BT, D], tl.float32)
        elif (t0 >= S) & (t0 < tl.minimum(bnd, p0)):   # a tile starting below S has its valid t below S
            x = _dequant(codes_ptr, cen_ptr, half_ptr, oval_ptr, oidx_ptr, lev_ptr, norm_ptr, bh, t, t0,
                         d, inq, T, D, S, BITS, AXIS, GS, NG, SYM, LUT, NOUT, NORM, False, BT)
            x = tl.where(inq[:, None], x, 0.0)
        else:
            x = tl.zeros([BT, D], tl.float32)
        if S > 0:
            ins = tvalid & (t < S) & (t < p0)
            xs = tl.load(sink_ptr + bh64 * S * D + (t[:, None] * D + d[None, :]), mask=ins[:, None], other=0.0)
            x = tl.where(ins[:, None], xs.to(tl.float32), x)
        if WR > 0:
            inr = tvalid & (t >= bnd) & (t >= S) & (t < p0)
            xr = tl.load(ring_ptr + bh64 * WR * D + ((t % WR)[:, None] * D + d[None, :]), mask=inr[:, None],
                         other=0.0)
            x = tl.where(inr[:, None], xr.to(tl.float32), x)
    inc = tvalid & (t >= p0) & (t < p0 + nch)
    xc = tl.load(chunk_ptr + b.to(tl.int64) * stride_cb + h * stride_ch + (t - p0)[:, None] * stride_cn + d[None, :],
                 mask=inc[:, None], other=0.0)
    return tl.where(inc[:, None], xc.to(tl.float32), x)


@triton.jit
def _dot(a, b, dt: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr):
    """a @ b with inputs rounded to the cache dtype dt (tensor cores), fp32 accumulation. fp32 caches use
    IEEE fp32 (no tf32). Triton 3.6's interpreter mis-multiplies bf16, so there the rounded inputs are
    multiplied in fp32: the same numbers."""
    if INTERP:
        return tl.dot(a.to(dt).to(tl.float32), b.to(dt).to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a.to(dt), b.to(dt), input_precision="ieee")
    else:
        return tl.dot(a.to(dt), b.to(dt))


@triton.jit
def _rope(k, t, d, cos_ptr, sin_ptr, b, tmask, T, D: tl.constexpr, BT: tl.constexpr):
    """k * cos_t + rotate_half(k) * sin_t, rotate_half(k) = cat(-k[D/2:], k[:D/2]) formed in registers."""
    base = b.to(tl.int64) * T * D
    off = t[:, None] * D + d[None, :]
    c = tl.load(cos_ptr + base + off, mask=tmask[:, None], other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + base + off, mask=tmask[:, None], other=0.0).to(tl.float32)
    k1, k2 = tl.split(tl.permute(tl.reshape(k, [BT, 2, D // 2]), (0, 2, 1)))
    rot = tl.reshape(tl.permute(tl.join(-k2, k1), (0, 2, 1)), [BT, D])
    return k * c + rot * s


@triton.jit
def _stat_rows(cen_ptr, half_ptr, bh, t0, d, S: tl.constexpr, GS: tl.constexpr, NG, D: tl.constexpr,
               SYM: tl.constexpr):
    """(center, half) [D] of the CHANNEL-axis statistics row that covers a whole tile starting at t0."""
    if GS == 0:
        off = bh.to(tl.int64) * D
    else:
        off = bh.to(tl.int64) * NG * D + ((t0 - S) // GS) * D
    h = tl.load(half_ptr + off + d).to(tl.float32)
    if SYM == 1:
        c = h * 0.0
    else:
        c = tl.load(cen_ptr + off + d).to(tl.float32)
    return c, h


@triton.jit
def _code_values(C, LEV, bh, t, tvalid, T, D: tl.constexpr, BITS: tl.constexpr, SYM: tl.constexpr,
                 LUT: tl.constexpr, BT: tl.constexpr):
    """[BT, D] float32: the codebook level LUT[code] of each code, or the code itself (uniform levels)."""
    CPW: tl.constexpr = 32 // BITS
    W: tl.constexpr = (D + CPW - 1) // CPW
    code = _unpack(C + bh.to(tl.int64) * T * W, t, tvalid, D, BITS, BT, SYM != 2)
    if LUT:
        return tl.load(LEV + code)
    return code.to(tl.float32)


@triton.jit
def _token_stats(CEN, HALF, bh, t, tvalid, T, SYM: tl.constexpr):
    """(center, half) [BT] of TOKEN-axis statistics with one group per token (center 0 when symmetric)."""
    off = bh.to(tl.int64) * T
    h = tl.load(HALF + off + t, mask=tvalid, other=0.0).to(tl.float32)
    if SYM == 1:
        c = h * 0.0
    else:
        c = tl.load(CEN + off + t, mask=tvalid, other=0.0).to(tl.float32)
    return c, h


@triton.jit
def _post_logits(qn, KC, KCEN, KHALF, KLEV, bh, t, t0, tvalid, d, T, NG, D: tl.constexpr, S: tl.constexpr,
                 BITS: tl.constexpr, GS: tl.constexpr, SYM: tl.constexpr, LUT: tl.constexpr, POST: tl.constexpr,
                 BT: tl.constexpr, dt: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr):
    """CalibQuant post-scaling, logits q . k_hat without forming k_hat (uniform levels l = a*code - 1):
    POST 1 (per-channel statistics, one row per tile): (q * h * a) . code + q . (c - h)
    POST 2 (one statistic per token):                  h_t * (a * q . code_t - sum q) + c_t * sum q
    With a codebook, l = LUT[code] replaces a*code - 1."""
    A = _step(BITS, SYM)
    x = _code_values(KC, KLEV, bh, t, tvalid, T, D, BITS, SYM, LUT, BT)
    if POST == 1:
        c, h = _stat_rows(KCEN, KHALF, bh, t0, d, S, GS, NG, D, SYM)
        if LUT:
            s = _dot(qn * h[None, :], tl.trans(x), dt, IEEE, INTERP) + tl.sum(qn * c[None, :], 1)[:, None]
        else:
            s = _dot(qn * (h * A)[None, :], tl.trans(x), dt, IEEE, INTERP)
            s += tl.sum(qn * (c - h)[None, :], 1)[:, None]
    else:
        c, h = _token_stats(KCEN, KHALF, bh, t, tvalid, T, SYM)
        qs = tl.sum(qn.to(dt).to(tl.float32), 1)[:, None]
        if LUT:
            s = _dot(qn, tl.trans(x), dt, IEEE, INTERP) * h[None, :] + qs * c[None, :]
        else:
            s = (_dot(qn, tl.trans(x), dt, IEEE, INTERP) * A - qs) * h[None, :] + qs * c[None, :]
    return s


@triton.jit
def _post_pv(p, VC, VCEN, VHALF, VLEV, bh, t, t0, tvalid, d, T, NG, D: tl.constexpr, S: tl.constexpr,
             BITS: tl.constexpr, GS: tl.constexpr, SYM: tl.constexpr, LUT: tl.constexpr, POST: tl.constexpr,
             BT: tl.constexpr, dt: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr):
    """p . v_hat without forming v_hat (uniform levels l = a*code - 1):
    POST 1 (per-channel statistics, one row per tile): h * (a * p . code - sum p) + c * sum p
    POST 2 (one statistic per token):                  (p * h_t * a) . code + sum_t p_t (c_t - h_t)"""
    A = _step(BITS, SYM)
    x = _code_values(VC, VLEV, bh, t, tvalid, T, D, BITS, SYM, LUT, BT)
    if POST == 1:
        c, h = _stat_rows(VCEN, VHALF, bh, t0, d, S, GS, NG, D, SYM)
        ps = tl.sum(p.to(dt).to(tl.float32), 1)[:, None]
        if LUT:
            pv = _dot(p, x, dt, IEEE, INTERP) * h[None, :] + ps * c[None, :]
        else:
            pv = (_dot(p, x, dt, IEEE, INTERP) * A - ps) * h[None, :] + ps * c[None, :]
    else:
        c, h = _token_stats(VCEN, VHALF, bh, t, tvalid, T, SYM)
        if LUT:
            pv = _dot(p * h[None, :], x, dt, IEEE, INTERP) + tl.sum(p * c[None, :], 1)[:, None]
        else:
            pv = _dot(p * (h * A)[None, :], x, dt, IEEE, INTERP) + tl.sum(p * (c - h)[None, :], 1)[:, None]
    return pv


@triton.jit
def _load_query(Q, stride_qb, stride_qh, bh, H: tl.constexpr, REP: tl.constexpr, REP_PAD: tl.constexpr,
                D: tl.constexpr):
    """The REP query rows of KV head row bh = b * H + h ([REP_PAD, D], rows REP.. zero)."""
    r = tl.arange(0, REP_PAD)
    d = tl.arange(0, D)
    qh = (bh % H) * REP + r
    return tl.load(Q + (bh // H).to(tl.int64) * stride_qb + qh[:, None] * stride_qh + d[None, :],
                   mask=(r < REP)[:, None], other=0.0)


@triton.jit
def _decode_program(
        q,
        KC, KCEN, KHALF, KOVAL, KOIDX, KLEV, KNORM, KDATA, KSINK, KRING, KCHUNK, stride_kb, stride_kh,
        VC, VCEN, VHALF, VOVAL, VOIDX, VLEV, VDATA, VSINK, VRING, VCHUNK, stride_vb, stride_vh,
        COS, SIN, POS, AMASK, stride_mb, stride_mh, TEMP,
        OUT_M, OUT_L, OUT_ACC, scale, T, NG_K, NG_V, NSPLIT, bh, slot,
        H: tl.constexpr, REP: tl.constexpr, REP_PAD: tl.constexpr, D: tl.constexpr,
        S: tl.constexpr, R: tl.constexpr,
        BITS_K: tl.constexpr, AXIS_K: tl.constexpr, GS_K: tl.constexpr,
        SYM_K: tl.constexpr, LUT_K: tl.constexpr, NOUT_K: tl.constexpr, NORM_K: tl.constexpr,
        TPG_K: tl.constexpr, WR_K: tl.constexpr,
        BITS_V: tl.constexpr, AXIS_V: tl.constexpr, GS_V: tl.constexpr,
        SYM_V: tl.constexpr, LUT_V: tl.constexpr, NOUT_V: tl.constexpr, TPG_V: tl.constexpr, WR_V: tl.constexpr,
        ROPE: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHARED: tl.constexpr, IS_CAUSAL: tl.constexpr,
        TAU_PHASE: tl.constexpr,
        KPOST: tl.constexpr, VPOST: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
        WINDOW: tl.constexpr, NWIN: tl.constexpr, PDL: tl.constexpr, TRB=None, TRACE: tl.constexpr = False, tr0=0,
        waits=True):
    """One program of the quantized-region launch (WINDOW False: slice `slot` of KV head row bh = b * H + h) or
    of the window launch (WINDOW: window tile `slot`), given the query rows q [REP_PAD, D] of its GQA group
    (`_load_query`): its (max, sum, acc) into slot `slot` (WINDOW: NSPLIT + `slot`) of each real row. The
    launches (`_decode_kernel`, `_fused_decode`) only say which program runs where. TRACE (debug, `TRACE`): the
    record (`_trace_store`) of timer reads tr0 (the launch's start), before and after the wait for the quantized
    region's launch (in a program that does not wait, the two reads agree), and at the end, at TRB + 8
    (bh NWIN + slot) (the window launch only). `waits` (the window launch under PDL): whether this program waits for
    the quantized region's launch before it ends (one waiter suffices: the launches after this one wait for all its
    programs' ends)."""
    split = NSPLIT + slot if WINDOW else slot
    b = bh // H
    h = bh % H
    p0 = tl.load(POS).to(tl.int32)
    L = p0 + 1
    bnd_k = _quantized_end(L, S, R, TPG_K, BITS_K)
    bnd_v = _quantized_end(L, S, R, TPG_V, BITS_V)
    S_EFF: tl.constexpr = 0 if (BITS_K == 16 and BITS_V == 16) else S
    qend = tl.minimum(tl.minimum(bnd_k, bnd_v), p0)
    qlen = tl.maximum(qend - S_EFF, 0)

    r = tl.arange(0, REP_PAD)
    d = tl.arange(0, D)
    rvalid = r < REP
    qh = h * REP + r
    dt: tl.constexpr = q.dtype
    if TAU_PHASE == 2:
        temp = tl.load(TEMP + b * H * REP + qh, mask=rvalid, other=1.0)
    KP: tl.constexpr = 0 if WINDOW else KPOST
    VP: tl.constexpr = 0 if WINDOW else VPOST
    # no window tile holds a side's codes where its token groups are longer than the other side's and a multiple of
    # them (InnerQ's Values: 32 tokens against 1; KIVI's Keys: 32 against 1): its Q(L) is then the lower one, where the
    # window starts (min(Q_K, Q_V)). Its unpacking is left out of the window launch: with it, once the hybrid masks
    # had left the store, Triton laid innerq-2's tile loads out differently and its window launch took 18.3 us instead
    # of 12.5 at (32, 4096) on an H200 (bench/debug/parts.py); without it 13.9 us, and offline sm_90
    # (bench/debug/window_regs.py) innerq-2's window launch has 80 registers instead of 146 (128 with the masks),
    # kivi-2's 1160 SASS instructions instead of 1752 (session 47)
    V_WINDOW_CODES: tl.constexpr = not (WINDOW and TPG_V > TPG_K and TPG_V % TPG_K == 0)
    K_WINDOW_CODES: tl.constexpr = not (WINDOW and TPG_K > TPG_V and TPG_K % TPG_V == 0)
    if KP != 0:
        qn = q.to(tl.float32)
        if NORM_K:
            qn = qn * tl.load(KNORM + bh.to(tl.int64) * D + d)[None, :]

    m_i = tl.full([REP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([REP_PAD], tl.float32)
    lo_i = tl.full([REP_PAD], float("inf"), tl.float32)
    acc = tl.zeros([REP_PAD, D], tl.float32)

    if WINDOW:  # the exact windows, [0, min(S_EFF, p0)) then [min(max(S_EFF, qend), p0), p0]: tile j of them
        win_lo = tl.minimum(tl.maximum(S_EFF, qend), p0)   # p0 < S: the appended token follows the sink's tiles
        n_sink = tl.cdiv(tl.minimum(S_EFF, p0), BLOCK_T)
        it_lo = slot
        n_iter = tl.minimum(n_sink + tl.cdiv(p0 + 1 - win_lo, BLOCK_T), it_lo + 1)
    else:  # this program's slice of the region where both sides are quantized
        per = tl.cdiv(tl.cdiv(qlen, NSPLIT), BLOCK_T) * BLOCK_T
        start = S_EFF + split * per
        stop = tl.minimum(start + per, qend)
        it_lo = 0
        n_iter = tl.cdiv(tl.maximum(stop - start, 0), BLOCK_T)
    for it in range(it_lo, n_iter):
        if WINDOW:
            t, tvalid, t0 = _window_t(it, n_sink, tl.minimum(S_EFF, p0), win_lo, p0 + 1, BLOCK_T)
        else:
            t0 = start + it * BLOCK_T
            t = t0 + tl.arange(0, BLOCK_T)
            tvalid = t < stop
        if KP != 0:
            s = _post_logits(qn, KC, KCEN, KHALF, KLEV, bh, t, t0, tvalid, d, T, NG_K, D, S,
                             BITS_K, GS_K, SYM_K, LUT_K, KP, BLOCK_T, dt, IEEE, INTERP)
        else:
            k = _load_side(KC, KCEN, KHALF, KOVAL, KOIDX, KLEV, KNORM, KDATA, KSINK, KRING, KCHUNK,
                           stride_kb, stride_kh, 0, 1, b, h, bh, t, t0, d, tvalid, p0, bnd_k, T, D, S, WR_K, BITS_K, AXIS_K,
                           GS_K, NG_K, SYM_K, LUT_K, NOUT_K, NORM_K, not WINDOW, BLOCK_T,
                           K_WINDOW_CODES)
            if ROPE:
                # the chunk's own key arrives already rotated (it is the attention's input, not the store's)
                k = tl.where((t == p0)[:, None], k, _rope(k, t, d, COS, SIN, b, tvalid, T, D, BLOCK_T))
            s = _dot(q, tl.trans(k), dt, IEEE, INTERP)
        s = s * scale
        allowed = rvalid[:, None] & tvalid[None, :]
        if MASK_SHARED:  # one mask row for all query heads ([B|1, 1, 1, T]: HF's decode mask): load it once
            s, allowed = _apply_mask(s, allowed, AMASK, b.to(tl.int64) * stride_mb + t[None, :], tvalid[None, :],
                                     MASK_KIND)
        else:
            moff = b.to(tl.int64) * stride_mb + qh[:, None] * stride_mh + t[None, :]
            s, allowed = _apply_mask(s, allowed, AMASK, moff, allowed, MASK_KIND)
        if IS_CAUSAL:
            allowed = allowed & (t[None, :] <= 0)
        if TAU_PHASE == 1:
            m_i = tl.maximum(m_i, tl.max(tl.where(allowed, s, float("-inf")), 1))
            lo_i = tl.minimum(lo_i, tl.min(tl.where(allowed, s, float("inf")), 1))
        else:
            if TAU_PHASE == 2:
                s = s * temp[:, None]
            s = tl.where(allowed, s, float("-inf"))
            p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i)
            if VP != 0:
                pv = _post_pv(p, VC, VCEN, VHALF, VLEV, bh, t, t0, tvalid, d, T, NG_V, D, S,
                              BITS_V, GS_V, SYM_V, LUT_V, VP, BLOCK_T, dt, IEEE, INTERP)
            else:
                v = _load_side(VC, VCEN, VHALF, VOVAL, VOIDX, VLEV, VLEV, VDATA, VSINK, VRING, VCHUNK,
                               stride_vb, stride_vh, 0, 1, b, h, bh, t, t0, d, tvalid, p0, bnd_v, T, D, S, WR_V, BITS_V,
                               AXIS_V, GS_V, NG_V, SYM_V, LUT_V, NOUT_V, False, not WINDOW, BLOCK_T, V_WINDOW_CODES)
                pv = _dot(p, v, dt, IEEE, INTERP)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

    if TRACE:
        tr1 = _trace_now()
    if PDL and WINDOW:
        # the waiting program must reach this line whatever its tile (no early return above): the launches after
        # this one rely on it to end after the quantized-region launch
        if waits:
            gdc_wait()   # ends after the quantized-region launch: the launches after this one wait for both
    if TRACE:
        tr2 = _trace_now()
    o = (bh * REP_PAD + r) * (NSPLIT + NWIN) + split   # rows REP..REP_PAD-1 are never read
    tl.store(OUT_M + o, m_i, mask=rvalid)
    if TAU_PHASE == 1:
        tl.store(OUT_L + o, lo_i, mask=rvalid)
    else:
        tl.store(OUT_L + o, l_i, mask=rvalid)
        tl.store(OUT_ACC + o[:, None] * D + d[None, :], acc, mask=rvalid[:, None])
    if TRACE:
        _trace_store(TRB + (bh * NWIN + slot).to(tl.int64) * 8, tr0, tr1, tr2, _trace_now())


@triton.jit
def _decode_kernel(
        Q, stride_qb, stride_qh,
        KC, KCEN, KHALF, KOVAL, KOIDX, KLEV, KNORM, KDATA, KSINK, KRING, KCHUNK, stride_kb, stride_kh,
        VC, VCEN, VHALF, VOVAL, VOIDX, VLEV, VDATA, VSINK, VRING, VCHUNK, stride_vb, stride_vh,
        COS, SIN, POS, AMASK, stride_mb, stride_mh, TEMP,
        OUT_M, OUT_L, OUT_ACC, scale, T, NG_K, NG_V, NSPLIT,
        H: tl.constexpr, REP: tl.constexpr, REP_PAD: tl.constexpr, D: tl.constexpr,
        S: tl.constexpr, R: tl.constexpr,
        BITS_K: tl.constexpr, AXIS_K: tl.constexpr, GS_K: tl.constexpr,
        SYM_K: tl.constexpr, LUT_K: tl.constexpr, NOUT_K: tl.constexpr, NORM_K: tl.constexpr,
        TPG_K: tl.constexpr, WR_K: tl.constexpr,
        BITS_V: tl.constexpr, AXIS_V: tl.constexpr, GS_V: tl.constexpr,
        SYM_V: tl.constexpr, LUT_V: tl.constexpr, NOUT_V: tl.constexpr, TPG_V: tl.constexpr, WR_V: tl.constexpr,
        ROPE: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHARED: tl.constexpr, IS_CAUSAL: tl.constexpr,
        TAU_PHASE: tl.constexpr,
        KPOST: tl.constexpr, VPOST: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
        WINDOW: tl.constexpr, NWIN: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr = False, TRB=None,
        TRACE: tl.constexpr = False, ONE_WAIT: tl.constexpr = False):
    """The quantized-region launch (grid (B * H, NSPLIT)) or the window launch (WINDOW, grid (B * H, NWIN)):
    `_decode_program` per program (TRACE: its debug records, the window launch only)."""
    tr0 = _trace_now() if TRACE else 0
    if PDL and (TRIGGER or not WINDOW):
        # the next launch may start now: the window launch reads nothing the quantized region's launch writes; the
        # final reduction (after a window launch with TRIGGER) waits for this launch's end before it reads
        gdc_launch_dependents()
    bh = tl.program_id(0)
    waits = True
    if ONE_WAIT:  # the window launch's last program alone waits for the quantized region's launch (`WINDOW_ONE_WAIT`)
        waits = (bh == tl.num_programs(0) - 1) & (tl.program_id(1) == tl.num_programs(1) - 1)
    q = _load_query(Q, stride_qb, stride_qh, bh, H, REP, REP_PAD, D)
    _decode_program(q, KC, KCEN, KHALF, KOVAL, KOIDX, KLEV, KNORM, KDATA, KSINK, KRING, KCHUNK, stride_kb,
        stride_kh, VC, VCEN, VHALF, VOVAL, VOIDX, VLEV, VDATA, VSINK, VRING, VCHUNK, stride_vb, stride_vh,
        COS, SIN, POS, AMASK, stride_mb, stride_mh, TEMP, OUT_M, OUT_L, OUT_ACC, scale, T, NG_K, NG_V, NSPLIT, bh,
        tl.program_id(1), H, REP, REP_PAD, D, S, R, BITS_K, AXIS_K, GS_K, SYM_K, LUT_K, NOUT_K, NORM_K, TPG_K,
        WR_K, BITS_V, AXIS_V, GS_V, SYM_V, LUT_V, NOUT_V, TPG_V, WR_V, ROPE, MASK_KIND, MASK_SHARED, IS_CAUSAL,
        TAU_PHASE, KPOST, VPOST, BLOCK_T, IEEE, INTERP, WINDOW, NWIN, PDL, TRB, TRACE and WINDOW, tr0, waits)


@triton.jit
def _merge_slots(OUT_M, OUT_L, OUT_ACC, bh, NS, REP: tl.constexpr, REP_PAD: tl.constexpr, D: tl.constexpr):
    """out [REP_PAD, D] of the REP rows of KV head row bh: sum_j exp(m_j - m) acc_j / sum_j exp(m_j - m) l_j
    over their NS slots (`_combine_kernel`'s math, for one program that merges a whole GQA group). The slots
    were written by other programs of the same launch: loaded past L1 (.cg)."""
    r = tl.arange(0, REP_PAD)
    d = tl.arange(0, D)
    rv = r < REP
    base = (bh * REP_PAD + r) * NS
    CH: tl.constexpr = 64
    j = tl.arange(0, CH)
    mx2 = tl.full([REP_PAD, CH], float("-inf"), tl.float32)
    # the row maximum is reduced after the loop: reduced inside it, triton 3.6's OptimizeThreadLocality pass
    # asserted (head_dim 64, on an H200)
    for j0 in range(0, NS, CH):
        jm = rv[:, None] & ((j0 + j) < NS)[None, :]
        m = tl.load(OUT_M + base[:, None] + (j0 + j)[None, :], mask=jm, other=float("-inf"), cache_modifier=".cg")
        mx2 = tl.maximum(mx2, m)
    mx = tl.max(mx2, 1)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    num = tl.zeros([REP_PAD, D], tl.float32)
    den = tl.zeros([REP_PAD], tl.float32)
    U: tl.constexpr = 4   # slots per iteration: their loads all issue before the first is used
    for j0 in range(0, NS, U):
        for u in tl.static_range(U):
            ok = rv & (j0 + u < NS)
            w = tl.exp(tl.load(OUT_M + base + j0 + u, mask=ok, other=float("-inf"), cache_modifier=".cg") - mx)
            den += w * tl.load(OUT_L + base + j0 + u, mask=ok, other=0.0, cache_modifier=".cg")
            acc = tl.load(OUT_ACC + (base + j0 + u)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0,
                          cache_modifier=".cg")
            num += w[:, None] * acc
    return tl.where(den[:, None] > 0, num / tl.where(den > 0, den, 1.0)[:, None], 0.0)


@triton.jit
def _fused_decode(
        q,
        KC, KCEN, KHALF, KOVAL, KOIDX, KLEV, KNORM, KDATA, KSINK, KRING, KCHUNK, stride_kb, stride_kh,
        VC, VCEN, VHALF, VOVAL, VOIDX, VLEV, VDATA, VSINK, VRING, VCHUNK, stride_vb, stride_vh,
        COS, SIN, POS, AMASK, stride_mb, stride_mh, TEMP,
        OUT_M, OUT_L, OUT_ACC, scale, T, NG_K, NG_V, NSPLIT, CNT,
        H: tl.constexpr, REP: tl.constexpr, REP_PAD: tl.constexpr, D: tl.constexpr,
        S: tl.constexpr, R: tl.constexpr,
        BITS_K: tl.constexpr, AXIS_K: tl.constexpr, GS_K: tl.constexpr,
        SYM_K: tl.constexpr, LUT_K: tl.constexpr, NOUT_K: tl.constexpr, NORM_K: tl.constexpr,
        TPG_K: tl.constexpr, WR_K: tl.constexpr,
        BITS_V: tl.constexpr, AXIS_V: tl.constexpr, GS_V: tl.constexpr,
        SYM_V: tl.constexpr, LUT_V: tl.constexpr, NOUT_V: tl.constexpr, TPG_V: tl.constexpr, WR_V: tl.constexpr,
        ROPE: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHARED: tl.constexpr, IS_CAUSAL: tl.constexpr,
        TAU_PHASE: tl.constexpr,
        KPOST: tl.constexpr, VPOST: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
        NWIN: tl.constexpr, WBLOCK_T: tl.constexpr):
    """A whole decode-attention call in one launch, grid (B * H, NWIN + NSPLIT): programs j < NWIN take window tile j
    (WBLOCK_T tokens: shorter than the region's, since the window's code is compiled into the same kernel and sets
    its registers too: kivi-2 at bf16 on sm_90, 255 registers and spills with 64-token window tiles, 157 with 16,
    the region's own launch 128), the others slice j - NWIN of the quantized region (BLOCK_T-token tiles)
    (`_decode_program` either way); each then counts
    itself in CNT[bh] (zero before the launch), and the last of a KV head's NSPLIT + NWIN programs merges their
    slots (`_merge_slots`) and resets CNT[bh] to zero. Returns (last, out [REP_PAD, D] fp32): the caller stores
    out where last (the Inductor template `kvq_compile.lowering` emits, or `_fused_decode_kernel`). No softmax
    calibration (TAU_PHASE 0): CalibQuant's range pass must end before its attention pass starts."""
    bh = tl.program_id(0)
    j = tl.program_id(1)
    tl.static_assert(TAU_PHASE == 0, "the one-launch kernel has no calibrated softmax")
    # window tiles first, their tile index program_id(1) itself: as j - NSPLIT the kernel took 237 registers instead
    # of 168 (kivi-2 bf16, sm_90)
    if j < NWIN:
        _decode_program(q, KC, KCEN, KHALF, KOVAL, KOIDX, KLEV, KNORM, KDATA, KSINK, KRING, KCHUNK,
                        stride_kb, stride_kh, VC, VCEN, VHALF, VOVAL, VOIDX, VLEV, VDATA, VSINK, VRING,
                        VCHUNK, stride_vb, stride_vh, COS, SIN, POS, AMASK, stride_mb, stride_mh, TEMP, OUT_M,
                        OUT_L, OUT_ACC, scale, T, NG_K, NG_V, NSPLIT, bh, j, H, REP, REP_PAD, D, S, R,
                        BITS_K, AXIS_K, GS_K, SYM_K, LUT_K, NOUT_K, NORM_K, TPG_K, WR_K, BITS_V, AXIS_V, GS_V,
                        SYM_V, LUT_V, NOUT_V, TPG_V, WR_V, ROPE, MASK_KIND, MASK_SHARED, IS_CAUSAL, TAU_PHASE,
                        KPOST, VPOST, WBLOCK_T, IEEE, INTERP, True, NWIN, False)
    else:
        _decode_program(q, KC, KCEN, KHALF, KOVAL, KOIDX, KLEV, KNORM, KDATA, KSINK, KRING, KCHUNK,
                        stride_kb, stride_kh, VC, VCEN, VHALF, VOVAL, VOIDX, VLEV, VDATA, VSINK, VRING,
                        VCHUNK, stride_vb, stride_vh, COS, SIN, POS, AMASK, stride_mb, stride_mh, TEMP, OUT_M,
                        OUT_L, OUT_ACC, scale, T, NG_K, NG_V, NSPLIT, bh, j - NWIN, H, REP, REP_PAD, D, S, R, BITS_K,
                        AXIS_K, GS_K, SYM_K, LUT_K, NOUT_K, NORM_K, TPG_K, WR_K, BITS_V, AXIS_V, GS_V, SYM_V,
                        LUT_V, NOUT_V, TPG_V, WR_V, ROPE, MASK_KIND, MASK_SHARED, IS_CAUSAL, TAU_PHASE, KPOST,
                        VPOST, BLOCK_T, IEEE, INTERP, False, NWIN, False)
    tl.debug_barrier()   # every warp's slot stores before the count (its atomic releases them to the last program)
    n = tl.atomic_add(CNT + bh, 1, sem="acq_rel", scope="gpu")
    last = n == NSPLIT + NWIN - 1
    out = tl.zeros([REP_PAD, D], tl.float32)
    if last:
        out = _merge_slots(OUT_M, OUT_L, OUT_ACC, bh, NSPLIT + NWIN, REP, REP_PAD, D)
        tl.store(CNT + bh, 0)   # ready for the next launch on the same counters
    return last, out


@triton.jit
def _fused_decode_kernel(
        Q, stride_qb, stride_qh, O,
        KC, KCEN, KHALF, KOVAL, KOIDX, KLEV, KNORM, KDATA, KSINK, KRING, KCHUNK, stride_kb, stride_kh,
        VC, VCEN, VHALF, VOVAL, VOIDX, VLEV, VDATA, VSINK, VRING, VCHUNK, stride_vb, stride_vh,
        COS, SIN, POS, AMASK, stride_mb, stride_mh, TEMP,
        OUT_M, OUT_L, OUT_ACC, scale, T, NG_K, NG_V, NSPLIT, CNT,
        H: tl.constexpr, REP: tl.constexpr, REP_PAD: tl.constexpr, D: tl.constexpr,
        S: tl.constexpr, R: tl.constexpr,
        BITS_K: tl.constexpr, AXIS_K: tl.constexpr, GS_K: tl.constexpr,
        SYM_K: tl.constexpr, LUT_K: tl.constexpr, NOUT_K: tl.constexpr, NORM_K: tl.constexpr,
        TPG_K: tl.constexpr, WR_K: tl.constexpr,
        BITS_V: tl.constexpr, AXIS_V: tl.constexpr, GS_V: tl.constexpr,
        SYM_V: tl.constexpr, LUT_V: tl.constexpr, NOUT_V: tl.constexpr, TPG_V: tl.constexpr, WR_V: tl.constexpr,
        ROPE: tl.constexpr, MASK_KIND: tl.constexpr, MASK_SHARED: tl.constexpr, IS_CAUSAL: tl.constexpr,
        TAU_PHASE: tl.constexpr,
        KPOST: tl.constexpr, VPOST: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
        NWIN: tl.constexpr, WBLOCK_T: tl.constexpr):
    """`_fused_decode` as a plain Triton launch into O [B, Hq, 1, D] (contiguous): what the Inductor template of
    `kvq_compile.lowering` computes, for the launcher's `fused=True` (the CPU tests, the kernel benchmark)."""
    bh = tl.program_id(0)
    q = _load_query(Q, stride_qb, stride_qh, bh, H, REP, REP_PAD, D)
    last, out = _fused_decode(q, KC, KCEN, KHALF, KOVAL, KOIDX, KLEV, KNORM, KDATA, KSINK, KRING, KCHUNK,
                              stride_kb, stride_kh, VC, VCEN, VHALF, VOVAL, VOIDX, VLEV, VDATA, VSINK, VRING,
                              VCHUNK, stride_vb, stride_vh, COS, SIN, POS, AMASK, stride_mb, stride_mh, TEMP, OUT_M,
                              OUT_L, OUT_ACC, scale, T, NG_K, NG_V, NSPLIT, CNT, H, REP, REP_PAD, D, S, R, BITS_K,
                              AXIS_K, GS_K, SYM_K, LUT_K, NOUT_K, NORM_K, TPG_K, WR_K, BITS_V, AXIS_V, GS_V, SYM_V,
                              LUT_V, NOUT_V, TPG_V, WR_V, ROPE, MASK_KIND, MASK_SHARED, IS_CAUSAL, TAU_PHASE, KPOST,
                              VPOST, BLOCK_T, IEEE, INTERP, NWIN, WBLOCK_T)
    if last:
        r = tl.arange(0, REP_PAD)
        d = tl.arange(0, D)
        row = (bh // H) * (H * REP) + (bh % H) * REP + r
        tl.store(O + row[:, None] * D + d[None, :], out.to(O.dtype.element_ty), mask=(r < REP)[:, None])


@triton.jit
def _temperature_kernel(OUT_M, OUT_L, TEMP, tau_sum, REP: tl.constexpr, REP_PAD: tl.constexpr, NS: tl.constexpr,
                        NS_PAD: tl.constexpr):
    """CalibQuant's temperature of one row from the range pass (TAU_PHASE 1) over its NS partial results:
    t = 1 - (tau1 + tau2) / (max - min), and 1 where the range is empty, zero or not finite (one launch where
    torch's ops took about ten, ~20 us at batch 32 on an H100: bench/RESULTS.md, session 11)."""
    row = tl.program_id(0)  # (b * H + h) * REP + r
    bh = row // REP
    r = row % REP
    j = tl.arange(0, NS_PAD)
    base = (bh * REP_PAD + r) * NS
    hi = tl.max(tl.load(OUT_M + base + j, mask=j < NS, other=float("-inf")), 0)
    lo = tl.min(tl.load(OUT_L + base + j, mask=j < NS, other=float("inf")), 0)
    width = hi - lo
    ok = (width > 0) & (width < float("inf"))
    tl.store(TEMP + row, tl.where(ok, 1.0 - tl.div_rn(tau_sum, tl.where(ok, width, 1.0)), 1.0))


@triton.jit
def _combine_kernel(OUT_M, OUT_L, OUT_ACC, O, H: tl.constexpr, REP: tl.constexpr, REP_PAD: tl.constexpr,
                    D: tl.constexpr, NS: tl.constexpr, NS_PAD: tl.constexpr, PDL: tl.constexpr, TRB=None,
                    TRACE: tl.constexpr = False, DB: tl.constexpr = 0):
    """out = sum_j exp(m_j - m) acc_j / sum_j exp(m_j - m) l_j over the NS partial results of one row: grid
    (rows, D / BLK), program (row, c) the channels [c BLK, (c + 1) BLK), BLK = DB (0: BLK = D, one program a row;
    `_combine_blocks`). TRACE (debug, `TRACE`): the record (`_trace_store`) of timer reads at the start, after the
    wait and at the end at TRB + 8 (row D / BLK + c)."""
    if TRACE:
        tr0 = _trace_now()
    if PDL:
        gdc_wait()   # launched early behind the window launch (or calibquant's attention pass): its results first
    if TRACE:
        tr1 = _trace_now()
    row = tl.program_id(0)  # (b * H + h) * REP + r
    bh = row // REP
    r = row % REP
    j = tl.arange(0, NS_PAD)
    BLK: tl.constexpr = DB if DB else D
    d = tl.program_id(1) * BLK + tl.arange(0, BLK)
    base = (bh * REP_PAD + r) * NS
    jm = j < NS
    m = tl.load(OUT_M + base + j, mask=jm, other=float("-inf"))
    l = tl.load(OUT_L + base + j, mask=jm, other=0.0)
    mx = tl.max(m, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp(m - mx)
    acc = tl.load(OUT_ACC + (base + j)[:, None] * D + d[None, :], mask=jm[:, None], other=0.0)
    num = tl.sum(w[:, None] * acc, 0)
    den = tl.sum(w * l, 0)
    out = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(O + row * D + d, out.to(O.dtype.element_ty))
    if TRACE:
        _trace_store(TRB + (row * (D // BLK) + tl.program_id(1)).to(tl.int64) * 8, tr0, tr1, tr1, _trace_now())


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------
def _side_args(bufs: dict, side: str, q, geo, cfg):
    """Pointers and constants of one side (K or V) of a layer's store, by buffer name; the pointers' dict also says
    whether the side's groups are hybrid ("hybrid": their choice is the sign of `half`, `store.signed_half`)."""
    from kvq_compile.config import Axis, Symmetry

    g = lambda n: bufs.get(f"{side}.{n}")  # noqa: E731
    if not q.quantized:
        data = g("data")
        ptrs = dict(codes=data, cen=data, half=data, oval=data, oidx=data, lev=data, norm=data,
                    data=data, sink=data, ring=data, hybrid=False)
        return ptrs, dict(BITS=16, AXIS=0, GS=1, NG=1, SYM=1, LUT=False, NOUT=0, NORM=False, TPG=1, WR=0)
    half = g("half")
    pick = lambda n: g(n) if g(n) is not None else half  # noqa: E731  absent buffers are never read
    ptrs = {k: pick(n) for k, n in (("codes", "codes"), ("cen", "center"), ("half", "half"),
                                    ("oval", "out_val"), ("oidx", "out_idx"), ("lev", "levels"),
                                    ("norm", "norm"), ("data", "half"), ("sink", "sink"), ("ring", "ring"))}
    ptrs["hybrid"] = q.symmetry is Symmetry.HYBRID
    if g("codes") is None:
        raise ValueError(f"kvq decode attention: the {side} codes are missing from the store tensors")
    if q.axis is Axis.TOKEN:
        axis, gs = 0, q.group_size or geo.head_dim
    else:
        axis, gs = 1, q.group_size or 0
    consts = dict(BITS=q.bits, AXIS=axis, GS=gs, NG=half.shape[2] if axis == 1 and gs else 1,
                  SYM={Symmetry.ASYMMETRIC: 0, Symmetry.SYMMETRIC: 1, Symmetry.HYBRID: 2}[q.symmetry],
                  LUT=g("levels") is not None, NOUT=g("out_val").shape[-1] if g("out_val") is not None else 0,
                  NORM=g("norm") is not None, TPG=q.tokens_per_group, WR=g("ring").shape[2] if g("ring") is not None else 0)
    return ptrs, consts


def side_constants(kc: dict, vc: dict) -> dict:
    """The kernels' per-side constants (BITS_K .. WR_K, BITS_V .. WR_V) from the two `_side_args` results."""
    names = ("BITS", "AXIS", "GS", "SYM", "LUT", "NOUT", "NORM", "TPG", "WR")
    return {f"{n}_K": kc[n] for n in names} | {f"{n}_V": vc[n] for n in names if n != "NORM"}


def side_pointers(p: dict, key: bool) -> tuple:
    """The kernels' per-side buffer arguments, in their order (Keys also pass the InnerQ norm)."""
    names = ("codes", "cen", "half", "oval", "oidx", "lev") + (("norm",) if key else ()) + (
        "data", "sink", "ring")
    return tuple(p[n] for n in names)


def _program_args(kp: dict, vp: dict, key, value, cos, sin, positions, amask, smb: int, smh: int, temp, partials,
                  scale: float, T: int, kc: dict, vc: dict, nsplit: int) -> tuple:
    """`_decode_program`'s arguments from KC to NSPLIT, in order: what `_decode_kernel` and `_fused_decode` pass on
    (partials: the (max, sum, acc) slot buffers)."""
    return (*side_pointers(kp, True), key, key.stride(0), key.stride(1),
            *side_pointers(vp, False), value, value.stride(0), value.stride(1),
            cos, sin, positions, amask, smb, smh, temp, *partials, float(scale), T, kc["NG"], vc["NG"], nsplit)


def _program_consts(cfg, kc: dict, vc: dict, H: int, rep: int, rep_pad: int, D: int, rope: bool, mask_kind: int,
                    smh: int, is_causal: bool, phase: int, block_t: int, post_scaling: bool, ieee: bool,
                    nwin: int) -> dict:
    """`_decode_program`'s constexprs (but WINDOW and PDL) for one launch."""
    return dict(H=H, REP=rep, REP_PAD=rep_pad, D=D, S=cfg.sink, R=cfg.recent, **side_constants(kc, vc),
                ROPE=rope, MASK_KIND=mask_kind, MASK_SHARED=smh == 0, IS_CAUSAL=is_causal, TAU_PHASE=phase,
                KPOST=_post_mode(kc, block_t, D) if (post_scaling and not rope) else 0,
                VPOST=_post_mode(vc, block_t, D) if post_scaling else 0,
                BLOCK_T=block_t, IEEE=ieee, INTERP=_INTERPRET, NWIN=nwin)


def _post_mode(c: dict, block_t: int, head_dim: int) -> int:
    """1: per-channel statistics constant over each tile; 2: one statistic per token; 0: dequantize per element
    (hybrid groups, outliers, several groups per token, or channel groups a tile straddles). A batched dot over
    several Value groups per token was 1.4-1.7x slower than per-element dequantization for kivi-2 / kivi-4 on an
    H100 (bench/RESULTS.md, session 7), so those dequantize per element."""
    if c["BITS"] == 16 or c["SYM"] == 2 or c["NOUT"]:
        return 0
    if c["AXIS"] == 1 and (c["GS"] == 0 or c["GS"] % block_t == 0):
        return 1
    if c["AXIS"] == 0 and c["GS"] == head_dim:
        return 2
    return 0


def default_block_t(kc: dict, vc: dict, rope: bool) -> int:
    """Tokens per tile when the caller names none: 32 where a side dequantizes element by element through a
    codebook, hybrid levels or outliers, or keys are rotated after dequantization (64-token tiles need more than
    255 registers there and spill: kvquant-4 and innerq-2 on an H100, bench/RESULTS.md), else 64."""
    return 32 if _per_element(kc, vc, rope) else 64


def _per_element(kc: dict, vc: dict, rope: bool) -> bool:
    """Whether a side dequantizes element by element (codebook, hybrid levels, outliers, RoPE after
    dequantization) rather than through unpacked codes alone."""
    return rope or any(c["BITS"] != 16 and (c["LUT"] or c["SYM"] == 2 or c["NOUT"]) for c in (kc, vc))


def layout_block_t(cfg, spec, names) -> int:
    """`default_block_t` of a layer from its spec and its store's buffer names (no tensors: what the lowering
    sees)."""
    return 32 if layout_per_element(cfg, spec, names) else 64


def layout_per_element(cfg, spec, names) -> bool:
    """`_per_element` of a layer from its spec and its store's buffer names."""
    from kvq_compile.config import Symmetry

    def consts(side, q):
        if not q.quantized:
            return dict(BITS=16, LUT=False, SYM=1, NOUT=0)
        return dict(BITS=q.bits, LUT=f"{side}.levels" in names, SYM=2 if q.symmetry is Symmetry.HYBRID else 0,
                    NOUT=int(f"{side}.out_val" in names))

    return _per_element(consts("k", spec.key), consts("v", spec.value), cfg.keys_before_rope and spec.key.quantized)


def _window_tiles(cfg, kc: dict, vc: dict, block_t: int) -> int:
    """Programs of the window launch, one tile each: the sink's tiles plus the most tiles
    [min(max(S, Q(L)), L - 1), L) can span (1 <= L - max(S, Q(L)) <= R + TPG - 1 for a quantized side when L > S;
    for L <= S, cdiv(L - 1, BT) + 1 tiles in all). One program per KV head walking them in turn took 23-26 us
    whatever the batch (kivi-2 on an H100, bench/RESULTS.md, session 9)."""
    quantized = [c["TPG"] for c in (kc, vc) if c["BITS"] != 16]
    if not quantized:
        return 1  # the chunk alone
    return -(-cfg.sink // block_t) + -(-max(1, cfg.recent + max(quantized) - 1) // block_t)


COMBINE_WARPS = None    # warps of each program of the final reduction (None: `_combine_warps`; bench/check_gluon.py
                        # --sweep flips it)
PDL = None              # programmatic dependent launch of the window launch and the final reduction (each may start
                        # before the launch ahead of it ends; the window launch's last program waits for the
                        # quantized region's before it ends, the reduction for the window's before it reads; with
                        # calibquant's windows inside its Gluon launches, its attention pass waits for the range
                        # pass before it reads and the reduction for the attention pass): None = on sm_90+, False off
WINDOW_ONE_WAIT = True  # under PDL, only the window launch's last program waits for the quantized region's launch
                        # (its programs that end early free their slots instead of holding them; False: every
                        # program waits, sessions 13-35). H200, session 36: 1.7-7.1% faster at (32, 4096) (kivi-2 48.6
                        # against 51.4 us, 1243 of kivi-4's 1280 window programs beside the Gluon launch, not 391)
APPEND_BESIDE = True    # a step's append given to `decode_attention` (`append`) goes out after the window launch, as
                        # its programmatic dependent, where the attention reads nothing it writes: its programs run
                        # beside the attention's instead of ahead of them (False: first, on its own)
WINDOW_TRIGGER = None   # whether the window launch lets the final reduction launch early (None: `_window_triggers`'s
                        # rule; True / False: always / never, for A/Bs)
POISON = False          # partial-result buffers filled with NaN before each call (a check that nothing reads a slot
                        # before it is written: bench/check_gluon.py --pdl, tests/test_templates.py on a GPU)
TRACE: dict | None = None  # debug (bench/debug/timeline.py): {"main", "window", "combine"} int64 CUDA buffers of 8
                           # per program, where the KIVI-layout Gluon launch, the window launch and the final
                           # reduction write their timer records (`_trace_store`); None: no records, the kernels build
                           # as without them
LAST_KERNELS: dict = {}  # the last launch's compiled kernels (registers, spills) and slices per KV head: see bench/


def _combine_warps(ns: int) -> int:
    """Warps of each program of the final reduction, which merges `ns` slots a row: COMBINE_WARPS where set, else 2
    for at most 16 slots, 4 for more. On an H100 (bench/RESULTS.md, session 34, calls 7-8), 2 warps against 4 at
    batch 32 (8-12 slots): 0.5-3.5% faster at (32, 4096) and (32, 16384) for six presets (kivi-4 at (32, 4096) 75.4
    against 76.9 us), within 0.3% at (32, 65536) but innerq-2 (4.1% faster); at (1, 65536) (137 slots) 2 were slower
    (kivi-4 42.2 against 39.6 us). On an H200 (session 35, call 6) 1.4-1.8 us faster at (32, 4096) for six presets,
    0.5-1.4% at (32, 16384), within run-to-run noise at (32, 65536)."""
    return COMBINE_WARPS or (2 if ns <= 16 else 4)


COMBINE_BLOCKS = None   # channel blocks per row of the final reduction (None: `_combine_blocks`'s rule; 0 or 1:
                        # none; else rounded down to a power of two)


def _combine_blocks(rows: int, D: int, device) -> int:
    """Channels per program of the final reduction (`_combine_kernel` DB; 0: a row's D in one program): where its
    `rows` programs would not fill the SMs once (batch 1: 32 rows on 132 SMs, each merging over a hundred slots of
    128 channels), each row's channels in 4 blocks (`COMBINE_BLOCKS` overrides the count). The count is a power of
    two (so that it divides D, a power of two) and leaves at least 16 channels a block.
    On an H100 (bench/RESULTS.md, session 35, call 8) against one program a row at (1, 65536) and (1, 16384): 0-5.7%
    faster for seven presets (int8 63.7 against 67.0 us, innerq-2 38.0 against 40.3 at (1, 65536)), but kivi-4 at
    (1, 16384) (13.6 against 13.5); 2 and 8 blocks within 0.4 us of 4. Batch 2-4 (64-128 rows, also split) was not
    measured."""
    import torch

    blocks = COMBINE_BLOCKS
    if blocks is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        blocks = 4 if rows < sms else 1
    blocks = max(1, min(blocks, D // 16))
    blocks = 1 << (blocks.bit_length() - 1)   # a power of two: it divides D
    return D // blocks if blocks > 1 else 0


def _trace_buffer(name: str, programs: int):
    """The debug record buffer `TRACE[name]` for a launch of `programs` programs (8 int64 each), or None without
    TRACE; ValueError where it is too small (the kernels write past no buffer)."""
    if not TRACE:
        return None
    buf = TRACE[name]
    if buf.numel() < 8 * programs:
        raise ValueError(f"decode_attention.TRACE[{name!r}] holds {buf.numel() // 8} records; the launch has "
                         f"{programs} programs")
    return buf


def _window_triggers(programs: int, device, kivi_programs: int | None = None) -> bool:
    """Whether the window launch (`programs` programs) lets the final reduction launch early (PDL): when all its
    programs start at once on their own SMs, or when KIVI's layout's Gluon launch (`kivi_programs` programs; None:
    another launch) holds at most KIVI_FILL_PER_SM a SM (`_fill_cap`'s short slices), the reduction's programs wait
    beside them (`gdc_wait`) instead of being launched after the window ends. WINDOW_TRIGGER overrides.
    Measured on an H100 (bench/RESULTS.md, session 17, the trigger in every window launch, every program of it
    waiting, CUDA-graph timed): at batch 1 (8-40 window programs) 3-11% faster for kivi-2, kivi-4, kvquant-4 and
    int8; within +-1.5% at batch 8 (64-320); up to 4% slower at batch 32 (256-1280), where the early reduction
    competed with the window's programs for the SMs' slots. With only the window's last program waiting
    (`WINDOW_ONE_WAIT`), on an H200 (session 36, call 2, two rounds): at (8, 16384) and (32, 4096), where KIVI's
    launch holds 8 a SM, 0.2-1.1 us faster for kivi-4, kivi-2 and xquant-1.38 (kivi-4 at (32, 4096) 58.0 against
    59.1 us), 0.2-0.8 us slower for innerq-2; at (32, 16384) and (8, 65536) (12 a SM) int8 0.7-9.7 us slower."""
    import torch

    if WINDOW_TRIGGER is not None:
        return bool(WINDOW_TRIGGER)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return programs <= sms or (kivi_programs is not None and kivi_programs <= KIVI_FILL_PER_SM * sms)


def _use_pdl(query) -> bool:
    """Whether the window launch and the final reduction go out as programmatic dependent launches (`PDL`): an
    NVIDIA GPU of compute capability 9.0 or more (`griddepcontrol` is sm_90 PTX), whatever PDL says."""
    import torch

    if (PDL is not None and not PDL) or _INTERPRET or not query.is_cuda or torch.version.hip is not None \
            or gdc_wait is None:
        return False
    return torch.cuda.get_device_capability(query.device) >= (9, 0)


def _num_splits(bh: int, max_len: int, block_t: int, device, programs_per_sm: int = 16) -> int:
    """About 16 programs per SM in all (each program streams its slice tile by tile with little memory in
    flight, so the GPU needs many of them), never slices shorter than two tiles. On an H200 the best split
    counts of a sweep (bench/RESULTS.md) put 1000-2100 programs in flight at every batch size."""
    import torch

    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(-(-programs_per_sm * sms // bh), max_len // (2 * block_t), 1024))


def _fill_splits(bh: int, max_len: int, device, resident: int) -> int:
    """Slices per KV head for the Gluon launch: as many programs as the SMs hold at once (`resident` each;
    `_gluon_splits` passes its cap as `resident` where the cap is lower), in one wave, never slices shorter than 128
    tokens (four 32-token tiles, eight of kvquant's 16-token ones). Its one-warp programs each keep one tile in
    flight, so the more of them the better, up to a second wave: with 5 slices at
    batch 32 (1280 programs, 12 fit per SM) Nsight Compute showed 0.8 waves, 2.4 warps per scheduler and an
    instruction issued on 59% of cycles. At batch 1-4 slices of
    four tiles beat two by 0-12% (bench/RESULTS.md, session 11)."""
    import torch

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(resident * sms // bh, max_len // (4 * dag.BT), 1024))


FILL_PER_SM = None   # programs per SM the Gluon launch's slices fill at most, every layout (None: `_fill_cap`'s rule).
# For A/Bs: `bench_decode_attention.py --variants 'default;FILL_PER_SM=99'` (99: the old fill, as many as fit)
KIVI_FILL_PER_SM = 8     # `_fill_cap` of KIVI's layout where the fill's slices are short
SHORT_SLICE = 1024       # tokens: a slice shorter than this is short (fewer than 32 tiles)


def _fill_cap(kind: str | None, max_len: int, fill_slices: int) -> int | None:
    """The most programs per SM the Gluon launch's slices fill (None: as many as fit): FILL_PER_SM where set, else
    KIVI_FILL_PER_SM (8) for KIVI's layout (any bits) where the fill (`fill_slices` slices per KV head) would cut
    the max_len tokens into slices shorter than SHORT_SLICE: fewer, longer slices then pay each program's fixed
    costs (its prologue, q . z refills, partial results) over more tiles.
    Measured (bench/RESULTS.md, session 34; fills of 12 and 8 per SM): at (1, 65536), (8, 16384) and (32, 4096),
    where the fill's slices are 331-683 tokens, 8 was faster for kivi-2 and kivi-4 on an H100 (1.1-8.0%) and an
    H200 (1.3-6.3%), and for xquant's 1-bit layers on an H100 (0.9-11%). At (8, 65536), (32, 16384) and
    (32, 65536) (2731-10923-token slices) it was 2.1-3.6% faster for kivi-2 and kivi-4 on the H100 but up to 11%
    slower on the H200 (kivi-2 at (32, 65536); a guess, not profiled: its higher bandwidth needs more loads in
    flight), and 5.9-7.5% slower for 1-bit layers on the H100. Why, at batch 1 (session 35,
    `bench/debug/timeline.py`): the window launch's 4-warp programs (96 registers, offline:
    `bench/debug/window_regs.py`) fit beside 8 KIVI programs a SM, and run there from the start; beside 12 they do
    not, and start only as the KIVI programs end. (kivi-2 at 10, with room for one, was slower than 12 in session 34:
    not traced.) The other layouts were slower with 8 at
    almost every one of these shapes (int8, kvquant-4, innerq-2, calibquant-1 on the H100: up to 38%)."""
    if FILL_PER_SM:
        return FILL_PER_SM
    return KIVI_FILL_PER_SM if kind == "kivi" and max_len < SHORT_SLICE * fill_slices else None


def _gluon_splits(kind: str | None, bh: int, max_len: int, device, resident: int) -> int:
    """Slices per KV head for the Gluon launch of a `kind` layout (`dag.layout_kind`) whose SMs hold `resident`
    programs each: `_fill_splits` of them, or of `_fill_cap`'s cap where it is lower."""
    fill = _fill_splits(bh, max_len, device, resident)
    cap = _fill_cap(kind, max_len, fill)
    return _fill_splits(bh, max_len, device, cap) if cap and cap < resident else fill


FUSED_WINDOW_TILE = 16   # tokens per window tile of `_fused_decode` (32 over outliers on a GPU: see decode_attention)
FUSED_MAX_SPLITS = 64    # slices per KV head of `_fused_decode` at most: its last program merges them one by one
                         # (kivi-2 at (1, 65536) on an H200: 264 slices 203 us, 66 slices 154 us, the three
                         # launches 108 us; at (8, 16384) 33 slices beat 8)


def fused_splits(bh: int, max_len: int, block_t: int, device, programs_per_sm: int = 16) -> int:
    """`_fused_decode`'s slices per KV head: `_num_splits`, at most FUSED_MAX_SPLITS."""
    return min(_num_splits(bh, max_len, block_t, device, programs_per_sm), FUSED_MAX_SPLITS)


def _min_tile(kc: dict, vc: dict, gpu: bool) -> int:
    """The shortest tile a layout may take: 16-token tiles over outliers compute wrong results on an H100 with
    triton 3.6 (relative error 0.13-1.8 for kvquant-4-1%, in both launches; right under the interpreter):
    bench/RESULTS.md, session 12. So 32 tokens there on a GPU."""
    return 32 if gpu and (kc["NOUT"] or vc["NOUT"]) else 1


def _check_tile(block_t: int, kc: dict, vc: dict, gpu: bool) -> None:
    """Raises where `block_t` is shorter than `_min_tile`."""
    if block_t < _min_tile(kc, vc, gpu):
        raise ValueError(f"kvq decode attention: block_t={block_t} with outliers is not supported on the GPU "
                         "(use 32 or more)")


def _output(out, query):
    """`out` checked as the call's output (a contiguous tensor like the query), or a new one."""
    import torch

    if out is None:
        return torch.empty_like(query, memory_format=torch.contiguous_format)
    if tuple(out.shape) != tuple(query.shape) or out.dtype != query.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {query.dtype} tensor of shape {tuple(query.shape)}, got "
                         f"{out.dtype} {tuple(out.shape)} with strides {out.stride()}")
    return out


def _mask_args(attn_mask, query) -> tuple:
    """(MASK_KIND, mask tensor, batch stride, head stride) of an attention mask for the kernels (the query stands
    in for an absent one); strides are 0 along broadcast dims. Raises on a mask that does not broadcast as
    [B|1, Hq|1, 1, >= L]."""
    import torch

    B, Hq = query.shape[:2]
    if attn_mask is None:
        return 0, query, 0, 0
    amask = attn_mask if attn_mask.stride(-1) == 1 else attn_mask.contiguous()
    while amask.dim() < 4:
        amask = amask.unsqueeze(0)
    if amask.dim() > 4 or amask.shape[0] not in (1, B) or amask.shape[1] not in (1, Hq) or amask.shape[2] != 1:
        raise ValueError(f"attn_mask must broadcast as [B|1, Hq|1, 1, >= L] = [{B}|1, {Hq}|1, 1, >= L] for a "
                         f"decode step, got shape {tuple(attn_mask.shape)}")
    return (1 if amask.dtype == torch.bool else 2, amask, amask.stride(0) if amask.shape[0] > 1 else 0,
            amask.stride(1) if amask.shape[1] > 1 else 0)


def fused_plan(query, bufs: dict, key, value, positions, attn_mask, scale: float, is_causal: bool, cfg, spec, geo,
               alloc, block_t: int | None = None, num_splits: int | None = None, programs_per_sm: int = 16,
               post_scaling: bool = True) -> dict:
    """The arguments of `_fused_decode` (one launch for a whole call, no Gluon) for one decode step: `args` (its
    positional arguments after q, in order), `consts` (its constexprs), `grid`, `nsplit`, `nwin`. Its scratch
    buffers come from alloc(kind, numel) for kind "m", "l", "acc" (float32) and "cnt" (int32, zero). Tensors may
    be on the meta device (the Inductor lowering maps them back to its buffers by identity), except that the split
    count then needs num_splits. Raises ValueError where one launch cannot serve the layer (calibrated softmax)."""
    import torch

    B, Hq, n, D = query.shape
    H = key.shape[1]
    if n != 1 or Hq % H:
        raise ValueError(f"fused decode attention takes one query token per sequence and Hq % H == 0, got "
                         f"query {tuple(query.shape)} and {H} KV heads")
    if cfg.softmax_tau is not None:
        raise ValueError("fused decode attention: a calibrated softmax (softmax_tau) needs its range pass first")
    rep = Hq // H
    rep_pad = max(16, triton.next_power_of_2(rep))
    kp, kc = _side_args(bufs, "k", spec.key, geo, cfg)
    vp, vc = _side_args(bufs, "v", spec.value, geo, cfg)
    rope = cfg.keys_before_rope and spec.key.quantized
    if block_t is None:
        block_t = default_block_t(kc, vc, rope)
    _check_tile(block_t, kc, vc, query.device.type != "cpu")
    mask_kind, amask, smb, smh = _mask_args(attn_mask, query)
    wblock_t = max(FUSED_WINDOW_TILE, _min_tile(kc, vc, query.device.type != "cpu"))
    nwin = _window_tiles(cfg, kc, vc, wblock_t)
    nsplit = num_splits or fused_splits(B * H, geo.max_len, block_t, query.device, programs_per_sm)
    slots = B * H * rep_pad * (nsplit + nwin)
    bufs_out = [alloc("m", slots), alloc("l", slots), alloc("acc", slots * D)]
    args = (*_program_args(kp, vp, key, value, bufs["rope.cos"] if rope else query,
                           bufs["rope.sin"] if rope else query, positions, amask, smb, smh, query, bufs_out, scale,
                           geo.rows, kc, vc, nsplit), alloc("cnt", B * H))
    consts = dict(**_program_consts(cfg, kc, vc, H, rep, rep_pad, D, rope, mask_kind, smh, is_causal, 0, block_t,
                                    post_scaling, query.dtype == torch.float32, nwin), WBLOCK_T=wblock_t)
    return dict(args=args, consts=consts, grid=(B * H, nsplit + nwin), nsplit=nsplit, nwin=nwin)


def _fused_launch(query, bufs, key, value, positions, attn_mask, scale, is_causal, cfg, spec, geo, block_t,
                  num_splits, num_warps, num_stages, post_scaling, programs_per_sm, out):
    """`decode_attention(fused=True)`: `fused_plan` launched as `_fused_decode_kernel`."""
    import torch

    if query.stride(-1) != 1:
        query = query.contiguous()
    key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (key, value))

    def alloc(kind, n):
        if kind == "cnt":
            return torch.zeros(n, dtype=torch.int32, device=query.device)
        if POISON:
            return torch.full((n,), float("nan"), dtype=torch.float32, device=query.device)
        return torch.empty(n, dtype=torch.float32, device=query.device)

    plan = fused_plan(query, bufs, key, value, positions, attn_mask, scale, is_causal, cfg, spec, geo, alloc,
                      block_t, num_splits, programs_per_sm, post_scaling)
    out = _output(out, query)
    LAST_KERNELS["splits"] = plan["nsplit"]
    LAST_KERNELS["main"] = _fused_decode_kernel[plan["grid"]](query, query.stride(0), query.stride(1), out,
                                                              *plan["args"], **plan["consts"], num_warps=num_warps,
                                                              num_stages=num_stages)
    LAST_KERNELS["window"] = None
    return out


def decode_attention(query, bufs: dict, key, value, positions, attn_mask, scale: float, is_causal: bool,
                     cfg, spec, geo, block_t: int | None = None, num_splits: int | None = None,
                     num_warps: int = 4, num_stages: int = 2, post_scaling: bool = True,
                     programs_per_sm: int = 16, out=None, gluon: bool | None = None, window_warps: int = 4,
                     fused: bool = False, append=None):
    """kvq::attend for one query token per sequence (decode), entirely on the device.

    query [B, Hq, 1, D]; bufs: the layer's attend tensors by name (store.LayerStore.attend_tensors);
    key/value [B, H, 1, D]: the chunk just appended at positions[0]; attn_mask [B|1, Hq|1, 1, >= L] or None.
    Launch configuration (what `kvq_compile.lowering` tunes under max_autotune): block_t tokens per tile (None: the
    layout's `default_block_t`), num_warps and
    num_stages of the main launch, programs_per_sm for the split count (or num_splits outright).
    out: a contiguous [B, Hq, 1, D] tensor to write into (else a new one).
    gluon: run the quantized region through `decode_attention_gluon` where it supports the layout (None: unless
    KVQ_GLUON=0; False: never; True: required, ValueError where unsupported). That launch has its own fixed
    configuration (one warp, 32-token tiles (`KIVI_BT`; 16 for kvquant's and int8's), as many slices as fill the
    SMs once, fewer for KIVI's layout where those slices are short: `_gluon_splits`): block_t, num_warps and
    num_stages then apply to the window launch only (block_t; for calibquant, whose Gluon launches attend the
    windows too, to nothing) or not at all, programs_per_sm not at all; block_t None then means 32 (faster than 64
    by 2-7% on an H100, session 10).
    window_warps: warps of each window-launch program.
    fused: the whole call in one Triton launch (`_fused_decode_kernel`: the quantized region's slices and the
    window tiles in one grid, the last program of each KV head merges): what the Inductor template of
    `kvq_compile.lowering` runs; no Gluon, no calibrated softmax (ValueError).
    append: this step's append, as a function that launches it (`quantize_append.append_decode` with its arguments
    bound) and takes the keywords chain and trigger. Where the attention reads nothing the append writes
    (`store.attention_independent`), PDL applies, the softmax is plain and the windows take a launch of their own,
    it goes out after the window launch as its programmatic dependent (`APPEND_BESIDE`): its programs run beside the
    attention's, and the final reduction waits for it; elsewhere it is launched first, on its own."""
    import torch

    if fused:
        if append is not None:
            append(chain=False, trigger=False)
        return _fused_launch(query, bufs, key, value, positions, attn_mask, scale, is_causal, cfg, spec, geo,
                             block_t, num_splits, num_warps, num_stages, post_scaling, programs_per_sm, out)

    B, Hq, n, D = query.shape
    H = key.shape[1]
    if n != 1:
        raise ValueError("decode_attention takes one query token per sequence; use the reference path for chunks")
    if Hq % H:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {H}")
    rep = Hq // H
    rep_pad = max(16, triton.next_power_of_2(rep))
    T = geo.rows   # the buffers' rows (`Geometry.rows`)
    if query.stride(-1) != 1:
        query = query.contiguous()
    key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (key, value))
    kp, kc = _side_args(bufs, "k", spec.key, geo, cfg)
    vp, vc = _side_args(bufs, "v", spec.value, geo, cfg)
    rope = cfg.keys_before_rope and spec.key.quantized
    cos = bufs["rope.cos"] if rope else query
    sin = bufs["rope.sin"] if rope else query
    mask_kind, amask, smb, smh = _mask_args(attn_mask, query)
    use_gluon = dag.enabled() if gluon is None else gluon
    if use_gluon:
        why = dag.supports(query, rep, kc, vc, kp, rope, mask_kind, smh == 0, is_causal, cfg.softmax_tau)
        if gluon and why:
            raise ValueError(f"kvq decode attention: the Gluon kernel cannot serve this layer: {why}")
        use_gluon = why is None
    # with the Gluon launch, block_t is the window launch's tile only
    block_t = block_t or (32 if use_gluon else default_block_t(kc, vc, rope))
    _check_tile(block_t, kc, vc, query.is_cuda)
    kind = dag.layout_kind(kc, vc, D) if use_gluon else None
    # calibquant's Gluon launch attends the exact windows itself, into the window launch's slots (then not launched)
    win_in = use_gluon and dag.window_inside(kind, kc, vc, cfg.softmax_tau)
    nwin = _window_tiles(cfg, kc, vc, dag.BT if win_in else block_t)
    pdl = _use_pdl(query)   # the window launch and the final reduction start early (sm_90+)
    early = dict(launch_pdl=True) if pdl else {}
    # the layer as both `dag.resident_programs` and `dag.launch` take it
    gluon_layer = dict(positions=positions, amask=amask, smb=smb, mask_kind=mask_kind, T=T, nwin=nwin,
                       ng_k=vc["NG"] if kind == "inner" else kc["NG"],   # the token-grouped side's statistics rows
                       H=H, rep=rep, sink=cfg.sink, recent=cfg.recent, tpg_v=vc["TPG"], kbits=kc["BITS"],
                       vbits=vc["BITS"], kind=kind, rope=(cos, sin) if rope else None, nout=(kc["NOUT"], vc["NOUT"]),
                       pdl=pdl, exact=dict(k=dict(sink=kp["sink"], ring=kp["ring"], chunk=key),
                                           v=dict(sink=vp["sink"], ring=vp["ring"], chunk=value)) if win_in else None)

    def splits(phase):  # slices per KV head of the quantized-region launch in this softmax phase
        if num_splits:
            return num_splits
        if use_gluon:  # the calibrated softmax's phases differ in registers, hence in programs per SM
            return _gluon_splits(kind, B * H, T, query.device,
                                 dag.resident_programs(query, kp, vp, phase=phase, **gluon_layer))
        return _num_splits(B * H, T, block_t, query.device, programs_per_sm)

    def new_buffer(n):  # fp32 scratch of n elements (NaN-filled under POISON)
        if POISON:
            return torch.full((n,), float("nan"), dtype=torch.float32, device=query.device)
        return torch.empty(n, dtype=torch.float32, device=query.device)

    def partials(nsplit, with_acc=True):  # (max, sum, acc) buffers: nsplit + nwin slots per row
        m = new_buffer(B * H * rep_pad * (nsplit + nwin))
        return m, new_buffer(m.numel()), (new_buffer(m.numel() * D) if with_acc else m)

    nsplit = splits(0 if cfg.softmax_tau is None else 2)
    ns = nsplit + nwin
    # the final reduction launches early where the SMs hold its programs beside the others (`_window_triggers`)
    trigger = pdl and _window_triggers(B * H * nwin, query.device,
                                       B * H * nsplit if use_gluon and kind == "kivi" else None)
    beside = (append is not None and APPEND_BESIDE and pdl and not win_in and cfg.softmax_tau is None
              and st.attention_independent(cfg))
    if append is not None and not beside:
        append(chain=False, trigger=False)
    LAST_KERNELS["splits"] = nsplit
    m_buf, l_buf, acc_buf = partials(nsplit)
    out = _output(out, query)
    ieee = query.dtype == torch.float32

    def launch(phase, temp, nsplit, m_buf, l_buf, acc_buf, logits=None, ranges=None):
        args = (query, query.stride(0), query.stride(1),
                *_program_args(kp, vp, key, value, cos, sin, positions, amask, smb, smh, temp,
                               (m_buf, l_buf, acc_buf), scale, T, kc, vc, nsplit))
        consts = dict(**_program_consts(cfg, kc, vc, H, rep, rep_pad, D, rope, mask_kind, smh, is_causal, phase,
                                        block_t, post_scaling, ieee, nwin), PDL=pdl)
        if use_gluon:
            LAST_KERNELS["main"] = dag.launch(query, kp, vp, m_buf=m_buf, l_buf=l_buf, acc_buf=acc_buf, scale=scale,
                                              nsplit=nsplit, phase=phase, temp=temp if phase == 2 else None,
                                              logits=logits, ranges=ranges, **gluon_layer,
                                              trace=_trace_buffer("main", B * H * nsplit))
        else:
            LAST_KERNELS["main"] = _decode_kernel[(B * H, nsplit)](*args, **consts, WINDOW=False,
                                                                   num_warps=num_warps, num_stages=num_stages)
        LAST_KERNELS["window_grid"] = None if win_in else (B * H, nwin)
        LAST_KERNELS["window"] = None if win_in else _decode_kernel[(B * H, nwin)](
            *args, **consts, WINDOW=True, num_warps=window_warps, num_stages=1, TRIGGER=trigger or beside,
            ONE_WAIT=bool(pdl and WINDOW_ONE_WAIT), **early,
            **(dict(TRB=_trace_buffer("window", B * H * nwin), TRACE=True) if TRACE else {}))

    if cfg.softmax_tau is not None:
        n1 = splits(1)   # the range pass: its own slices (and buffers of max and min, no acc)
        m1, l1, _ = partials(n1, with_acc=False)
        # the Gluon kernel's range pass keeps its logits for the attention pass (fp32 [B * H, T, rep]: 4 rep bytes a
        # token and KV head, as many as the 1-bit Keys' 16 at rep 4), which then reads no Keys
        logits = new_buffer(B * H * T * rep) if use_gluon else None
        launch(1, query, n1, m1, l1, acc_buf, logits)
        if win_in:  # the attention pass turns the ranges into temperatures itself (no temperature launch)
            launch(2, None, nsplit, m_buf, l_buf, acc_buf, logits, ranges=(m1, l1, n1 + nwin,
                                                                             float(sum(cfg.softmax_tau))))
        else:
            temp = torch.empty(B * Hq, dtype=torch.float32, device=query.device)
            _temperature_kernel[(B * Hq,)](m1, l1, temp, float(sum(cfg.softmax_tau)), REP=rep, REP_PAD=rep_pad,
                                           NS=n1 + nwin, NS_PAD=triton.next_power_of_2(n1 + nwin))
            launch(2, temp, nsplit, m_buf, l_buf, acc_buf, logits)
    else:
        launch(0, query, nsplit, m_buf, l_buf, acc_buf)
        if beside:  # beside the attention's launches; the final reduction waits for its end, hence theirs
            append(chain=True, trigger=trigger)
    db = _combine_blocks(B * Hq, D, query.device)
    grid = LAST_KERNELS["combine_grid"] = (B * Hq, D // db if db else 1)
    _combine_kernel[grid](
        m_buf, l_buf, acc_buf, out, H=H, REP=rep, REP_PAD=rep_pad, D=D, NS=ns, DB=db, num_warps=_combine_warps(ns),
        NS_PAD=triton.next_power_of_2(ns), PDL=pdl, **early,
        **(dict(TRB=_trace_buffer("combine", grid[0] * grid[1]), TRACE=True) if TRACE else {}))
    return out
