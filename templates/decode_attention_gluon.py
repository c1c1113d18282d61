"""Decode attention over a KIVI-layout store, in Gluon: the quantized-region launch of `decode_attention`
with its layouts written out, so that packed words go straight into the registers of the tensor-core operands.

Why a second kernel. In the Triton template (`decode_attention._decode_kernel`) the codes are unpacked in a
blocked layout that Triton then converts into the mma operand layout through shared memory: at 2 bits that
costs ~5 instructions per element and holds the kernel to 14-21% of copy bandwidth (bench/RESULTS.md, sessions
3 and 8). Gluon (`triton.experimental.gluon`, shipped with triton 3.6) declares every layout, so each lane loads
exactly the packed words its mma fragments need and one inline-PTX block per word writes the dequantized
f16x2 / bf16x2 operand registers: `prmt` (replicate or interleave a byte), `lop3` (two code bits into the
mantissa of the magic number M = 1024 (fp16) / 128 (bf16), at bit 0 or 2), an exact `add` of -M, one `fma` with
the group's scale (divided by 4 for codes at bit 2) and offset. The blocks are checked bit by bit on the CPU by
a small PTX interpreter (tests/test_decode_gluon.py); Gluon has no interpreter mode, so the kernel itself runs
on a GPU only.

Scope (`supports`): the layout of kivi-2 (and xquant's 2-bit layers): 2-bit asymmetric uniform codes, Keys
per channel in groups of 32 tokens (statistics rows [NG, D]), Values per token in groups of 32 channels
(statistics [T, D / 32]), head_dim 128, at most 8 query heads per KV head, fp16 or bf16, an attention mask of
one row per sequence (HF's decode mask) or none. Everything else runs the Triton template, as do the exact
windows (sink, ring, chunk) of every layout: this kernel writes the same (max, sum, acc) partial results into
slots [0, NSPLIT) that `_decode_kernel` would, its window launch slots [NSPLIT, NSPLIT + NWIN), and
`_combine_kernel` merges them.

Math (one program = one KV head of one sequence and one slice of the quantized region, one warp):
    k[t, c] = s_k[g, c] * code + z_k[g, c]     s = half * 2 / (2^B - 1), z = center - half, g = (t - S) // 32
    v[t, c] = s_v[t, c // 32] * code + z_v[t, c // 32]
    per 32-token tile: logits = q @ k^T (mma m16n8k16, the <= 8 query rows padded to 16), online softmax in base
    2, acc^T = acc^T * alpha + v^T @ p^T (m16n8k16 with the 8 query rows as its columns).
    Scale and offset are rounded to the cache dtype before the multiply-add (one rounding of the value after
    it): values can differ from the reference's fp32 dequantization by about one unit in the last place; fp16
    scales below 2^-12 lose bits in the division by 4 (at most 3 * 2^-23 absolute).

Layouts (one warp; the mma B fragment of m16n8k16 gives lane l the reduction indices 2(l%4) + {0, 1, 8, 9}
of every 16 and the column l/4 of every 8). The reduction index of the Key mma is a permutation of the
channel, so that each lane's 32 channels of a token are two whole words (q is loaded in the same order):
    k = 64a + 32c3 + 16c2 + 8c1 + 4b1 + 2b0 + c0  <->  channel 32b + 16a + c   (c = c0 + 2c1 + 4c2 + 8c3)
The row of the transposed Value mma (v^T as its A operand) is a permutation of the channel, so that each lane's
16 rows are one word (the partial results are stored back in channel order):
    n = 8j + w  <->  channel 16w + j.

Glossary: BT tokens per tile (= the Key group, 32); REP query heads per KV head (<= 8); S sink tokens, R recent
tokens, TPG_K / TPG_V tokens per group of each side (the fill boundary); MASK_KIND 0 none / 1 bool / 2
additive; IS_BF16 the cache dtype; NSPLIT slices of the quantized region per KV head, NWIN programs of the
window launch (partial-result slots per row: NSPLIT + NWIN); A_HI + A_LO the level spacing 2/3 in two terms of
the cache dtype.
"""
from __future__ import annotations

import functools

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    HAVE_GLUON = True
except ImportError:  # an older triton: the Triton template serves every layout
    HAVE_GLUON = False

BT = 32      # tokens per tile: one Key group
D = 128      # head_dim


def _round(x: float, bf16: bool) -> float:
    import torch

    return torch.tensor(x, dtype=torch.bfloat16 if bf16 else torch.float16).item()


def _f16x2(lo: float, hi: float, bf16: bool) -> str:
    """The 32-bit pattern of an f16x2 / bf16x2 pair (lo in the low half), each rounded to nearest."""
    import torch

    def bits(x):
        return int(torch.tensor(x, dtype=torch.bfloat16 if bf16 else torch.float16).view(torch.int16).item()) & 0xFFFF

    return f"0x{(bits(hi) << 16) | bits(lo):08X}"


def _key_asm(bf16: bool) -> str:
    """16 codes of one word -> 8 registers of (value 2i, value 2i+1). Operands: $0-$7 out, $8-$23 the word (16
    copies), $24-$31 scale pairs, $32-$39 offset pairs (channels 2i, 2i+1). Per byte: `prmt` copies it into both
    halves of y; `lop3` puts codes (2m, 2m+1) of y into the mantissas of the magic number M (1024 fp16, 128 bf16)
    at bits 0 and 2: (M + code, M + 4 code); `add` removes M (exact); `fma` applies the scale (its high half
    pre-divided by 4, `_scale_offset`) and the offset. y >> 4 brings codes 2, 3 of the byte down."""
    ty = "bf16x2" if bf16 else "f16x2"
    magic = "0x43004300" if bf16 else "0x64006400"
    neg = _f16x2(-128.0, -128.0, True) if bf16 else _f16x2(-1024.0, -1024.0, False)
    lines = ["{ .reg .b32 y, x, n;", f"mov.b32 n, {neg};"]
    for i in range(4):
        lines.append(f"prmt.b32 y, $8, $8, 0x{i:x}{i:x}{i:x}{i:x};")
        for half in range(2):
            if half:
                lines.append("shr.b32 y, y, 4;")
            r = 2 * i + half
            lines.append(f"lop3.b32 x, y, 0x000C0003, {magic}, 0xea; add.rn.{ty} x, x, n; "
                         f"fma.rn.{ty} ${r}, x, ${24 + r}, ${32 + r};")
    lines.append("}")
    return "\n".join(lines)


def _value_asm(bf16: bool) -> str:
    """Codes 0-7 of two tokens' words (pre-shifted so they sit in bytes 0-1) -> 8 registers (token t, token t+1)
    of code j = 0..7. Operands: $0-$7 out, $8-$23 words (even: token t, odd: token t+1), $24-$31 scale pairs,
    $32-$39 offset pairs (t, t+1). `prmt` interleaves a byte of the two words; `lop3` puts code m (m = 0, 1) of
    each half into the mantissa of M (M + 4^m code); `add` removes M; `fma` applies the scale (divided by 4^m)
    and the offset; y >> 4 brings codes 2, 3 of the byte down."""
    ty = "bf16x2" if bf16 else "f16x2"
    magic = "0x43004300" if bf16 else "0x64006400"
    neg = _f16x2(-128.0, -128.0, True) if bf16 else _f16x2(-1024.0, -1024.0, False)
    lines = ["{ .reg .b32 y, x, n, s1, z0;", f"mov.b32 n, {neg}; mov.b32 z0, {_NEG0};",
             f"mov.b32 s1, {_f16x2(0.25, 0.25, bf16)}; fma.rn.{ty} s1, $24, s1, z0;"]
    for byte in range(2):
        lines.append(f"prmt.b32 y, $8, $9, 0x{4 + byte:x}{4 + byte:x}{byte:x}{byte:x};")
        for j in range(4):
            if j == 2:
                lines.append("shr.b32 y, y, 4;")
            mask = "0x00030003" if j % 2 == 0 else "0x000C000C"
            scale = "$24" if j % 2 == 0 else "s1"
            lines.append(f"lop3.b32 x, y, {mask}, {magic}, 0xea; add.rn.{ty} x, x, n; "
                         f"fma.rn.{ty} ${4 * byte + j}, x, {scale}, $32;")
    lines.append("}")
    return "\n".join(lines)


_NEG0 = "0x80008000"  # (-0, -0): the addend of a product written as fma


def _stats_asm(bf16: bool) -> tuple[str, str]:
    """(s = fma(half, hi, half * lo), z = center - half) on packed pairs. Operands of s: $0 out, $1 half, $2 hi,
    $3 lo (the scale split in two terms of the cache dtype, so s is rounded once in effect); of z: $0 out,
    $1 half, $2 center."""
    ty = "bf16x2" if bf16 else "f16x2"
    s = (f"{{ .reg .b32 z, t; mov.b32 z, {_NEG0}; fma.rn.{ty} t, $1, $3, z; fma.rn.{ty} $0, $1, $2, t; }}")
    z = f"{{ .reg .b32 a; mov.b32 a, {_f16x2(-1.0, -1.0, bf16)}; fma.rn.{ty} $0, $1, a, $2; }}"
    return s, z


@functools.lru_cache(maxsize=None)
def split_scale(scale: float, bf16: bool) -> tuple[float, float]:
    """(hi, lo): scale = hi + lo to about twice the cache dtype's precision, both representable in it."""
    hi = _round(scale, bf16)
    return hi, _round(scale - hi, bf16)


_C = {}
for _bf in (False, True):
    _s, _z = _stats_asm(_bf)
    _C[_bf] = (_key_asm(_bf), _value_asm(_bf), _s, _z)
_KEY_F16, _VAL_F16, _SCL_F16, _OFF_F16 = _C[False]
_KEY_BF16, _VAL_BF16, _SCL_BF16, _OFF_BF16 = _C[True]
_CONSTRAINTS = "=r,=r,=r,=r,=r,=r,=r,=r," + ",".join(["r"] * 32)

if HAVE_GLUON:
    KEY_F16 = gl.constexpr(_KEY_F16)
    VAL_F16 = gl.constexpr(_VAL_F16)
    SCL_F16 = gl.constexpr(_SCL_F16)
    OFF_F16 = gl.constexpr(_OFF_F16)
    KEY_BF16 = gl.constexpr(_KEY_BF16)
    VAL_BF16 = gl.constexpr(_VAL_BF16)
    SCL_BF16 = gl.constexpr(_SCL_BF16)
    OFF_BF16 = gl.constexpr(_OFF_BF16)
    CONSTRAINTS = gl.constexpr(_CONSTRAINTS)
    D_ = gl.constexpr(D)

    def _key_layout(bt: int):
        """Keys as [a(2), b(4), c(16), t(bt)]: code c of word a + 2b of token t; registers c0..c3 first (one word
        per inline-asm block), lanes (b, t % 8), registers t // 8: the mma B fragment after the reshape."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0], [0, 0, 8, 0], [1, 0, 0, 0]]
            + [[0, 0, 0, 8 << i] for i in range(bt.bit_length() - 4)],
            lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]],
            warp_bases=[], block_bases=[], shape=[2, 4, 16, bt])

    def _value_layout(bt: int):
        """Values as [t(bt), w(8), jh(2), jl(8)]: code 8jh + jl of word w of token t; registers (t % 2, jl) first
        (one inline-asm block: two tokens, eight codes), lanes (t // 2 % 4, w): the mma A fragment of v^T."""
        return gl.DistributedLinearLayout(
            reg_bases=[[1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0]]
            + [[8 << i, 0, 0, 0] for i in range(bt.bit_length() - 4)],
            lane_bases=[[2, 0, 0, 0], [4, 0, 0, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
            warp_bases=[], block_bases=[], shape=[bt, 8, 2, 8])

    PK32 = gl.constexpr(_key_layout(32))
    PV32 = gl.constexpr(_value_layout(32))

    @gluon.jit
    def _scale_offset(half, center, hi, lo, IS_BF16: gl.constexpr):
        """(half * (hi + lo), center - half) in the cache dtype, two per instruction (hi, lo broadcast)."""
        if IS_BF16:
            s = gl.inline_asm_elementwise(SCL_BF16, "=r,r,r,r", [half, hi, lo], dtype=gl.bfloat16, is_pure=True,
                                          pack=2)
            z = gl.inline_asm_elementwise(OFF_BF16, "=r,r,r", [half, center], dtype=gl.bfloat16, is_pure=True,
                                          pack=2)
        else:
            s = gl.inline_asm_elementwise(SCL_F16, "=r,r,r,r", [half, hi, lo], dtype=gl.float16, is_pure=True,
                                          pack=2)
            z = gl.inline_asm_elementwise(OFF_F16, "=r,r,r", [half, center], dtype=gl.float16, is_pure=True, pack=2)
        return s, z

    @gluon.jit
    def _words_to_values(words, s, z, ASM_F16: gl.constexpr, ASM_BF16: gl.constexpr, IS_BF16: gl.constexpr):
        """Dequantized values (cache dtype) from packed words broadcast over their codes, 16 per asm block."""
        if IS_BF16:
            x = gl.inline_asm_elementwise(ASM_BF16, CONSTRAINTS, [words, s, z], dtype=gl.bfloat16, is_pure=True,
                                          pack=16)
        else:
            x = gl.inline_asm_elementwise(ASM_F16, CONSTRAINTS, [words, s, z], dtype=gl.float16, is_pure=True,
                                          pack=16)
        return x

    @gluon.jit
    def _kivi_decode_kernel(
            Q, stride_qb, stride_qh, KC, KCEN, KHALF, VC, VCEN, VHALF, POS, AMASK, stride_mb,
            OUT_M, OUT_L, OUT_ACC, scale, T, NG_K, NSPLIT,
            H: gl.constexpr, REP: gl.constexpr, S: gl.constexpr, R: gl.constexpr,
            TPG_K: gl.constexpr, TPG_V: gl.constexpr, MASK_KIND: gl.constexpr, IS_BF16: gl.constexpr,
            BT: gl.constexpr, A_HI: gl.constexpr, A_LO: gl.constexpr, NWIN: gl.constexpr):
        bh = gl.program_id(0)
        split = gl.program_id(1)
        b = bh // H
        h = bh % H
        dt: gl.constexpr = gl.bfloat16 if IS_BF16 else gl.float16
        W: gl.constexpr = 8  # int32 words per token (2-bit codes, 128 channels)
        D: gl.constexpr = D_

        # the slice of [S, qend) this program covers, as `_decode_kernel` computes it
        p0 = gl.load(POS).to(gl.int32)
        L = p0 + 1
        bnd_k = S + gl.maximum(L - S - R, 0) // TPG_K * TPG_K
        bnd_v = S + gl.maximum(L - S - R, 0) // TPG_V * TPG_V
        qend = gl.minimum(gl.minimum(bnd_k, bnd_v), p0)
        qlen = gl.maximum(qend - S, 0)
        per = gl.cdiv(gl.cdiv(qlen, NSPLIT), BT) * BT
        start = S + split * per
        stop = gl.minimum(start + per, qend)
        n_iter = gl.cdiv(gl.maximum(stop - start, 0), BT)

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        gl.static_assert(BT == 32, "one tile = one Key group of 32 tokens")
        PK: gl.constexpr = PK32
        KW: gl.constexpr = gl.SliceLayout(2, PK)   # words [2, 4, BT]
        KS: gl.constexpr = gl.SliceLayout(3, PK)   # statistics [2, 4, 16]
        PV: gl.constexpr = PV32
        VW3: gl.constexpr = gl.SliceLayout(3, PV)  # [BT, 8, 2]
        VW: gl.constexpr = gl.SliceLayout(2, VW3)  # words, statistics [BT, 8]

        # Key words and statistics offsets
        ka = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, KW)))
        kb = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, KW)))
        kt = gl.arange(0, BT, layout=gl.SliceLayout(0, gl.SliceLayout(0, KW)))
        kword = gl.expand_dims(gl.expand_dims(ka, 1) + gl.expand_dims(kb, 0) * 2, 2)   # [2, 4, 1]
        koff = gl.expand_dims(gl.expand_dims(kt, 0), 0) * W + kword                   # [2, 4, BT]
        sa = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, KS)))
        sb = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, KS)))
        sc = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(0, KS)))
        schan = gl.expand_dims(gl.expand_dims(sa * 16, 1) + gl.expand_dims(sb * 32, 0), 2) + \
            gl.expand_dims(gl.expand_dims(sc, 0), 0)                                    # [2, 4, 16] channels
        # the level spacing 2 / 3 as hi + lo; Keys' odd channels divided by 4 (their code sits at bit 2, `_key_asm`)
        kfac = gl.where(sc % 2 == 0, 1.0, 0.25)
        khi = gl.expand_dims(gl.expand_dims((kfac * A_HI).to(dt), 0), 0)              # [1, 1, 16]
        klo = gl.expand_dims(gl.expand_dims((kfac * A_LO).to(dt), 0), 0)
        # Value words and statistics offsets
        vt = gl.arange(0, BT, layout=gl.SliceLayout(1, VW))
        vw = gl.arange(0, 8, layout=gl.SliceLayout(0, VW))
        voff = gl.expand_dims(vt, 1) * W + gl.expand_dims(vw, 0)                      # [BT, 8]
        vsoff = gl.expand_dims(vt, 1) * 4 + gl.expand_dims(vw // 2, 0)                # [BT, 8] group w // 2
        jh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, VW3)))
        vshift = gl.expand_dims(gl.expand_dims(jh * 16, 0), 0)                         # [1, 1, 2]
        jl = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, PV))))
        jdummy = gl.expand_dims(gl.expand_dims(gl.expand_dims(jl, 0), 0), 0)         # [1, 1, 1, 8], broadcast only
        vhi = gl.full([BT, 8], A_HI, dt, VW)
        vlo = gl.full([BT, 8], A_LO, dt, VW)

        bh64 = bh.to(gl.int64)
        kc_base = KC + bh64 * T * W
        ks_base = bh64 * NG_K * D
        vc_base = VC + bh64 * T * W
        vs_base = bh64 * T * 4

        # q [16, 128] in the Key mma's reduction order
        qm = gl.arange(0, 16, layout=gl.SliceLayout(1, a_l))
        qk = gl.arange(0, 128, layout=gl.SliceLayout(0, a_l))
        qc = (qk & 1) + ((qk >> 3) & 1) * 2 + ((qk >> 4) & 1) * 4 + ((qk >> 5) & 1) * 8
        qchan = 16 * ((qk >> 6) & 1) + 32 * ((qk >> 1) & 3) + qc
        q = gl.load(Q + b.to(gl.int64) * stride_qb + gl.expand_dims((h * REP + qm) * stride_qh, 1)
                    + gl.expand_dims(qchan, 0), mask=gl.expand_dims(qm < REP, 1), other=0.0)

        LOG2E: gl.constexpr = 1.4426950408889634
        qscale = scale * LOG2E
        rows = gl.arange(0, 16, layout=gl.SliceLayout(1, mma))
        cols = gl.arange(0, BT, layout=gl.SliceLayout(0, mma))
        m_i = gl.full([16], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
        l_i = gl.zeros([16], gl.float32, gl.SliceLayout(1, mma))
        acc = gl.zeros([128, 8], gl.float32, mma)   # transposed: out^T = v^T @ p^T, channels n = 8j + w

        for it in range(0, n_iter):
            t0 = start + it * BT
            kwords, kh, kcen, vwords, vh, vcen = _load_tile(kc_base, KHALF, KCEN, vc_base, VHALF, VCEN, ks_base,
                                                            vs_base, t0, stop, S, koff, schan, kt, voff, vsoff, vt,
                                                            BT, D, W)
            ks, kz = _scale_offset(kh, kcen, khi, klo, IS_BF16)
            wb, ks4 = gl.broadcast(gl.expand_dims(kwords, 2), gl.expand_dims(ks, 3))
            wb, kz4 = gl.broadcast(wb, gl.expand_dims(kz, 3))
            kv = _words_to_values(wb, ks4, kz4, KEY_F16, KEY_BF16, IS_BF16)
            kv = kv.reshape([2, 2, 2, 2, 2, 2, 2, BT]).permute([0, 3, 4, 5, 1, 2, 6, 7]).reshape([128, BT])
            kv = gl.convert_layout(kv, b_l)
            s = mma_v2(q, kv, gl.zeros([16, BT], gl.float32, mma)) * qscale

            tt = t0 + cols
            allowed = gl.expand_dims(rows < REP, 1) & gl.expand_dims(tt < stop, 0)
            if MASK_KIND == 1:
                mv = gl.load(AMASK + b.to(gl.int64) * stride_mb + tt, mask=tt < stop, other=0)
                allowed = allowed & gl.expand_dims(mv != 0, 0)
            elif MASK_KIND == 2:
                mv = gl.load(AMASK + b.to(gl.int64) * stride_mb + tt, mask=tt < stop, other=0.0).to(gl.float32)
                s = s + gl.expand_dims(mv * LOG2E, 0)
                allowed = allowed & gl.expand_dims(mv > float("-inf"), 0)
            s = gl.where(allowed, s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s - gl.expand_dims(m_use, 1))
            alpha = gl.exp2(m_i - m_use)
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new

            vs, vz = _scale_offset(vh, vcen, vhi, vlo, IS_BF16)
            vw3 = gl.expand_dims(vwords, 2) >> vshift                                   # [BT, 8, 2]
            wv, _ = gl.broadcast(gl.expand_dims(vw3, 3), jdummy)                      # [BT, 8, 2, 8]
            wv, vs4 = gl.broadcast(wv, gl.expand_dims(gl.expand_dims(vs, 2), 3))
            wv, vz4 = gl.broadcast(wv, gl.expand_dims(gl.expand_dims(vz, 2), 3))
            vv = _words_to_values(wv, vs4, vz4, VAL_F16, VAL_BF16, IS_BF16)
            vv = vv.permute([0, 2, 3, 1]).reshape([BT, 128]).permute([1, 0])          # v^T [128 (n = 8j + w), BT]
            vv = gl.convert_layout(vv, a_l)
            # p^T [BT, 8]: rows 0-7 of p (the mma's rows 8-15 are padding: REP <= 8), as the B operand
            p_lo, p_hi = gl.split(p.to(dt).reshape([2, 8, BT]).permute([1, 2, 0]))
            pt = gl.convert_layout(p_lo.permute([1, 0]), b_l)
            a_lo, a_hi = gl.split(alpha.reshape([2, 8]).permute([1, 0]))
            a8 = gl.convert_layout(a_lo, gl.SliceLayout(0, mma))
            acc = mma_v2(vv, pt, acc * gl.expand_dims(a8, 0))

        # partial results, as `_decode_kernel` writes them (rows REP..15 are never read): output channels back
        # in channel order
        o = (bh * 16 + rows) * (NSPLIT + NWIN) + split
        LN2: gl.constexpr = 0.6931471805599453
        gl.store(OUT_M + o, m_i * LN2, mask=rows < REP)
        gl.store(OUT_L + o, l_i, mask=rows < REP)
        n = gl.arange(0, 128, layout=gl.SliceLayout(1, mma))
        r8 = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
        chan = 16 * (n & 7) + (n >> 3)
        o8 = (bh * 16 + r8) * (NSPLIT + NWIN) + split
        gl.store(OUT_ACC + gl.expand_dims(o8, 0) * 128 + gl.expand_dims(chan, 1), acc,
                 mask=gl.expand_dims(r8 < REP, 0))

    @gluon.jit
    def _load_tile(kc_base, KHALF, KCEN, vc_base, VHALF, VCEN, ks_base, vs_base, t0, stop, S: gl.constexpr, koff,
                   schan, kt, voff, vsoff, vt, BT: gl.constexpr, D: gl.constexpr, W: gl.constexpr):
        """Packed words and raw statistics of the tile at t0 (positions >= stop load 0)."""
        kvalid = (t0 + kt) < stop
        kwords = gl.load(kc_base + t0 * W + koff, mask=gl.expand_dims(gl.expand_dims(kvalid, 0), 0), other=0)
        grow = (t0 - S) // 32
        srow = ks_base + grow * D + schan
        kh = gl.load(KHALF + srow)  # t0 < stop: the tile's group row is written
        kcen = gl.load(KCEN + srow)
        vvalid = gl.expand_dims((t0 + vt) < stop, 1)
        vwords = gl.load(vc_base + t0 * W + voff, mask=vvalid, other=0)
        vh = gl.load(VHALF + vs_base + t0 * 4 + vsoff, mask=vvalid, other=0.0)
        vcen = gl.load(VCEN + vs_base + t0 * 4 + vsoff, mask=vvalid, other=0.0)
        return kwords, kh, kcen, vwords, vh, vcen


def supports(query, rep: int, kc: dict, vc: dict, kp: dict, rope: bool, mask_kind: int, mask_shared: bool,
             is_causal: bool, tau) -> str | None:
    """None when this kernel serves the layer's quantized region, else why not (the Triton template does)."""
    import torch

    key = dict(BITS=2, AXIS=1, GS=32, SYM=0, LUT=False, NOUT=0, NORM=False, TPG=32)
    val = dict(BITS=2, AXIS=0, GS=32, SYM=0, LUT=False, NOUT=0)
    if any(kc[n] != v for n, v in key.items()) or any(vc[n] != v for n, v in val.items()):
        return "the store is not in KIVI's 2-bit layout"
    if query.shape[-1] != D:
        return "needs head_dim 128"
    if rep > 8:
        return "needs at most 8 query heads per KV head"
    if rope or is_causal or tau is not None or (mask_kind != 0 and not mask_shared):
        return "RoPE after dequantization, is_causal, calibrated softmax or a per-head mask"
    if query.dtype not in (torch.float16, torch.bfloat16) or kp["half"].dtype != query.dtype:
        return "needs fp16 or bf16 queries and statistics of the same dtype"
    if not query.is_cuda or torch.cuda.get_device_capability(query.device) < (8, 0):
        return "needs an NVIDIA GPU of compute capability 8.0 or newer"
    if not HAVE_GLUON:
        return "triton.experimental.gluon is not available"
    return None


@functools.lru_cache(maxsize=None)
def enabled() -> bool:
    """KVQ_GLUON=0 turns the kernel off (every layout then runs the Triton template); read once per process."""
    import os

    return HAVE_GLUON and os.environ.get("KVQ_GLUON", "1") != "0"


def launch(query, kp: dict, vp: dict, positions, amask, smb: int, mask_kind: int, m_buf, l_buf, acc_buf,
           scale: float, T: int, ng_k: int, nsplit: int, nwin: int, H: int, rep: int, sink: int, recent: int,
           tpg_v: int):
    """Run the quantized-region launch into slots [0, nsplit) of the partial buffers (grid (B * H, nsplit); each
    row has nsplit + nwin slots, the last nwin the window launch's)."""
    import torch

    B = query.shape[0]
    bf16 = query.dtype == torch.bfloat16
    a_hi, a_lo = split_scale(2.0 / 3.0, bf16)
    return _kivi_decode_kernel[(B * H, nsplit)](
        query, query.stride(0), query.stride(1), kp["codes"], kp["cen"], kp["half"], vp["codes"], vp["cen"],
        vp["half"], positions, amask, smb, m_buf, l_buf, acc_buf, float(scale), T, ng_k, nsplit,
        H=H, REP=rep, S=sink, R=recent, TPG_K=32, TPG_V=tpg_v, MASK_KIND=mask_kind,
        IS_BF16=bf16, BT=BT, A_HI=a_hi, A_LO=a_lo, NWIN=nwin, num_warps=1)

