"""Quantize-on-append of one decode token per sequence, in Triton: K and V of a layer in one launch.

The same writes as `kvq_compile.store.append_decode` (the reference this is tested against), per
(sequence b, KV head h, side K|V; a side whose groups span tokens also per chunk of channels: `_chunks`), with the
token x = chunk[b, h, 0] at device position p0 and the side's fill boundary Q(L) = S + floor(max(0, L - S - R) / G) * G:

    unquantized side:  data[p0] = x
    p0 == 0:           norm = sqrt(max_t |x|) (InnerQ Keys); static per-channel ranges from x / norm:
                       c = (max + min) / 2 (0 symmetric), h = (max - min) / 2 (max |x| symmetric),
                       h *= (1 - 2 eta) * range_scale          (rounded to the cache dtype)
    flush = C(p0 + 1) > C(p0), C the code boundary (`store.code_boundary`: S + floor(max(0, L - S - RC) / G) * G,
                       RC 0 (EAGER_GROUPS: the group that p0 completes) or R (the group that leaves the window);
                       EAGER: single-token groups, x itself): the group of G tokens at [C(p0), C(p0) + G) (the
                       ring's slots, x at p0) is quantized, x_g = tokens.to(dtype) / norm:
        outliers       per token, the NOUT channels farthest from their range's center in units of its
                       half-width (static range (c, h): |x - c| / h; else the group's full range [mn, mx]:
                       max(x - mn, mx - x) / (mx - mn), its max and min exactly 1), kept exact; ties to the
                       larger |x|, then the lower channel, NaN scores first (the reference's stable sorts)
        range          per group over the other members: asymmetric (c, h) = ((max + min) / 2, (max - min) / 2),
                       symmetric (0, max |x|); h *= 1 - 2 eta; both rounded to the cache dtype
        hybrid         symmetric B-bit vs asymmetric (B-1)-bit by the group's L1 error, symmetric only when
                       lower by more than float rounding (err_s < err_a * (1 - 1e-5)), else asymmetric; the
                       choice is stored as the sign of h (negative: symmetric; `store.signed_half`)
        code           uniform: round_half_even((clamp((x - c) / h, -1, 1) + 1) * (n - 1) / 2), n levels
                       (reference.level_count), each product rounded before the next add (the kernel is compiled
                       without multiply-add fusion, LAUNCH_OPTIONS); codebook: #{midpoints between levels < (x - c) / h}
        packed         word w of a token holds channels w * CPW + j at bit offset j * BITS
    sink:              p0 < S: sink[p0] = x
    ring:              p0 in the recent window (Q(p0 + 1) <= p0): ring[p0 % WR] = x; where RC > 0, after the
                       group's ring slots were read (a CTA barrier between the read and the write: the group's first
                       slot is p0's). With RC 0 the group's slots are those of [p0 - G + 1, p0): not p0's where R >= 1
                       (WR = R + G - 1); where R = 0 the first one is, but a step that completes a group leaves p0
                       out of the ring (Q(p0 + 1) = p0 + 1), so nothing is written there
    RoPE table (Keys stored before RoPE): cos/sin[b, p0] = the step's cos/sin row.
    A position past the buffers' rows (p0 >= T, `Geometry.rows`: the cache length rounded up to even) writes
    nothing (the reference raises or clamps; no memory is touched); at an odd cache length p0 = length writes the
    padding row, which nothing reads.

Layout in registers: a group is [GP, WP, CP] (tokens, words, codes per word, each padded to a power of
two); channel d = w * CPW + j, so packing is a reduction over the last dimension for every bit width
(3-bit words hold 10 codes). Per-token groups of GS channels reduce over their members in one reduction of
the group seen as [GP, D // GS, GS] where their channels fill whole words (GROUP_RESHAPE), else by a static loop
over the D // GS groups; per-channel groups reduce over the tokens (where the program's channels fill whole
power-of-two words, RING_VEC > 0: loaded from the ring as [channel vectors, VEC, tokens] and permuted, which led
Triton to a layout with several tokens of a channel in a thread).

Glossary: D head_dim; G tokens per group (1 unless Keys/Values are CHANNEL-grouped, KIVI); GP its power of two; BITS
code width (16: unquantized); CPW codes per int32 word (32 // BITS), CP its power of two; W words per token, WP its
power of two; AXIS 0 TOKEN / 1 CHANNEL; GS channels (TOKEN) or tokens (CHANNEL, 0 = static ranges) per group; NGRP
groups per token (TOKEN axis); EAGER single-token groups coded on append (G 1, `store.EAGER_GROUPS`); RC the code
boundary's recent window (0 with `store.EAGER_GROUPS`, else R); SYM 0 asymmetric / 1 symmetric / 2 hybrid; LUT
levels from a table of NLEV; NOUT outliers per token; NORM InnerQ key normalization; S sink, R recent, WR ring
slots; T max cache length; HAS_CODES False when the codes are shared from an earlier layer (XQuant: only this
layer's statistics are written); ETA XQuant's range shrink; RSCALE static ranges' range_scale; NCH programs per
side, each over D / NCH channels (CCH, WC words: `_chunks`); VEC channels a vector of a group's ring load, loaded as
[channel vectors, VEC, tokens] (`RING_VEC`; 0: loaded as [tokens, words, codes]).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvq_compile import compat

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a triton without grid dependency control: appends are never chained (decode_attention._use_pdl)
    gdc_launch_dependents = gdc_wait = None

compat.fix_triton_interpreter()

EPS = tl.constexpr(1e-6)
HYBRID_MARGIN = tl.constexpr(1e-5)  # reference.HYBRID_MARGIN


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _fill_boundary(L, S: tl.constexpr, R: tl.constexpr, G: tl.constexpr):
    return S + tl.maximum(L - S - R, 0) // G * G


@triton.jit
def _reduce_dim(v, OP: tl.constexpr, DIM: tl.constexpr):
    """v reduced over dimension DIM: OP 0 max, 1 min, 2 sum."""
    if OP == 0:
        r = tl.max(v, DIM)
    elif OP == 1:
        r = tl.min(v, DIM)
    else:
        r = tl.sum(v, DIM)
    return r


@triton.jit
def _reduce(v, grp, OP: tl.constexpr, AXIS: tl.constexpr, NGRP: tl.constexpr, RS: tl.constexpr = False):
    """Reduce v [GP, WP, CP] over each quantization group and broadcast back: OP 0 max, 1 min, 2 sum.
    AXIS 1: a channel's group is its tokens (dim 0); AXIS 0: group `grp` (d // GS) of each token, by a loop over
    the NGRP groups, or (RS: slots in channel order, every group whole words) as one reduction of v seen as
    [GP, NGRP, WP x CP / NGRP]."""
    if OP == 0:
        ident = float("-inf")
    elif OP == 1:
        ident = float("inf")
    else:
        ident = 0.0
    if AXIS == 1:
        out = tl.broadcast_to(_reduce_dim(v, OP, 0)[None, :, :], v.shape)
    elif RS:
        GPR: tl.constexpr = v.shape[0]
        WPR: tl.constexpr = v.shape[1]
        CPR: tl.constexpr = v.shape[2]
        PER: tl.constexpr = WPR * CPR // NGRP
        r = _reduce_dim(tl.reshape(v, [GPR, NGRP, PER]), OP, 2)
        out = tl.reshape(tl.broadcast_to(r[:, :, None], [GPR, NGRP, PER]), [GPR, WPR, CPR])
    else:
        out = tl.zeros(v.shape, tl.float32)
        for gi in tl.static_range(NGRP):
            sel = grp == gi
            r = _reduce_dim(_reduce_dim(tl.where(sel, v, ident), OP, 2), OP, 1)
            out = tl.where(sel, r[:, None, None], out)
    return out


@triton.jit
def _extent(x, valid, grp, AXIS: tl.constexpr, NGRP: tl.constexpr, RS: tl.constexpr = False):
    """(max, min) of each group over its valid members (reference._extent; 0, 0 for an empty group)."""
    mx = _reduce(tl.where(valid, x, float("-inf")), grp, 0, AXIS, NGRP, RS)
    mn = _reduce(tl.where(valid, x, float("inf")), grp, 1, AXIS, NGRP, RS)
    empty = mx == float("-inf")
    return tl.where(empty, 0.0, mx), tl.where(empty, 0.0, mn)


@triton.jit
def _range(x, valid, grp, SYMMETRIC: tl.constexpr, AXIS: tl.constexpr, NGRP: tl.constexpr, RS: tl.constexpr = False):
    """(center, half) of each group over its valid members (reference._range; 0, 0 for an empty group)."""
    mx, mn = _extent(x, valid, grp, AXIS, NGRP, RS)
    if SYMMETRIC:
        return tl.zeros(mx.shape, tl.float32), tl.maximum(tl.abs(mx), tl.abs(mn))
    return (mx + mn) / 2, (mx - mn) / 2


@triton.jit
def _div_by(a, h):
    """a / h as tl.math.div_rn gives it, from r = div_rn(1, h), one reciprocal for a group's members (their h is
    one value broadcast, so the compiler computes r once per group: session 41's SASS): q = a * r, the remainder
    a - q * h by one FMA and q + remainder * r by another (the correction step of div.rn's own fast path, without
    recomputing the reciprocal and without a range check and slow-path call per value). Not a proof:
    q can be 1.5 ulps off a / h here, beyond Markstein's premise (one ulp), yet no quotient differed from div_rn on
    the H200 over 70 divisors x every float32 numerator significand (`bench/debug/div_by_check.py`, session 41), nor
    in an exact model of the 330 divisor significands with the largest reciprocal error (session 41's review). Where
    it can differ: numerators below about 2^-102 in magnitude (the remainder underflows; the quotient then is a unit
    of its last place off, or +-0 for the smallest subnormal numerators of float32 caches, which a codebook's zero
    midpoint would see), and a near float32's max over h < 1 (inf for the max; a code clamps both alike). The
    remainder is taken as (q * h - a) * -1 so that a zero a keeps its sign (products by -1 are negations; Triton's
    `-x` is 0 - x, +0 for +0); an infinite q is returned as it is. An infinite h (a range beyond float32's, from
    values near +-1.7e38) gives NaN where div_rn gives +-0: such a group dequantizes to inf or NaN either way. Each
    div_rn per value had been a reciprocal, five FMAs, a range check and a branch around the slow path, which kept
    a thread's divisions from overlapping."""
    r = tl.math.div_rn(1.0, h)
    q = a * r
    return tl.where(tl.abs(q) < float("inf"), tl.fma(tl.fma(q, h, a * -1.0) * -1.0, r, q), q)


@triton.jit
def _round_half_even(y):
    """y in [0, 2^22) rounded to the nearest integer, ties to even, as int32: y + 1.5 * 2^23 lies in [2^23, 2^24),
    where float32 steps by 1, so the add itself rounds y (to even on ties: 1.5 * 2^23 is even) and the integer is
    the sum's bits less those of 1.5 * 2^23 (an add and an integer subtract, no floor, tie test or conversion)."""
    return (y + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def _uniform_code(xn, N: tl.constexpr):
    """Nearest of N evenly spaced levels in [-1, 1] (reference.nearest_level, uniform), as the reference only in a
    kernel launched without multiply-add fusion (`LAUNCH_OPTIONS`): fused, the product is not rounded before the
    add that rounds it to an integer."""
    xc = tl.minimum(tl.maximum(xn, -1.0), 1.0)
    return _round_half_even((xc + 1.0) * ((N - 1) / 2))


@triton.jit
def _nearest_code(xn, LEV, BITS: tl.constexpr, SYM: tl.constexpr, LUT: tl.constexpr, NLEV: tl.constexpr):
    """Code of the level nearest to each normalized value: codebook (#midpoints below, as torch.bucketize) or
    uniform levels (reference.level_count of them)."""
    if LUT:
        code = tl.zeros(xn.shape, tl.int32)
        for i in tl.static_range(NLEV - 1):
            mid = (tl.load(LEV + i) + tl.load(LEV + i + 1)) / 2
            code += (mid < xn).to(tl.int32)
    else:
        code = _uniform_code(xn, (1 << BITS) - 1 if (SYM == 1 and BITS > 1) else (1 << BITS))
    return code


@triton.jit
def _level(code, N: tl.constexpr):
    """Level k of N evenly spaced in [-1, 1], as torch.linspace forms them (from -1 below the middle, from 1
    above it: reference.uniform_levels), so the hybrid L1 errors are summed over the same values."""
    STEP: tl.constexpr = 2.0 / (N - 1)
    k = code.to(tl.float32)
    return tl.where(code < N // 2, tl.fma(k, STEP, -1.0), tl.fma(k - (N - 1), STEP, 1.0))  # one rounding, as torch


@triton.jit
def _append_side(X, stride_xb, stride_xh, DATA, CODES, CEN, HALF, OVAL, OIDX, SINK, RING, LEV, NORM,
                 b, h, bh, p0, T, NGC, chunk,
                 D: tl.constexpr, BITS: tl.constexpr, AXIS: tl.constexpr, GS: tl.constexpr, SYM: tl.constexpr,
                 LUT: tl.constexpr, NLEV: tl.constexpr, NOUT: tl.constexpr, NORM_ON: tl.constexpr,
                 S: tl.constexpr, R: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, WR: tl.constexpr,
                 HAS_CODES: tl.constexpr, ETA: tl.constexpr, RSCALE: tl.constexpr, NCH: tl.constexpr,
                 RESHAPE: tl.constexpr = False, EAGER: tl.constexpr = False, VEC: tl.constexpr = 0,
                 RC: tl.constexpr = 0):
    bh64 = bh.to(tl.int64)
    dt = RING.dtype.element_ty
    xrow = X + b.to(tl.int64) * stride_xb + h * stride_xh
    CCH: tl.constexpr = D // NCH  # channels of this program: [chunk * CCH, (chunk + 1) * CCH)
    d1 = chunk * CCH + tl.arange(0, CCH)
    if BITS == 16:
        tl.store(DATA + bh64 * T * D + p0.to(tl.int64) * D + d1, tl.load(xrow + d1).to(DATA.dtype.element_ty),
                 mask=(d1 < D) & (p0 < T))
        return
    CPW: tl.constexpr = 32 // BITS
    W: tl.constexpr = (D + CPW - 1) // CPW
    WC: tl.constexpr = W // NCH  # words of this program (NCH > 1: whole words, `_chunks`)
    WP: tl.constexpr = triton.next_power_of_2(WC)
    CP: tl.constexpr = triton.next_power_of_2(CPW)
    NGRP: tl.constexpr = D // GS if AXIS == 0 else 1
    # per-token groups reduced as [GP, NGRP, words x codes] (`_reduce`): the slots hold channels in order, whole words
    RS: tl.constexpr = (RESHAPE and AXIS == 0 and NGRP > 1 and NCH == 1 and CP == CPW and WP == W and GS % CPW == 0
                        and D % GS == 0)
    STATIC: tl.constexpr = AXIS == 1 and GS == 0
    gt = tl.arange(0, GP)[:, None, None]
    w3 = chunk * WC + tl.arange(0, WP)[None, :, None]
    j3 = tl.arange(0, CP)[None, None, :]
    dch = w3 * CPW + j3  # [1, WP, CP] channel of each slot
    ev = (j3 < CPW) & (w3 < (chunk + 1) * WC) & (dch < D)  # slot holds a channel of this program
    dsafe = tl.where(ev, dch, 0)
    grp = dsafe // GS if AXIS == 0 else dsafe * 0

    xtok = tl.load(xrow + dch, mask=ev, other=0.0).to(tl.float32)  # [1, WP, CP] the appended token
    first = p0 == 0
    if NORM_ON:
        nrm = tl.load(NORM + bh64 * D + dch, mask=ev, other=1.0)
        nrm = tl.where(first, tl.maximum(tl.sqrt_rn(tl.abs(xtok)), EPS), nrm)
        tl.store(NORM + bh64 * D + dch, nrm, mask=ev & first)
    if STATIC:
        sc = xtok
        if NORM_ON:
            sc = tl.math.div_rn(xtok, nrm)
        if SYM == 1:
            c_new = tl.zeros(sc.shape, tl.float32)
            h_new = tl.abs(sc)
        else:
            c_new = sc
            h_new = tl.zeros(sc.shape, tl.float32)
        h_new = tl.maximum(h_new * (1 - 2 * ETA) * RSCALE, EPS)
        scen = tl.load(CEN + bh64 * D + dch, mask=ev, other=0.0)
        shalf = tl.load(HALF + bh64 * D + dch, mask=ev, other=1.0)
        scen = tl.where(first, c_new.to(dt), scen)
        shalf = tl.where(first, h_new.to(dt), shalf)
        if SYM != 1:
            tl.store(CEN + bh64 * D + dch, scen, mask=ev & first)
        tl.store(HALF + bh64 * D + dch, shalf, mask=ev & first)
        scen = scen.to(tl.float32)
        shalf = shalf.to(tl.float32)
        if SYM == 1:
            scen = tl.zeros(scen.shape, tl.float32)

    w_new = _fill_boundary(p0 + 1, S, R, G)   # the recent window's start once p0 is in
    if EAGER:  # single-token groups: the appended token's own codes (store.code_boundary)
        q_old = tl.maximum(p0, S)
        q_new = tl.maximum(p0 + 1, S)
    else:  # the code boundary: groups complete (RC 0, store.EAGER_GROUPS: the group p0 completes) or out of the window
        q_old = _fill_boundary(p0, S, RC, G)
        q_new = _fill_boundary(p0 + 1, S, RC, G)
    flush = (q_new > q_old) & (p0 < T)  # nothing is written for a position past the cache (p0 >= T)
    if flush:  # a group completes at most once per step: skip the group's quantization on the other steps
        # (KIVI's 32-token Key groups: 31 steps of 32; the stores below are masked by flush all the same)
        pos = q_old + gt  # [GP, 1, 1]
        tv = gt < G
        emask = tv & ev
        if WR > 0 and not EAGER:
            if AXIS == 1 and WP * CP == CCH and VEC > 0 and VEC <= CCH:  # the slots are exactly the channels
                # loaded as [channel vectors, VEC, tokens], then seen as [tokens, words, codes]: Triton lays the
                # group out with a thread's VEC channels over several tokens, so the reductions over the tokens
                # below run mostly in registers, not across lanes (RING_VEC)
                NV: tl.constexpr = CCH // VEC
                pt = q_old + tl.arange(0, GP)[None, None, :]
                dl = chunk * CCH + tl.arange(0, NV)[:, None, None] * VEC + tl.arange(0, VEC)[None, :, None]
                xr = tl.load(RING + bh64 * WR * D + ((pt % WR) * D + dl), mask=(pt < q_old + G) & (pt != p0),
                             other=0.0)
                xr = tl.reshape(tl.permute(xr, (2, 0, 1)), [GP, WP, CP])
            else:
                xr = tl.load(RING + bh64 * WR * D + ((pos % WR) * D + dch), mask=emask & (pos != p0), other=0.0)
            xg = tl.where(pos == p0, xtok.to(dt), xr)
        else:
            xg = tl.broadcast_to(xtok, (GP, WP, CP)).to(dt)  # (not xtok + 0.0, which makes -0.0 +0.0)
        xg = xg.to(tl.float32)
        if NORM_ON:
            xg = tl.math.div_rn(xg, nrm)
        xg = tl.where(emask, xg, 0.0)

        valid = emask
        if NOUT > 0:
            if STATIC:
                score = tl.math.div_rn(tl.abs(xg - scen), tl.maximum(shalf, EPS))
            else:  # the reference's max(x - mn, mx - x) / (mx - mn): a group's max and min score exactly 1
                mx, mn = _extent(xg, emask, grp, AXIS, NGRP, RS)
                score = tl.math.div_rn(tl.maximum(xg - mn, mx - xg), tl.maximum(mx - mn, 2 * EPS))
            score = tl.where(emask, score, -1.0)
            mag = tl.abs(xg)
            dfull = gt * 0 + tl.where(ev, dch, D)  # [GP, WP, CP]; D marks the slots past a word's codes
            for k in tl.static_range(NOUT):
                # the highest score of each token, ties to the larger |x|, then the lowest channel, NaN above all
                # (the reference's stable descending sorts), by maxima and a min over the slots; not argmax over
                # the scores reshaped to [GP, WP * CP], which picked repeated and out-of-range channels on an H200
                # with the [tokens, words, codes] ring load (RING_VEC 0, session 40)
                nan = score != score
                any_nan = tl.max(tl.max(nan.to(tl.int32), 2), 1) > 0  # [GP]
                best = tl.max(tl.max(tl.where(nan, -1.0, score), 2), 1)  # [GP]
                top = score == best[:, None, None]
                big = tl.max(tl.max(tl.where(top, mag, -1.0), 2), 1)  # [GP]
                top = tl.where(any_nan[:, None, None], nan, top & (mag == big[:, None, None]))
                f = tl.min(tl.min(tl.where(top, dfull, D), 2), 1)  # [GP]
                chosen = dfull == f[:, None, None]
                # the chosen value's bits (a float sum over the other slots' zeros would turn -0.0 into +0.0)
                obits = tl.sum(tl.sum(tl.where(chosen, xg.to(tl.int32, bitcast=True), 0), 2), 1)
                oval = obits.to(tl.float32, bitcast=True)
                orow = bh64 * T * NOUT + pos.reshape([GP]).to(tl.int64) * NOUT + k
                om = tv.reshape([GP]) & flush
                tl.store(OVAL + orow, oval.to(OVAL.dtype.element_ty), mask=om)
                tl.store(OIDX + orow, f.to(OIDX.dtype.element_ty), mask=om)
                score = tl.where(chosen, -1.0, score)
                valid = valid & ~chosen

        if SYM == 2 and not STATIC:
            NS: tl.constexpr = (1 << BITS) - 1
            NA: tl.constexpr = 1 << (BITS - 1)
            cs, hs = _range(xg, valid, grp, True, AXIS, NGRP, RS)
            ca, ha = _range(xg, valid, grp, False, AXIS, NGRP, RS)
            cs = cs.to(dt).to(tl.float32)
            hs = tl.maximum(hs, EPS).to(dt).to(tl.float32)
            ca = ca.to(dt).to(tl.float32)
            ha = tl.maximum(ha, EPS).to(dt).to(tl.float32)
            ks = _uniform_code(_div_by(xg - cs, hs), NS)
            ka = _uniform_code(_div_by(xg - ca, ha), NA)
            es = tl.where(valid, tl.abs(_level(ks, NS) * hs + cs - xg), 0.0)
            ea = tl.where(valid, tl.abs(_level(ka, NA) * ha + ca - xg), 0.0)
            m = _reduce(es, grp, 2, AXIS, NGRP, RS) < _reduce(ea, grp, 2, AXIS, NGRP, RS) * (1 - HYBRID_MARGIN)
            code = tl.where(m, ks, ka)
            cen = tl.where(m, cs, ca)
            half = tl.where(m, hs, ha)
        else:
            if STATIC:
                cen, half = scen, shalf
            else:
                cen, half = _range(xg, valid, grp, SYM == 1, AXIS, NGRP, RS)
                half = tl.maximum(half * (1 - 2 * ETA), EPS).to(dt).to(tl.float32)
                cen = cen.to(dt).to(tl.float32)
            code = _nearest_code(_div_by(xg - cen, half), LEV, BITS, SYM, LUT, NLEV)

        if HAS_CODES:
            code = tl.where(emask, code, 0)
            words = tl.reduce(code << tl.where(j3 < CPW, j3 * BITS, 0), 2, _or)  # [GP, WP] (no shift past 31 bits)
            wi = chunk * WC + tl.arange(0, WP)[None, :]
            posw = pos.reshape([GP, 1]).to(tl.int64)
            tl.store(CODES + bh64 * T * W + posw * W + wi, words,
                     mask=(tv.reshape([GP, 1]) & (wi < (chunk + 1) * WC) & (wi < W)) & flush)
        if not STATIC:  # group statistics, one writer slot per group
            if AXIS == 0:
                rep = emask & (dsafe % GS == 0)
                off = bh64 * T * NGRP + pos.to(tl.int64) * NGRP + grp
            else:
                rep = emask & (gt == 0)
                off = bh64 * NGC * D + ((q_old - S) // G) * D + dch + gt * 0
            rep = rep & flush
            if SYM != 1:
                tl.store(CEN + off, cen.to(dt), mask=rep)
            if SYM == 2:   # the group's choice in the sign of its half-range (`store.signed_half`)
                half = tl.where(m, -half, half)
            tl.store(HALF + off, half.to(dt), mask=rep)

    xrow1 = tl.load(xrow + d1).to(dt)
    if S > 0:
        tl.store(SINK + bh64 * S * D + p0 * D + d1, xrow1, mask=(d1 < D) & (p0 < S))
    if WR > 0:
        if RC > 0:  # (groups coded when complete read slots of [p0 - G + 1, p0), never p0 % WR's)
            tl.debug_barrier()  # every thread has read the group's ring slots before one is overwritten
        tl.store(RING + bh64 * WR * D + (p0 % WR) * D + d1, xrow1, mask=(d1 < D) & (w_new <= p0) & (p0 < T))


@triton.jit
def _append_kernel(
        KX, stride_kb, stride_kh, KDATA, KCODES, KCEN, KHALF, KOVAL, KOIDX, KSINK, KRING, KLEV, KNORM,
        VX, stride_vb, stride_vh, VDATA, VCODES, VCEN, VHALF, VOVAL, VOIDX, VSINK, VRING, VLEV,
        POS, COS_IN, SIN_IN, stride_cb, COS_T, SIN_T, T, NGC_K, NGC_V,
        H: tl.constexpr, D: tl.constexpr, S: tl.constexpr, R: tl.constexpr, ROPE: tl.constexpr,
        BITS_K: tl.constexpr, AXIS_K: tl.constexpr, GS_K: tl.constexpr, SYM_K: tl.constexpr, LUT_K: tl.constexpr,
        NLEV_K: tl.constexpr, NOUT_K: tl.constexpr, NORM_K: tl.constexpr, G_K: tl.constexpr, GP_K: tl.constexpr,
        WR_K: tl.constexpr, CODES_K: tl.constexpr, ETA_K: tl.constexpr, RSCALE_K: tl.constexpr, NCH_K: tl.constexpr,
        EAGER_K: tl.constexpr, RC_K: tl.constexpr,
        BITS_V: tl.constexpr, AXIS_V: tl.constexpr, GS_V: tl.constexpr, SYM_V: tl.constexpr, LUT_V: tl.constexpr,
        NLEV_V: tl.constexpr, NOUT_V: tl.constexpr, G_V: tl.constexpr, GP_V: tl.constexpr,
        WR_V: tl.constexpr, CODES_V: tl.constexpr, ETA_V: tl.constexpr, RSCALE_V: tl.constexpr, NCH_V: tl.constexpr,
        EAGER_V: tl.constexpr, RC_V: tl.constexpr, RESHAPE: tl.constexpr = False, VEC: tl.constexpr = 0,
        CHAIN: tl.constexpr = False, TRIGGER: tl.constexpr = False):
    """Grid (B * H, NCH_K + NCH_V): program (bh, c) appends channel chunk c of the Keys (c < NCH_K) or chunk
    c - NCH_K of the Values of KV head bh. RESHAPE: `GROUP_RESHAPE`; VEC: `RING_VEC`. CHAIN (`append_decode`'s
    chain): a programmatic dependent of the launch ahead that reads nothing it writes; program (0, 0) waits for
    that launch before it ends, so that this launch ends after it. TRIGGER: the next launch may start at once."""
    if TRIGGER:
        gdc_launch_dependents()
    bh = tl.program_id(0)
    c = tl.program_id(1)
    b = bh // H
    h = bh % H
    p0 = tl.load(POS).to(tl.int32)
    if c < NCH_K:
        _append_side(KX, stride_kb, stride_kh, KDATA, KCODES, KCEN, KHALF, KOVAL, KOIDX, KSINK, KRING,
                     KLEV, KNORM, b, h, bh, p0, T, NGC_K, c, D, BITS_K, AXIS_K, GS_K, SYM_K, LUT_K, NLEV_K, NOUT_K,
                     NORM_K, S, R, G_K, GP_K, WR_K, CODES_K, ETA_K, RSCALE_K, NCH_K, RESHAPE, EAGER_K, VEC, RC_K)
        if ROPE:
            if (h == 0) & (c == 0) & (p0 < T):
                d = tl.arange(0, D)
                src = b.to(tl.int64) * stride_cb + d
                dst = b.to(tl.int64) * T * D + p0.to(tl.int64) * D + d
                tl.store(COS_T + dst, tl.load(COS_IN + src).to(COS_T.dtype.element_ty))
                tl.store(SIN_T + dst, tl.load(SIN_IN + src).to(SIN_T.dtype.element_ty))
    else:
        _append_side(VX, stride_vb, stride_vh, VDATA, VCODES, VCEN, VHALF, VOVAL, VOIDX, VSINK, VRING,
                     VLEV, VLEV, b, h, bh, p0, T, NGC_V, c - NCH_K, D, BITS_V, AXIS_V, GS_V, SYM_V, LUT_V, NLEV_V,
                     NOUT_V, False, S, R, G_V, GP_V, WR_V, CODES_V, ETA_V, RSCALE_V, NCH_V, RESHAPE, EAGER_V, VEC, RC_V)
    if CHAIN:
        if (bh == 0) & (c == 0):  # every program reaches this line (no early return above)
            gdc_wait()   # this launch ends after the one ahead: the launches after it wait for both


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------
def _side(bufs: dict, side: str, q, cfg, geo, rows: int = 0, sms: int = 0):
    """(pointers, constants) of one side; absent buffers are never read (any tensor stands in). rows, sms: `_chunks`."""
    from kvq_compile import store as st
    from kvq_compile.config import Axis, Symmetry

    g = lambda n: bufs.get(f"{side}.{n}")  # noqa: E731
    if not q.quantized:
        data = g("data")
        ptrs = dict(data=data, codes=data, cen=data, half=data, oval=data, oidx=data, sink=data,
                    ring=data, lev=data, norm=data)
        return ptrs, dict(BITS=16, AXIS=0, GS=1, SYM=0, LUT=False, NLEV=1, NOUT=0, NORM=False, G=1, GP=1, WR=0,
                          CODES=False, ETA=0.0, RSCALE=1.0, NGC=1, NCH=1, EAGER=False, RC=0)
    half = g("half")
    pick = lambda n: g(n) if g(n) is not None else half  # noqa: E731
    ptrs = {k: pick(n) for k, n in (("data", "half"), ("codes", "codes"), ("cen", "center"), ("half", "half"),
                                    ("oval", "out_val"), ("oidx", "out_idx"),
                                    ("sink", "sink"), ("ring", "ring"), ("lev", "levels"), ("norm", "norm"))}
    if q.axis is Axis.TOKEN:
        axis, gs = 0, q.group_size or geo.head_dim
    else:
        axis, gs = 1, q.group_size or 0
    G = q.tokens_per_group
    if g("ring") is not None and g("ring").dtype != half.dtype:
        raise ValueError("kvq append: ring and statistics must share the cache dtype")
    return ptrs, dict(BITS=q.bits, AXIS=axis, GS=gs, SYM={Symmetry.ASYMMETRIC: 0, Symmetry.SYMMETRIC: 1,
                                                            Symmetry.HYBRID: 2}[q.symmetry],
                      LUT=g("levels") is not None, NLEV=g("levels").numel() if g("levels") is not None else 1,
                      NOUT=g("out_val").shape[-1] if g("out_val") is not None else 0, NORM=g("norm") is not None,
                      G=G, GP=triton.next_power_of_2(G), WR=g("ring").shape[2] if g("ring") is not None else 0,
                      CODES=g("codes") is not None, ETA=float(cfg.eta_for(q)), RSCALE=float(q.range_scale),
                      NGC=half.shape[2] if axis == 1 and gs else 1,
                      NCH=_chunks(q.bits, axis, gs, G, g("out_val") is not None, geo.head_dim, rows, sms),
                      EAGER=G == 1 and st.EAGER_GROUPS, RC=0 if st.EAGER_GROUPS else cfg.recent)


LAUNCH_OPTIONS = dict(enable_fp_fusion=False)  # every product rounded before it is added, as the reference's torch
# ops do: fused, (x + 1) * (N - 1) / 2 + 1.5 * 2^23 in `_uniform_code` rounds the exact product, a level off where
# the float32 product is a tie (4 bits, xn = 0.26666665: 9.5 - 2^-23 exactly, 9.5 in float32; session 39's review),
# and fused, the hybrid groups' error level * h + c - x skipped the rounding of level * h that the reference does.
# The tl.fma written out in `_level` (torch.linspace's levels, one rounding) stays an FMA
RING_VEC = 2   # a group of channel groups spanning tokens (KIVI's Keys, InnerQ's Values) read back from the ring as
# [channel vectors, RING_VEC, tokens] (`_append_side`; 0: as [tokens, words, codes]): Triton then gives each thread
# RING_VEC channels of several tokens, and the reductions over the tokens run in registers and one or two shuffles
# instead of five (a warp's 32 lanes held 32 tokens). H200, session 39 (bench/RESULTS.md): the flush step at
# (32, 4096) timed inside an (append, attention) step kivi-2 7.1 -> 5.5 us, innerq-2 12.1 -> 8.5 us (4.9 and 7.3
# with `_round_half_even`'s add, the EAGER sides' barrier dropped and fusion off as well); Nsight Compute, kivi-2:
# 2.54M -> 1.93M warp instructions, 94 -> 64 registers a thread
GROUP_RESHAPE = True   # per-token groups of several whole words reduced as one [tokens, groups, members] reduction
# (`_reduce`), not by a loop over the groups. H200, session 38 (bench/RESULTS.md, `bench_append.py --sweep`, 2 warps):
# the step that completes no channel group 0.0-1.2 us faster for kivi-2, kivi-4, xquant-1.38 and innerq-2 at
# (8, 8192) and (32, 4096) (innerq-2 at (8, 8192) 2.7 against 3.9 us), the flush step 0.0-1.1 us faster
FLUSH_CHANNELS = 16   # channels per program of a side whose groups span tokens (KIVI's Keys), at least a word's
# (`_chunks`; a power of two). Of 128 / 32 / 16 on an H100 (bench/RESULTS.md, session 14): 16 the fastest group step
FLUSH_PROGRAMS_PER_SM = 8  # at most this many such programs of a side per SM over all KV heads (`_chunks` halves the
# split until they fit or one program a KV head is left; each side on its own; 0: no cap). H200, session 38: at
# (32, 4096) (256 KV heads) 32 channels a program (1024 Key programs) against 16 (2048) made the step that completes
# no group 2.6 against 3.8 us for kivi-2 and kivi-4 (innerq-2, its Values split: 2.9 against 3.8), the flush step
# 6.5-6.7 against 5.9-6.0 us (innerq-2 11.8 against 10.5): 2.7 against 3.9 us on the mean over a group's 32 steps
# for kivi-2 and kivi-4


def _chunks(bits: int, axis: int, gs: int, tokens_per_group: int, outliers: bool, head_dim: int, rows: int = 0,
            sms: int = 0) -> int:
    """Programs per (KV head, side): a side whose groups span tokens (channel groups of G > 1 tokens: KIVI's
    Keys) quantizes a whole group on the step that completes it, G x head_dim values. Split by channels into
    programs of FLUSH_CHANNELS or one word's channels if more (each program reads and writes only its channels,
    so the ring's read-before-overwrite stays within one program), that step runs across more SMs. Other sides
    run one program: per-token groups and a token's outliers span the channels, static ranges quantize one token
    per step, and 3-bit words (10 codes) straddle any power-of-two split. rows (KV heads in all) and sms (the
    device's SMs; 0: no cap): the split is halved while rows x programs exceed FLUSH_PROGRAMS_PER_SM a SM (every
    step launches them all, and on the steps that complete no group they only copy the token to the ring)."""
    if FLUSH_CHANNELS < 1 or FLUSH_CHANNELS & (FLUSH_CHANNELS - 1):
        raise ValueError(f"quantize_append.FLUSH_CHANNELS must be a power of two, not {FLUSH_CHANNELS}")
    if 32 % bits or tokens_per_group == 1 or axis != 1 or not gs or outliers:
        return 1
    n = max(1, head_dim // max(FLUSH_CHANNELS, 32 // bits))
    while FLUSH_PROGRAMS_PER_SM and rows and sms and n > 1 and rows * n > FLUSH_PROGRAMS_PER_SM * sms:
        n //= 2
    return n


@functools.lru_cache(maxsize=None)
def _sm_count(device) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def supported(cfg, spec, geo) -> str | None:
    """Why this layer's append cannot run here (None: it can)."""
    if geo.head_dim & (geo.head_dim - 1):
        return f"head_dim {geo.head_dim} is not a power of two"
    for q in (spec.key, spec.value):
        if q.quantized and q.symmetry.value == "hybrid" and q.bits < 2:
            return "hybrid groups need at least 2 bits"
    return None


@triton.jit
def _step_guard_kernel(POS, FRONT, OK, N, MAX_LEN, HAS_FRONT: tl.constexpr, BLOCK: tl.constexpr):
    """OK = every position p of the step < MAX_LEN and, with a frontier F (HAS_FRONT), p == 0 or p >= F for the
    first one; then F = the last one + 1 (one program: its load of F comes before its store)."""
    i = tl.arange(0, BLOCK)
    p = tl.load(POS + i, mask=i < N, other=0).to(tl.int64)
    ok = tl.max(p, 0) < MAX_LEN
    if HAS_FRONT:
        first = tl.min(tl.where(i < N, p, MAX_LEN), 0)
        ok = ok & ((first == 0) | (first >= tl.load(FRONT)))
        tl.store(FRONT, tl.max(p, 0) + 1)
    tl.store(OK, ok.to(tl.int8))


def step_guard(positions, max_len: int, frontier=None):
    """A decode step's positions checked on the device (no host synchronization; `ops._assert_in_store` asserts the
    result): a bool [] tensor, True where every position is below max_len and, with the store's frontier
    (`store.ModelStore.frontier`, advanced here), the step starts at 0 or at or past it (`store.check_rollback`,
    the host check of chunks and of the reference path)."""
    pos = positions.reshape(-1)
    ok = torch.empty((), dtype=torch.int8, device=pos.device)
    _step_guard_kernel[(1,)](pos, frontier if frontier is not None else ok, ok, pos.numel(), max_len,
                             HAS_FRONT=frontier is not None, BLOCK=triton.next_power_of_2(max(pos.numel(), 16)))
    return ok.view(torch.bool)


def append_decode(bufs: dict, cfg, spec, geo, key, value, positions, cos=None, sin=None,
                  num_warps: int | None = None, chain: bool = False, trigger: bool = False):
    """kvq::append of one token per sequence at positions[0], on the device (no host synchronization).
    key/value [B, H, 1, D]; cos/sin [B|1, 1, D] or [B|1, 1, 1, D] for Keys stored before RoPE.
    chain (sm_90+, `decode_attention.decode_attention`'s `append`): launched as the programmatic dependent of the
    launch ahead of it, which must write nothing this append reads nor read anything it writes (the same step's
    attention where `store.attention_independent`): its programs start while that launch runs, and one of them
    waits for it before it ends. trigger: the launch after this one may start at once (it must wait for this one
    before it reads, as the final reduction does)."""
    B, H, n, D = key.shape
    if n != 1:
        raise ValueError("append_decode takes one token per sequence; chunks use store.append")
    why = supported(cfg, spec, geo)
    if why:
        raise NotImplementedError(f"kvq Triton append: {why}")
    if trigger and not chain:
        raise ValueError("append_decode: trigger applies to a chained append (chain=True)")
    if chain and (gdc_wait is None or not key.is_cuda):
        raise ValueError("append_decode: chain needs a CUDA tensor and a triton with grid dependency control "
                         "(decode_attention chains only where PDL applies)")
    if RING_VEC < 0 or RING_VEC & (RING_VEC - 1):
        raise ValueError(f"quantize_append.RING_VEC must be 0 or a power of two, not {RING_VEC}")
    key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (key, value))
    sms = _sm_count(key.device) if key.is_cuda else 0
    kp, kc = _side(bufs, "k", spec.key, cfg, geo, B * H, sms)
    vp, vc = _side(bufs, "v", spec.value, cfg, geo, B * H, sms)
    if num_warps is None:
        # 2: every group step within 10% of its attention on an H100 (1 warp: steps that complete no group 0.4-0.9 us
        # faster, xquant's 1-bit group step 4.1 us, 10.3%; bench/RESULTS.md, session 14). 4 where a side keeps
        # outliers. Chosen in session 15, when 1 and 2 warps miscomputed a channel-grouped side's codes with
        # outliers on an H100; session 40 found the outliers' argmax over reshaped scores wrong on an H200 at 4
        # warps too, replaced it, and then every outlier case was exact at 1, 2 and 4 warps on the H200 (not
        # rerun on an H100). 4 stays for time: kvquant-3-1% 3.5-3.9 us a step at 4 warps, 4.0-4.3 at 2, 5.2-5.6
        # at 1; kvquant-4-1% 3.4-3.7 at 4, 2.7-3.0 at 1 (H200, bench/results/session40_call3)
        num_warps = 4 if kc["NOUT"] or vc["NOUT"] else 2
    rope = cos is not None and "rope.cos" in bufs
    if rope:
        cos, sin = (c.reshape(c.shape[0], -1, D)[:, 0].contiguous() for c in (cos, sin))
        stride_cb = D if cos.shape[0] > 1 else 0
        cos_t, sin_t = bufs["rope.cos"], bufs["rope.sin"]
    else:
        cos = sin = cos_t = sin_t = key
        stride_cb = 0
    _append_kernel[(B * H, kc["NCH"] + vc["NCH"])](
        key, key.stride(0), key.stride(1), kp["data"], kp["codes"], kp["cen"], kp["half"], kp["oval"],
        kp["oidx"], kp["sink"], kp["ring"], kp["lev"], kp["norm"],
        value, value.stride(0), value.stride(1), vp["data"], vp["codes"], vp["cen"], vp["half"],
        vp["oval"], vp["oidx"], vp["sink"], vp["ring"], vp["lev"],
        positions, cos, sin, stride_cb, cos_t, sin_t, geo.rows, kc["NGC"], vc["NGC"],
        H=H, D=D, S=cfg.sink, R=cfg.recent, ROPE=rope,
        **{f"{k}_K": v for k, v in kc.items() if k != "NGC"},
        **{f"{k}_V": v for k, v in vc.items() if k not in ("NGC", "NORM")},
        RESHAPE=GROUP_RESHAPE, VEC=RING_VEC, num_warps=num_warps, CHAIN=chain, TRIGGER=trigger,
        **(dict(launch_pdl=True) if chain else {}), **LAUNCH_OPTIONS)
