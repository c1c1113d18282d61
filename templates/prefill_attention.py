"""Chunk (prefill) attention over the packed kvq store plus the exact chunk, in Triton: n query tokens per
sequence whose keys and values were just appended at positions [p0, p0 + n), p0 > 0 (a later prefill chunk,
the next turn of a chat). p0 = 0 needs no store and stays with torch's SDPA (`ops.attend_chunk`).

Math (per sequence b, KV head h, query rows (i, r): chunk token i < n, head r < REP of the GQA group; written
length L = p0 + n):

    k_t, v_t for t < p0: the store as `decode_attention` reads it at length L (sink, codes below Q_side(L),
          ring), dequantized in the tile loads (decode_attention._load_side), keys stored before RoPE rotated
          after dequantization; t in [p0, L): the chunk itself, exact (its keys arrive rotated).
    s_(i,r),t = scale * q_(i,r) . k_t + bias_(i,r),t over allowed t: the mask [b, hq, i, t] (bool, or additive
          with -inf as masked) and is_causal (SDPA's top-left alignment: t <= i).
    CalibQuant: a first pass over the keys gives each row's range [lo, hi] of s over its allowed t; then
          s *= 1 - (tau1 + tau2) / (hi - lo) (1 when hi - lo is not positive and finite), as
          `reference.calibrated_softmax`.
    out_(i,r) = sum_t softmax(s_(i,r))_t v_t; a row with no allowed t gives 0, as torch's SDPA.

Work split: one program per (b * H + h, block of BLOCK_M chunk tokens); its rows are BLOCK_M tokens x REP_P2
heads ([ROWS, D] x [D, BLOCK_T] dots), so each K/V tile is dequantized once for all of them. The store is
not split along t: B * H * cdiv(n, BLOCK_M) programs, which fill an H100 (132 SMs) only for long chunks or
large batches (a short chunk of a small batch, e.g. a speculative-decoding check, runs few long programs). p0
is read on the device.

Glossary (as decode_attention, plus): NCH chunk length n; REP_P2 query heads per KV head rounded up to a
power of two; BLOCK_M chunk tokens per program; ROWS = BLOCK_M * REP_P2; TAU CalibQuant's calibration on
(TAU_SUM = tau1 + tau2); stride_*n the token strides of query, chunk keys / values, mask and output.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from kvq_compile import compat
from kvq_compile.templates.decode_attention import (_apply_mask, _dot, _load_side, _quantized_end, _rope,
                                                     _side_args, _softmax_step, _window_t, side_constants,
                                                     side_pointers)

compat.fix_triton_interpreter()
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _logits(q, KC, KCEN, KHALF, KOVAL, KOIDX, KLEV, KNORM, KDATA, KSINK, KRING, KCHUNK,
            stride_kb, stride_kh, stride_kn, COS, SIN, AMASK, stride_mb, stride_mh, stride_mn,
            b, h, bh, qh64, i, i64, rvalid, t, t0, tvalid, d, p0, bnd_k, scale, T, NG_K, NCH,
            D: tl.constexpr, S: tl.constexpr, BITS_K: tl.constexpr, AXIS_K: tl.constexpr, GS_K: tl.constexpr,
            SYM_K: tl.constexpr, LUT_K: tl.constexpr, NOUT_K: tl.constexpr, NORM_K: tl.constexpr,
            WR_K: tl.constexpr, ROPE: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
            ONLY_CODES: tl.constexpr, BLOCK_T: tl.constexpr, dt: tl.constexpr, IEEE: tl.constexpr,
            INTERP: tl.constexpr):
    """(s [ROWS, BLOCK_T] float32 with the additive bias, allowed [ROWS, BLOCK_T]) of one key tile; ONLY_CODES:
    every t of the tile is in the quantized region (no window or chunk loads)."""
    k = _load_side(KC, KCEN, KHALF, KOVAL, KOIDX, KLEV, KNORM, KDATA, KSINK, KRING, KCHUNK,
                   stride_kb, stride_kh, stride_kn, NCH, b, h, bh, t, t0, d, tvalid, p0, bnd_k, T, D, S, WR_K, BITS_K,
                   AXIS_K, GS_K, NG_K, SYM_K, LUT_K, NOUT_K, NORM_K, ONLY_CODES, BLOCK_T)
    if ROPE:  # the chunk's keys arrive already rotated (they are the attention's input, not the store's)
        if ONLY_CODES:
            k = _rope(k, t, d, COS, SIN, b, tvalid, T, D, BLOCK_T)
        else:
            k = tl.where((t >= p0)[:, None], k, _rope(k, t, d, COS, SIN, b, tvalid & (t < p0), T, D, BLOCK_T))
    s = _dot(q, tl.trans(k), dt, IEEE, INTERP) * scale
    allowed = rvalid[:, None] & tvalid[None, :]
    moff = b.to(tl.int64) * stride_mb + qh64[:, None] * stride_mh + i64[:, None] * stride_mn + t[None, :]
    s, allowed = _apply_mask(s, allowed, AMASK, moff, allowed, MASK_KIND)
    if IS_CAUSAL:
        allowed = allowed & (t[None, :] <= i[:, None])
    return s, allowed


@triton.jit
def _prefill_kernel(
        Q, stride_qb, stride_qh, stride_qn,
        KC, KCEN, KHALF, KOVAL, KOIDX, KLEV, KNORM, KDATA, KSINK, KRING, KCHUNK,
        stride_kb, stride_kh, stride_kn,
        VC, VCEN, VHALF, VOVAL, VOIDX, VLEV, VDATA, VSINK, VRING, VCHUNK, stride_vb, stride_vh, stride_vn,
        COS, SIN, POS, AMASK, stride_mb, stride_mh, stride_mn,
        O, stride_ob, stride_oh, stride_on, scale, TAU_SUM, T, NG_K, NG_V, NCH,
        H: tl.constexpr, REP: tl.constexpr, REP_P2: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
        S: tl.constexpr, R: tl.constexpr,
        BITS_K: tl.constexpr, AXIS_K: tl.constexpr, GS_K: tl.constexpr,
        SYM_K: tl.constexpr, LUT_K: tl.constexpr, NOUT_K: tl.constexpr, NORM_K: tl.constexpr,
        TPG_K: tl.constexpr, WR_K: tl.constexpr,
        BITS_V: tl.constexpr, AXIS_V: tl.constexpr, GS_V: tl.constexpr,
        SYM_V: tl.constexpr, LUT_V: tl.constexpr, NOUT_V: tl.constexpr, TPG_V: tl.constexpr, WR_V: tl.constexpr,
        ROPE: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, TAU: tl.constexpr,
        BLOCK_T: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    p0 = tl.load(POS).to(tl.int32)
    L = p0 + NCH
    bnd_k = _quantized_end(L, S, R, TPG_K, BITS_K)
    bnd_v = _quantized_end(L, S, R, TPG_V, BITS_V)

    ROWS: tl.constexpr = BLOCK_M * REP_P2
    m = tl.arange(0, ROWS)
    i = tl.program_id(1) * BLOCK_M + m // REP_P2
    r = m % REP_P2
    rvalid = (r < REP) & (i < NCH)
    qh64 = (h * REP + r).to(tl.int64)  # 64-bit offsets: one batch row of a [B, Hq, n, T] mask can pass 2^31
    i64 = i.to(tl.int64)
    d = tl.arange(0, D)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + qh64[:, None] * stride_qh + i64[:, None] * stride_qn + d[None, :],
                mask=rvalid[:, None], other=0.0)
    dt: tl.constexpr = Q.dtype.element_ty

    # Segments of [0, t_end): the region where both sides are quantized [S_EFF, main_hi) (codes only, as
    # decode's main launch), and the windows [0, sink_hi) + [win_lo, t_end) (sink, ring, chunk).
    t_end = L
    if IS_CAUSAL:  # no row of this block sees past its last token
        t_end = tl.minimum(L, tl.minimum(tl.program_id(1) * BLOCK_M + BLOCK_M, NCH))
    S_EFF: tl.constexpr = 0 if (BITS_K == 16 and BITS_V == 16) else S
    qend = tl.minimum(tl.minimum(bnd_k, bnd_v), p0)
    main_hi = tl.minimum(qend, t_end)
    n_main = tl.cdiv(tl.maximum(main_hi - S_EFF, 0), BLOCK_T)
    sink_hi = tl.minimum(S_EFF, t_end)
    win_lo = tl.maximum(S_EFF, qend)
    n_sink = tl.cdiv(sink_hi, BLOCK_T)
    n_win = n_sink + tl.cdiv(tl.maximum(t_end - win_lo, 0), BLOCK_T)

    temp = tl.full([ROWS], 1.0, tl.float32)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)  # range pass: the row maximum; attention pass: running max
    l_i = tl.full([ROWS], float("inf"), tl.float32)  # range pass: the row minimum; attention pass: running sum
    acc = tl.zeros([ROWS, D], tl.float32)
    # CalibQuant (over a stored prefix only, as the reference): pass 0 finds each row's range, pass 1 attends
    for ps in tl.static_range(0 if TAU else 1, 2):
        if ps == 1:
            if TAU:
                width = m_i - l_i
                ok = (width > 0) & (width < float("inf")) & (p0 > 0)
                temp = tl.where(ok, 1.0 - TAU_SUM / tl.where(ok, width, 1.0), 1.0)
            m_i = tl.full([ROWS], float("-inf"), tl.float32)
            l_i = tl.zeros([ROWS], tl.float32)
        for seg in tl.static_range(2):  # 0: the quantized region, codes only (fewer live tiles); 1: the windows
            for it in range(0, n_main if seg == 0 else n_win):
                t0 = S_EFF + it * BLOCK_T  # the tile's first position
                if seg == 0:
                    t = t0 + tl.arange(0, BLOCK_T)
                    tvalid = t < main_hi
                else:
                    t, tvalid, t0 = _window_t(it, n_sink, sink_hi, win_lo, t_end, BLOCK_T)
                s, allowed = _logits(q, KC, KCEN, KHALF, KOVAL, KOIDX, KLEV, KNORM, KDATA, KSINK, KRING,
                                     KCHUNK, stride_kb, stride_kh, stride_kn, COS, SIN, AMASK, stride_mb, stride_mh,
                                     stride_mn, b, h, bh, qh64, i, i64, rvalid, t, t0, tvalid, d, p0, bnd_k, scale, T,
                                     NG_K, NCH, D, S, BITS_K, AXIS_K, GS_K, SYM_K, LUT_K, NOUT_K, NORM_K, WR_K, ROPE,
                                     MASK_KIND, IS_CAUSAL, seg == 0, BLOCK_T, dt, IEEE, INTERP)
                if ps == 0:
                    m_i = tl.maximum(m_i, tl.max(tl.where(allowed, s, float("-inf")), 1))
                    l_i = tl.minimum(l_i, tl.min(tl.where(allowed, s, float("inf")), 1))
                else:
                    v = _load_side(VC, VCEN, VHALF, VOVAL, VOIDX, VLEV, VLEV, VDATA, VSINK, VRING, VCHUNK,
                                   stride_vb, stride_vh, stride_vn, NCH, b, h, bh, t, t0, d, tvalid, p0, bnd_v, T, D, S,
                                   WR_V, BITS_V, AXIS_V, GS_V, NG_V, SYM_V, LUT_V, NOUT_V, False, seg == 0, BLOCK_T)
                    m_i, l_i, acc = _online_softmax(s, allowed, v, temp, m_i, l_i, acc, TAU, dt, IEEE, INTERP)

    out = tl.where((l_i > 0)[:, None], acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(O + b.to(tl.int64) * stride_ob + qh64[:, None] * stride_oh + i64[:, None] * stride_on + d[None, :],
             out.to(O.dtype.element_ty), mask=rvalid[:, None])


@triton.jit
def _online_softmax(s, allowed, v, temp, m_i, l_i, acc, TAU: tl.constexpr, dt: tl.constexpr, IEEE: tl.constexpr,
                    INTERP: tl.constexpr):
    """One tile of the running softmax: (max, sum, acc) updated with scores s (masked by allowed) and values v."""
    if TAU:
        s = s * temp[:, None]
    p, alpha, m_new, l_new = _softmax_step(tl.where(allowed, s, float("-inf")), m_i, l_i)
    return m_new, l_new, acc * alpha[:, None] + _dot(p, v, dt, IEEE, INTERP)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------
def default_block_m(rep_p2: int, rows: int = 64) -> int:
    """Chunk tokens per program: `rows` query rows (tokens x GQA heads padded to rep_p2), at least one token."""
    return max(1, rows // rep_p2)


def prefill_attention(query, bufs: dict, key, value, positions, attn_mask, scale: float, is_causal: bool,
                      cfg, spec, geo, block_m: int | None = None, block_t: int = 16, num_warps: int = 8,
                      num_stages: int = 2, out=None):
    """kvq::attend for a chunk of n >= 1 query tokens per sequence over the store plus the chunk, on the device.

    query [B, Hq, n, D]; bufs: the layer's attend tensors by name (store.LayerStore.attend_tensors), written
    through the chunk's append; key/value [B, H, n, D]: the chunk, appended at positions [p0, p0 + n) (p0 is
    read on the device; the op's dispatcher sends p0 = 0 to SDPA); attn_mask [B|1, Hq|1, n|1, >= L] or None
    (its last dimension must cover the written length L = p0 + n: the kernel reads it up to L).
    out: a [B, Hq, n, D] tensor of the query dtype with unit last stride to write into (else a new one).
    Default launch (64 query rows, 16-token tiles, 8 warps): compiled for sm_90 at head_dim 128 it spills no
    registers for any preset but kvquant-4 under a bool mask (8 bytes; additive masks not checked); 32-token
    tiles or 4 warps spill for several
    (`bench/sm90_registers.py`, bench/RESULTS.md session 6). Timed on an H100 in session 7 (bench/RESULTS.md):
    faster than SDPA over the dequantized prefix for short chunks and CalibQuant, slower for long chunks
    (`ops._prefill_choice` picks)."""
    import torch

    B, Hq, n, D = query.shape
    H = key.shape[1]
    if Hq % H:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {H}")
    if tuple(key.shape) != (B, H, n, D) or tuple(value.shape) != (B, H, n, D):
        raise ValueError(f"key / value must be [B, H, n, D] = {(B, H, n, D)}, got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    rep = Hq // H
    rep_p2 = triton.next_power_of_2(rep)
    block_m = block_m or default_block_m(rep_p2)
    if block_m * rep_p2 < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two with block_m * {rep_p2} >= 16, got {block_m}")
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two >= 16 (the p @ V dot), got {block_t}")
    T = geo.rows   # the buffers' rows (`Geometry.rows`)
    query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    kp, kc = _side_args(bufs, "k", spec.key, geo, cfg)
    vp, vc = _side_args(bufs, "v", spec.value, geo, cfg)
    rope = cfg.keys_before_rope and spec.key.quantized
    cos = bufs["rope.cos"] if rope else query
    sin = bufs["rope.sin"] if rope else query
    if attn_mask is None:
        mask_kind, amask, smb, smh, smn = 0, query, 0, 0, 0
    else:
        amask = attn_mask if attn_mask.stride(-1) == 1 else attn_mask.contiguous()
        while amask.dim() < 4:
            amask = amask.unsqueeze(0)
        mask_kind = 1 if amask.dtype == torch.bool else 2
        smb, smh, smn = (amask.stride(j) if amask.shape[j] > 1 else 0 for j in range(3))
    if out is None:
        out = torch.empty(B, Hq, n, D, dtype=query.dtype, device=query.device)
    elif tuple(out.shape) != (B, Hq, n, D) or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be a {query.dtype} tensor of shape {(B, Hq, n, D)} with unit last stride, got "
                         f"{out.dtype} {tuple(out.shape)} with strides {out.stride()}")
    tau = cfg.softmax_tau
    args = (query, query.stride(0), query.stride(1), query.stride(2),
            *side_pointers(kp, True), key, key.stride(0), key.stride(1), key.stride(2),
            *side_pointers(vp, False), value, value.stride(0), value.stride(1), value.stride(2),
            cos, sin, positions, amask, smb, smh, smn, out, out.stride(0), out.stride(1), out.stride(2),
            float(scale), float(sum(tau)) if tau else 0.0, T, kc["NG"], vc["NG"], n)
    consts = dict(H=H, REP=rep, REP_P2=rep_p2, BLOCK_M=block_m, D=D, S=cfg.sink, R=cfg.recent,
                  **side_constants(kc, vc), ROPE=rope, MASK_KIND=mask_kind, IS_CAUSAL=is_causal, TAU=tau is not None,
                  BLOCK_T=block_t, IEEE=query.dtype == torch.float32, INTERP=_INTERPRET)
    _prefill_kernel[(B * H, triton.cdiv(n, block_m))](*args, **consts, num_warps=num_warps, num_stages=num_stages)
    return out
