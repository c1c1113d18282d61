"""Decode attention over the packed kvq store, in Triton: one query token per sequence.

Math (per sequence b, KV head h, the REP = Hq / H query heads of its GQA group, written length L = p0 + 1):

    k_t = dequant_K(t)   v_t = dequant_V(t)    for t in [0, L), each from where the store keeps it:
          t < S              -> sink (exact)              S <= t < Q_side(L) -> codes (quantized)
          Q_side(L) <= t < p0 -> ring slot t % Wr (exact)   t == p0            -> the appended chunk (exact)
    dequant(t, d) = (lev[code(t, d)] * half(g) + center(g)) [outliers replace their channels] [* norm(d)]
          lev = uniform -1 + 2k/(2^B - 1) | codebook LUT | hybrid: mask(g) ? uniform(2^B) : uniform(2^(B-1))
          g = (t, d // gsize) for TOKEN-axis groups (inner grouping of Keys), ((t - S) // G, d) for
          CHANNEL-axis token groups (KIVI Keys), (0, d) for static per-channel ranges (KVQuant, CalibQuant)
    keys stored before RoPE: k_t <- k_t * cos_t + rotate_half(k_t) * sin_t  (RoPE after dequantization)
    s_r,t = scale * q_r . k_t + bias_r,t  over allowed t (attention mask, is_causal);  CalibQuant: s *= temp_r
    out_r = sum_t softmax(s_r)_t v_t   (a row with no allowed t gives 0, as torch's SDPA)

Work split (flash-decoding): launch 1, programs (b*H + h, j < NSPLIT), each covers one slice of the region
[S, min(Q_K(L), Q_V(L), p0)) where both sides are quantized, with unpacking fused into the tile loads
and each K/V tile loaded once for all REP query heads (a [REP_PAD, D] x [D, BLOCK_T] dot); launch 2
(WINDOW, one program per b*H + h, slot NSPLIT) covers the exact windows (sink, ring, chunk) and the
stretch where only one side is quantized. Each writes its running (max, sum, acc); `_combine_kernel`
merges them. CalibQuant's temperature needs each row's logit range first: TAU_PHASE 1 runs both launches
without V, then TAU_PHASE 2 attends. Every length is read
from `positions` on the device: no host synchronization, fixed launch shapes (CUDA-graph safe).

Glossary of constants: D head_dim; REP query heads per KV head (REP_PAD: padded to >= 16 for tl.dot);
BITS_* code width (16: unquantized `data` buffer); CPW codes per int32 word = 32 // BITS; AXIS_* 0 TOKEN /
1 CHANNEL; GS_* group size (TOKEN: channels per group; CHANNEL: tokens per group, 0 = static ranges);
SYM_* 0 asymmetric / 1 symmetric / 2 hybrid; LUT_* levels from a table; NOUT_* outliers per token;
NORM_K InnerQ key normalization; S sink tokens, R recent tokens, WR_* ring slots; T max cache length;
NG_* channel-group rows; MASK_KIND 0 none / 1 bool / 2 additive; TAU_PHASE 0 plain softmax / 1 range
pass (max, min of s) / 2 calibrated pass (s *= temp).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fill_boundary(L, S: tl.constexpr, R: tl.constexpr, TPG: tl.constexpr):
    """Q(L) = S + floor(max(0, L - S - R) / TPG) * TPG (store.fill_boundary)."""
    return S + tl.maximum(L - S - R, 0) // TPG * TPG


@triton.jit
def _dequant(codes_ptr, cen_ptr, half_ptr, hmask_ptr, oval_ptr, oidx_ptr, lev_ptr, norm_ptr, bh, t, d, tmask,
             T: tl.constexpr, D: tl.constexpr, S: tl.constexpr, BITS: tl.constexpr, AXIS: tl.constexpr,
             GS: tl.constexpr, NG: tl.constexpr, SYM: tl.constexpr, LUT: tl.constexpr, NOUT: tl.constexpr,
             NORM: tl.constexpr):
    """float32 [BT, D] values of positions t (quantized region) at channels d."""
    CPW: tl.constexpr = 32 // BITS
    W: tl.constexpr = (D + CPW - 1) // CPW
    bh64 = bh.to(tl.int64)
    m2 = tmask[:, None]
    words = tl.load(codes_ptr + bh64 * T * W + t[:, None] * W + (d // CPW)[None, :], mask=m2, other=0)
    code = (words >> ((d % CPW) * BITS)[None, :]) & ((1 << BITS) - 1)
    if AXIS == 0:
        NGRP: tl.constexpr = D // GS
        gi = bh64 * T * NGRP + t[:, None] * NGRP + (d // GS)[None, :]
    elif GS == 0:
        gi = bh64 * D + t[:, None] * 0 + d[None, :]
    else:
        gi = bh64 * NG * D + ((t - S) // GS)[:, None] * D + d[None, :]
    half = tl.load(half_ptr + gi, mask=m2, other=0.0).to(tl.float32)
    N: tl.constexpr = 1 << BITS
    if LUT:
        lev = tl.load(lev_ptr + code)
    elif SYM == 2:
        HN: tl.constexpr = N // 2
        sym = tl.load(hmask_ptr + gi, mask=m2, other=0) != 0
        lev_s = -1.0 + code.to(tl.float32) * (2.0 / (N - 1))
        if HN > 1:
            lev_a = -1.0 + tl.minimum(code, HN - 1).to(tl.float32) * (2.0 / (HN - 1))
        else:
            lev_a = lev_s * 0.0 - 1.0
        lev = tl.where(sym, lev_s, lev_a)
    else:
        lev = -1.0 + code.to(tl.float32) * (2.0 / (N - 1))
    x = lev * half
    if SYM != 1:
        x += tl.load(cen_ptr + gi, mask=m2, other=0.0).to(tl.float32)
    for j in tl.static_range(NOUT):
        oi = bh64 * T * NOUT + t * NOUT + j
        idx = tl.load(oidx_ptr + oi, mask=tmask, other=0).to(tl.int32)
        val = tl.load(oval_ptr + oi, mask=tmask, other=0.0).to(tl.float32)
        x = tl.where(d[None, :] == idx[:, None], val[:, None], x)
    if NORM:
        x = x * tl.load(norm_ptr + bh64 * D + d)[None, :]
    return x


@triton.jit
def _load_side(codes_ptr, cen_ptr, half_ptr, hmask_ptr, oval_ptr, oidx_ptr, lev_ptr, norm_ptr,
               data_ptr, sink_ptr, ring_ptr, chunk_ptr, stride_cb, stride_ch, b, h, bh, t, d, tvalid, p0, bnd,
               T: tl.constexpr, D: tl.constexpr, S: tl.constexpr, WR: tl.constexpr, BITS: tl.constexpr,
               AXIS: tl.constexpr, GS: tl.constexpr, NG: tl.constexpr, SYM: tl.constexpr, LUT: tl.constexpr,
               NOUT: tl.constexpr, NORM: tl.constexpr, ONLY_CODES: tl.constexpr):
    """float32 [BT, D] of one side (K or V) at positions t, from wherever the store keeps each position."""
    bh64 = bh.to(tl.int64)
    if BITS == 16:
        x = tl.load(data_ptr + bh64 * T * D + t[:, None] * D + d[None, :],
                    mask=(tvalid & (t < p0))[:, None], other=0.0).to(tl.float32)
    elif ONLY_CODES:
        x = _dequant(codes_ptr, cen_ptr, half_ptr, hmask_ptr, oval_ptr, oidx_ptr, lev_ptr, norm_ptr, bh, t, d,
                     tvalid, T, D, S, BITS, AXIS, GS, NG, SYM, LUT, NOUT, NORM)
        return x
    else:
        inq = tvalid & (t >= S) & (t < bnd) & (t < p0)
        x = _dequant(codes_ptr, cen_ptr, half_ptr, hmask_ptr, oval_ptr, oidx_ptr, lev_ptr, norm_ptr, bh, t, d,
                     inq, T, D, S, BITS, AXIS, GS, NG, SYM, LUT, NOUT, NORM)
        x = tl.where(inq[:, None], x, 0.0)
        if S > 0:
            ins = tvalid & (t < S) & (t < p0)
            xs = tl.load(sink_ptr + bh64 * S * D + t[:, None] * D + d[None, :], mask=ins[:, None], other=0.0)
            x = tl.where(ins[:, None], xs.to(tl.float32), x)
        if WR > 0:
            inr = tvalid & (t >= bnd) & (t >= S) & (t < p0)
            xr = tl.load(ring_ptr + bh64 * WR * D + (t % WR)[:, None] * D + d[None, :], mask=inr[:, None],
                         other=0.0)
            x = tl.where(inr[:, None], xr.to(tl.float32), x)
    inc = tvalid & (t == p0)
    xc = tl.load(chunk_ptr + b.to(tl.int64) * stride_cb + h * stride_ch + t[:, None] * 0 + d[None, :],
                 mask=inc[:, None], other=0.0)
    return tl.where(inc[:, None], xc.to(tl.float32), x)


@triton.jit
def _rope(k, kp, t, d, cos_ptr, sin_ptr, b, tmask, T: tl.constexpr, D: tl.constexpr):
    """k * cos_t + rotate_half(k) * sin_t, with kp the values at the partner channels (d + D/2) % D."""
    off = b.to(tl.int64) * T * D + t[:, None] * D + d[None, :]
    c = tl.load(cos_ptr + off, mask=tmask[:, None], other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + off, mask=tmask[:, None], other=0.0).to(tl.float32)
    sign = tl.where(d < D // 2, -1.0, 1.0)
    return k * c + sign[None, :] * kp * s


@triton.jit
def _decode_kernel(
        Q, stride_qb, stride_qh,
        KC, KCEN, KHALF, KMASK, KOVAL, KOIDX, KLEV, KNORM, KDATA, KSINK, KRING, KCHUNK, stride_kb, stride_kh,
        VC, VCEN, VHALF, VMASK, VOVAL, VOIDX, VLEV, VDATA, VSINK, VRING, VCHUNK, stride_vb, stride_vh,
        COS, SIN, POS, AMASK, stride_mb, stride_mh, TEMP,
        OUT_M, OUT_L, OUT_ACC, scale,
        H: tl.constexpr, REP: tl.constexpr, REP_PAD: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
        S: tl.constexpr, R: tl.constexpr,
        BITS_K: tl.constexpr, AXIS_K: tl.constexpr, GS_K: tl.constexpr, NG_K: tl.constexpr,
        SYM_K: tl.constexpr, LUT_K: tl.constexpr, NOUT_K: tl.constexpr, NORM_K: tl.constexpr,
        TPG_K: tl.constexpr, WR_K: tl.constexpr,
        BITS_V: tl.constexpr, AXIS_V: tl.constexpr, GS_V: tl.constexpr, NG_V: tl.constexpr,
        SYM_V: tl.constexpr, LUT_V: tl.constexpr, NOUT_V: tl.constexpr, TPG_V: tl.constexpr, WR_V: tl.constexpr,
        ROPE: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, TAU_PHASE: tl.constexpr,
        NSPLIT: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr):
    bh = tl.program_id(0)
    split = NSPLIT if WINDOW else tl.program_id(1)
    b = bh // H
    h = bh % H
    p0 = tl.load(POS).to(tl.int32)
    L = p0 + 1
    if BITS_K == 16:
        bnd_k = L
    else:
        bnd_k = _fill_boundary(L, S, R, TPG_K)
    if BITS_V == 16:
        bnd_v = L
    else:
        bnd_v = _fill_boundary(L, S, R, TPG_V)
    S_EFF: tl.constexpr = 0 if (BITS_K == 16 and BITS_V == 16) else S
    qend = tl.minimum(tl.minimum(bnd_k, bnd_v), p0)
    qlen = tl.maximum(qend - S_EFF, 0)

    r = tl.arange(0, REP_PAD)
    d = tl.arange(0, D)
    rvalid = r < REP
    qh = h * REP + r
    q = tl.load(Q + b.to(tl.int64) * stride_qb + qh[:, None] * stride_qh + d[None, :], mask=rvalid[:, None],
                other=0.0)
    dt = q.dtype
    if ROPE:
        dp = (d + D // 2) % D
    if TAU_PHASE == 2:
        temp = tl.load(TEMP + b * H * REP + qh, mask=rvalid, other=1.0)

    m_i = tl.full([REP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([REP_PAD], tl.float32)
    lo_i = tl.full([REP_PAD], float("inf"), tl.float32)
    acc = tl.zeros([REP_PAD, D], tl.float32)

    if WINDOW:  # the exact windows: [0, min(S_EFF, p0)) then [max(S_EFF, qend), p0]
        win_lo = tl.maximum(S_EFF, qend)
        n_sink = tl.cdiv(tl.minimum(S_EFF, p0), BLOCK_T)
        n_iter = n_sink + tl.cdiv(p0 + 1 - win_lo, BLOCK_T)
    else:  # this program's slice of the region where both sides are quantized
        per = tl.cdiv(tl.cdiv(qlen, NSPLIT), BLOCK_T) * BLOCK_T
        start = S_EFF + split * per
        stop = tl.minimum(start + per, qend)
        n_iter = tl.cdiv(tl.maximum(stop - start, 0), BLOCK_T)
    for it in range(0, n_iter):
        if WINDOW:
            t_sink = it * BLOCK_T + tl.arange(0, BLOCK_T)
            t_win = win_lo + (it - n_sink) * BLOCK_T + tl.arange(0, BLOCK_T)
            in_sink = it < n_sink
            t = tl.where(in_sink, t_sink, t_win)
            tvalid = tl.where(in_sink, t_sink < tl.minimum(S_EFF, p0), t_win <= p0)
        else:
            t = start + it * BLOCK_T + tl.arange(0, BLOCK_T)
            tvalid = t < stop
        k = _load_side(KC, KCEN, KHALF, KMASK, KOVAL, KOIDX, KLEV, KNORM, KDATA, KSINK, KRING, KCHUNK,
                       stride_kb, stride_kh, b, h, bh, t, d, tvalid, p0, bnd_k, T, D, S, WR_K, BITS_K, AXIS_K,
                       GS_K, NG_K, SYM_K, LUT_K, NOUT_K, NORM_K, not WINDOW)
        if ROPE:
            kp = _load_side(KC, KCEN, KHALF, KMASK, KOVAL, KOIDX, KLEV, KNORM, KDATA, KSINK, KRING, KCHUNK,
                            stride_kb, stride_kh, b, h, bh, t, dp, tvalid, p0, bnd_k, T, D, S, WR_K, BITS_K,
                            AXIS_K, GS_K, NG_K, SYM_K, LUT_K, NOUT_K, NORM_K, not WINDOW)
            # the chunk's own key arrives already rotated (it is the attention's input, not the store's)
            k = tl.where((t == p0)[:, None], k, _rope(k, kp, t, d, COS, SIN, b, tvalid, T, D))
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(dt)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(dt)))
        s = s * scale
        allowed = rvalid[:, None] & tvalid[None, :]
        if MASK_KIND != 0:
            moff = b.to(tl.int64) * stride_mb + qh[:, None] * stride_mh + t[None, :]
            mv = tl.load(AMASK + moff, mask=allowed, other=0)
            if MASK_KIND == 1:
                allowed = allowed & (mv != 0)
            else:
                s = s + mv.to(tl.float32)
                allowed = allowed & (mv.to(tl.float32) > float("-inf"))
        if IS_CAUSAL:
            allowed = allowed & (t[None, :] <= 0)
        if TAU_PHASE == 1:
            m_i = tl.maximum(m_i, tl.max(tl.where(allowed, s, float("-inf")), 1))
            lo_i = tl.minimum(lo_i, tl.min(tl.where(allowed, s, float("inf")), 1))
        else:
            if TAU_PHASE == 2:
                s = s * temp[:, None]
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_use[:, None])
            alpha = tl.exp(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_side(VC, VCEN, VHALF, VMASK, VOVAL, VOIDX, VLEV, VLEV, VDATA, VSINK, VRING, VCHUNK,
                           stride_vb, stride_vh, b, h, bh, t, d, tvalid, p0, bnd_v, T, D, S, WR_V, BITS_V,
                           AXIS_V, GS_V, NG_V, SYM_V, LUT_V, NOUT_V, False, not WINDOW)
            if IEEE:
                pv = tl.dot(p.to(dt), v.to(dt), input_precision="ieee")
            else:
                pv = tl.dot(p.to(dt), v.to(dt))
            acc = acc * alpha[:, None] + pv
            m_i = m_new

    o = (bh * REP_PAD + r) * (NSPLIT + 1) + split
    tl.store(OUT_M + o, m_i)
    if TAU_PHASE == 1:
        tl.store(OUT_L + o, lo_i)
    else:
        tl.store(OUT_L + o, l_i)
        tl.store(OUT_ACC + o[:, None] * D + d[None, :], acc)


@triton.jit
def _combine_kernel(OUT_M, OUT_L, OUT_ACC, O, H: tl.constexpr, REP: tl.constexpr, REP_PAD: tl.constexpr,
                    D: tl.constexpr, NS: tl.constexpr, NS_PAD: tl.constexpr):
    """out = sum_j exp(m_j - m) acc_j / sum_j exp(m_j - m) l_j over the NS partial results of one row."""
    row = tl.program_id(0)  # (b * H + h) * REP + r
    bh = row // REP
    r = row % REP
    j = tl.arange(0, NS_PAD)
    d = tl.arange(0, D)
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


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------
def _side_args(bufs: dict, side: str, q, geo, cfg):
    """Pointers and constants of one side (K or V) of a layer's store, by buffer name."""
    from kvq_compile.config import Axis, Symmetry

    g = lambda n: bufs.get(f"{side}.{n}")  # noqa: E731
    if not q.quantized:
        data = g("data")
        ptrs = dict(codes=data, cen=data, half=data, hmask=data, oval=data, oidx=data, lev=data, norm=data,
                    data=data, sink=data, ring=data)
        return ptrs, dict(BITS=16, AXIS=0, GS=1, NG=1, SYM=1, LUT=False, NOUT=0, NORM=False, TPG=1, WR=0)
    half = g("half")
    pick = lambda n: g(n) if g(n) is not None else half  # noqa: E731  absent buffers are never read
    ptrs = {k: pick(n) for k, n in (("codes", "codes"), ("cen", "center"), ("half", "half"), ("hmask", "mask"),
                                    ("oval", "out_val"), ("oidx", "out_idx"), ("lev", "levels"),
                                    ("norm", "norm"), ("data", "half"), ("sink", "sink"), ("ring", "ring"))}
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


def _num_splits(bh: int, max_len: int, block_t: int, device) -> int:
    """Enough programs to fill the GPU twice over, never slices shorter than 4 tiles."""
    import torch

    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(-(-2 * sms // bh), max_len // (4 * block_t), 64))


def decode_attention(query, bufs: dict, key, value, positions, attn_mask, scale: float, is_causal: bool,
                     cfg, spec, geo, block_t: int | None = None, num_splits: int | None = None):
    """kvq::attend for one query token per sequence (decode), entirely on the device.

    query [B, Hq, 1, D]; bufs: the layer's attend tensors by name (store.LayerStore.attend_tensors);
    key/value [B, H, 1, D]: the chunk just appended at positions[0]; attn_mask [B|1, Hq|1, 1, >= L] or None."""
    import torch

    B, Hq, n, D = query.shape
    H = key.shape[1]
    if n != 1:
        raise ValueError("decode_attention takes one query token per sequence; use the reference path for chunks")
    if Hq % H:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {H}")
    rep = Hq // H
    rep_pad = max(16, triton.next_power_of_2(rep))
    block_t = block_t or 64
    T = geo.max_len
    if query.stride(-1) != 1:
        query = query.contiguous()
    key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (key, value))
    kp, kc = _side_args(bufs, "k", spec.key, geo, cfg)
    vp, vc = _side_args(bufs, "v", spec.value, geo, cfg)
    rope = cfg.keys_before_rope and spec.key.quantized
    cos = bufs["rope.cos"] if rope else query
    sin = bufs["rope.sin"] if rope else query
    if attn_mask is None:
        mask_kind, amask, smb, smh = 0, query, 0, 0
    else:
        amask = attn_mask if attn_mask.stride(-1) == 1 else attn_mask.contiguous()
        while amask.dim() < 4:
            amask = amask.unsqueeze(0)
        mask_kind = 1 if amask.dtype == torch.bool else 2
        smb = amask.stride(0) if amask.shape[0] > 1 else 0
        smh = amask.stride(1) if amask.shape[1] > 1 else 0
    nsplit = num_splits or _num_splits(B * H, T, block_t, query.device)
    ns = nsplit + 1
    m_buf = torch.empty(B * H * rep_pad * ns, dtype=torch.float32, device=query.device)
    l_buf = torch.empty_like(m_buf)
    acc_buf = torch.empty(B * H * rep_pad * ns * D, dtype=torch.float32, device=query.device)
    out = torch.empty(B, Hq, 1, D, dtype=query.dtype, device=query.device)
    ieee = query.dtype == torch.float32

    def launch(phase, temp):
        args = (query, query.stride(0), query.stride(1),
                kp["codes"], kp["cen"], kp["half"], kp["hmask"], kp["oval"], kp["oidx"], kp["lev"], kp["norm"],
                kp["data"], kp["sink"], kp["ring"], key, key.stride(0), key.stride(1),
                vp["codes"], vp["cen"], vp["half"], vp["hmask"], vp["oval"], vp["oidx"], vp["lev"],
                vp["data"], vp["sink"], vp["ring"], value, value.stride(0), value.stride(1),
                cos, sin, positions, amask, smb, smh, temp, m_buf, l_buf, acc_buf, float(scale))
        consts = dict(H=H, REP=rep, REP_PAD=rep_pad, D=D, T=T, S=cfg.sink, R=cfg.recent,
                      BITS_K=kc["BITS"], AXIS_K=kc["AXIS"], GS_K=kc["GS"], NG_K=kc["NG"], SYM_K=kc["SYM"],
                      LUT_K=kc["LUT"], NOUT_K=kc["NOUT"], NORM_K=kc["NORM"], TPG_K=kc["TPG"], WR_K=kc["WR"],
                      BITS_V=vc["BITS"], AXIS_V=vc["AXIS"], GS_V=vc["GS"], NG_V=vc["NG"], SYM_V=vc["SYM"],
                      LUT_V=vc["LUT"], NOUT_V=vc["NOUT"], TPG_V=vc["TPG"], WR_V=vc["WR"],
                      ROPE=rope, MASK_KIND=mask_kind, IS_CAUSAL=is_causal, TAU_PHASE=phase,
                      NSPLIT=nsplit, BLOCK_T=block_t, IEEE=ieee)
        _decode_kernel[(B * H, nsplit)](*args, **consts, WINDOW=False)
        _decode_kernel[(B * H, 1)](*args, **consts, WINDOW=True)

    if cfg.softmax_tau is not None:
        launch(1, query)
        hi = m_buf.view(B * H, rep_pad, ns)[:, :rep].amax(-1)
        lo = l_buf.view(B * H, rep_pad, ns)[:, :rep].amin(-1)
        width = hi - lo
        ok = torch.isfinite(width) & (width > 0)
        tau1, tau2 = cfg.softmax_tau
        temp = torch.where(ok, 1 - (tau1 + tau2) / torch.where(ok, width, 1.0), 1.0).contiguous()
        launch(2, temp)
    else:
        launch(0, query)
    _combine_kernel[(B * Hq,)](m_buf, l_buf, acc_buf, out, H=H, REP=rep, REP_PAD=rep_pad, D=D, NS=ns,
                               NS_PAD=triton.next_power_of_2(ns))
    return out
