"""Decode attention over a KIVI-, InnerQ-, calibquant-, kvquant- or int8-layout store, in Gluon: the quantized-region launch of `decode_attention`
with its layouts written out, so that packed words go straight into the registers of the tensor-core operands.

Why a second kernel. In the Triton template (`decode_attention._decode_kernel`) the codes are unpacked in a
blocked layout that Triton then converts into the mma operand layout through shared memory: at 2 bits that
costs ~5 instructions per element and holds the kernel to 14-21% of copy bandwidth (bench/RESULTS.md, sessions
3 and 8). Gluon (`triton.experimental.gluon`, shipped with triton 3.6) declares every layout, so each lane loads
exactly the packed words its mma fragments need and one inline-PTX block per word writes the dequantized
f16x2 / bf16x2 operand registers: `prmt` (replicate or interleave a byte, or pair it with the word shifted by one
code), `lop3` (a code into the mantissa of the magic number M = 1024 (fp16) / 128 (bf16)), an exact `add` of -M,
one `fma` with the group's scale (at 2 bits divided by 4 for codes at bit 2) and offset. KIVI's Keys skip even that
(post-scaled, `_kpost_asm`): one `lop3` per register, their per-channel scale folded into q. The blocks are checked
bit by bit on the CPU by a small PTX interpreter (tests/test_decode_gluon.py); Gluon has no interpreter mode, so
the kernel itself runs on a GPU only.

Every kernel here computes the logits transposed, logits^T [BT, 8] = k @ q^T: the tile's tokens are the rows of
the mma (the codes its A operand), the <= 8 query heads of the KV head its columns (q^T the B operand), so no row
is padding (q @ k^T padded 8 query rows to 16: twice the registers for q and the logits, twice the tensor-core
work). The online softmax runs per column; each lane keeps partial sums until the slice ends; `movmatrix`
transposes p^T's 8 x 8 blocks into the B operand of acc^T = v^T @ p^T (`_p_transposed`). Time per call against
the padded form (bench/RESULTS.md, session 16, with KIVI's post-scaled Keys): kivi-2 -7 to -15%, calibquant-1 -3 to
-19%, kvquant-4 -3 to -4%.

calibquant-1's layout (1-bit channel-wise Keys and Values, one static range per channel) has its own kernel,
`_post_decode_kernel`: post-scaling folds the Keys' scale into q and the Values' into the accumulator, so each code
reaches the mma as `M + 2^i code` from one `lop3` (~450 SASS instructions per 32-token tile against ~790 in the
KIVI kernel at 2 bits), with the calibrated softmax's two phases: the range pass keeps its logits (fp32), which the
attention pass reads instead of the Keys (at batch x context >= 64k 7-13% faster, 2% at (1, 65536): H100,
bench/RESULTS.md session 20).

kvquant's layout (4-bit codebook Keys with one static range per channel, stored before or after RoPE; 4-bit codebook
Values with one range per token; optional dense-and-sparse outliers) has `_lut_decode_kernel`: the same structure
with 16-token tiles, each code looked up in 8 table registers by byte permutes (`_lut_key_asm`, `_lut_value_asm`),
outliers replacing their channels, and RoPE applied to the dequantized Keys in registers (every lane holds each
channel's rotation partner c + 64), under a 168-register cap (12 programs per SM). int8's layout (symmetric 8-bit
codes, one scale per token vector) has `_sym8_decode_kernel`: Keys post-scaled (fp16 codes - 127 into the mma, the
per-token scale on the logits), Values dequantized per element, 16-token tiles at 123-127 registers.

Scope of `_kivi_decode_kernel` (`supports`, `layout_kind`): KIVI's layout at 1, 2 or 4 bits per side (kivi-2,
kivi-4, xquant's 2-bit / 1-bit layers, shared codes included): asymmetric uniform codes, Keys per channel in groups of 32 tokens (statistics rows
[NG, D]), Values per token in groups of 32 channels (statistics [T, D / 32]), head_dim 128, at most 8 query heads
per KV head, fp16 or bf16, an attention mask of one row per sequence (HF's decode mask) or none. With INNER, InnerQ's
layout (innerq-2, `layout_kind` "inner"): the same packed words with the statistics the other way round, Keys per
token in groups of 32 channels (statistics [T, 4], one per lane group b of the Key layout below) and Values per
channel in groups of 32 tokens (rows [NG, D], one 32-token tile per row), asymmetric or hybrid (the sign of a
group's stored half picks symmetric levels, spacing 2 / (2^B - 2), or asymmetric ones at twice that:
`_hybrid_stats_asm`), its per-channel Key norm folded into q; its codes through a TMA ring of their own
(`INNER_TMA`, below), its statistics by plain loads. Layouts that
none of the kernels covers run the Triton template, as do the exact windows (sink, ring, chunk) of every layout: the
kernels write the same (max, sum, acc) partial results into slots [0, NSPLIT) that `_decode_kernel` would, its
window launch slots [NSPLIT, NSPLIT + NWIN), and `_combine_kernel` merges them. With PDL (sm_90+) each program
first lets the window launch start (`griddepcontrol.launch_dependents`): see `decode_attention`.

Loads (TMA): on sm_90+ inside CUDA-graph capture (`launch`), each tile's codes and statistics (with QZROWS the Key
half-ranges but not their centers, which `_qz_rows` loads itself) are copied by the
tensor-memory accelerator into a ring of NST shared-memory slots (one mbarrier each; the slot just read takes the
tile NST ahead), then read into the same register layouts; 7-15% faster than plain loads at 2 and 4 bits on an
H100, no faster with 1-bit Values (bench/RESULTS.md, session 10). Used at every width of KIVI's layout. The Values'
statistics ([BT, 4]: one per token and 32-channel group) are read in `_stats4_layout` (lane bit 2 holds them twice)
and widened to the [BT, 8] statistics layout over that lane bit (`_widen`, `WIDEN_IN_LANES`); the register join it
replaced became per-lane byte selects and shuffles (kivi-2 4.7-7.3% faster, kivi-4 3.0-3.5%, calibquant-1 2.5-5.3%,
session 27). A slot holds RING_TILES tiles (TPS: 2 at 1 and 2 bits, 1 at 4, where two would cost a program per SM),
filled by one set of copies, whose issue block (barriers, elect, the descriptors' addresses that ptxas recomputes
in the loop: 86 SASS instructions) then runs every other tile: xquant-1.38 0.7-4.5% faster, kivi-2 -2.6% to +1.6%
(session 28). With two tiles a slot (post-scaled Keys, whole tiles) the online softmax takes one step per slot
(`PAIR_SOFTMAX`): both tiles' logits, one max and one rescale, then both tiles' Values, in slices of whole slots;
558 instructions a tile against 595 (offline sm_90, kivi-2), 3.0-4.9% faster at batch x context >= 512k, 0.9% slower
at batch 1 (session 29); at 4 bits the same step over two one-tile slots was 0.5% slower on average (session 30,
`bench/debug/pair_across_slots_tried.patch`). Otherwise (and for an odd sink or cache length, where a Value-statistics
box would start misaligned) every lane loads its words from global memory. kvquant's kernel takes the same ring for
its codes alone (64-byte rows: any sink or length), its statistics, outliers and RoPE table rows by plain loads:
10.8-14.7% faster at batch x context >= 64k with a bool mask, 9.6-13.0% without, on an H100 (bench/RESULTS.md,
session 23), and no longer spilling at its register cap; the RoPE rows through the ring too were slower
(`bench/debug/lut_rope_ring_tried.patch`).
calibquant's passes take it for the codes they read (`POST_TMA`): at batch x context >= 64k the kernel is 0.4-3.5%
faster at four shapes and 1.1% / 4.8% slower at (8, 65536) / (1, 65536); a decode step takes 1% less GPU time end
to end at (32, 4096) (session 23). InnerQ's layout too (`INNER_TMA`, codes only, any sink or length): 128 registers
instead of 167, 6.8-10.2% faster at batch x context >= 64k with a bool mask, and 3.6-7.9% more at four of those
shapes once its slices were sized for that build (session 24); session 15's ring that also copied the statistics
was 0-3% slower than plain loads.

Math (one program = one KV head of one sequence and one slice of the quantized region, one warp):
    k[t, c] = s_k[g, c] * code + z_k[g, c]     s = half * 2 / (2^B - 1), z = center - half, g = (t - S) // 32
    v[t, c] = s_v[t, c // 32] * code + z_v[t, c // 32]
    InnerQ (INNER): k[t, c] = s_k[t, c // 32] * code + z_k[t, c // 32], v[t, c] = s_v[g, c] * code + z_v[g, c],
    hybrid groups s = |half| * (2 - sym) * 2 / (2^B - 2), sym = half < 0; q <- q * norm (the Key norm, rounded once).
    per 32-token tile: logits^T = k @ q^T (mma m16n8k16, tokens as rows, query heads as columns), online softmax
    in base 2 per column, acc^T = acc^T * alpha + v^T @ p^T (m16n8k16 with the 8 query heads as its columns).
    KPOST (KIVI's Keys, the default): q . k = U (e @ q'^T) + q . z, e the codes straight from `_kpost_asm`,
    q' = (q a 2^(E - b)) * half per tile, the per-head q . z by a small mma into the logits' initial accumulator
    (see `_kivi_decode_kernel`). The codes are subnormals (fp16 code 2^(b - 24); bf16 code 2^(b - 133),
    `BF16_SUBNORMAL_KEYS`, up to bit 7 of the pattern with `SUB_WINDOW` 8, where the smallest normals continue them:
    the tensor cores take them as they are), so the mma's products are exact and need no
    offset; bf16 with the flag off takes 128 + code 2^b and one more mma per tile for -128 sum q'. Subnormals
    instead: 558 -> 542 SASS instructions per tile at 2 bits, 685 -> 671 at 4, kivi-2 2.7-4.7% faster, kivi-4
    1.1-4.2%, xquant-1.38 1.2-4.7% at batch x context >= 64k (H200, bench/RESULTS.md session 30). On the TMA path q . z comes from one mma per QZ_N = 8
    Key groups (their zero points as the mma's rows, `_qz_rows`), kept in shared memory (QZROWS, `QZ_ROWS`): 8
    instead of 16 HMMA per tile at bf16 (0 instead of 8 at fp16), plus 8 per refill, bit-equal logits.
    VZ (KIVI's Values in bf16, `VALUE_ZERO_APART`): p @ v = p @ (s code) + p @ z, the registers hold s code from one
    `fma` each ((M + 4^m code) s / 4^m - M s / 4^m: exact before its one rounding, no `add` of -M), the offsets' share
    comes from one more mma per tile (z as its A rows, `_zero_rows`) into a [16, 8] accumulator added to the rows of
    acc^T once per slice: 785 -> 739 SASS instructions per 32-token tile at 2 bits (TMA build), 1.2-2.6% faster at
    batch x context >= 64k (H200, bench/RESULTS.md session 27). fp16 keeps the `add`: its -1024 s overflows from s = 64.
    KZA (InnerQ's Keys in bf16, `INNER_KEY_ZERO_APART`): the Key registers hold s code from one `fma` each ((M + code)
    s - M s, as VZ: no `add`), the offsets' share q . z = sum_g z[t, g] sum_g(q) comes from one more small mma
    per 16 tokens into the logits' initial accumulator: A [BT, 16] the token's four group offsets (each lane holds
    its group's, `_inner_zrows`), B [16, 8] the query's per-group sums as a rounded bf16 and its remainder
    (`_inner_qsum_rows`, once per program): innerq-2's tile loops 855 / 870 -> 806 / 822 SASS instructions (offline
    sm_90), 1.4-4.2% less time at batch x context >= 64k (H200, bench/RESULTS.md session 53). The same for its
    Values (per channel: z_c sum(p) by 16 more HMMA a tile) saved 8 more instructions but took 133 registers, 12
    programs per SM instead of 16 (offline; not kept).
    VF (KIVI's 4-, 2- and 1-bit Values in bf16 through the ring, `VALUE_FOLD`): each group's scale goes into p instead,
        p @ v = sum_c (p' * half_c) @ (a 2^-VF_E e_c) + p @ z,   p' = p 2^VF_E,
    per Value group c (32 channels: a 16-byte chunk of a token's codes) one mma, its A operand the group's codes
    bare ("kqs8" at 4 bits: the bf16 code 2^(bit - 133) per register, a subnormal or one of the smallest normals,
    from the 16-bit elements that `ldmatrix.trans` hands each lane as (token t, t + 1) pairs), its B operand p'^T
    times the group's per-token half-ranges; the rows' 2^(133 - bit) a and 2^-VF_E once per slice (`_fold_finish`).
    No per-register multiply-add: 671 -> 626 SASS instructions per tile (offline sm_90), the code rows swizzled
    (`VF_SWIZZLE`) so that `ldmatrix` reads them without bank conflicts, the codes at bits 0 and 4 (VF_BITS), with
    the Keys' 8-bit window (`SUB_WINDOW`) 564; kivi-4 5-13% less time than without the fold at the same window
    (H200, bench/RESULTS.md session 31). At 2 bits a 16-byte chunk spans two groups (lanes k < 4 of `ldmatrix`
    get the first, k >= 4 the second): one `shfl.bfly` and one `prmt` per register (`_VF_EXCHANGE`, `_fold_chunk2`)
    give every lane one byte of each, then the 2-bit "kqs8" block takes eight codes (both groups) per register: kivi-2
    534 -> 469 SASS instructions per tile with its one softmax step per slot, 4.4-8.0% less time at batch x context
    >= 64k (H200, session 32). At 1 bit a token's 16-byte row spans four groups: a 4 x 4 transpose of nibbles over
    two lane bits (`_VF_EXCHANGE4`: the byte exchange, then a `shfl.bfly` by 8, `shf.wrap` and `lop3`) gives every
    lane four channels of each group, the 1-bit block "vf" sixteen codes per register: k2v1 (xquant-1.38's 1-bit
    Value layers) 570 -> 470 instructions a tile, xquant-1.38 8.8-12.3% less time (session 32).
    WT (KIVI's and InnerQ's layouts with a recent window, `WHOLE_TILES`): every slice is whole BT-token tiles
    (`whole_tiles`), so no position is compared with the slice's end: 683 -> 633 SASS instructions per tile at 2 bits,
    kivi-2 3.9-4.7% faster, xquant-1.38 5.0-7.5% (H200, session 28).
    MOK (KIVI's and InnerQ's layouts with a bool mask, `MASK_SLICE`): the tile loops built twice, once without the
    mask; a program runs that copy where its slice's mask bytes, checked once before the loop, are all true (HF's
    decode mask of an unpadded batch): kivi-2 469 -> 445, kivi-4 564 -> 523 SASS instructions per tile (offline
    sm_90, bf16 ring), 0.7-4.9% faster at batch x context >= 64k for kivi-2, kivi-4, innerq-2, xquant-1.38 (H200,
    session 48). Session 43 had predicated the tiles' mask loads off in one loop instead: slower.
    Scale and offset are rounded to the cache dtype before the multiply-add (one rounding of the value after
    it): values can differ from the reference's fp32 dequantization by about one unit in the last place; at 2
    bits fp16 scales below 2^-12 lose bits in the division by 4 (at most 3 * 2^-23 absolute). Post-scaled Keys
    round q' twice (q a 2^(E - b) once per program, its product with half once per tile). With VZ a Value register
    is s code rounded once, and its offset z enters the mma as stored (relative error against the reference op,
    `bench_decode_attention.py`: kivi-2 7.6e-3 -> 7.5e-3, kivi-4 7.6e-3 -> 8.0e-3, xquant-1.38 5.8e-3 either way).

Layouts (one warp; the A fragment of m16n8k16 gives lane l the reduction indices 2(l%4) + {0, 1, 8, 9} of every
16 and the rows l/4, l/4 + 8 of every 16, the B fragment the same reduction indices and the column l/4 of every
8). The reduction index of the Key mma is a permutation of the channel, so that each lane's 32 channels of a token
are whole asm blocks of P codes (P = 16 at 1 and 2 bits: a word or half of one; 8 at 4 bits: a word); q^T is
loaded in the same order, the same at every width:
    k = 64x4 + 32x3 + 16x2 + 8x1 + 4b1 + 2b0 + x0  <->  channel 32b + x   (x = P a + c: block a, code c)
With post-scaled Keys the block's element c = 2r + h holds its code r + P/2 h (a register pairs code r of each half
of the word): channel 32b + P a + r + P/2 h.
The row of the transposed Value mma (v^T as its A operand) is a permutation of the channel, so that each lane's
16 rows of a token are one 16-channel chunk (the partial results are stored back in channel order):
    n = 8j + w  <->  channel 16w + j.

Glossary: BT tokens per tile (the Key group, 32, or half of one: `KIVI_BT`); REP query heads per KV head (<= 8);
S sink tokens, R recent tokens, TPG_K / TPG_V tokens per group of each side (the fill boundary); MASK_KIND 0 none /
1 bool / 2 additive / 3 none through the bool build (kvquant's kernel only, `LUT_NO_MASK_AS_BOOL`); IS_BF16 the
cache dtype; KBITS / VBITS the code widths; NSPLIT slices of the quantized region per KV head, NWIN programs of the
window launch (partial-result slots per row: NSPLIT + NWIN); PDL the window launch may start early; KA_HI + KA_LO
(VA_*) the level spacing 2 / (2^B - 1) of each side in two terms of the cache dtype;
TMA the shared-memory ring of NST slots; KPOST post-scaled Keys (`KEY_POST`), POST_E and U their fp16 range
factors; QZROWS / QZ_N the Keys' q . z per QZ_N groups (`QZ_ROWS`); VZ the Values' offsets by their own mma
(`VALUE_ZERO_APART`); WL the ring's Value statistics widened over a lane bit (`WIDEN_IN_LANES`); WT no tile crosses
its slice's end (`WHOLE_TILES`, `whole_tiles`); TPS tiles per ring slot (`RING_TILES`); PAIR one softmax step
per slot (`PAIR_SOFTMAX`, `pair_flags`); KSUB bf16 post-scaled Keys as subnormals (`BF16_SUBNORMAL_KEYS`, SUB_E); VF
4-, 2- and 1-bit bf16 Values with their scales folded into p (`VALUE_FOLD`, `VALUE_FOLD_BITS`, `fold_flags`, VF_E, VF_BITS,
`VF_SWIZZLE`, `VF_PAIR_SEL`, `VF_NIB`); MOK the KIVI kernel's bool-mask slice check, bytes a step, and its tile
loops built twice, once without the mask (`MASK_SLICE`).
"""
from __future__ import annotations

import functools
import os

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    HAVE_GLUON = True
    try:
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        HAVE_TMA = True
    except ImportError:
        HAVE_TMA = False
except ImportError:  # an older triton: the Triton template serves every layout
    HAVE_GLUON = HAVE_TMA = False

BT = 32      # tokens per tile of `_post_decode_kernel` (calibquant), and the unit of `_fill_splits`'s shortest slice
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


def _magic(bf16: bool) -> tuple[str, str]:
    """(M, -M) as f16x2 / bf16x2 pairs: the magic number whose mantissa takes a code (1024 fp16, 128 bf16)."""
    if bf16:
        return "0x43004300", _f16x2(-128.0, -128.0, True)
    return "0x64006400", _f16x2(-1024.0, -1024.0, False)


def _code_mask(bits: int) -> str:
    """The lowest code of each half: (2^bits - 1) in both 16-bit halves."""
    m = (1 << bits) - 1
    return f"0x{m:04X}{m:04X}"


def _key_asm(bits: int, bf16: bool, tokenwise: bool = False, zero_apart: bool = False) -> str:
    """The codes of one word (16 at 1 or 2 bits, 8 at 4 bits) -> registers of (value 2i, value 2i+1). Operands:
    P = codes per block, $0..$(P/2 - 1) out, then P copies of the word, P/2 scale pairs, P/2 offset pairs
    (channels 2i, 2i+1). `lop3` puts a code into the mantissa of the magic number M (1024 fp16, 128 bf16):
    M + code; `add` removes M (exact); `fma` applies the scale and the offset.
    2 bits, per byte: `prmt` copies it into both halves of y; `lop3` takes codes (2m, 2m+1) of y at bits 0 and 2
    (M + code, M + 4 code: the high scale is pre-divided by 4, `_scale_offset`); y >> 4 brings codes 2, 3 down.
    4 bits: `prmt` pairs byte i of the word (low half) with byte i of word >> 4 (high half): its two codes at bit 0.
    1 bit (the word pre-shifted: its 16 codes at bits 0-15): `prmt` pairs byte i of the word with byte i of
    word >> 1, so codes (2m, 2m+1) sit at bit 2m of the halves; y >> 2 steps to the next pair.
    tokenwise (InnerQ's Keys: one scale per token and 32-channel group, the same for both halves of a register):
    2 bits as 4 bits, byte i of the word beside byte i of word >> 2 (codes 4i, 4i + 1 at bit 0), y >> 4 brings
    codes 4i + 2, 4i + 3 down; no scale divided by 4 (one more `shr` per word).
    zero_apart (InnerQ's Keys in bf16, `_kivi_decode_kernel` KZA): s * code alone, the offset left to a small mma;
    the offset operands hold -M * s, so one `fma` (M + code) * s - M * s gives s * code exactly before its one
    rounding: no `add` (as `_value_asm` zero_apart: -128 s exact for 2^-126 <= |s| < 2^121, not checked at run
    time)."""
    assert not zero_apart or (bf16 and tokenwise), "zero_apart: InnerQ's bf16 Keys"
    ty = "bf16x2" if bf16 else "f16x2"
    magic, neg = _magic(bf16)
    P = 8 if bits == 4 else 16
    w, sc, of = P // 2, P // 2 + P, P + P
    paired = bits == 2 and not tokenwise   # KIVI's 2-bit Keys: codes at bits 0 and 2 of one byte copy
    lines = ["{ .reg .b32 y, x, n;" if paired else "{ .reg .b32 y, x, n, h;", f"mov.b32 n, {neg};"]

    def value(r: int, mask: str):
        if zero_apart:
            lines.append(f"lop3.b32 x, y, {mask}, {magic}, 0xea; fma.rn.{ty} ${r}, x, ${sc + r}, ${of + r};")
        else:
            lines.append(f"lop3.b32 x, y, {mask}, {magic}, 0xea; add.rn.{ty} x, x, n; "
                         f"fma.rn.{ty} ${r}, x, ${sc + r}, ${of + r};")

    if paired:
        for i in range(4):
            lines.append(f"prmt.b32 y, ${w}, ${w}, 0x{i:x}{i:x}{i:x}{i:x};")
            for half in range(2):
                if half:
                    lines.append("shr.b32 y, y, 4;")
                value(2 * i + half, "0x000C0003")
    elif bits in (1, 2, 4):  # byte i of the word beside byte i of word >> bits; 4 / bits code pairs per byte
        lines.append(f"shr.b32 h, ${w}, {bits};")
        for i in range(P * bits // 8):
            lines.append(f"prmt.b32 y, ${w}, h, 0x{4 + i:x}{4 + i:x}{i:x}{i:x};")
            for m in range(4 // bits):
                if m:
                    lines.append(f"shr.b32 y, y, {2 * bits};")
                value(4 // bits * i + m, _code_mask(bits))
    else:
        raise ValueError(f"no Key unpack for {bits}-bit codes")
    lines.append("}")
    return "\n".join(lines)


def _value_asm(bits: int, bf16: bool, per_code: bool = False, zero_apart: bool = False) -> str:
    """Codes 0-7 of two tokens' words (pre-shifted so they sit at bits 0 .. 8 * bits - 1) -> 8 registers (token t,
    token t+1) of code j = 0..7. Operands: $0-$7 out, $8-$23 words (even: token t, odd: token t+1), $24-$31 scale
    pairs, $32-$39 offset pairs (t, t+1). `prmt` interleaves a byte of the two words (low half: token t, high
    half: token t+1); `lop3` puts a code of each half into the mantissa of M; `add` removes M; `fma` applies the
    scale and the offset.
    2 bits: codes m = 0, 1 of the byte at bits 0 and 2 (M + 4^m code, the scale divided by 4^m); y >> 4 brings
    codes 2, 3 down. 4 bits: code 0 of the byte at bit 0, y >> 4 brings code 1 down. 1 bit: y >> 1 per code.
    KIVI's Values (one group per block) read the scale and offset pair of $24 and $32 only; per_code (InnerQ's
    Values, statistics per channel) reads register j's own $(24 + j), $(32 + j), at 2 bits its odd codes' scale
    handed over divided by 4.
    zero_apart (KIVI's Values in bf16, `VZ`): s * code alone, the offset left to a small mma (`_kivi_decode_kernel`);
    $32 holds -M * s, so one `fma` (M + 4^m code) * s / 4^m - M * s / 4^m gives s * code exactly before its one
    rounding: no `add`. (-M s, M = 128, and the quarters are exact in bf16 for 2^-124 <= s < 2^121: a Value group's
    half-range between about 2^-124 and 2^120, not checked at run time; fp16's -1024 s would overflow from s = 64.)"""
    ty = "bf16x2" if bf16 else "f16x2"
    magic, neg = _magic(bf16)
    assert not (per_code and zero_apart), "zero_apart: KIVI's Values, one scale per block"
    lines = ["{ .reg .b32 y, x, n;" if per_code else
             "{ .reg .b32 y, x, n, s1, c1, z0;" if zero_apart else "{ .reg .b32 y, x, n, s1, z0;", f"mov.b32 n, {neg};"]

    def value(r: int, mask: str, scale: str = "$24", offset: str = "$32"):
        if per_code:
            scale, offset = f"${24 + r}", f"${32 + r}"
        if zero_apart:
            lines.append(f"lop3.b32 x, y, {mask}, {magic}, 0xea; fma.rn.{ty} ${r}, x, {scale}, {offset};")
        else:
            lines.append(f"lop3.b32 x, y, {mask}, {magic}, 0xea; add.rn.{ty} x, x, n; "
                         f"fma.rn.{ty} ${r}, x, {scale}, {offset};")

    def interleave(byte: int):
        lines.append(f"prmt.b32 y, $8, $9, 0x{4 + byte:x}{4 + byte:x}{byte:x}{byte:x};")

    if bits == 2:
        if not per_code:
            lines[-1] += f" mov.b32 z0, {_NEG0};"
            lines.append(f"mov.b32 s1, {_f16x2(0.25, 0.25, bf16)}; fma.rn.{ty} s1, $24, s1, z0;")
            if zero_apart:
                lines.append(f"mov.b32 c1, {_f16x2(0.25, 0.25, bf16)}; fma.rn.{ty} c1, $32, c1, z0;")
        for byte in range(2):
            interleave(byte)
            for j in range(4):
                if j == 2:
                    lines.append("shr.b32 y, y, 4;")
                value(4 * byte + j, "0x00030003" if j % 2 == 0 else "0x000C000C", "$24" if j % 2 == 0 else "s1",
                      "$32" if j % 2 == 0 or not zero_apart else "c1")
    elif bits in (1, 4):  # the 8 codes fill `bits` bytes; y >> bits steps to the next code of a byte
        for byte in range(bits):
            interleave(byte)
            for m in range(8 // bits):
                if m:
                    lines.append(f"shr.b32 y, y, {bits};")
                value(8 // bits * byte + m, _code_mask(bits))
    else:
        raise ValueError(f"no Value unpack for {bits}-bit codes")
    lines.append("}")
    return "\n".join(lines)


def _post_key_asm(bf16: bool) -> str:
    """Post-scaled 1-bit Keys (calibquant): one word pre-shifted by 8a -> 8 registers, register i = (M + 2^i
    code(bit i), M + 2^i code(bit 16 + i)) by one `lop3` each: no add, no multiply. The 2^i and the per-channel
    scale are folded into q, M (1024 fp16, 128 bf16; M + 2^7 exact in both) into a per-row constant. Operands: $0-$7
    out, $8-$23 the word."""
    magic = _magic(bf16)[0]
    return "\n".join(["{"] + [f"lop3.b32 ${i}, $8, 0x{(1 << i) | (1 << (16 + i)):08X}, {magic}, 0xea;"
                              for i in range(8)] + ["}"])


def _post_value_asm(bf16: bool) -> str:
    """Post-scaled 1-bit Values: byte 0 of two tokens' pre-shifted words -> 8 registers, register j = (M + 2^j
    code_j(t), M + 2^j code_j(t + 1)): `prmt` interleaves the bytes, one `lop3` per register. The 2^j, M and the
    per-channel scale and offset are applied to the accumulator after the loop. Operands: $0-$7 out, $8-$23 words
    (even: token t, odd: token t+1)."""
    magic = _magic(bf16)[0]
    return "\n".join(["{ .reg .b32 y;", "prmt.b32 y, $8, $9, 0x4400;"]
                      + [f"lop3.b32 ${j}, y, 0x{(1 << j) | (1 << (16 + j)):08X}, {magic}, 0xea;" for j in range(8)]
                      + ["}"])


SUB_WINDOW = 8   # bits of the code window of KIVI's bf16 subnormal Keys (`BF16_SUBNORMAL_KEYS`; kernel constexpr KSW):
# a bf16 bit pattern below 256 (exponent field 0 or 1) is pattern * 2^-133 exactly, so a code may reach bit 7: at 2 bits
# four codes per shift instead of three, at 4 bits two instead of one (7: session 30's window, bits 0-6). Offline:
# kivi-2 542 -> 534, kivi-4 596 -> 567 instructions a tile; kivi-2 0.9-2.9% faster, xquant-1.38 0-0.4% (H200, session
# 31, call 4). Not bit-equal with 7 in 4 of 12 GPU cases (relative <= 6e-5, calls 5-6; q' ruled out, attributed to the
# tensor cores' sums of the same products in two encodings)
assert SUB_WINDOW in (7, 8)


def post_positions(bits: int, bf16: bool, n: int, window: int | None = None) -> list[tuple[int, int]]:
    """(shift, bit) of each of the n registers of a post-scaled Key block (`_kpost_asm`): register r takes code r of
    each half of the word shifted down by `shift`, at `bit` = r * bits - shift, as many codes per shift as the
    code window holds (fp16: bits 0-7 of a subnormal, value code * 2^(bit - 24); bf16: bits 0-6 below the magic
    128, value 128 + code * 2^bit; bf16 subnormal Keys: bits 0 .. window - 1 (`SUB_WINDOW`), value code *
    2^(bit - 133), exactly up to bit 7 where the exponent field reaches 1)."""
    per = (window or (7 if bf16 else 8)) // bits
    return [(r // per * per * bits, r % per * bits) for r in range(n)]


POST_E = 2  # fp16 post-scaled Keys: q' = q s 2^(POST_E - bit), the logits 2^(24 - POST_E) times the mma (range of q')
SUB_E = 64  # bf16 subnormal Keys (`BF16_SUBNORMAL_KEYS`): q' = q s 2^(SUB_E - bit), the logits 2^(133 - SUB_E) times
# the mma. q' = |q s| 2^64 at most stays below bf16's ~2^128 for |q s| < 2^64, and a product code q s 2^-69 is a
# normal fp32 for |code q s| >= 2^-57 (smaller ones move a logit by less than 2^-57). Calls 8-9 ran SUB_E = 100
# (|q s| < 2^28): the same instructions, the logits scaled by exact powers of two, so the same outputs where
# neither overflows


def _kpost_asm(bits: int, bf16: bool, sub: bool = False, window: int = 7, halves: bool = False) -> str:
    """Post-scaled KIVI Keys (the per-channel scale folded into q, `_kivi_decode_kernel` with KPOST): the codes of one
    block (P = 16 at 1 and 2 bits, 8 at 4 bits) -> P / 2 registers, register r = (code r, code P / 2 + r) at bit b_r
    of each half (`post_positions`), by one `lop3` each and a `shr` per group of registers: fp16 a subnormal
    code * 2^(b_r - 24), bf16 128 + code * 2^b_r (the magic 128 and 2^-b_r go into q' and a per-row constant).
    2 and 4 bits: the word's halves hold codes 0 .. P/2 - 1 and P/2 .. P - 1. 1 bit (the word pre-shifted: the
    block's 16 codes at bits 0-15): `prmt` puts byte 1 into the high half. Operands: $0..$(P/2 - 1) out, then P
    copies of the word. sub (bf16, `BF16_SUBNORMAL_KEYS`): no magic number, the code as the bf16 code * 2^(b_r - 133)
    in a window of `window` bits (`SUB_WINDOW`; the magic number's is bits 0-6). halves (the folded Values' block,
    `_fold_block`): the word's halves are two tokens' 16 bits, register r takes code r of each (at 1 bit P = 32 and
    no `prmt`; at 2 and 4 bits the same block as without)."""
    P = 32 if bits == 1 and halves else 8 if bits == 4 else 16   # `key_pack`
    magic = "0x43004300" if bf16 and not sub else "0"
    w = f"${P // 2}"
    lines = ["{ .reg .b32 x, y;"]
    base = w
    if bits == 1 and not halves:
        lines.append(f"prmt.b32 x, {w}, 0, 0x4140;")
        base = "x"
    cur = 0
    for r, (shift, bit) in enumerate(post_positions(bits, bf16, P // 2, window if bf16 and sub else None)):
        if shift != cur:
            lines.append(f"shr.b32 y, {base}, {shift};")
            cur = shift
        m = ((1 << bits) - 1) << bit
        lines.append(f"lop3.b32 ${r}, {base if shift == 0 else 'y'}, 0x{m:04X}{m:04X}, {magic}, 0xea;")
    lines.append("}")
    return "\n".join(lines)


VF_E = 64   # folded Values (`VALUE_FOLD`): p' = p 2^VF_E, so that a product code 2^(bit - 133) * p' half is a
# normal fp32 for p half >= 2^(7 - VF_E) = 2^-57 (a smaller one drops out: its p code a half < 2^-56 of absolute
# error per such token); p' half must stay below bf16's ~2^128 (half < 2^64) and the offsets' share sum z p' below fp32's
# (|z| * sum p < 2^64); the accumulator, the offsets' share and the partial sum take 2^-VF_E back at the end
# The folded Values' block is the subnormal Key block with the 8-bit window (`_kpost_asm`, "kqs8"): from two tokens'
# 16-bit elements (t low, t + 1 high: what `ldmatrix.trans` gives a lane) register i holds code i of each half at
# bit VF_BITS[bits][i] (one `lop3` each, one `shr` for codes 2 and 3 at 4 bits, for the second group's at 2), the bf16
# code 2^(bit - 133); no scale and no offset: the scale goes into p, the offset into its own mma, the 2^(133 - bit)
# onto the accumulator's rows
def _fold_block(bits: int) -> str:
    """The folded Values' block ("vf"): from two tokens' 16-bit elements (t low, t + 1 high) 16 / bits registers,
    register r code r of each half at bit VF_BITS[bits][r] (the subnormal Key block "kqs8" with its halves as
    tokens)."""
    return _kpost_asm(bits, True, sub=True, window=8, halves=True)


VF_BITS = {bits: tuple(bit for _, bit in post_positions(bits, True, 16 // bits, 8)) for bits in (1, 2, 4)}
assert VF_BITS[4] == (0, 4, 0, 4) and VF_BITS[2] == (0, 2, 4, 6) * 2 and VF_BITS[1] == tuple(range(8)) * 2
# The folded 2-bit Values: a 16-byte chunk of a token's codes spans two Value groups (64 channels), and `ldmatrix.trans`
# hands lane (t, k) the 16-bit element k (channels 8k .. 8k + 7 of the chunk) of tokens 2t and 2t + 1: lanes k < 4 hold
# the first group, lanes k >= 4 the second, while an mma's A rows (lane k: rows k and k + 8) must share one group.
# One `shfl.bfly` by 16 (lane bit 4 is k's bit 2) and one `prmt` give every lane the low byte of both groups' element
# k % 4 (k < 4: in-group channels 8k .. 8k + 3) or their high byte (k >= 4: 8 (k - 4) + 4 ..), as (first group, second
# group) per token: then the 2-bit Key block "kqs8" (register r = code r of each token's 16 bits) takes code i of the
# first group to r = i, of the second to r = 4 + i, at bit 2i. $0 out, $1 the lane's element pair, $2 the selector
# (`VF_PAIR_SEL`; its low 16 bits: k < 4 own byte 0, partner's byte 0, own byte 2, partner's 2; k >= 4 the partner's
# byte 1, own 1, partner's 3, own 3)
_VF_EXCHANGE = "{ .reg .b32 p; shfl.sync.bfly.b32 p, $1, 16, 0x1f, -1; prmt.b32 $0, $1, p, $2; }"
VF_PAIR_SEL = (0x6240, 0x3715)   # the exchange's `prmt` selector for lanes k < 4, k >= 4
# The folded 1-bit Values: a token's 16-byte row is one chunk of four groups, lane k holding 16 channels (four
# nibbles) of group k // 2: a 4 x 4 transpose of nibbles over lane bits 3 and 4 (j = k // 2) in two butterflies, the
# exchange above by 16 (bytes), then by 8 (nibbles: the partner's word rotated by 4 one way or the other, `shf.wrap`
# by $3 = 28 or 4, kept where the mask $4 is 0x0F0F0F0F or 0xF0F0F0F0 is not, `lop3` 0xe4 = a & c | b & ~c). Lane k
# then holds nibble j of every group in its h = k % 2 half: in-group channels 16 h + 4 j + i of group G at bit 4 G + i
# of each token's 16 bits (the block "vf" at 1 bit: register 4 G + i). $0 out, $1 the element pair, $2 the byte
# selector (`VF_PAIR_SEL` by lane bit 4), $3 the rotation, $4 the kept nibbles (`VF_NIB` by lane bit 3)
_VF_EXCHANGE4 = ("{ .reg .b32 p, q, y; shfl.sync.bfly.b32 p, $1, 16, 0x1f, -1; prmt.b32 y, $1, p, $2; "
                 "shfl.sync.bfly.b32 p, y, 8, 0x1f, -1; shf.r.wrap.b32 q, p, p, $3; lop3.b32 $0, y, q, $4, 0xe4; }")
VF_NIB = ((28, 0x0F0F), (4, -0x0F10))   # (rotation, kept nibbles as int16: 0x0F0F / 0xF0F0) for lane bit 3 = 0, 1


_NEG0 = "0x80008000"  # (-0, -0): the addend of a product written as fma


def _lut_lines(y: str, tab: list[str]) -> list[str]:
    """The 16-level codebook lookup of four 4-bit codes: y holds them as the nibbles of its low 16 bits; tab names
    the 8 table registers (lo0..lo3, hi0..hi3: byte k of lo_i / hi_i is the low / high byte of level 4i + k in the
    cache dtype). Writes lo, hi (byte k: the low / high byte of code k's level) in 9 instructions: `prmt` picks
    byte (code & 7) of a table pair for levels 0-7 and 8-15 (4 codes at once), a second `prmt` keeps per byte the
    one that bit 3 of its code names (selector nibble k + 4 bit3)."""
    lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3 = tab
    return [f"lop3.b32 s, {y}, 0x00007777, 0, 0xc0;",
            f"prmt.b32 la, {lo0}, {lo1}, s; prmt.b32 lb, {lo2}, {lo3}, s;",
            f"prmt.b32 ha, {hi0}, {hi1}, s; prmt.b32 hb, {hi2}, {hi3}, s;",
            f"shr.b32 m, {y}, 1; lop3.b32 m, m, 0x00004444, 0x00003210, 0xea;",
            "prmt.b32 lo, la, lb, m; prmt.b32 hi, ha, hb, m;"]


def _paired_levels(ty: str, r0: int, sels: tuple, s0: int, z0: int) -> list[str]:
    """Output registers r0, r0 + 1 of a codebook block: `prmt` pairs two levels' low and high bytes (selectors sels),
    `fma` applies scale pair $(s0 + r) and offset pair $(z0 + r)."""
    return [f"prmt.b32 x, lo, hi, {sel}; fma.rn.{ty} ${r0 + i}, x, ${s0 + r0 + i}, ${z0 + r0 + i};"
            for i, sel in enumerate(sels)]


_LUT_DECLS = "{ .reg .b32 y, s, m, la, lb, ha, hb, lo, hi, x;"  # the codebook blocks' scratch registers


def _lut_key_asm(bf16: bool) -> str:
    """A word of 8 4-bit Key codes (channels 0-7 of a block) -> 4 registers (level(2r) * s + z, level(2r + 1) * s +
    z) of the codebook's levels: `_lut_lines` per half word, a `prmt` pairs codes (2r, 2r + 1), one `fma` applies
    the channels' scale (half-range) and offset (center). Operands: $0-$3 out, $4-$11 copies of the word, $12-$15
    scale pairs, $16-$19 offset pairs, $20-$27 the table (lo0..lo3, hi0..hi3)."""
    ty = "bf16x2" if bf16 else "f16x2"
    lines = [_LUT_DECLS]
    for half in range(2):
        lines.append("mov.b32 y, $4;" if half == 0 else "shr.b32 y, $4, 16;")
        lines += _lut_lines("y", [f"${20 + i}" for i in range(8)])
        lines += _paired_levels(ty, 2 * half, ("0x5140", "0x7362"), 12, 16)
    lines.append("}")
    return "\n".join(lines)


def _lut_value_asm(bf16: bool) -> str:
    """Two tokens' words of 8 4-bit Value codes -> 8 registers (token t, token t+1) of code j = 0..7: level * s + z.
    Per byte i, a `prmt` puts byte i of each word side by side (codes 2i, 2i + 1 of t, then of t+1), `_lut_lines`
    looks the four up, a `prmt` pairs the two tokens' levels of one code, one `fma` applies each token's scale and
    offset. Operands: $0-$7 out, $8-$23 words (even: token t, odd: token t+1), $24-$31 scale pairs, $32-$39 offset
    pairs (t, t+1), $40-$55 the table (operand 40 + e holds table register e // 2: lo0..lo3, hi0..hi3)."""
    ty = "bf16x2" if bf16 else "f16x2"
    lines = [_LUT_DECLS]
    for i in range(4):
        lines.append(f"prmt.b32 y, $8, $9, 0x{4 + i:x}{i:x};")
        lines += _lut_lines("y", [f"${40 + 2 * e}" for e in range(8)])
        lines += _paired_levels(ty, 2 * i, ("0x6240", "0x7351"), 24, 32)
    lines.append("}")
    return "\n".join(lines)


def _rope_asm(bf16: bool, sign: int) -> str:
    """RoPE on packed pairs: $0 = $1 * $3 + sign * $2 * $4 (sign -1 for channels below D / 2: x cos - partner sin;
    +1 above: x cos + partner sin); the product with the partner is rounded once, then the sum."""
    ty = "bf16x2" if bf16 else "f16x2"
    neg = f" lop3.b32 t, t, {_NEG0}, 0, 0x3c;" if sign < 0 else ""
    return f"{{ .reg .b32 t, z; mov.b32 z, {_NEG0}; fma.rn.{ty} t, $2, $4, z;{neg} fma.rn.{ty} $0, $1, $3, t; }}"


def _sym8_key_asm() -> str:
    """A word of 4 8-bit Key codes -> 2 fp16 registers (code - 127 of channels 0, 1 and 2, 3), exactly: `prmt` puts
    a byte below 0x64 (the fp16 magic M = 1024: M + code), `add` removes M + 127. The Keys' per-token scale is applied
    to the logits, so the mma runs in fp16 whatever the cache dtype. Operands: $0, $1 out, $2-$5 copies of the
    word."""
    n = _f16x2(-1151.0, -1151.0, False)
    return "\n".join(["{ .reg .b32 m, n, x;", "mov.b32 m, 0x64646464;", f"mov.b32 n, {n};",
                      "prmt.b32 x, $2, m, 0x4140; add.rn.f16x2 $0, x, n;",
                      "prmt.b32 x, $2, m, 0x4342; add.rn.f16x2 $1, x, n;", "}"])


def _sym8_value_asm(bf16: bool) -> str:
    """Two words of 4 8-bit Value codes per token (A: codes 0-3, B: 4-7) of two tokens -> 8 registers (token t,
    token t+1) of s * (code j - 127). fp16: `prmt` pairs byte j % 4 of the tokens' words (A for j < 4, else B), a
    second puts them below the magic 0x64 (M + code), `add` removes M + 127 (exact), `fma` with -0 applies each
    token's scale. bf16 (no magic holds 8 bits): each byte below the fp32 magic 2^23 (`prmt`), an fp32 `sub` of
    2^23 + 127 (exact), the two upper halves paired by `prmt` (exact: |code - 127| < 2^8), then the scale. Operands: $0-$7 out, $8-$23 words
    (operand 8 + e: token e % 2, word A for e < 8, B above), $24-$31 scale pairs (t, t+1)."""
    ty = "bf16x2" if bf16 else "f16x2"
    lines = ["{ .reg .b32 m, n, z, y, x, f0, f1;", f"mov.b32 z, {_NEG0};"]
    lines.append("mov.b32 m, 0x4B000000; mov.b32 n, 0x4B00007F;" if bf16 else
                 f"mov.b32 m, 0x64646464; mov.b32 n, {_f16x2(-1151.0, -1151.0, False)};")
    for j in range(8):
        wt, wt1, i = ("$8", "$9", j) if j < 4 else ("$16", "$17", j - 4)
        if bf16:
            lines.append(f"prmt.b32 f0, {wt}, m, 0x744{i}; prmt.b32 f1, {wt1}, m, 0x744{i}; "
                         "sub.f32 f0, f0, n; sub.f32 f1, f1, n; prmt.b32 x, f0, f1, 0x7632;")
        else:
            lines.append(f"prmt.b32 y, {wt}, {wt1}, 0x{4 + i:x}{i:x}; prmt.b32 x, y, m, 0x4140; "
                         "add.rn.f16x2 x, x, n;")
        lines.append(f"fma.rn.{ty} ${j}, x, ${24 + j}, z;")
    lines.append("}")
    return "\n".join(lines)


def lut_table(levels, bf16: bool) -> list[int]:
    """The 8 table registers `_lut_lines` reads (lo0..lo3, hi0..hi3) from 16 levels, each rounded to the cache
    dtype (the kernel builds the same from the store's fp32 levels; tests use this)."""
    import torch

    bits = [int(x) & 0xFFFF for x in torch.tensor(list(levels), dtype=torch.float64).to(
        torch.bfloat16 if bf16 else torch.float16).view(torch.int16)]
    return [sum(((bits[4 * i + k] >> 8 * hi) & 0xFF) << 8 * k for k in range(4)) for hi in (0, 1) for i in range(4)]


def _stats_asm(bf16: bool) -> tuple[str, str]:
    """(s = fma(half, hi, half * lo), z = center - half) on packed pairs. Operands of s: $0 out, $1 half, $2 hi,
    $3 lo (the scale split in two terms of the cache dtype, so s is rounded once in effect); of z: $0 out,
    $1 half, $2 center."""
    ty = "bf16x2" if bf16 else "f16x2"
    s = (f"{{ .reg .b32 z, t; mov.b32 z, {_NEG0}; fma.rn.{ty} t, $1, $3, z; fma.rn.{ty} $0, $1, $2, t; }}")
    z = f"{{ .reg .b32 a; mov.b32 a, {_f16x2(-1.0, -1.0, bf16)}; fma.rn.{ty} $0, $1, a, $2; }}"
    return s, z


def _hybrid_stats_asm(bf16: bool) -> tuple[str, str]:
    """InnerQ's hybrid groups: `_stats_asm` from the signed half-range h (`store.signed_half`: negative where the
    group chose symmetric levels) on packed pairs. Each half's sign, replicated over it (`prmt` selector 0xBB99: the
    sign of byte 1, then of byte 3), picks the scale's two terms by `lop3` ((m & x) | (~m & y), table 0xCA): those
    of the symmetric levels where set ($2 hi, $4 lo), of the asymmetric ones (twice the spacing) where not ($3, $5);
    then s = fma(|h|, hi, |h| * lo). z = center - |h| (operands: $0 out, $1 h, $2 center). Bit-equal to `_stats_asm`
    on |h| with the chosen terms."""
    ty = "bf16x2" if bf16 else "f16x2"
    s = ("{ .reg .b32 a, m, h, l, t, z; and.b32 a, $1, 0x7FFF7FFF; prmt.b32 m, $1, 0, 0xBB99; "
         f"lop3.b32 h, m, $2, $3, 0xCA; lop3.b32 l, m, $4, $5, 0xCA; mov.b32 z, {_NEG0}; fma.rn.{ty} t, a, l, z; "
         f"fma.rn.{ty} $0, a, h, t; }}")
    z = (f"{{ .reg .b32 a, c; and.b32 a, $1, 0x7FFF7FFF; mov.b32 c, {_f16x2(-1.0, -1.0, bf16)}; "
         f"fma.rn.{ty} $0, a, c, $2; }}")
    return s, z


@functools.lru_cache(maxsize=None)
def split_scale(scale: float, bf16: bool) -> tuple[float, float]:
    """(hi, lo): scale = hi + lo to about twice the cache dtype's precision, both representable in it."""
    hi = _round(scale, bf16)
    return hi, _round(scale - hi, bf16)


def whole_tiles(r, tpg_k, tpg_v, bt):
    """Whether every tile of every slice lies before the slice's stop (`_slice`), from the constexprs alone: with
    a recent window (r > 0) the quantized region ends at S + a multiple of the larger fill boundary (the smaller
    divides it: min(bnd_k, bnd_v) is the coarser one's, and it lies at or below the current position), a
    multiple of the tile; slices are whole tiles. KIVI's layouts (tpg_k 32, tpg_v 1 or 32) and InnerQ's (1, 32)
    with 32-token tiles; not calibquant's or kvquant's (a token at a time)."""
    lo, hi = min(tpg_k, tpg_v), max(tpg_k, tpg_v)
    return r > 0 and hi % lo == 0 and hi % bt == 0


BITS = (1, 2, 4)  # code widths the kernel unpacks (per side: xquant pairs 2-bit Keys with 1-bit Values)
_ASM = {(side, bits, bf): (_key_asm if side == "k" else _value_asm)(bits, bf)
        for side in "kv" for bits in BITS for bf in (False, True)}
# InnerQ's layout: Keys with statistics per token ("kt"), Values with statistics per channel ("vc")
_ASM.update({(side, bits, bf): _key_asm(bits, bf, tokenwise=True) if side == "kt" else _value_asm(bits, bf, True)
             for side in ("kt", "vc") for bits in BITS for bf in (False, True)})
# InnerQ's Keys without their offset ("ktz", bf16 only: `KZA`)
_ASM.update({("ktz", bits, True): _key_asm(bits, True, tokenwise=True, zero_apart=True) for bits in BITS})
# KIVI's Values without their offset ("vz", bf16 only: `VZ`)
_ASM.update({("vz", bits, True): _value_asm(bits, True, zero_apart=True) for bits in BITS})
_STATS = {bf: _stats_asm(bf) for bf in (False, True)}
_HYBRID_STATS = {bf: _hybrid_stats_asm(bf) for bf in (False, True)}
_ASM.update({(side + "post", 1, bf): (_post_key_asm if side == "k" else _post_value_asm)(bf)
             for side in "kv" for bf in (False, True)})
_ASM.update({(side, "lut", bf): (_lut_key_asm if side == "k" else _lut_value_asm)(bf) for side in "kv"
             for bf in (False, True)})
_ASM.update({("rope", sign, bf): _rope_asm(bf, sign) for sign in (-1, 1) for bf in (False, True)})
_ASM.update({("kq", bits, bf): _kpost_asm(bits, bf) for bits in BITS for bf in (False, True)})
_ASM.update({(f"kqs{w}", bits, True): _kpost_asm(bits, True, sub=True, window=w) for bits in BITS for w in (7, 8)})
_ASM.update({("mul", 0, bf): f"mul.rn.{'bf16x2' if bf else 'f16x2'} $0, $1, $2;" for bf in (False, True)})
_ASM[("vfx", 2, True)] = _VF_EXCHANGE   # the folded 2-bit Values' byte exchange
_ASM[("vfx", 1, True)] = _VF_EXCHANGE4   # the folded 1-bit Values' nibble transpose
_ASM.update({("vf", bits, True): _fold_block(bits) for bits in (1, 2, 4)})
_ASM.update({("k", "sym8", bf): _sym8_key_asm() for bf in (False, True)})
_ASM.update({("v", "sym8", bf): _sym8_value_asm(bf) for bf in (False, True)})


def key_pack(bits: int) -> int:
    """Codes per Key asm block: one word at 4 bits (8 codes), 16 codes (a word or half of one) at 1 and 2 bits."""
    return 8 if bits == 4 else 16


if HAVE_GLUON:
    D_ = gl.constexpr(D)
    POST_E_ = gl.constexpr(POST_E)
    SUB_E_ = gl.constexpr(SUB_E)
    VF_E_ = gl.constexpr(VF_E)
    VF_DOWN_ = gl.constexpr(2.0 ** -VF_E)

    @gluon.constexpr_function
    def _asm(side, bits, bf16):
        return _ASM[(side, bits, bf16)]

    @gluon.constexpr_function
    def _vf_row(bits, c, i):
        """The folded Values' row factor 2^(133 - VF_E - bit) of code i of group c (`VF_BITS`, register 4 c + i of a
        block): its bf16 code 2^(bit - 133) and p's 2^VF_E undone."""
        regs = VF_BITS[bits]
        return 2.0 ** (133 - VF_E - regs[(4 * c + i) % len(regs)])

    @gluon.constexpr_function
    def _vf_nib(odd, which):
        """The folded 1-bit Values' nibble step operands (`VF_NIB`): which 0 the rotation, 1 the kept nibbles, for
        lanes whose lane bit 3 is `odd`."""
        return VF_NIB[odd][which]

    @gluon.constexpr_function
    def _vf_pair_sel(k):
        """The folded 2-bit Values' exchange selector of the lanes holding element k (`VF_PAIR_SEL`)."""
        return VF_PAIR_SEL[k // 4]

    @gluon.constexpr_function
    def _kqs(window):
        """The `_ASM` name of the subnormal Key blocks with a code window of `window` bits (`SUB_WINDOW`)."""
        return f"kqs{window}"

    @gluon.constexpr_function
    def _cons(pack, stats):
        """Operand constraints of a block of `pack` codes: pack / 2 output registers, pack word copies, and with
        stats pack / 2 scale and pack / 2 offset pairs."""
        return ",".join(["=r"] * (pack // 2) + ["r"] * (2 * pack if stats else pack))

    @gluon.constexpr_function
    def _fold_cons(n):
        """Operand constraints of the block "vf" with n output registers: n outputs, n copies of the 16-bit element
        pair (2 n elements a block)."""
        return ",".join(["=r"] * n + ["r"] * n)

    @gluon.constexpr_function
    def _lut_cons(pack):
        """Operand constraints of a codebook block of `pack` codes: pack / 2 outputs, pack word copies, pack / 2
        scale and offset pairs, pack table registers."""
        return ",".join(["=r"] * (pack // 2) + ["r"] * (3 * pack))

    @gluon.constexpr_function
    def _sym8_value_cons():
        """Operand constraints of int8's Value block: 8 outputs, 16 words, 8 scale pairs."""
        return ",".join(["=r"] * 8 + ["r"] * 24)

    _whole_tiles = gluon.constexpr_function(whole_tiles)

    @gluon.constexpr_function
    def _stats(bf16, which):
        return _STATS[bf16][which]

    @gluon.constexpr_function
    def _hybrid_stats(bf16, which):
        return _HYBRID_STATS[bf16][which]

    @gluon.constexpr_function
    def _key_layout(bt, pack):
        """Keys as [a(32 / pack), b(4), c(pack), t(bt)]: code c of asm block a of lane group b, token t (the
        kernel picks the channel: 32b + pack * a + c in the KIVI kernel, `_lut_chan` in kvquant's); registers c first (one asm block), then a, lanes (b, t % 8), registers t // 8: the mma
        A fragment of the transposed logits after the reshape (`_kred_t`)."""
        na = 32 // pack
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1 << i, 0] for i in range(pack.bit_length() - 1)]
            + [[1 << i, 0, 0, 0] for i in range(na.bit_length() - 1)]
            + [[0, 0, 0, 8 << i] for i in range(bt.bit_length() - 4)],
            lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]],
            warp_bases=[], block_bases=[], shape=[na, 4, pack, bt])

    @gluon.constexpr_function
    def _value_layout(bt):
        """Values as [t(bt), w(8), jh(2), jl(8)]: code 8jh + jl of the 16-channel chunk w of token t (channel
        16w + 8jh + jl); registers (t % 2, jl) first (one inline-asm block: two tokens, eight codes), lanes
        (t // 2 % 4, w): the mma A fragment of v^T."""
        return gl.DistributedLinearLayout(
            reg_bases=[[1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0]]
            + [[8 << i, 0, 0, 0] for i in range(bt.bit_length() - 4)],
            lane_bases=[[2, 0, 0, 0], [4, 0, 0, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
            warp_bases=[], block_bases=[], shape=[bt, 8, 2, 8])

    @gluon.constexpr_function
    def _stats4_layout(bt):
        """[bt, 4] as the Values' statistics layout ([bt, 8] of `_value_layout`) without w % 2: lane bit 2
        broadcasts."""
        return gl.DistributedLinearLayout(
            reg_bases=[[1, 0]] + [[8 << i, 0] for i in range(bt.bit_length() - 4)],
            lane_bases=[[2, 0], [4, 0], [0, 0], [0, 1], [0, 2]], warp_bases=[], block_bases=[], shape=[bt, 4])

    @gluon.constexpr_function
    def _stats42_layout(bt):
        """[bt, 4, 2] (token, group, w % 2): `_stats4_layout` with w % 2 on lane bit 2, so that its reshape to
        [bt, 8] (w = 2 group + w % 2) is the Values' statistics layout and widening moves no data."""
        return gl.DistributedLinearLayout(
            reg_bases=[[1, 0, 0]] + [[8 << i, 0, 0] for i in range(bt.bit_length() - 4)],
            lane_bases=[[2, 0, 0], [4, 0, 0], [0, 0, 1], [0, 1, 0], [0, 2, 0]], warp_bases=[], block_bases=[],
            shape=[bt, 4, 2])

    @gluon.constexpr_function
    def _fold_layout(bt, n):
        """Folded Values (`_kivi_decode_kernel` VF) as [t(bt), k(8), r(n)]: register r of the block "vf" (n = 16 /
        bits: code r % 4 of group r // 4 of a 16-byte chunk; at 4 bits code r of the 16-bit element k of a group's
        chunk, channel 32 c + 4 k + r of group c) for the element pair that lane k holds after the exchange (none at 4
        bits), token t; registers (t % 2, r) first (one asm block: two tokens, n codes), lanes (t // 2 % 4, k). Its
        slice over r is `ldmatrix.trans`'s fragment of the chunk ([t, k] as the mma's B operand), a group's [t, k, 4]
        reshaped to v_c^T [32 (8 i + k), bt] the mma's A fragment."""
        return gl.DistributedLinearLayout(
            reg_bases=[[1, 0, 0]] + [[0, 0, 1 << j] for j in range(n.bit_length() - 1)]
            + [[8 << i, 0, 0] for i in range(bt.bit_length() - 4)],
            lane_bases=[[2, 0, 0], [4, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]], warp_bases=[], block_bases=[],
            shape=[bt, 8, n])

    @gluon.constexpr_function
    def _fold_stats_layout(bt):
        """[bt, 4] Value half-ranges (token, group) with each lane holding its B-fragment tokens (t % 2 and t // 8 in
        registers, t // 2 % 4 on lane bits 0-1) and all four groups: the factors of p' per group (VF)."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [1, 0]] + [[8 << i, 0] for i in range(bt.bit_length() - 4)],
            lane_bases=[[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]], warp_bases=[], block_bases=[], shape=[bt, 4])

    @gluon.jit
    def _columns4(x):
        """The four columns of x [N, 4] (registers only where the column sits in registers)."""
        a, b = gl.split(x.reshape([x.shape[0], 2, 2]))   # columns (0, 2), (1, 3)
        c0, c2 = gl.split(a)
        c1, c3 = gl.split(b)
        return c0, c1, c2, c3

    @gluon.jit
    def _fold_group(vt16, hc, pT, acc, C: gl.constexpr, a_l: gl.constexpr, b_l: gl.constexpr, BT: gl.constexpr):
        """acc + e_C^T @ (p' half_C)^T for Value group C of one tile (`_kivi_decode_kernel` VF): the group's 16-byte
        chunk of each token's codes by `ldmatrix.trans` (vt16: the tile's code rows as [BT, 32] 16-bit elements), its
        codes bare (the subnormal Key block "kqs8", VF_BITS), the group's per-token half-ranges hc [BT] folded into
        p'^T (pT: the B operand). Rows of the result: 8 i + k, channel 32 C + 4 k + i (`_fold_finish` scales and reorders them)."""
        PF: gl.constexpr = _fold_layout(BT, 4)
        codes = vt16.slice(8 * C, 8, dim=1).load(gl.SliceLayout(2, PF))                 # [BT, 8] 16-bit elements
        e = _fold_codes(codes, PF, 4)
        return _fold_mma(e, hc, pT, acc, a_l, b_l, BT)

    @gluon.jit
    def _fold_mma(e, hc, pT, acc, a_l: gl.constexpr, b_l: gl.constexpr, BT: gl.constexpr):
        """acc + e^T @ (p' hc)^T: one Value group's bare codes e [BT, 8 (k), 4 (i)] (rows 8 i + k of the result) against
        p'^T times the group's per-token half-ranges hc [BT]."""
        eT = gl.convert_layout(e.permute([0, 2, 1]).reshape([BT, 32]).permute([1, 0]), a_l)   # [32, BT]
        hb, _ = gl.broadcast(gl.expand_dims(gl.convert_layout(hc, gl.SliceLayout(1, b_l)), 1), pT)
        return mma_v2(eT, _mul(pT, hb, True), acc)

    @gluon.jit
    def _fold_chunk2(vt16, ha, hb, pT, acc_a, acc_b, CH: gl.constexpr, a_l: gl.constexpr, b_l: gl.constexpr,
                     BT: gl.constexpr):
        """(acc_a, acc_b) + the folded 2-bit Values of chunk CH (groups 2 CH, 2 CH + 1; vt16: the tile's code rows as
        [BT, 16] 16-bit elements) against (p' ha)^T and (p' hb)^T: `ldmatrix.trans`, the byte exchange
        (`_VF_EXCHANGE`), the 2-bit "kqs8" block. Rows of each result: 8 i + k, in-group channel 4 (2 (k % 4) + k // 4) + i."""
        PF: gl.constexpr = _fold_layout(BT, 8)
        LE: gl.constexpr = gl.SliceLayout(2, PF)
        codes = vt16.slice(8 * CH, 8, dim=1).load(LE)                                     # [BT, 8] 16-bit elements
        k8 = gl.arange(0, 8, layout=gl.SliceLayout(0, LE))
        sel = _lane_operand(gl.where(k8 < 4, _vf_pair_sel(0), _vf_pair_sel(4)), codes)
        x = gl.inline_asm_elementwise(_asm("vfx", 2, True), "=r,r,r", [codes, sel], dtype=gl.int16, is_pure=True,
                                      pack=2)
        e = _fold_codes(x, PF, 8)
        ea, eb = gl.split(e.reshape([BT, 8, 2, 4]).permute([0, 1, 3, 2]))                  # r = i + 4 (group)
        return _fold_mma(ea, ha, pT, acc_a, a_l, b_l, BT), _fold_mma(eb, hb, pT, acc_b, a_l, b_l, BT)

    @gluon.jit
    def _fold_chunk1(vt16, h0, h1, h2, h3, pT, acc0, acc1, acc2, acc3, a_l: gl.constexpr, b_l: gl.constexpr,
                     BT: gl.constexpr):
        """The four accumulators + the folded 1-bit Values of a tile (vt16: its code rows as [BT, 8] 16-bit elements,
        one chunk of four groups) against (p' h_c)^T: `ldmatrix.trans`, the nibble transpose (`_VF_EXCHANGE4`), the
        1-bit block "vf". Rows of each result: 8 i + k, in-group channel 16 (k % 2) + 4 (k // 2) + i."""
        PF: gl.constexpr = _fold_layout(BT, 16)
        LE: gl.constexpr = gl.SliceLayout(2, PF)
        codes = vt16.load(LE)                                                             # [BT, 8] 16-bit elements
        k8 = gl.arange(0, 8, layout=gl.SliceLayout(0, LE))
        sel = _lane_operand(gl.where(k8 < 4, _vf_pair_sel(0), _vf_pair_sel(4)), codes)
        odd = (k8 // 2) % 2 == 1
        rot = _lane_operand(gl.where(odd, _vf_nib(1, 0), _vf_nib(0, 0)), codes)
        keep = _lane_operand(gl.where(odd, _vf_nib(1, 1), _vf_nib(0, 1)), codes)
        x = gl.inline_asm_elementwise(_asm("vfx", 1, True), "=r,r,r,r,r", [codes, sel, rot, keep], dtype=gl.int16,
                                      is_pure=True, pack=2)
        e = _fold_codes(x, PF, 16)
        e0, e1 = gl.split(e.reshape([BT, 8, 2, 2, 4]).permute([0, 1, 4, 2, 3]))           # r = i + 4 (2 g1 + g0)
        ea, ec = gl.split(e0)
        eb, ed = gl.split(e1)
        return (_fold_mma(ea, h0, pT, acc0, a_l, b_l, BT), _fold_mma(eb, h1, pT, acc1, a_l, b_l, BT),
                _fold_mma(ec, h2, pT, acc2, a_l, b_l, BT), _fold_mma(ed, h3, pT, acc3, a_l, b_l, BT))

    @gluon.jit
    def _lane_operand(x, like):
        """A per-element int16 operand of an exchange block (`_VF_EXCHANGE`, `_VF_EXCHANGE4`): x [8] by the element
        k that a lane holds, broadcast over the tokens of `like` [BT, 8] (a token pair's register: (x, x))."""
        y, _ = gl.broadcast(gl.expand_dims(x.to(gl.int16), 0), like)
        return y

    @gluon.jit
    def _fold_codes(x, PF: gl.constexpr, N: gl.constexpr):
        """The block "vf" over element pairs x [BT, 8] (16-bit, in PF's slice): [BT, 8, N] bf16 codes (register r)."""
        r = gl.arange(0, N, layout=gl.SliceLayout(0, gl.SliceLayout(0, PF)))
        w, _ = gl.broadcast(gl.expand_dims(x, 2), gl.expand_dims(gl.expand_dims(r, 0), 0))   # [BT, 8, N]
        return gl.inline_asm_elementwise(_asm("vf", 16 // N, True), _fold_cons(N), [w], dtype=gl.bfloat16,
                                         is_pure=True, pack=2 * N)

    @gluon.jit
    def _fold_values(vtile, vhtile, pT, acc0, acc1, acc2, acc3, t0, stop, VF16: gl.constexpr, VBITS: gl.constexpr,
                     WT: gl.constexpr, a_l: gl.constexpr, b_l: gl.constexpr, BT: gl.constexpr):
        """The four Value groups' accumulators + one ring tile's folded Values (`_kivi_decode_kernel` VF; vtile its
        code rows, read as 16-bit elements in VF16, the ring's swizzle; vhtile its [BT * 4] half-ranges): each group's
        codes bare against p'^T times its half-ranges."""
        vt16 = vtile._reinterpret(gl.int16, [BT, 8 * VBITS], VF16)
        LHB: gl.constexpr = _fold_stats_layout(BT)
        flatv: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        hb4 = vhtile._reinterpret(vhtile.dtype, [BT, 4], flatv).load(LHB)
        if not WT:   # past `stop`: zeros (stale statistics there might not be finite), as the offsets' statistics
            tb4 = gl.arange(0, BT, layout=gl.SliceLayout(1, LHB))
            hb4 = gl.where(gl.expand_dims((t0 + tb4) < stop, 1), hb4, 0.0)
        h0, h1, h2, h3 = _columns4(hb4)
        if VBITS == 4:
            acc0 = _fold_group(vt16, h0, pT, acc0, 0, a_l, b_l, BT)
            acc1 = _fold_group(vt16, h1, pT, acc1, 1, a_l, b_l, BT)
            acc2 = _fold_group(vt16, h2, pT, acc2, 2, a_l, b_l, BT)
            acc3 = _fold_group(vt16, h3, pT, acc3, 3, a_l, b_l, BT)
        elif VBITS == 2:
            acc0, acc1 = _fold_chunk2(vt16, h0, h1, pT, acc0, acc1, 0, a_l, b_l, BT)
            acc2, acc3 = _fold_chunk2(vt16, h2, h3, pT, acc2, acc3, 1, a_l, b_l, BT)
        else:
            acc0, acc1, acc2, acc3 = _fold_chunk1(vt16, h0, h1, h2, h3, pT, acc0, acc1, acc2, acc3, a_l, b_l, BT)
        return acc0, acc1, acc2, acc3

    @gluon.jit
    def _fold_rows(i, VBITS: gl.constexpr, C: gl.constexpr):
        """Group C's row factors a 2^(133 - VF_E - bit) (`_vf_row`) by code i [32] of each row, as a [32, 1] column."""
        VAF: gl.constexpr = 2.0 / ((1 << VBITS) - 1)
        F0: gl.constexpr = VAF * _vf_row(VBITS, C, 0)
        F1: gl.constexpr = VAF * _vf_row(VBITS, C, 1)
        F2: gl.constexpr = VAF * _vf_row(VBITS, C, 2)
        F3: gl.constexpr = VAF * _vf_row(VBITS, C, 3)
        return gl.expand_dims(gl.where(i < 2, gl.where(i == 0, F0, F1), gl.where(i == 2, F2, F3)), 1)

    @gluon.jit
    def _fold_finish(acc0, acc1, acc2, acc3, accz, VBITS: gl.constexpr, mma: gl.constexpr):
        """out^T [128, 8] (row 32 c + n: `_fold_values`' row n of group c) from the four groups' accumulators (each
        row times a 2^(133 - VF_E - bit): the level spacing a, the codes' 2^(bit - 133) and p's 2^VF_E) and the
        offsets' share (accz: `_zero_rows`' rows, group (r % 8) // 2, times 2^-VF_E)."""
        i = (gl.arange(0, 32, layout=gl.SliceLayout(1, mma)) >> 3) % 4     # code i = (n // 8) % 4
        grp = gl.expand_dims((gl.arange(0, 16, layout=gl.SliceLayout(1, mma)) % 8) // 2, 1)   # accz's row groups
        az = accz * VF_DOWN_   # (the rows of a group are equal: their max is any of them)
        o0 = acc0 * _fold_rows(i, VBITS, 0) + gl.expand_dims(gl.max(gl.where(grp == 0, az, float("-inf")), 0), 0)
        o1 = acc1 * _fold_rows(i, VBITS, 1) + gl.expand_dims(gl.max(gl.where(grp == 1, az, float("-inf")), 0), 0)
        o2 = acc2 * _fold_rows(i, VBITS, 2) + gl.expand_dims(gl.max(gl.where(grp == 2, az, float("-inf")), 0), 0)
        o3 = acc3 * _fold_rows(i, VBITS, 3) + gl.expand_dims(gl.max(gl.where(grp == 3, az, float("-inf")), 0), 0)
        x = gl.join(gl.join(o0, o1), gl.join(o2, o3))                    # [32, 8, 2 (c % 2), 2 (c // 2)]
        return gl.convert_layout(x.permute([3, 2, 0, 1]).reshape([128, 8]), mma)

    @gluon.jit
    def _scale_offset(half, center, hi, lo, IS_BF16: gl.constexpr):
        """(half * (hi + lo), center - half) in the cache dtype, two per instruction (hi, lo broadcast)."""
        if IS_BF16:
            s = gl.inline_asm_elementwise(_stats(True, 0), "=r,r,r,r", [half, hi, lo], dtype=gl.bfloat16,
                                          is_pure=True, pack=2)
            z = gl.inline_asm_elementwise(_stats(True, 1), "=r,r,r", [half, center], dtype=gl.bfloat16,
                                          is_pure=True, pack=2)
        else:
            s = gl.inline_asm_elementwise(_stats(False, 0), "=r,r,r,r", [half, hi, lo], dtype=gl.float16,
                                          is_pure=True, pack=2)
            z = gl.inline_asm_elementwise(_stats(False, 1), "=r,r,r", [half, center], dtype=gl.float16,
                                          is_pure=True, pack=2)
        return s, z

    @gluon.jit
    def _hybrid_scale_offset(half, center, hi_s, hi_a, lo_s, lo_a, IS_BF16: gl.constexpr):
        """`_scale_offset` of hybrid groups from their signed half-ranges (`_hybrid_stats_asm`): the terms (hi_s, lo_s)
        where a group chose symmetric levels, (hi_a, lo_a) where not."""
        if IS_BF16:
            s = gl.inline_asm_elementwise(_hybrid_stats(True, 0), "=r,r,r,r,r,r", [half, hi_s, hi_a, lo_s, lo_a],
                                          dtype=gl.bfloat16, is_pure=True, pack=2)
            z = gl.inline_asm_elementwise(_hybrid_stats(True, 1), "=r,r,r", [half, center], dtype=gl.bfloat16,
                                          is_pure=True, pack=2)
        else:
            s = gl.inline_asm_elementwise(_hybrid_stats(False, 0), "=r,r,r,r,r,r", [half, hi_s, hi_a, lo_s, lo_a],
                                          dtype=gl.float16, is_pure=True, pack=2)
            z = gl.inline_asm_elementwise(_hybrid_stats(False, 1), "=r,r,r", [half, center], dtype=gl.float16,
                                          is_pure=True, pack=2)
        return s, z

    @gluon.jit
    def _unpack(words, s, z, SIDE: gl.constexpr, BITS: gl.constexpr, PACK: gl.constexpr, IS_BF16: gl.constexpr):
        """Dequantized values (cache dtype) from packed words broadcast over their codes, PACK per asm block. (Here
        and in the other blocks' wrappers, one branch per dtype: inline_asm_elementwise takes a dtype object, not a
        constexpr choosing one.)"""
        if IS_BF16:
            x = gl.inline_asm_elementwise(_asm(SIDE, BITS, True), _cons(PACK, True), [words, s, z], dtype=gl.bfloat16,
                                          is_pure=True, pack=PACK)
        else:
            x = gl.inline_asm_elementwise(_asm(SIDE, BITS, False), _cons(PACK, True), [words, s, z], dtype=gl.float16,
                                          is_pure=True, pack=PACK)
        return x

    @gluon.jit
    def _unpack_post(words, SIDE: gl.constexpr, IS_BF16: gl.constexpr):
        """`M + 2^i code` pairs (cache dtype) from packed words broadcast over their codes, 16 per asm block."""
        if IS_BF16:
            x = gl.inline_asm_elementwise(_asm(SIDE, 1, True), _cons(16, False), [words], dtype=gl.bfloat16,
                                          is_pure=True, pack=16)
        else:
            x = gl.inline_asm_elementwise(_asm(SIDE, 1, False), _cons(16, False), [words], dtype=gl.float16,
                                          is_pure=True, pack=16)
        return x

    @gluon.jit
    def _unpack_kq(words, BITS: gl.constexpr, PACK: gl.constexpr, IS_BF16: gl.constexpr, KSUB: gl.constexpr = False,
                   KSW: gl.constexpr = 7):
        """Post-scaled KIVI Key registers (`_kpost_asm`) from packed words broadcast over their PACK codes (KSUB:
        bf16 subnormals, no magic number, in a code window of KSW bits)."""
        if IS_BF16 and KSUB:
            x = gl.inline_asm_elementwise(_asm(_kqs(KSW), BITS, True), _cons(PACK, False), [words], dtype=gl.bfloat16,
                                          is_pure=True, pack=PACK)
        elif IS_BF16:
            x = gl.inline_asm_elementwise(_asm("kq", BITS, True), _cons(PACK, False), [words], dtype=gl.bfloat16,
                                          is_pure=True, pack=PACK)
        else:
            x = gl.inline_asm_elementwise(_asm("kq", BITS, False), _cons(PACK, False), [words], dtype=gl.float16,
                                          is_pure=True, pack=PACK)
        return x

    @gluon.jit
    def _offset(half, center, IS_BF16: gl.constexpr):
        """center - half in the cache dtype, two per instruction."""
        if IS_BF16:
            z = gl.inline_asm_elementwise(_stats(True, 1), "=r,r,r", [half, center], dtype=gl.bfloat16,
                                          is_pure=True, pack=2)
        else:
            z = gl.inline_asm_elementwise(_stats(False, 1), "=r,r,r", [half, center], dtype=gl.float16,
                                          is_pure=True, pack=2)
        return z

    @gluon.jit
    def _mul(x, y, IS_BF16: gl.constexpr):
        """x * y in the cache dtype, rounded once, two per instruction."""
        if IS_BF16:
            z = gl.inline_asm_elementwise(_asm("mul", 0, True), "=r,r,r", [x, y], dtype=gl.bfloat16, is_pure=True,
                                          pack=2)
        else:
            z = gl.inline_asm_elementwise(_asm("mul", 0, False), "=r,r,r", [x, y], dtype=gl.float16, is_pure=True,
                                          pack=2)
        return z

    @gluon.jit
    def _sigma(x, KP: gl.constexpr):
        """[NA, 4, KP] statistics in channel order -> in a post-scaled Key block's element order (element 2r + h:
        code r + KP / 2 h), registers only."""
        NA: gl.constexpr = 32 // KP
        return x.reshape([NA, 4, 2, KP // 2]).permute([0, 1, 3, 2]).reshape([NA, 4, KP])

    @gluon.jit
    def _kred(x, KP: gl.constexpr):
        """[NA, 4, KP] -> [128] in the Key mma's reduction order (the permutation of the Key codes' reshape)."""
        if KP == 16:
            y = x.reshape([2, 2, 2, 2, 2, 2, 2]).permute([0, 3, 4, 5, 1, 2, 6]).reshape([128])
        else:
            y = x.reshape([2, 2, 2, 2, 2, 2, 2]).permute([0, 1, 4, 5, 2, 3, 6]).reshape([128])
        return y

    @gluon.jit
    def _kred_t(kv, KP: gl.constexpr, BT: gl.constexpr):
        """Key registers [NA, 4, KP, BT] -> [BT, 128], the A operand of the transposed logits mma (k as `_kred`)."""
        if KP == 16:
            y = kv.reshape([2, 2, 2, 2, 2, 2, 2, BT]).permute([7, 0, 3, 4, 5, 1, 2, 6]).reshape([BT, 128])
        else:
            y = kv.reshape([2, 2, 2, 2, 2, 2, 2, BT]).permute([7, 0, 1, 4, 5, 2, 3, 6]).reshape([BT, 128])
        return y

    @gluon.jit
    def _rows(c, BT: gl.constexpr, mma: gl.constexpr):
        """[16, 8] -> [BT, 8] (row r reads row r % 16), in the accumulator layout."""
        if BT == 32:
            y = gl.convert_layout(gl.join(c, c).permute([2, 0, 1]).reshape([32, 8]), mma)
        else:
            y = c
        return y

    @gluon.jit
    def _zero_rows(z, a_l: gl.constexpr, BT: gl.constexpr):
        """[BT, 8] per-token Value offsets (column w: those of channels 16w .. 16w + 15, group w // 2) -> the A
        operand [16, BT] of the offsets' mma (`_kivi_decode_kernel` VZ), row r = column r % 8: each lane holds the
        offsets its Value registers were dequantized with, so no data moves."""
        zt = z.permute([1, 0])
        return gl.convert_layout(gl.join(zt, zt).permute([2, 0, 1]).reshape([16, BT]), a_l)

    @gluon.jit
    def _inner_qsum_rows(qT, b_l: gl.constexpr):
        """InnerQ's Keys with their offsets apart (`_kivi_decode_kernel` KZA): q^T [128, 8] (the Key mma's reduction
        order, group g = (k >> 1) & 3, `_key_channel`) -> the B operand [16, 8] of the offsets' mma, row
        8 j + 2 g + i: sum_g(q) as a bf16 pair (i = 0 the rounded sum, i = 1 its remainder) for j = 0, zero for j = 1.
        The lanes l with l % 4 = b hold group b's 32 channels in the B fragment, so the sums stay in a lane."""
        qs = gl.sum(gl.sum(gl.sum(qT.to(gl.float32).reshape([8, 2, 4, 2, 8]), 3), 1), 0)          # [4 (g), 8]
        hi = qs.to(qT.dtype)
        lo = (qs - hi.to(gl.float32)).to(qT.dtype)
        x = gl.join(hi, lo)                                                                         # [4, 8, 2 (i)]
        y = gl.join(x, gl.full(x.shape, 0.0, x.dtype, x.type.layout))                               # [4, 8, 2, 2 (j)]
        return gl.convert_layout(y.permute([3, 0, 2, 1]).reshape([16, 8]), b_l)

    @gluon.jit
    def _inner_zrows(kz, a_l: gl.constexpr, BT: gl.constexpr):
        """InnerQ's Key offsets [4 (g), BT] (one per token and 32-channel group) -> the A operand [BT, 16] of the
        offsets' mma, A[t, 8 j + 2 g + i] = z[g, t]: with `_inner_qsum_rows` row t of the product is
        sum_g z[g, t] (hi_g + lo_g), each product exact in fp32 (hi + lo is the fp32 group sum to about 2^-17).
        Lane b + 4 (t % 8) holds z[b, t] in the Key layout and in the A fragment alike."""
        zt = kz.permute([1, 0])                                                                     # [BT, 4]
        x = gl.join(zt, zt)                                                                         # [BT, 4, 2 (i)]
        y = gl.join(x, x)                                                                           # [BT, 4, 2, 2 (j)]
        return gl.convert_layout(y.permute([0, 3, 1, 2]).reshape([BT, 16]), a_l)

    @gluon.jit
    def _rows128(c, mma: gl.constexpr):
        """[16, 8] -> [128, 8] (row r reads row r % 16), in the accumulator layout."""
        x = gl.join(c, c)
        x = gl.join(x, x)
        x = gl.join(x, x)                                           # [16, 8, 2, 2, 2]
        return gl.convert_layout(x.permute([4, 3, 2, 0, 1]).reshape([128, 8]), mma)

    @gluon.jit
    def _p_transposed(p, b_l: gl.constexpr, BT: gl.constexpr, IS_BF16: gl.constexpr):
        """p^T [BT, 8] (tokens x query heads, in the accumulator layout of the transposed logits) as the B operand
        of v^T @ p^T: `movmatrix` transposes each 8 x 8 block across the warp (lane l then holds tokens
        2 (l % 4) + {0, 1} of query head l / 4), the reshape only renames the elements."""
        MOV: gl.constexpr = "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;"
        if IS_BF16:
            x = gl.inline_asm_elementwise(MOV, "=r,r", [p], dtype=gl.bfloat16, is_pure=True, pack=2)
        else:
            x = gl.inline_asm_elementwise(MOV, "=r,r", [p], dtype=gl.float16, is_pure=True, pack=2)
        return gl.convert_layout(x.reshape([BT // 8, 8, 8]).permute([0, 2, 1]).reshape([BT, 8]), b_l)

    @gluon.jit
    def _before(t, stop, WT: gl.constexpr):
        """t < stop; with WT (`_whole_tiles`) a constant True, which drops the compare and the select or predicate
        it would feed."""
        if WT:
            ok = gl.full(t.shape, 1, gl.int1, t.type.layout)
        else:
            ok = t < stop
        return ok

    @gluon.jit
    def _mask_scores(s, trow, tcol, t0, stop, AMASK, moff, REP: gl.constexpr, MASK_KIND: gl.constexpr,
                     WT: gl.constexpr = False):
        """(s, allowed) of a transposed [BT, 8] tile of base-2 logits (rows: positions t0 + trow, columns: query
        heads): real heads, positions < stop (WT: all, `_whole_tiles`), and the one-row attention mask (MASK_KIND 1
        bool, 2 additive: added to s in base 2; 3 none, through the bool build's code with its load predicated off:
        kvquant's kernel only, `LUT_NO_MASK_AS_BOOL`)."""
        tt = t0 + trow
        inside = _before(tt, stop, WT)
        allowed = gl.expand_dims(tcol < REP, 0) & gl.expand_dims(inside, 1)
        if MASK_KIND == 1:
            mv = gl.load(AMASK + moff + tt, mask=inside, other=0)
            allowed = allowed & gl.expand_dims(mv != 0, 1)
        elif MASK_KIND == 3:   # no mask, through the bool build's code: a load predicated off (tt >= 0)
            mv = gl.load(AMASK.to(gl.pointer_type(gl.int8), bitcast=True) + moff + tt, mask=tt < 0, other=1)
            allowed = allowed & gl.expand_dims(mv != 0, 1)
        elif MASK_KIND == 2:
            mv = gl.load(AMASK + moff + tt, mask=inside, other=0.0).to(gl.float32)
            s = s + gl.expand_dims(mv * 1.4426950408889634, 1)
            allowed = allowed & gl.expand_dims(mv > float("-inf"), 1)
        return s, allowed

    @gluon.jit
    def _mask_slice_ok(AMASK, moff, start, stop, N: gl.constexpr):
        """1 where the bool mask row allows every position of [start, stop), else 0 (int32, one value for the
        program): N bytes a step (N / 32 a lane), ahead of the tile loop (`MASK_SLICE`)."""
        lay: gl.constexpr = gl.BlockedLayout([N // 32], [32], [1], [0])
        i = gl.arange(0, N, layout=lay)
        bad = gl.zeros([N], gl.int32, lay)
        for c in range(start, stop, N):
            mv = gl.load(AMASK + moff + c + i, mask=c + i < stop, other=1)
            bad = bad | (mv == 0).to(gl.int32)
        return 1 - gl.max(bad, 0)

    @gluon.jit
    def _loop_runs(mok, VAR: gl.constexpr, MOKON: gl.constexpr):
        """Whether the tile loop's copy VAR runs (`_kivi_decode_kernel` MOK): copy 0 (built without the mask) where
        mok = 1, copy 1 where mok = 0; without MOKON the one copy always."""
        if MOKON:
            go = mok != VAR
        else:
            go = True
        return go

    @gluon.constexpr_function
    def _mok_on(mok, mask_kind):
        """Whether the KIVI kernel builds its maskless loop copy (MOK > 0 with a bool mask); an offline build that
        leaves MOK out (None) builds the one loop."""
        return bool(mok) and mask_kind == 1

    @gluon.constexpr_function
    def _loop_mask_kind(mask_kind, mokon, var):
        """The mask kind a copy of the tile loop is built with (`_loop_runs`): MOK's copy 0 none."""
        return 0 if (mokon and var == 0) else mask_kind

    @gluon.jit
    def _load_qT(Q, b, h, stride_qb, stride_qh, tchan, REP: gl.constexpr, b_l: gl.constexpr):
        """q^T [128, 8] of the REP query heads of KV head h (columns past REP zero), row k = channel tchan[k]: the B
        operand of the transposed logits mma."""
        tn = gl.arange(0, 8, layout=gl.SliceLayout(0, b_l))
        return gl.load(Q + b.to(gl.int64) * stride_qb + gl.expand_dims((h * REP + tn) * stride_qh, 0)
                       + gl.expand_dims(tchan, 1), mask=gl.expand_dims(tn < REP, 0), other=0.0)

    @gluon.jit
    def _softmax_step(s, allowed, m8, lacc, PE: gl.constexpr = 0):
        """One tile of the online softmax in base 2 over transposed logits [BT, 8] (a column per query head):
        (p, alpha, new max, new per-lane partial sums); heads with nothing allowed yet keep max -inf and p = 0.
        PE: p and the sums times 2^PE (`_kivi_decode_kernel` VF)."""
        s = gl.where(allowed, s, float("-inf"))
        m_new = gl.maximum(m8, gl.max(s, 0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        if PE != 0:
            p = gl.exp2(s - gl.expand_dims(m_use - PE, 0))
        else:
            p = gl.exp2(s - gl.expand_dims(m_use, 0))
        alpha = gl.exp2(m8 - m_use)
        return p, alpha, m_new, lacc * gl.expand_dims(alpha, 0) + p

    @gluon.jit
    def _softmax_pair(s_a, s_b, m8, lacc, PE: gl.constexpr = 0):
        """`_softmax_step` over two tiles at once (a ring slot), their logits masked already (-inf): one max over
        both, one alpha; (p_a, p_b, alpha, new max, new per-lane partial sums). PE as `_softmax_step`'s."""
        m_new = gl.maximum(m8, gl.max(gl.maximum(s_a, s_b), 0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        if PE != 0:
            m_p = m_use - PE
        else:
            m_p = m_use
        p_a = gl.exp2(s_a - gl.expand_dims(m_p, 0))
        p_b = gl.exp2(s_b - gl.expand_dims(m_p, 0))
        alpha = gl.exp2(m8 - m_use)
        return p_a, p_b, alpha, m_new, lacc * gl.expand_dims(alpha, 0) + p_a + p_b

    @gluon.jit
    def _softmax_state(BT: gl.constexpr, mma: gl.constexpr):
        """(positions, heads of a transposed [BT, 8] logits tile, running max -inf, partial sums 0, accumulator 0)."""
        trow = gl.arange(0, BT, layout=gl.SliceLayout(1, mma))
        tcol = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
        m8 = gl.full([8], float("-inf"), gl.float32, gl.SliceLayout(0, mma))
        return trow, tcol, m8, gl.zeros([BT, 8], gl.float32, mma), gl.zeros([128, 8], gl.float32, mma)

    @gluon.jit
    def _store_partials(OUT_M, OUT_L, OUT_ACC, bh, split, NSPLIT, NWIN: gl.constexpr, m8, l8, acc,
                         REP: gl.constexpr, mma: gl.constexpr, FOLD: gl.constexpr = 0):
        """This program's (max in base e, sum, acc) into slot `split` of each real head's row, as `_decode_kernel`
        writes them (rows REP..15 are never read): max and sum per query head as [8] vectors along the
        accumulator's columns, the accumulator's channels back in channel order."""
        r8 = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
        o8 = (bh * 16 + r8) * (NSPLIT + NWIN) + split
        LN2: gl.constexpr = 0.6931471805599453
        gl.store(OUT_M + o8, m8 * LN2, mask=r8 < REP)
        gl.store(OUT_L + o8, l8, mask=r8 < REP)
        n = gl.arange(0, 128, layout=gl.SliceLayout(1, mma))
        if FOLD == 4:   # `_fold_finish`'s rows: n = 32 c + 8 i + k, channel 32 c + 4 k + i
            chan = (n & 96) + 4 * (n & 7) + ((n >> 3) & 3)
        elif FOLD == 2:   # the same rows, channel 32 c + 4 (2 (k % 4) + k // 4) + i (`_fold_chunk2`)
            chan = (n & 96) + 8 * (n & 3) + 4 * ((n >> 2) & 1) + ((n >> 3) & 3)
        elif FOLD == 1:   # the same rows, channel 32 c + 16 (k % 2) + 4 (k // 2) + i (`_fold_chunk1`)
            chan = (n & 96) + 16 * (n & 1) + 4 * ((n >> 1) & 3) + ((n >> 3) & 3)
        else:      # n = 8 j + w, channel 16 w + j
            chan = 16 * (n & 7) + (n >> 3)
        gl.store(OUT_ACC + gl.expand_dims(o8, 0) * 128 + gl.expand_dims(chan, 1), acc,
                 mask=gl.expand_dims(r8 < REP, 0))

    @gluon.jit
    def _trace_now():
        """Debug (TRACE): the GPU's global nanosecond timer (`%globaltimer`), comparable across SMs and launches."""
        return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                         pack=1)

    @gluon.jit
    def _trace_store(P, t0, t1, t2, t3, t4, smid, n):
        """Debug (TRACE): one program's record, 8 int64 at P: five timer reads, its SM, a count, 0."""
        gl.store(P, t0)
        gl.store(P + 1, t1)
        gl.store(P + 2, t2)
        gl.store(P + 3, t3)
        gl.store(P + 4, t4)
        gl.store(P + 5, smid.to(gl.int64))
        gl.store(P + 6, n.to(gl.int64))
        gl.store(P + 7, t4 * 0)

    @gluon.jit
    def _trace_smid():
        """Debug (TRACE): the SM this program runs on (`%smid`)."""
        return gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.constexpr_function
    def _rows_layout(bt):
        """[bt, 128] rows of the cache dtype, 8 channels (16 bytes) a register block: the exact windows' Values."""
        return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[1, 1],
                                order=[1, 0])

    @gluon.jit
    def _window(POS, S: gl.constexpr, R: gl.constexpr, BT: gl.constexpr):
        """(p0, win_lo, sink tiles) of the exact windows of a layout whose sides are both quantized a
        token at a time (kvquant's, calibquant's: Q(L) = S + max(L - S - R, 0) on both sides): tiles
        [0, sink tiles) cover [0, min(S, p0)), the rest [win_lo, p0] (the ring, then the appended chunk at p0), as
        `decode_attention._window_t` lays them out."""
        p0 = gl.load(POS).to(gl.int32)
        qend = gl.minimum(S + gl.maximum(p0 + 1 - S - R, 0), p0)
        win_lo = gl.minimum(gl.maximum(qend, S), p0)
        n_sink = gl.cdiv(gl.minimum(p0, S), BT)
        return p0, win_lo, n_sink

    @gluon.jit
    def _window_tile(wt, p0, win_lo, n_sink, S: gl.constexpr, BT: gl.constexpr):
        """(first position, end of the valid positions) of exact-window tile wt (`_window`)."""
        in_sink = wt < n_sink
        t0 = gl.where(in_sink, wt * BT, win_lo + (wt - n_sink) * BT)
        return t0, gl.where(in_sink, gl.minimum(p0, S), p0 + 1)

    @gluon.jit
    def _exact_rows(SINK, RING, CHUNK, stride_cb, stride_ch, b, h, bh64, t, c, valid, p0, S: gl.constexpr,
                    WR: gl.constexpr):
        """Cache-dtype values at positions t (a row tensor) and channels c (a tensor that broadcasts against it)
        from where the store keeps them exactly: the sink [B * H, S, 128] below S, ring slot t % WR
        [B * H, WR, 128] from S up to p0, the appended chunk (the attention's key or value input, row stride_cb,
        head stride_ch) at p0; zero where not valid. One predicated load per source into the same registers (each
        keeps the last one's values where it does not load). Window tiles of `_window` meet no codes."""
        x = gl.load(CHUNK + b.to(gl.int64) * stride_cb + h * stride_ch + c + t * 0, mask=valid & (t == p0), other=0.0)
        if WR > 0:
            x = gl.load(RING + bh64 * (WR * 128) + (t % WR) * 128 + c, mask=valid & (t >= S) & (t < p0), other=x)
        if S > 0:
            x = gl.load(SINK + bh64 * (S * 128) + t * 128 + c, mask=valid & (t < S) & (t < p0), other=x)
        return x

    @gluon.jit
    def _exact_keys(KSINK, KRING, KCHUNK, stride_cb, stride_ch, b, h, bh64, t0, stop, p0, S: gl.constexpr,
                    WR: gl.constexpr, BT: gl.constexpr, a_l: gl.constexpr):
        """An exact-window tile's Keys [BT, 128] (channels in order), loaded straight into the A operand of the
        transposed logits (each register: two adjacent channels of one token)."""
        t = gl.expand_dims(t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, a_l)), 1)              # [BT, 1]
        c = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, a_l)), 0)                  # [1, 128]
        return _exact_rows(KSINK, KRING, KCHUNK, stride_cb, stride_ch, b, h, bh64, t, c, t < stop, p0, S, WR)

    @gluon.jit
    def _exact_values(VSINK, VRING, VCHUNK, stride_cb, stride_ch, b, h, bh64, t0, stop, p0, S: gl.constexpr,
                      WR: gl.constexpr, BT: gl.constexpr, a_l: gl.constexpr):
        """An exact-window tile's v^T [128 (n = 8r + w), BT] in the Values' mma order (channel 16w + r, as the kernels
        unpack theirs: `_value_layout`), the A operand of v^T @ p^T; loaded as rows (16 bytes a register block)."""
        RL: gl.constexpr = _rows_layout(BT)
        t = gl.expand_dims(t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, RL)), 1)               # [BT, 1]
        c = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, RL)), 0)                   # [1, 128]
        v = _exact_rows(VSINK, VRING, VCHUNK, stride_cb, stride_ch, b, h, bh64, t, c, t < stop, p0, S, WR)
        return gl.convert_layout(v.reshape([BT, 8, 16]).permute([2, 1, 0]).reshape([128, BT]), a_l)

    @gluon.jit
    def _temperatures(M1, L1, NS1, tau_sum, bh, REP: gl.constexpr, layout: gl.constexpr):
        """CalibQuant's temperature of the REP query heads of KV head bh, from the range pass's NS1 partial results
        per row (max in M1, min in L1, rows (bh * 16 + r) * NS1) as `decode_attention._temperature_kernel` computes
        it: t = 1 - (tau1 + tau2) / (max - min), 1 where the range is empty, zero or not finite; an [8] vector in
        `layout` (1 past REP)."""
        TL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[8, 4], warps_per_cta=[1, 1],
                                            order=[1, 0])   # [8 heads, 16 slots]
        r = gl.arange(0, 8, layout=gl.SliceLayout(1, TL))
        j = gl.arange(0, 16, layout=gl.SliceLayout(0, TL))
        row = gl.expand_dims((bh * 16 + r) * NS1, 1)
        hi = gl.full([8], float("-inf"), gl.float32, gl.SliceLayout(1, TL))
        lo = gl.full([8], float("inf"), gl.float32, gl.SliceLayout(1, TL))
        for j0 in range(0, NS1, 16):
            ok = gl.expand_dims(r < REP, 1) & gl.expand_dims(j0 + j < NS1, 0)
            hi = gl.maximum(hi, gl.max(gl.load(M1 + row + j0 + gl.expand_dims(j, 0), mask=ok, other=float("-inf")),
                                       1))
            lo = gl.minimum(lo, gl.min(gl.load(L1 + row + j0 + gl.expand_dims(j, 0), mask=ok, other=float("inf")), 1))
        width = hi - lo
        ok = (width > 0) & (width < float("inf"))
        t = gl.where(ok, 1.0 - gl.div_rn(gl.zeros_like(width) + tau_sum, gl.where(ok, width, 1.0)), 1.0)
        return gl.convert_layout(t, layout)

    @gluon.jit
    def _window_partials(Q, stride_qb, stride_qh, KSINK, KRING, KCHUNK, stride_kcb, stride_kch, VSINK, VRING, VCHUNK,
                         stride_vcb, stride_vch, POS, AMASK, stride_mb, temp, LOGITS, OUT_M, OUT_L, OUT_ACC, scale, T,
                         bh, split, NSPLIT, H: gl.constexpr, REP: gl.constexpr, S: gl.constexpr, R: gl.constexpr,
                         WR_K: gl.constexpr, WR_V: gl.constexpr, MASK_KIND: gl.constexpr, IS_BF16: gl.constexpr,
                         BT: gl.constexpr, TAU_PHASE: gl.constexpr, NWIN: gl.constexpr):
        """The exact windows' partial results, as the window launch (`decode_attention._decode_kernel` WINDOW) writes
        them: tile wt of `_window` (BT tokens) into slot NSPLIT + wt, for wt = split, split + NSPLIT, ... < NWIN (a
        tile past the window: an empty result, max -inf, sum 0). Phase 0 attends; 1 writes the logits' max and min
        (and the logits, base 2, into LOGITS [B * H, T, REP] like the slices'); 2 reads the logits back, scales them
        by temp (per head, [8] along the logits' columns) and attends. Keys and Values come from the sink, the ring
        and the appended chunk (`_exact_rows`), 16 tokens at a time (32 took 138-174 registers); q . k on the tensor
        cores in the cache dtype with fp32 sums, as the window launch's tl.dot. Run before a program's slice, so that
        none of the slice's state is live here (after it, the slice's loop lost registers to it)."""
        b = bh // H
        h = bh % H
        bh64 = bh.to(gl.int64)
        dt: gl.constexpr = gl.bfloat16 if IS_BF16 else gl.float16
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        LN2: gl.constexpr = 0.6931471805599453
        SUB: gl.constexpr = 16
        p0, win_lo, n_sink = _window(POS, S, R, BT)   # the slots NWIN cover the longest window
        trow, tcol, m_init, l_init, a_init = _softmax_state(SUB, mma)
        lg_off = gl.expand_dims(trow, 1) * REP + gl.expand_dims(tcol, 0)
        lg_base = LOGITS + bh64 * T * REP
        for wt in range(split, NWIN, NSPLIT):
            t0w, wstop = _window_tile(wt, p0, win_lo, n_sink, S, BT)   # past the window: t0w > p0, nothing valid
            m8 = m_init
            lacc = l_init
            acc = a_init
            hi = gl.full([8], float("-inf"), gl.float32, gl.SliceLayout(0, mma))
            lo = gl.full([8], float("inf"), gl.float32, gl.SliceLayout(0, mma))
            for half in gl.static_range(BT // SUB):
                t0 = t0w + half * SUB
                lvalid = gl.expand_dims((t0 + trow) < wstop, 1) & gl.expand_dims(tcol < REP, 0)
                if TAU_PHASE == 2:
                    s = gl.load(lg_base + t0 * REP + lg_off, mask=lvalid, other=0.0)
                else:
                    kx = _exact_keys(KSINK, KRING, KCHUNK, stride_kcb, stride_kch, b, h, bh64, t0, wstop, p0, S, WR_K,
                                     SUB, a_l)
                    qn = _load_qT(Q, b, h, stride_qb, stride_qh, gl.arange(0, 128, layout=gl.SliceLayout(1, b_l)),
                                  REP, b_l)   # q^T in channel order
                    s = mma_v2(kx, qn, gl.zeros([SUB, 8], gl.float32, mma)) * (scale * 1.4426950408889634)
                    if TAU_PHASE == 1:
                        gl.store(lg_base + t0 * REP + lg_off, s, mask=lvalid)
                s, allowed = _mask_scores(s, trow, tcol, t0, wstop, AMASK, b.to(gl.int64) * stride_mb, REP,
                                          MASK_KIND)
                if TAU_PHASE == 1:
                    hi = gl.maximum(hi, gl.max(gl.where(allowed, s, float("-inf")), 0))
                    lo = gl.minimum(lo, gl.min(gl.where(allowed, s, float("inf")), 0))
                else:
                    if TAU_PHASE == 2:
                        s = s * gl.expand_dims(temp, 0)
                    p, alpha8, m8, lacc = _softmax_step(s, allowed, m8, lacc)
                    vx = _exact_values(VSINK, VRING, VCHUNK, stride_vcb, stride_vch, b, h, bh64, t0, wstop, p0, S,
                                       WR_V, SUB, a_l)
                    acc = mma_v2(vx, _p_transposed(p.to(dt), b_l, SUB, IS_BF16), acc * gl.expand_dims(alpha8, 0))
            if TAU_PHASE == 1:
                o8 = (bh * 16 + tcol) * (NSPLIT + NWIN) + NSPLIT + wt
                gl.store(OUT_M + o8, hi * LN2, mask=tcol < REP)
                gl.store(OUT_L + o8, lo * LN2, mask=tcol < REP)
            else:
                _store_partials(OUT_M, OUT_L, OUT_ACC, bh, NSPLIT + wt, NSPLIT, NWIN, m8, gl.sum(lacc, 0), acc, REP,
                                mma)

    @gluon.jit
    def _post_decode_kernel(
            Q, stride_qb, stride_qh, KC, KCEN, KHALF, VC, VCEN, VHALF, POS, AMASK, stride_mb, TEMP, LOGITS,
            OUT_M, OUT_L, OUT_ACC, scale, T, NSPLIT,
            KSINK, KRING, KCHUNK, stride_kcb, stride_kch, VSINK, VRING, VCHUNK, stride_vcb, stride_vch,
            M1, L1, NS1, tau_sum,
            H: gl.constexpr, REP: gl.constexpr, S: gl.constexpr, R: gl.constexpr, MASK_KIND: gl.constexpr,
            IS_BF16: gl.constexpr, BT: gl.constexpr, TAU_PHASE: gl.constexpr, NWIN: gl.constexpr,
            PDL: gl.constexpr, WIN: gl.constexpr = False, WR_K: gl.constexpr = 0, WR_V: gl.constexpr = 0,
            WCOST: gl.constexpr = 0, TMA: gl.constexpr = False, NST: gl.constexpr = 2, WL: gl.constexpr = True):
        """Post-scaled decode over 1-bit channel-wise Keys and Values with one static range per channel
        (calibquant-1): k[t, c] = s_k[c] code + z_k[c], v likewise, s = 2 half, z = center - half. (WL: the ring's
        Value words widened over a lane bit, `_widen`, `WIDEN_IN_LANES`.)
            logits^T = k @ q^T = codes @ (q * s_k)^T + q . z_k: the mma takes q' = q s_k / 2^i (rounded once to the
            cache dtype, formed once per program) against M + 2^i code straight from a `lop3`, and the per-head
            constant C = q . z_k - M sum(q') (fp32, from the rounded q') goes back in: no per-element arithmetic.
            out = sum_t p_t v_t = s_v acc / 2^j + z_v l^, acc = sum_t p^_t (M + 2^j code) - M l^, l^ = sum_t p^_t
            (p^: p rounded to the cache dtype, as the mma takes it; each tile's M l^ is taken out as the tile's mma
            starts from the accumulator, -M l^ by a small mma of p^T).
        TAU_PHASE 1 writes each head's max and min logit (CalibQuant's calibration reads them) and the logits
        themselves (base 2, before the mask: LOGITS [B * H, T, REP] fp32); 2 reads them back instead of the Keys,
        scales them by TEMP (per head) and runs the softmax and p @ v; 0 neither (the Keys, then the softmax).
        WIN: the exact windows (sink, ring, appended chunk: K/VSINK, K/VRING of WR_K / WR_V slots, K/VCHUNK) are
        attended here too, before each program's slice, into the window launch's slots (`_window_partials`), and no
        window launch follows; phase 2 then also computes its temperatures from the range pass's NS1 partial
        (max, min) slots M1, L1 and tau_sum = tau1 + tau2 (`_temperatures`; no temperature launch), after waiting
        for the range pass (PDL: `griddepcontrol.wait`; the launch may start early). WCOST: the programs with window
        tiles take shorter slices (`_slice`). TMA: KC and VC are TMA descriptors of the codes as [rows, 4 words], and
        the side the pass reads (phase 1 the Keys, 2 the Values, 0 both) streams through a ring of NST tiles in
        shared memory, copied NST tiles ahead (rows past the slice as they are: their logits are masked, their p is
        0, and any code is finite). The channel of Key reduction index k (same register layout as
        `_kivi_decode_kernel` at 1 bit, with the asm block a covering bits 8a..8a+7 and 16+8a..16+8a+7):
            x = 16a + c, c = 2i + h  <->  channel 32b + 16h + 8a + i, factor 2^-i."""
        bh = gl.program_id(0)
        split = gl.program_id(1)
        b = bh // H
        h = bh % H
        dt: gl.constexpr = gl.bfloat16 if IS_BF16 else gl.float16
        M: gl.constexpr = 128.0 if IS_BF16 else 1024.0
        D: gl.constexpr = D_
        start, stop, n_iter = _slice(POS, split, NSPLIT, S, R, 1, 1, BT, PDL, WCOST, NWIN)

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        gl.static_assert(BT == 32, "32-token tiles")
        if TAU_PHASE == 2:  # the temperature of each head (a column of the transposed logits)
            tc8 = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
            if WIN:  # from the range pass's partial results, once it has ended (PDL: this launch may start early)
                if PDL:
                    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                              pack=1)
                temp = _temperatures(M1, L1, NS1, tau_sum, bh, REP, gl.SliceLayout(0, mma))
            else:
                temp = gl.load(TEMP + bh * REP + tc8, mask=tc8 < REP, other=1.0)
        else:
            temp = 0.0
        if WIN:
            _window_partials(Q, stride_qb, stride_qh, KSINK, KRING, KCHUNK, stride_kcb, stride_kch, VSINK, VRING,
                             VCHUNK, stride_vcb, stride_vch, POS, AMASK, stride_mb, temp, LOGITS, OUT_M, OUT_L, OUT_ACC,
                             scale, T, bh, split, NSPLIT, H, REP, S, R, WR_K, WR_V, MASK_KIND, IS_BF16, BT, TAU_PHASE,
                             NWIN)
        PK: gl.constexpr = _key_layout(BT, 16)
        KW: gl.constexpr = gl.SliceLayout(2, PK)   # words [2, 4, BT]
        PV: gl.constexpr = _value_layout(BT)
        VW3: gl.constexpr = gl.SliceLayout(3, PV)
        VW: gl.constexpr = gl.SliceLayout(2, VW3)

        # Key words: block a of lane group b is word b shifted down by 8a
        ka = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, KW)))
        kb = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(0, KW)))
        kt = gl.arange(0, BT, layout=gl.SliceLayout(0, gl.SliceLayout(0, KW)))
        koff = gl.expand_dims(kt, 0) * 4 + gl.expand_dims(kb, 1)                                      # [4, BT]
        kshift = gl.expand_dims(gl.expand_dims(ka * 8, 1), 2)                                          # [2, 1, 1]
        c16 = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, PK))))
        cdummy = gl.expand_dims(gl.expand_dims(gl.expand_dims(c16, 0), 0), 3)                        # [1, 1, 16, 1]
        # Value words: chunk (w, jh) is byte 2 (w % 2) + jh of word w // 2
        vt = gl.arange(0, BT, layout=gl.SliceLayout(1, VW))
        vw = gl.arange(0, 8, layout=gl.SliceLayout(0, VW))
        jh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, VW3)))
        voff = gl.expand_dims(vt, 1) * 4 + gl.expand_dims(vw // 2, 0)                                  # [BT, 8]
        vshift = gl.expand_dims(gl.expand_dims(vw % 2 * 16, 0), 2) + gl.expand_dims(gl.expand_dims(jh * 8, 0), 0)
        jl = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, PV))))
        jdummy = gl.expand_dims(gl.expand_dims(gl.expand_dims(jl, 0), 0), 0)
        bh64 = bh.to(gl.int64)
        KEYS: gl.constexpr = TAU_PHASE != 2     # the passes that read the Keys' codes
        VALS: gl.constexpr = TAU_PHASE != 1     # and the Values'
        if TMA:  # a ring of NST tiles' code rows ([BT, 4 words] per side read), copied NST tiles ahead
            flat2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
            L4: gl.constexpr = _stats4_layout(BT)
            bars = gl.allocate_shared_memory(gl.int64, [NST, 1], mbarrier.MBarrierLayout())
            kbuf = bars   # stand-ins for the side a pass does not read
            vbuf = bars
            if KEYS:
                kbuf = gl.allocate_shared_memory(gl.int32, [NST, BT, 4], KC.layout)
            if VALS:
                vbuf = gl.allocate_shared_memory(gl.int32, [NST, BT, 4], VC.layout)
            for i in gl.static_range(NST):
                mbarrier.init(bars.index(i), count=1)
            for i in gl.static_range(NST):
                _issue_codes(KC, VC, kbuf, vbuf, bars.index(i), i, bh * T + start + i * BT, i < n_iter,
                             BT * 16 * (KEYS + VALS), KEYS, VALS)
        else:
            kc_base = KC + bh64 * T * 4
            vc_base = VC + bh64 * T * 4

        if TAU_PHASE != 2:
            # q'^T = (q s_k / 2^i)^T in the Key mma's reduction order (the B operand of the transposed logits), and
            # the per-head constant C
            tk = gl.arange(0, 128, layout=gl.SliceLayout(1, b_l))
            ti = ((tk >> 5) & 1) * 4 + ((tk >> 4) & 1) * 2 + ((tk >> 3) & 1)
            tchan = 32 * ((tk >> 1) & 3) + 16 * (tk & 1) + 8 * ((tk >> 6) & 1) + ti
            qT = _load_qT(Q, b, h, stride_qb, stride_qh, tchan, REP, b_l).to(gl.float32)
            khalf = gl.load(KHALF + bh64 * D + tchan).to(gl.float32)
            kz = gl.load(KCEN + bh64 * D + tchan).to(gl.float32) - khalf
            qpf = qT * gl.expand_dims(khalf * 2.0 / (1 << ti).to(gl.float32), 1)
            if IS_BF16:
                up = 1.0
            else:  # fp16 holds q' only below 65504: scaled by 2^-e (exact) to at most 2^14, the logits by 2^e
                qmax = gl.max(gl.max(gl.abs(qpf), 1), 0)
                up = gl.exp2(gl.maximum(gl.ceil(gl.log2(gl.maximum(qmax, 1.0) / 16384.0)), 0.0))
                qpf = qpf / up
            qp = qpf.to(dt)
            c8 = gl.convert_layout(gl.sum(qT * gl.expand_dims(kz, 1) - M * up * qp.to(gl.float32), 0),
                                   gl.SliceLayout(0, mma)) / up   # q . z - M sum(q') in units of the mma's q'
            LOG2E: gl.constexpr = 1.4426950408889634
            qscale = scale * LOG2E * up
        negm = gl.full([16, BT], -M, dt, a_l)   # sum_t p^_t (M + 2^j code) - M l^: -M l^ by one more small mma

        trow, tcol, m8, lacc, acc = _softmax_state(BT, mma)   # acc: out^T, channels n = 8j + w
        # the logits of phase 1, read back in phase 2: token t0 + trow, head tcol at LOGITS[bh, t0 + trow, tcol]
        lg_off = gl.expand_dims(trow, 1) * REP + gl.expand_dims(tcol, 0)
        lg_base = LOGITS + bh64 * T * REP
        if TAU_PHASE == 1:   # per-lane partial maxima and minima, reduced after the loop
            hi_p = gl.full([BT, 8], float("-inf"), gl.float32, mma)
            lo_p = gl.full([BT, 8], float("inf"), gl.float32, mma)
        lracc = gl.zeros([BT, 8], gl.float32, mma)   # per-lane partial sums of p^ (the rounded p the mma takes)

        for it in range(0, n_iter):
            t0 = start + it * BT
            lvalid = gl.expand_dims((t0 + trow) < stop, 1) & gl.expand_dims(tcol < REP, 0)
            if TMA:   # rows past the slice as they are: their logits are masked, their p is 0
                st = it % NST
                mbarrier.wait(bars.index(st), (it // NST) & 1)
            if TAU_PHASE == 2:
                s = gl.load(lg_base + t0 * REP + lg_off, mask=lvalid, other=0.0)
            else:
                if TMA:
                    kwords = gl.expand_dims(kbuf.index(st)._reinterpret(gl.int32, [BT, 4], flat2).permute(
                        [1, 0]).load(gl.SliceLayout(0, KW)), 0) >> kshift
                else:
                    kvalid = gl.expand_dims((t0 + kt) < stop, 0)
                    kwords = gl.expand_dims(gl.load(kc_base + t0 * 4 + koff, mask=kvalid, other=0), 0) >> kshift
                kw4, _ = gl.broadcast(gl.expand_dims(kwords, 2), cdummy)                          # [2, 4, 16, BT]
                kv = _unpack_post(kw4, "kpost", IS_BF16)
                kvT = gl.convert_layout(_kred_t(kv, 16, BT), a_l)                                 # [BT, 128]
                s = (mma_v2(kvT, qp, gl.zeros([BT, 8], gl.float32, mma)) + gl.expand_dims(c8, 0)) * qscale
                if TAU_PHASE == 1:
                    gl.store(lg_base + t0 * REP + lg_off, s, mask=lvalid)
            s, allowed = _mask_scores(s, trow, tcol, t0, stop, AMASK, b.to(gl.int64) * stride_mb, REP, MASK_KIND)
            if TAU_PHASE == 1:
                hi_p = gl.maximum(hi_p, gl.where(allowed, s, float("-inf")))
                lo_p = gl.minimum(lo_p, gl.where(allowed, s, float("inf")))
            else:
                if TAU_PHASE == 2:
                    s = s * gl.expand_dims(temp, 0)
                p, alpha8, m8, lacc = _softmax_step(s, allowed, m8, lacc)
                ph = p.to(dt)
                lracc = lracc * gl.expand_dims(alpha8, 0) + ph.to(gl.float32)

                if TMA:   # word w // 2 of each token into column w
                    vwords = gl.expand_dims(_widen(vbuf.index(st)._reinterpret(gl.int32, [BT, 4], flat2).load(L4),
                                                   VW, BT, WL), 2) >> vshift
                else:
                    vvalid = gl.expand_dims((t0 + vt) < stop, 1)
                    vwords = gl.expand_dims(gl.load(vc_base + t0 * 4 + voff, mask=vvalid, other=0), 2) >> vshift
                wv, _ = gl.broadcast(gl.expand_dims(vwords, 3), jdummy)                  # [BT, 8, 2, 8]
                vv = _unpack_post(wv, "vpost", IS_BF16)
                vv = vv.permute([0, 2, 3, 1]).reshape([BT, 128]).permute([1, 0])
                vv = gl.convert_layout(vv, a_l)
                pt = _p_transposed(ph, b_l, BT, IS_BF16)
                # M l^ of this tile leaves the accumulator as the tile enters it (fp16's M = 2^10 times a
                # slice's l^ would otherwise swamp the 2^j code sums: up to 2% off over one 1000-token slice)
                corr = _rows128(mma_v2(negm, pt, gl.zeros([16, 8], gl.float32, mma)), mma)
                acc = mma_v2(vv, pt, acc * gl.expand_dims(alpha8, 0) + corr)
            if TMA:  # the ring slot just read takes the tile NST ahead
                _issue_codes(KC, VC, kbuf, vbuf, bars.index(st), st, bh * T + t0 + NST * BT, it + NST < n_iter,
                             BT * 16 * (KEYS + VALS), KEYS, VALS)

        r8 = tcol
        o8 = (bh * 16 + r8) * (NSPLIT + NWIN) + split
        LN2: gl.constexpr = 0.6931471805599453
        if TAU_PHASE == 1:
            m8 = gl.max(hi_p, 0)
        gl.store(OUT_M + o8, m8 * LN2, mask=r8 < REP)
        if TAU_PHASE == 1:
            gl.store(OUT_L + o8, gl.min(lo_p, 0) * LN2, mask=r8 < REP)
        else:
            gl.store(OUT_L + o8, gl.sum(lacc, 0), mask=r8 < REP)
            n = gl.arange(0, 128, layout=gl.SliceLayout(1, mma))
            chan = 16 * (n & 7) + (n >> 3)
            vhalf = gl.load(VHALF + bh64 * D + chan).to(gl.float32)
            vz = gl.load(VCEN + bh64 * D + chan).to(gl.float32) - vhalf
            inv = 1.0 / (1 << ((n >> 3) & 7)).to(gl.float32)
            lr8 = gl.expand_dims(gl.sum(lracc, 0), 0)
            out = gl.expand_dims(2.0 * vhalf * inv, 1) * acc + gl.expand_dims(vz, 1) * lr8
            gl.store(OUT_ACC + gl.expand_dims(o8, 0) * 128 + gl.expand_dims(chan, 1), out,
                     mask=gl.expand_dims(r8 < REP, 0))

    @gluon.jit
    def _issue_codes(KC, VC, kbuf, vbuf, bar, slot, row, pred, NBYTES: gl.constexpr, KEYS: gl.constexpr = True,
                     VALS: gl.constexpr = True):
        """Start the TMA copies of one tile's code rows from `row` on, of the Keys (KEYS) and the Values (VALS), into
        ring slot `slot` (InnerQ's, kvquant's and calibquant's rings); `bar` completes when all NBYTES have
        landed."""
        mbarrier.expect(bar, NBYTES, pred=pred)
        if KEYS:
            tma.async_copy_global_to_shared(KC, [row, 0], bar, kbuf.index(slot), pred=pred)
        if VALS:
            tma.async_copy_global_to_shared(VC, [row, 0], bar, vbuf.index(slot), pred=pred)

    @gluon.jit
    def _qz_refill(KHROWS, KCROWS, zbase, gbase, t0, S: gl.constexpr, NG_K, qT, zsm, KP: gl.constexpr,
                   IS_BF16: gl.constexpr, a_l: gl.constexpr, mma: gl.constexpr, QZ_N: gl.constexpr,
                   KSUB: gl.constexpr = False, cinv=1.0):
        """(gbase, grel): the tile at t0 reads row grel of the q . z rows of the QZ_N Key groups from gbase held in
        shared memory (zsm); where it lies past them, the next QZ_N groups' rows replace them first (`_qz_rows`;
        KSUB: stored times cinv, the logits mma's scale)."""
        grel = (t0 - S) // 32 - gbase
        if grel >= QZ_N:
            gbase = gbase + grel
            grel = grel * 0
            czr = _qz_rows(KHROWS, KCROWS, zbase, gbase, NG_K, qT, KP, IS_BF16, a_l, mma, QZ_N)
            if KSUB:
                czr = czr * cinv
            gl.thread_barrier()   # every lane has read the rows it replaces
            zsm.store(czr)
            gl.thread_barrier()
        return gbase, grel

    @gluon.jit
    def _slice(POS, split, NSPLIT, S: gl.constexpr, R: gl.constexpr, TPG_K: gl.constexpr, TPG_V: gl.constexpr,
               BT: gl.constexpr, PDL: gl.constexpr, WCOST: gl.constexpr, NWIN: gl.constexpr, UNIT: gl.constexpr = 1):
        """(start, stop, tiles) of this program's slice of [S, qend), as `_decode_kernel` computes it (WCOST 0; a
        Python mirror, `_slice_mirror` in tests/test_decode_gluon.py, checks `whole_tiles` against it: keep them in
        step). PDL
        (sm_90+: `decode_attention._use_pdl`) first lets the launch that follows start: the window launch, which
        reads nothing this launch writes and whose last program waits for it before it ends, or (calibquant with its
        windows inside) the attention pass or the final reduction, which wait for it before they read.
        WCOST > 0 (calibquant with its windows inside, `POST_WCOST`): the programs that also attend exact-window tiles
        (tile wt of the NWIN to program wt mod NSPLIT, `_window_partials`) take shorter slices. Every program gets
        per = ceil((tiles + WCOST NWIN) / NSPLIT) units of work (at least WCOST times the most window tiles a
        program takes, so that no slice is negative), each of its own window tiles counting WCOST units and the rest
        its share of the quantized region's tiles, in order (`bench/debug/slice_wcost_check.py` mirrors it).
        UNIT (WCOST 0): slices of a multiple of UNIT tiles (KIVI's PAIR: whole ring slots; only a row's last slice
        can end inside one)."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        p0 = gl.load(POS).to(gl.int32)
        L = p0 + 1
        bnd_k = S + gl.maximum(L - S - R, 0) // TPG_K * TPG_K
        bnd_v = S + gl.maximum(L - S - R, 0) // TPG_V * TPG_V
        qend = gl.minimum(gl.minimum(bnd_k, bnd_v), p0)
        qlen = gl.maximum(qend - S, 0)
        if WCOST > 0:
            tiles = gl.cdiv(qlen, BT)
            per = gl.maximum(gl.cdiv(tiles + WCOST * NWIN, NSPLIT), WCOST * gl.cdiv(NWIN, NSPLIT))
            # window tiles of the programs before this one and before the next
            w_lo = NWIN // NSPLIT * split + gl.minimum(split, NWIN % NSPLIT)
            w_hi = NWIN // NSPLIT * (split + 1) + gl.minimum(split + 1, NWIN % NSPLIT)
            lo = split * per - WCOST * w_lo
            hi = (split + 1) * per - WCOST * w_hi
            start = S + gl.minimum(lo, tiles) * BT
            stop = gl.minimum(S + gl.minimum(hi, tiles) * BT, qend)
        else:
            per = gl.cdiv(gl.cdiv(qlen, NSPLIT), BT * UNIT) * (BT * UNIT)
            start = S + split * per
            stop = gl.minimum(start + per, qend)
        return start, stop, gl.cdiv(gl.maximum(stop - start, 0), BT)

    @gluon.jit
    def _key_element(k):
        """x = P a + c, the element of its lane group's 32 channels that reduction index k of the KIVI kernel's Key
        mma holds (module doc, Layouts)."""
        return (k & 1) + ((k >> 3) & 1) * 2 + ((k >> 4) & 1) * 4 + ((k >> 5) & 1) * 8 + ((k >> 6) & 1) * 16

    @gluon.jit
    def _key_channel(k, KP: gl.constexpr, KPOST: gl.constexpr):
        """The channel of reduction index k of the KIVI kernel's Key mma: element x (`_key_element`) of lane group b;
        post-scaled (KPOST), element c = 2r + h holds code r + KP / 2 h (`_kpost_asm`)."""
        x = _key_element(k)
        if KPOST:
            cc = x % KP
            chan = 32 * ((k >> 1) & 3) + x - cc + (cc >> 1) + (cc & 1) * (KP // 2)
        else:
            chan = 32 * ((k >> 1) & 3) + x
        return chan

    @gluon.jit
    def _qz_rows(KHROWS, KCROWS, zbase, g0, NG_K, qT, KP: gl.constexpr, IS_BF16: gl.constexpr, a_l: gl.constexpr,
                 mma: gl.constexpr, NZ: gl.constexpr):
        """q . z [16, 8] of Key groups g0 .. g0 + NZ - 1 (rows; rows from NZ on and groups past NG_K: 0) and the
        query heads (columns): one mma
        with the groups' zero points z = center - half (cache dtype, as `_offset` rounds them per tile) as its A
        rows, k in the Key mma's reduction order (`_key_channel`); row r is the mma the tile path runs on 16 copies
        of group g0 + r's row, so the same value. Lane l loads the 32 channels of rows l / 4 and l / 4 + 8 that
        its A fragment holds, 64 contiguous bytes each, in channel order; the reshapes put them in k order."""
        D: gl.constexpr = D_
        NA: gl.constexpr = 32 // KP
        rows: gl.constexpr = gl.BlockedLayout([1, 32], [8, 4], [1, 1], [1, 0])
        zr = gl.arange(0, 16, layout=gl.SliceLayout(1, rows))
        zc = gl.arange(0, 128, layout=gl.SliceLayout(0, rows))
        off = zbase + gl.expand_dims((g0 + zr).to(gl.int64) * D, 1) + gl.expand_dims(zc, 0)    # [16, 128]
        ok = gl.expand_dims(((g0 + zr) < NG_K) & (zr < NZ), 1)
        z = _offset(gl.load(KHROWS + off, mask=ok, other=0.0), gl.load(KCROWS + off, mask=ok, other=0.0), IS_BF16)
        # channel 32 b + KP a + c -> [16, NA (a), 4 (b), KP (c)] (`_sigma`'s input order), then `_sigma`, `_kred`
        z = z.reshape([16, 4, NA, KP]).permute([0, 2, 1, 3])
        z = z.reshape([16, NA, 4, 2, KP // 2]).permute([0, 1, 2, 4, 3]).reshape([16, NA, 4, KP])
        if KP == 16:
            z = z.reshape([16, 2, 2, 2, 2, 2, 2, 2]).permute([0, 1, 4, 5, 6, 2, 3, 7]).reshape([16, 128])
        else:
            z = z.reshape([16, 2, 2, 2, 2, 2, 2, 2]).permute([0, 1, 2, 5, 6, 3, 4, 7]).reshape([16, 128])
        return mma_v2(gl.convert_layout(z, a_l), qT, gl.zeros([16, 8], gl.float32, mma))

    @gluon.jit
    def _kivi_decode_kernel(
            Q, stride_qb, stride_qh, KC, KCEN, KHALF, VC, VCEN, VHALF, POS, AMASK, stride_mb,
            OUT_M, OUT_L, OUT_ACC, scale, T, NG_K, NSPLIT, KNORM, KHROWS, KCROWS,
            H: gl.constexpr, REP: gl.constexpr, S: gl.constexpr, R: gl.constexpr,
            TPG_K: gl.constexpr, TPG_V: gl.constexpr, MASK_KIND: gl.constexpr, IS_BF16: gl.constexpr,
            BT: gl.constexpr, KBITS: gl.constexpr, VBITS: gl.constexpr, KA_HI: gl.constexpr, KA_LO: gl.constexpr,
            VA_HI: gl.constexpr, VA_LO: gl.constexpr, NWIN: gl.constexpr, TMA: gl.constexpr, NST: gl.constexpr,
            PDL: gl.constexpr, INNER: gl.constexpr = False, KHYB: gl.constexpr = False,
            VHYB: gl.constexpr = False, NORM: gl.constexpr = False, KPOST: gl.constexpr = False,
            QZROWS: gl.constexpr = False, QZ_N: gl.constexpr = 8, VZ: gl.constexpr = False,
            WL: gl.constexpr = True, WT: gl.constexpr = False, TPS: gl.constexpr = 1, PAIR: gl.constexpr = False,
            KSUB: gl.constexpr = False, VF: gl.constexpr = False, KSW: gl.constexpr = 7, MOK: gl.constexpr = 0,
            KZA: gl.constexpr = False, TRB=None, TRACE: gl.constexpr = False):
        """KIVI's layout, or with INNER InnerQ's (Keys per token in groups of 32 channels, Values per channel in
        groups of 32 tokens: the same packed words, the statistics the other way round, the codes alone through the
        ring where TMA). NG_K: the
        statistics rows per KV head of the token-grouped side (KIVI's Keys, InnerQ's Values). InnerQ's extras:
        KHYB / VHYB hybrid groups (a negative half-range: symmetric levels, spacing KA / VA; else twice that),
        NORM its per-channel Key normalization KNORM [B * H, 128] folded into q (q * norm, rounded once).
        KPOST (KIVI's layout): the Keys post-scaled, their per-channel scale folded into q per tile:
            q . k = sum_c (q_c s_c 2^-b_c) (code_c 2^b_c) + q . z = U (e @ q'^T) + q . z
        e: each code straight from one `lop3` (`_kpost_asm`; fp16 the subnormal code 2^(b - 24), bf16 with KSUB the
        subnormal code 2^(b - 133), else 128 + code 2^b),
        q' = (q a 2^(E - b)) * half (a = 2 / (2^B - 1); q a 2^(E - b) rounded once per program, the product once per
        tile; fp16 E = POST_E, U = 2^(24 - E), q a 2^E scaled by 2^-e to at most 2^8 and U by 2^e, a tile with a
        half-range of 256 or more q a by 2^-g (hmax 2^-g < 256) and U by 2^g: q' <= 65504; bf16 with KSUB
        E = SUB_E, U = 2^(133 - E), else E = 0, U = 1); the per-head constant q . z (and, bf16 without KSUB,
        -128 sum(q')) by one or two more small mma into the logits' initial accumulator, times 1 / U.
        QZROWS (with KPOST; `QZ_ROWS`): q . z of QZ_N Key groups in one mma, their zero points z as its A rows
        (`_qz_rows`; KHROWS / KCROWS: the Keys' statistics rows [B * H, NG_K, 128] as pointers, also where TMA copies
        the tiles, whose ring then skips the centers), kept in shared memory and read back per tile: 8 mma per QZ_N
        groups instead of 8 per tile (a q . z is the same mma row either way: bit-equal logits). Each refill runs
        first in its tile's iteration, while few registers are live (placed after the tile's unpacking, the build
        took 254 registers).
        VZ (KIVI's Values in bf16, `VALUE_ZERO_APART`): the Values' offsets leave the dequantization,
            p @ v = p @ (s * code) + p @ z,
        the first term from one `fma` per register (`_value_asm` zero_apart: s * code rounded once, no `add`), the
        second from one more mma per tile, acc_z^T [16, 8] = z_rows @ p^T with row r the offsets of channel group
        (r % 8) // 2 (`_zero_rows`), rescaled with the accumulator and added to its rows once at the end
        (`_rows128`: accumulator row n holds channel 16 (n % 8) + n // 8, group (n % 8) // 2).
        WL (`WIDEN_IN_LANES`): the ring's Value statistics (and 1-bit Value words) widened from [BT, 4] to the
        [BT, 8] statistics layout without moving data (`_widen` LANES).
        WT (`WHOLE_TILES`, where `whole_tiles` holds): no tile crosses its slice's stop, so the tile's positions are
        not compared with it (loads, statistics and logits unmasked by position).
        TPS (`RING_TILES`, KIVI's ring): tiles per ring slot, filled by one set of copies (the descriptors' boxes
        hold TPS tiles: `descriptors` tps), so the copies' issue cost is paid once per TPS tiles.
        PAIR (`PAIR_SOFTMAX`, `pair_flags`: the ring with TPS 2, KPOST and WT): one online-softmax step per slot, over
        both tiles' logits (`_softmax_pair`), in slices of whole slots (`_slice` UNIT 2); where a row's last slice
        ends after a slot's first tile, the second one's logits are -inf (its Values finite: p V = 0). Not bit-equal
        with a step per tile: p rounds to the cache dtype against the slot's max.
        VF (`VALUE_FOLD`, `fold_flags`: KIVI's bf16 Values through the ring, with VZ; at 4 bits a step per tile):
        each Value group's scale folded into p, one accumulator [32, 8] per group (`_fold_values`: rows 8 i + k,
        channel 32 c + 4 k + i at 4 bits, 32 c + 4 (2 (k % 4) + k // 4) + i at 2 (`_fold_chunk2`'s byte exchange),
        32 c + 16 (k % 2) + 4 (k // 2) + i at 1 (`_fold_chunk1`'s nibble transpose)), p' = p 2^VF_E from the softmax step (`_softmax_step` / `_softmax_pair` PE: so that the products of the
        bare codes stay normal fp32), the partial sums and the offsets' share scaled back by 2^-VF_E at the end
        (`_fold_finish`). Exact where p half >= 2^-57 (below, that token's code products drop out: less than 2^-56
        of absolute error each), half < 2^64 (p' half in bf16) and |z| sum p < 2^64 (the offsets' share in fp32), z
        the group's offset (VF_E).
        MOK (`MASK_SLICE`, a bool mask, MASK_KIND 1): the tile loop is built twice, once without the mask; each
        program checks its slice's mask bytes once, MOK a step (`_mask_slice_ok`), and runs the maskless copy where
        they allow every position, the masked copy elsewhere (left padding inside the slice, a masked position).
        The copies compute the same values, not always bit for bit (compiled apart: within an output unit).
        TRACE (debug, `decode_attention.TRACE`, bench/debug/timeline.py): each program writes 8 int64 to TRB at
        8 (bh NSPLIT + split): the global timer at its start, before its loop (and MOK's check), once its first ring
        slot has landed (TMA; else before its loop again), after its loop and after its stores, then its SM and its
        tile count."""
        gl.static_assert(KPOST or not QZROWS, "QZROWS computes the post-scaled Keys' q . z")
        gl.static_assert(not (VZ and (INNER or not IS_BF16)), "VZ: KIVI's Values in bf16")
        gl.static_assert((not VF) or (VZ and TMA and ((VBITS < 4) or not PAIR)), "VF: KIVI's bf16 Values, ring")
        gl.static_assert((not KSUB) or (KSW == 7) or (KSW == 8), "KSW: a code window of 7 or 8 bits")
        bh = gl.program_id(0)
        split = gl.program_id(1)
        b = bh // H
        h = bh % H
        dt: gl.constexpr = gl.bfloat16 if IS_BF16 else gl.float16
        KW_: gl.constexpr = 4 * KBITS   # int32 words per token (128 channels)
        VW_: gl.constexpr = 4 * VBITS
        KP: gl.constexpr = 8 if KBITS == 4 else 16   # Key codes per asm block (`key_pack`)
        NA: gl.constexpr = 32 // KP                    # Key asm blocks per lane and token
        D: gl.constexpr = D_
        gl.static_assert((not WT) or _whole_tiles(R, TPG_K, TPG_V, BT), "WT: no tile may cross its slice's stop")
        gl.static_assert((TPS == 1) or (TMA and not INNER), "TPS: KIVI's ring (InnerQ's fills a tile a slot)")
        MOKON: gl.constexpr = _mok_on(MOK, MASK_KIND)
        if TRACE:
            tr0 = _trace_now()

        start, stop, n_iter = _slice(POS, split, NSPLIT, S, R, TPG_K, TPG_V, BT, PDL, 0, 0,   # this program's slice
                                     2 if PAIR else 1)

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        gl.static_assert((BT == 16) | (BT == 32), "a tile is a Key group of 32 tokens or half of one")
        PK: gl.constexpr = _key_layout(BT, KP)
        KW: gl.constexpr = gl.SliceLayout(2, PK)   # words [NA, 4, BT]
        KS: gl.constexpr = gl.SliceLayout(3, PK)   # statistics [NA, 4, KP]
        PV: gl.constexpr = _value_layout(BT)
        VW3: gl.constexpr = gl.SliceLayout(3, PV)  # words [BT, 8, 2]
        VW: gl.constexpr = gl.SliceLayout(2, VW3)  # statistics (and words below 4 bits) [BT, 8]

        # Key words: asm block a of lane group b starts at code 32b + KP * a
        ka = gl.arange(0, NA, layout=gl.SliceLayout(1, gl.SliceLayout(2, KW)))
        kb = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, KW)))
        kt = gl.arange(0, BT, layout=gl.SliceLayout(0, gl.SliceLayout(0, KW)))
        KBW: gl.constexpr = KP * KBITS // 32   # words per asm block (0 at 1 bit: half a word, shifted by 16a)
        kword = gl.expand_dims(gl.expand_dims(ka * KBW, 1) + gl.expand_dims(kb * KBITS, 0), 2)     # [NA, 4, 1]
        koff = gl.expand_dims(gl.expand_dims(kt, 0), 0) * KW_ + kword                             # [NA, 4, BT]
        kshift = gl.expand_dims(gl.expand_dims(ka * 16, 1), 2)
        kc16 = gl.arange(0, KP, layout=gl.SliceLayout(0, gl.SliceLayout(0, KS)))
        kdummy = gl.expand_dims(gl.expand_dims(gl.expand_dims(kc16, 0), 0), 3)         # [1, 1, KP, 1], broadcast only
        if INNER:  # InnerQ's Key statistics: one per token t and lane group b (its 32 channels), [4, BT]
            KT: gl.constexpr = gl.SliceLayout(0, KW)
            tb = gl.arange(0, 4, layout=gl.SliceLayout(1, KT))
            ksoff = gl.expand_dims(kt, 0) * 4 + gl.expand_dims(tb, 1)                  # [4, BT] (t, group b)
        else:
            sa = gl.arange(0, NA, layout=gl.SliceLayout(1, gl.SliceLayout(2, KS)))
            sb = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, KS)))
            sc = gl.arange(0, KP, layout=gl.SliceLayout(0, gl.SliceLayout(0, KS)))
            schan = gl.expand_dims(gl.expand_dims(sa * KP, 1) + gl.expand_dims(sb * 32, 0), 2) + \
                gl.expand_dims(gl.expand_dims(sc, 0), 0)                                # [NA, 4, KP] channels
            if not KPOST:  # the level spacing 2 / (2^B - 1) as hi + lo; at 2 bits the odd channels' scale divided
                # by 4 (their code sits at bit 2, `_key_asm`)
                if KBITS == 2:
                    kfac = gl.where(sc % 2 == 0, 1.0, 0.25)
                else:
                    kfac = gl.full([KP], 1.0, gl.float32, gl.SliceLayout(0, gl.SliceLayout(0, KS)))
                khi = gl.expand_dims(gl.expand_dims((kfac * KA_HI).to(dt), 0), 0)        # [1, 1, KP]
                klo = gl.expand_dims(gl.expand_dims((kfac * KA_LO).to(dt), 0), 0)
        # Value words: chunk (w, jh) of token t starts at code 16w + 8jh
        vt = gl.arange(0, BT, layout=gl.SliceLayout(1, VW))
        vw = gl.arange(0, 8, layout=gl.SliceLayout(0, VW))
        jh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, VW3)))
        if VBITS == 4:   # a whole word per chunk
            voff = gl.expand_dims(gl.expand_dims(vt, 1) * VW_ + gl.expand_dims(vw * 2, 0), 2) + \
                gl.expand_dims(gl.expand_dims(jh, 0), 0)                                     # [BT, 8, 2]
            vshift = 0   # (unused: nothing to shift)
        else:            # both chunks of w in one word, at bit 16 * VBITS * w % 32 + 8 * VBITS * jh
            voff = gl.expand_dims(vt, 1) * VW_ + gl.expand_dims(vw * 16 * VBITS // 32, 0)    # [BT, 8]
            if VBITS == 2:
                vshift = gl.expand_dims(gl.expand_dims(jh * 16, 0), 0)                       # [1, 1, 2]
            else:
                vshift = gl.expand_dims(gl.expand_dims(vw * 16 % 32, 0), 2) + \
                    gl.expand_dims(gl.expand_dims(jh * 8, 0), 0)                              # [1, 8, 2]
        vsoff = gl.expand_dims(vt, 1) * 4 + gl.expand_dims(vw // 2, 0)                # [BT, 8] group w // 2
        jl = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, PV))))
        jdummy = gl.expand_dims(gl.expand_dims(gl.expand_dims(jl, 0), 0), 0)         # [1, 1, 1, 8], broadcast only
        if INNER:  # InnerQ's Value statistics: one per channel 16w + 8jh + jl of the tile's group row, [8, 2, 8]
            PVS: gl.constexpr = gl.SliceLayout(0, PV)
            cw = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, PVS)))
            cjh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, PVS)))
            cjl = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, PVS)))
            vchan = gl.expand_dims(gl.expand_dims(cw * 16, 1) + gl.expand_dims(cjh * 8, 0), 2) + \
                gl.expand_dims(gl.expand_dims(cjl, 0), 1)                               # [8, 2, 8] channels
            # at 2 bits the odd codes' scale divided by 4 (their code sits at bit 2, `_value_asm` per_code)
            if VBITS == 2:
                vfac = gl.expand_dims(gl.expand_dims(gl.where(cjl % 2 == 0, 1.0, 0.25), 0), 1)
            else:
                vfac = gl.full([1, 1, 8], 1.0, gl.float32, PVS)
            # the scale's two terms per channel (hybrid: _s those of symmetric levels, _a of asymmetric ones, twice)
            vfac = gl.full([8, 2, 8], 1.0, gl.float32, PVS) * vfac
            vhi_s, vlo_s = (vfac * VA_HI).to(dt), (vfac * VA_LO).to(dt)
            vhi_a, vlo_a = (vfac * (2 * VA_HI)).to(dt), (vfac * (2 * VA_LO)).to(dt)
        else:
            vhi = gl.full([BT, 8], VA_HI, dt, VW)
            vlo = gl.full([BT, 8], VA_LO, dt, VW)
            vnegm = gl.full([BT, 8], -128.0, dt, VW)   # -M: bf16's magic number (`_value_asm`; VZ)
            if VZ:  # the offsets' share of the output, apart (`_kivi_values_t`)
                accz = gl.zeros([16, 8], gl.float32, mma)

        if TMA and INNER:  # InnerQ: a ring of the tiles' code rows only (`INNER_TMA`); statistics by plain loads
            kbuf = gl.allocate_shared_memory(gl.int32, [NST, BT, KW_], KC.layout)
            vbuf = gl.allocate_shared_memory(gl.int32, [NST, BT, VW_], VC.layout)
            bars = gl.allocate_shared_memory(gl.int64, [NST, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(NST):
                mbarrier.init(bars.index(i), count=1)
            row0 = bh * T
            for i in gl.static_range(NST):
                _issue_codes(KC, VC, kbuf, vbuf, bars.index(i), i, row0 + start + i * BT, i < n_iter,
                             BT * (KW_ + VW_) * 4)
            L4: gl.constexpr = _stats4_layout(BT)
            bh64 = bh.to(gl.int64)
            ks_base = bh64 * T * 4
            vs_base = bh64 * NG_K * D
        elif TMA:  # a ring of NST slots of TPS tiles in shared memory, filled by the tensor-memory accelerator
            gl.static_assert((TPS == 1) | (BT == 32), "a slot's Key statistics rows: one per tile")
            kbuf = gl.allocate_shared_memory(gl.int32, [NST, TPS * BT, KW_], KC.layout)   # the copies' boxes
            vbuf = gl.allocate_shared_memory(gl.int32, [NST, TPS * BT, VW_], VC.layout)
            khbuf = gl.allocate_shared_memory(dt, [NST, TPS, D], KHALF.layout)
            kzbuf = gl.allocate_shared_memory(dt, [NST, TPS, D], KCEN.layout)
            vhbuf = gl.allocate_shared_memory(dt, [NST, TPS * BT * 4], VHALF.layout)
            vzbuf = gl.allocate_shared_memory(dt, [NST, TPS * BT * 4], VCEN.layout)
            # the same bytes by tile (tile sub of slot st: TPS st + sub)
            ktile = kbuf._reinterpret(gl.int32, [NST * TPS, BT, KW_], KC.layout)
            vtile = vbuf._reinterpret(gl.int32, [NST * TPS, BT, VW_], VC.layout)
            khtile = khbuf._reinterpret(dt, [NST * TPS, 1, D], KHALF.layout)
            kztile = kzbuf._reinterpret(dt, [NST * TPS, 1, D], KCEN.layout)
            vhtile = vhbuf._reinterpret(dt, [NST * TPS, BT * 4], VHALF.layout)
            vztile = vzbuf._reinterpret(dt, [NST * TPS, BT * 4], VCEN.layout)
            bars = gl.allocate_shared_memory(gl.int64, [NST, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(NST):
                mbarrier.init(bars.index(i), count=1)
            # QZROWS: no centers
            NBYTES: gl.constexpr = TPS * (BT * (KW_ + VW_) * 4 + (2 if QZROWS else 4) * D + 16 * BT)
            row0 = bh * T
            grow0 = bh * NG_K
            for i in gl.static_range(NST):
                _issue(KC, VC, KHALF, KCEN, VHALF, VCEN, kbuf.index(i), vbuf.index(i), khbuf.index(i),
                       kzbuf.index(i), vhbuf.index(i), vzbuf.index(i), bars.index(i), row0, grow0,
                       start + i * TPS * BT, S, i * TPS < n_iter, NBYTES, not QZROWS)
            L4: gl.constexpr = _stats4_layout(BT)
        else:
            bh64 = bh.to(gl.int64)
            kc_base = KC + bh64 * T * KW_
            vc_base = VC + bh64 * T * VW_
            if INNER:  # the statistics the other way round
                ks_base = bh64 * T * 4
                vs_base = bh64 * NG_K * D
            else:
                ks_base = bh64 * NG_K * D
                vs_base = bh64 * T * 4

        # q^T [128, 8]: the B operand of the transposed logits mma, row k the Key layout's reduction index (below),
        # column n query head n (zero past REP)
        tk = gl.arange(0, 128, layout=gl.SliceLayout(1, b_l))
        tchan = _key_channel(tk, KP, KPOST)
        qT = _load_qT(Q, b, h, stride_qb, stride_qh, tchan, REP, b_l)
        if NORM:  # InnerQ's Key normalization: k = k~ * norm, so q . k = (q * norm) . k~
            nrm = gl.load(KNORM + bh.to(gl.int64) * D + tchan)
            qT = (qT.to(gl.float32) * gl.expand_dims(nrm, 1)).to(dt)
        if KZA:  # InnerQ's bf16 Keys with their offsets apart: q . z by one small mma per tile (`_inner_qsum_rows`)
            gl.static_assert(INNER and IS_BF16, "KZA: InnerQ's Keys in bf16")
            qzB = _inner_qsum_rows(qT, b_l)
            knegm = gl.full([4, BT], -128.0, dt, KT)   # -M: bf16's magic number (`_key_asm` zero_apart)
        if KPOST:  # q a 2^(E - b): a the level spacing, b the code's bit in its register (`post_positions`)
            gl.static_assert(not INNER, "post-scaled Keys: KIVI's layout")
            gl.static_assert(IS_BF16 or not KSUB, "KSUB: bf16 subnormal Keys (fp16's are subnormal anyway)")
            PE: gl.constexpr = (SUB_E_ if KSUB else 0) if IS_BF16 else POST_E_
            PER: gl.constexpr = ((KSW if KSUB else 7) if IS_BF16 else 8) // KBITS   # codes per shift
            KAF: gl.constexpr = 2.0 / ((1 << KBITS) - 1)
            tcc = _key_element(tk) % KP   # the block's element c
            # 2^(E - b) built from its exponent bits: exact (exp2 may compile to an approximation)
            qe = ((PE - (tcc >> 1) % PER * KBITS + 127) << 23).to(gl.float32, bitcast=True)
            UP: gl.constexpr = (float(2 ** (133 - SUB_E_)) if KSUB else 1.0) if IS_BF16 else float(2 ** (24 - POST_E_))
            qf = qT.to(gl.float32)
            if IS_BF16:
                qaT = (qf * gl.expand_dims(qe * KAF, 1)).to(dt)
                up = UP
            else:  # fp16 holds q' = q a 2^(E - b) half only below 65504: q a 2^E is scaled by 2^-e to at most 2^8
                # (exact), the logits by 2^e; a tile with a half-range of 256 or more scales it again in the loop
                qmax = gl.max(gl.max(gl.abs(qf), 1), 0) * (KAF * (1 << PE))
                qfac = gl.exp2(-gl.maximum(gl.ceil(gl.log2(gl.maximum(qmax, 1.0) / 256.0)), 0.0))
                qaT = (qf * gl.expand_dims(qe * (KAF * qfac), 1)).to(dt)
                up = UP / qfac
            negm = gl.full([16, 128], -128.0, dt, a_l)
            if QZROWS:  # q . z of QZ_N Key groups per mma (`_qz_rows`), read back per tile from shared memory
                gl.static_assert(QZ_N <= 16, "a refill's groups are the rows of one m16 mma")
                zsm = gl.allocate_shared_memory(gl.float32, [16, 8], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
                zrows = zsm._reinterpret(gl.float32, [16, 8], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # by row
                zbase = bh.to(gl.int64) * NG_K * D
                gbase = (start - S) // 32 - QZ_N   # the first tile fills it

        qscale = scale * 1.4426950408889634   # log2(e): the softmax runs in base 2
        if KPOST:
            sscale = qscale * up
            cinv = 1.0 / up
        trow, tcol, m8, lacc, acc = _softmax_state(BT, mma)
        if VF:  # one accumulator per Value group: rows 8 i + k (`_fold_values`)
            acc = gl.zeros([32, 8], gl.float32, mma)
            acc1 = gl.zeros([32, 8], gl.float32, mma)
            acc2 = gl.zeros([32, 8], gl.float32, mma)
            acc3 = gl.zeros([32, 8], gl.float32, mma)
            VF16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=VC.layout.swizzle_byte_width,
                                                      element_bitwidth=16, rank=2)   # the same bytes as 16-bit
            PEV: gl.constexpr = VF_E_
        else:
            PEV: gl.constexpr = 0
        if TRACE:  # the setup's end; then (TMA) the first slot's landing, which the loop would wait for first
            tr1 = _trace_now()
            if TMA:
                if n_iter > 0:
                    mbarrier.wait(bars.index(0), 0)
            tr2 = _trace_now()

        # MOK (`MASK_SLICE`, a bool mask): the loops below are built twice, the first without the mask; a program
        # whose slice the mask row allows whole (checked once, `_mask_slice_ok`) runs that one, the others the second
        if MOKON:
            mok = _mask_slice_ok(AMASK, b.to(gl.int64) * stride_mb, start, stop, MOK)
        else:
            mok = 0
        for var in gl.static_range(2 if MOKON else 1):
            if _loop_runs(mok, var, MOKON):
                if PAIR:  # two tiles (one ring slot) per online-softmax step: one max, one rescale per 64 tokens
                    gl.static_assert(TMA and (not INNER) and KPOST and (TPS == 2) and WT, "PAIR: KIVI's ring, 2 tiles a slot")
                    gl.static_assert((not QZROWS) or (QZ_N % 2 == 0), "PAIR: refills on a slot's first tile need an even QZ_N")
                    gl.static_assert(R >= BT, "PAIR: a masked second tile must lie below the current position")
                    for it in range(0, n_iter, 2):
                        t0 = start + it * BT
                        if QZROWS:  # refills fall on a slot's first tile (QZ_N even, a slot's tiles in one step)
                            gbase, grel = _qz_refill(KHROWS, KCROWS, zbase, gbase, t0, S, NG_K, qT, zsm, KP, IS_BF16, a_l,
                                                     mma, QZ_N, KSUB, cinv)
                        slot = it // 2
                        st = slot % NST
                        mbarrier.wait(bars.index(st), (slot // NST) & 1)
                        has_b = (it + 1) < n_iter   # an odd tile count (a row's last slice): the slot's second tile lies
                        # past the slice, in [qend, qend + BT) of this row (R >= BT: below p0 + 1 <= T, so its mask row and
                        # codes are this row's). Its logits are masked (p = 0); its Value statistics are read as they are:
                        # zeros (the store's buffers start zeroed) or a token quantized earlier (finite), so p V = 0
                        for sub in gl.static_range(2):
                            kwords, kh, kcen = _smem_keys(ktile.index(2 * st + sub), khtile.index(2 * st + sub),
                                                          kztile.index(2 * st + sub), KW, KS, BT, KBITS, KP)
                            if KBITS == 1:
                                kwords = kwords >> kshift
                            s = _post_logits(kwords, kh, zrows.index(grel + sub) if QZROWS else kcen, qT, qaT, negm, kdummy,
                                             sscale, cinv, a_l, b_l, mma, BT, KBITS, KP, IS_BF16, QZROWS, KSUB, KSW)
                            s, allowed = _mask_scores(s, trow, tcol, t0 + sub * BT, stop, AMASK,
                                                      b.to(gl.int64) * stride_mb, REP,
                                                      _loop_mask_kind(MASK_KIND, MOKON, var), WT)
                            if sub == 0:
                                s_a = gl.where(allowed, s, float("-inf"))
                            else:
                                s_b = gl.where(allowed & has_b, s, float("-inf"))
                        p_a, p_b, alpha8, m8, lacc = _softmax_pair(s_a, s_b, m8, lacc, PEV)
                        a8 = gl.expand_dims(alpha8, 0)
                        acc = acc * a8
                        if VF:
                            acc1 = acc1 * a8
                            acc2 = acc2 * a8
                            acc3 = acc3 * a8
                        if VZ:
                            accz = accz * a8
                        for sub in gl.static_range(2):
                            if sub == 0:
                                p = p_a
                            else:
                                p = p_b
                            pT = _p_transposed(p.to(dt), b_l, BT, IS_BF16)
                            if VF:   # each group's scale folded into p': acc_c + e_c^T @ (p' half_c)^T
                                vh, vcen = _smem_value_stats(vhtile.index(2 * st + sub), vztile.index(2 * st + sub), VW, L4,
                                                             BT, WL)
                                vz = _offset(vh, vcen, IS_BF16)
                                acc, acc1, acc2, acc3 = _fold_values(vtile.index(2 * st + sub), vhtile.index(2 * st + sub), pT,
                                                                     acc, acc1, acc2, acc3, t0 + sub * BT, stop, VF16, VBITS,
                                                                     WT, a_l, b_l, BT)
                            else:
                                vwords, vh, vcen = _smem_values(vtile.index(2 * st + sub), vhtile.index(2 * st + sub),
                                                                vztile.index(2 * st + sub), VW, VW3, L4, BT, VBITS, WL)
                                vv, vz = _kivi_values_t(vwords, vh, vcen, vhi, vlo, vnegm, vshift, jdummy, a_l, BT, VBITS,
                                                        IS_BF16, VZ)
                                acc = mma_v2(vv, pT, acc)
                            if VZ:
                                accz = mma_v2(_zero_rows(vz, a_l, BT), pT, accz)
                        _issue(KC, VC, KHALF, KCEN, VHALF, VCEN, kbuf.index(st), vbuf.index(st), khbuf.index(st),
                               kzbuf.index(st), vhbuf.index(st), vzbuf.index(st), bars.index(st), row0, grow0,
                               t0 + NST * 2 * BT, S, (slot + NST) * 2 < n_iter, NBYTES, not QZROWS)
                else:
                    for it in range(0, n_iter):
                        t0 = start + it * BT
                        if QZROWS:  # first, while few registers are live: the next QZ_N Key groups' q . z where this tile
                            # needs them
                            gbase, grel = _qz_refill(KHROWS, KCROWS, zbase, gbase, t0, S, NG_K, qT, zsm, KP, IS_BF16, a_l,
                                                     mma, QZ_N, KSUB, cinv)
                        if TMA and INNER:  # the statistics' loads first: in flight while the codes' slot fills
                            kh, kcen, vh, vcen = _load_inner_stats(KHALF, KCEN, VHALF, VCEN, ks_base, vs_base, t0, stop, S,
                                                                   ksoff, kt, vchan, D, WT)
                            st = it % NST
                            mbarrier.wait(bars.index(st), (it // NST) & 1)
                            kwords = _smem_key_codes(kbuf.index(st), KW, BT, KBITS, KP)
                            vwords = _smem_value_codes(vbuf.index(st), VW, VW3, L4, BT, VBITS, WL)
                        elif TMA:
                            slot = it // TPS
                            sub = it - slot * TPS   # this tile's place in its slot
                            st = slot % NST
                            mbarrier.wait(bars.index(st), (slot // NST) & 1)   # (again for sub > 0: already complete)
                            r = st * TPS + sub
                            kwords, kh, kcen = _smem_keys(ktile.index(r), khtile.index(r), kztile.index(r), KW, KS, BT, KBITS,
                                                          KP)
                            if VF:   # the codes by `_fold_values`
                                vh, vcen = _smem_value_stats(vhtile.index(r), vztile.index(r), VW, L4, BT, WL)
                            else:
                                vwords, vh, vcen = _smem_values(vtile.index(r), vhtile.index(r), vztile.index(r), VW, VW3, L4,
                                                                BT, VBITS, WL)
                            if not WT:   # a tile may cross `stop`: the statistics past it are zeros or stale, read as zeros
                                vvalid = gl.expand_dims((t0 + vt) < stop, 1)
                                vh = gl.where(vvalid, vh, 0.0)
                                vcen = gl.where(vvalid, vcen, 0.0)
                        elif INNER:
                            kwords, vwords, kh, kcen, vh, vcen = _load_inner_tile(
                                kc_base, KHALF, KCEN, vc_base, VHALF, VCEN, ks_base, vs_base, t0, stop, S, koff,
                                ksoff, kt, voff, vchan, vt, BT, D, KW_, VW_, VBITS, WT)
                        else:
                            kwords, kh, kcen, vwords, vh, vcen = _load_tile(kc_base, KHALF, KCEN, vc_base, VHALF, VCEN,
                                                                            ks_base, vs_base, t0, stop, S, koff, schan, kt,
                                                                            voff, vsoff, vt, BT, D, KW_, VW_, VBITS, WT)
                        if KBITS == 1:
                            kwords = kwords >> kshift
                        if INNER:  # [4, BT] -> [1, 4, 1, BT]: one scale and offset per token and lane group
                            if KHYB:   # the level spacing picked per group by the sign of its half-range
                                ks, kz = _hybrid_scale_offset(kh, kcen, gl.full(kh.shape, KA_HI, dt, kh.type.layout),
                                                              gl.full(kh.shape, 2 * KA_HI, dt, kh.type.layout),
                                                              gl.full(kh.shape, KA_LO, dt, kh.type.layout),
                                                              gl.full(kh.shape, 2 * KA_LO, dt, kh.type.layout), IS_BF16)
                            else:
                                ks, kz = _scale_offset(kh, kcen, gl.full(kh.shape, KA_HI, dt, kh.type.layout),
                                                       gl.full(kh.shape, KA_LO, dt, kh.type.layout), IS_BF16)
                            wb, _ = gl.broadcast(gl.expand_dims(kwords, 2), kdummy)                  # [NA, 4, KP, BT]
                            wb, ks4 = gl.broadcast(wb, gl.expand_dims(gl.expand_dims(ks, 0), 2))
                            if KZA:   # s * code in the registers (the addend -M s), z . sum(q) by the small mma
                                kneg = _mul(ks, knegm, IS_BF16)
                                wb, kz4 = gl.broadcast(wb, gl.expand_dims(gl.expand_dims(kneg, 0), 2))
                                kv = _unpack(wb, ks4, kz4, "ktz", KBITS, KP, IS_BF16)
                                s0 = mma_v2(_inner_zrows(kz, a_l, BT), qzB, gl.zeros([BT, 8], gl.float32, mma))
                            else:
                                wb, kz4 = gl.broadcast(wb, gl.expand_dims(gl.expand_dims(kz, 0), 2))
                                kv = _unpack(wb, ks4, kz4, "kt", KBITS, KP, IS_BF16)
                                s0 = gl.zeros([BT, 8], gl.float32, mma)
                            s = mma_v2(gl.convert_layout(_kred_t(kv, KP, BT), a_l), qT, s0) * qscale
                        elif KPOST:
                            s = _post_logits(kwords, kh, zrows.index(grel) if QZROWS else kcen, qT, qaT, negm, kdummy,
                                             sscale, cinv, a_l, b_l, mma, BT, KBITS, KP, IS_BF16, QZROWS, KSUB, KSW)
                        else:
                            ks, kz = _scale_offset(kh, kcen, khi, klo, IS_BF16)
                            wb, ks4 = gl.broadcast(gl.expand_dims(kwords, 2), gl.expand_dims(ks, 3))
                            wb, kz4 = gl.broadcast(wb, gl.expand_dims(kz, 3))
                            kv = _unpack(wb, ks4, kz4, "k", KBITS, KP, IS_BF16)
                            s = mma_v2(gl.convert_layout(_kred_t(kv, KP, BT), a_l), qT,
                                       gl.zeros([BT, 8], gl.float32, mma)) * qscale
                        s, allowed = _mask_scores(s, trow, tcol, t0, stop, AMASK, b.to(gl.int64) * stride_mb, REP,
                                                  _loop_mask_kind(MASK_KIND, MOKON, var), WT)
                        p, alpha8, m8, lacc = _softmax_step(s, allowed, m8, lacc, PEV)

                        if INNER:  # [8, 2, 8] -> [1, 8, 2, 8]: one scale and offset per channel
                            if VHYB:
                                vs, vz = _hybrid_scale_offset(vh, vcen, vhi_s, vhi_a, vlo_s, vlo_a, IS_BF16)
                            else:
                                vs, vz = _scale_offset(vh, vcen, vhi_s, vlo_s, IS_BF16)
                            if VBITS == 4:
                                vw3 = vwords
                            else:
                                vw3 = vwords >> vshift                                              # [BT, 8, 2]
                            wv, _ = gl.broadcast(gl.expand_dims(vw3, 3), jdummy)                  # [BT, 8, 2, 8]
                            wv, vs4 = gl.broadcast(wv, gl.expand_dims(vs, 0))
                            wv, vz4 = gl.broadcast(wv, gl.expand_dims(vz, 0))
                            vv = _unpack(wv, vs4, vz4, "vc", VBITS, 16, IS_BF16)
                            vv = gl.convert_layout(vv.permute([0, 2, 3, 1]).reshape([BT, 128]).permute([1, 0]), a_l)
                        elif VF:  # the offsets for their own mma; the codes per group below
                            vz = _offset(vh, vcen, IS_BF16)
                        else:
                            vv, vz = _kivi_values_t(vwords, vh, vcen, vhi, vlo, vnegm, vshift, jdummy, a_l, BT, VBITS,
                                                    IS_BF16, VZ)
                        pT = _p_transposed(p.to(dt), b_l, BT, IS_BF16)
                        if VF:  # each group's scale folded into p': acc_c + e_c^T @ (p' half_c)^T
                            a8 = gl.expand_dims(alpha8, 0)
                            acc, acc1, acc2, acc3 = _fold_values(vtile.index(r), vhtile.index(r), pT, acc * a8, acc1 * a8,
                                                                 acc2 * a8, acc3 * a8, t0, stop, VF16, VBITS, WT, a_l, b_l, BT)
                        else:
                            acc = mma_v2(vv, pT, acc * gl.expand_dims(alpha8, 0))
                        if VZ:  # the offsets' share: z_rows @ p^T
                            accz = mma_v2(_zero_rows(vz, a_l, BT), pT, accz * gl.expand_dims(alpha8, 0))
                        if TMA and INNER:  # the ring slot just read takes the tile NST ahead
                            _issue_codes(KC, VC, kbuf, vbuf, bars.index(st), st, row0 + t0 + NST * BT, it + NST < n_iter,
                                         BT * (KW_ + VW_) * 4)
                        elif TMA:  # a slot whose last tile was just read takes the slot NST ahead (its registers are consumed)
                            if sub == TPS - 1:
                                _issue(KC, VC, KHALF, KCEN, VHALF, VCEN, kbuf.index(st), vbuf.index(st), khbuf.index(st),
                                       kzbuf.index(st), vhbuf.index(st), vzbuf.index(st), bars.index(st), row0, grow0,
                                       t0 + (NST * TPS - TPS + 1) * BT, S, (slot + NST) * TPS < n_iter, NBYTES, not QZROWS)

        if TRACE:
            tr3 = _trace_now()
        lsum = gl.sum(lacc, 0)
        if VF:  # everything times 2^VF_E: the scale of p'
            acc = _fold_finish(acc, acc1, acc2, acc3, accz, VBITS, mma)
            lsum = lsum * VF_DOWN_
        elif VZ:
            acc = acc + _rows128(accz, mma)
        _store_partials(OUT_M, OUT_L, OUT_ACC, bh, split, NSPLIT, NWIN, m8, lsum, acc, REP, mma, VBITS if VF else 0)
        if TRACE:
            _trace_store(TRB + (bh * NSPLIT + split).to(gl.int64) * 8, tr0, tr1, tr2, tr3, _trace_now(),
                         _trace_smid(), n_iter)

    @gluon.jit
    def _issue(KC, VC, KHALF, KCEN, VHALF, VCEN, kb, vb, khb, kzb, vhb, vzb, bar, row0, grow0, t0, S: gl.constexpr,
               pred, NBYTES: gl.constexpr, KZ: gl.constexpr = True):
        """Start the copies of the tiles from t0 into one ring slot (codes [TPS BT, W] rows, the Key groups'
        statistics rows [TPS, 128], their centers too with KZ, the Values' [TPS BT * 4] statistics: the boxes of
        `descriptors`); `bar` completes when all NBYTES have landed."""
        mbarrier.expect(bar, NBYTES, pred=pred)
        tma.async_copy_global_to_shared(KC, [row0 + t0, 0], bar, kb, pred=pred)
        tma.async_copy_global_to_shared(VC, [row0 + t0, 0], bar, vb, pred=pred)
        g = grow0 + (t0 - S) // 32
        tma.async_copy_global_to_shared(KHALF, [g, 0], bar, khb, pred=pred)
        if KZ:
            tma.async_copy_global_to_shared(KCEN, [g, 0], bar, kzb, pred=pred)
        tma.async_copy_global_to_shared(VHALF, [(row0 + t0) * 4], bar, vhb, pred=pred)
        tma.async_copy_global_to_shared(VCEN, [(row0 + t0) * 4], bar, vzb, pred=pred)

    @gluon.jit
    def _widen(x4, VW: gl.constexpr, BT: gl.constexpr, LANES: gl.constexpr = True):
        """[BT, 4] -> [BT, 8] (column w reads column w // 2), in the layout VW. LANES (`WIDEN_IN_LANES`): the new
        column bit w % 2 broadcast over lane bit 2, where `_stats4_layout` already holds the value twice, so no data
        moves (else a join along the registers, which ptxas turned into per-lane byte selects and shuffles)."""
        if LANES:
            L42: gl.constexpr = _stats42_layout(BT)
            x = gl.expand_dims(gl.convert_layout(x4, gl.SliceLayout(2, L42)), 2)
            x, _ = gl.broadcast(x, gl.full([BT, 4, 2], 0, x4.dtype, L42))
            y = gl.convert_layout(x.reshape([BT, 8]), VW)
        else:
            y = gl.convert_layout(gl.join(x4, x4).reshape([BT, 8]), VW)
        return y

    @gluon.jit
    def _smem_keys(kb, khb, kzb, KW: gl.constexpr, KS: gl.constexpr, BT: gl.constexpr, KBITS: gl.constexpr,
                   KP: gl.constexpr):
        """One ring tile's Key words (at 1 bit unshifted), half-ranges and centers in registers, in the layouts
        `_load_tile` returns; with QZROWS the slot holds no Key centers (`_issue` KZ): their registers are then
        unused (and their loads dropped)."""
        flat3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
        kwords = _smem_key_codes(kb, KW, BT, KBITS, KP)
        kh = khb._reinterpret(khb.dtype, [4, 32 // KP, KP], flat3).permute([1, 0, 2]).load(KS)
        kcen = kzb._reinterpret(kzb.dtype, [4, 32 // KP, KP], flat3).permute([1, 0, 2]).load(KS)
        return kwords, kh, kcen

    @gluon.jit
    def _smem_values(vb, vhb, vzb, VW: gl.constexpr, VW3: gl.constexpr, L4: gl.constexpr, BT: gl.constexpr,
                     VBITS: gl.constexpr, LANES: gl.constexpr = True):
        """One ring tile's Value words, half-ranges and centers in registers (`_load_tile`'s layouts). LANES:
        `_widen`'s."""
        vh, vcen = _smem_value_stats(vhb, vzb, VW, L4, BT, LANES)
        return _smem_value_codes(vb, VW, VW3, L4, BT, VBITS, LANES), vh, vcen

    @gluon.jit
    def _smem_value_stats(vhb, vzb, VW: gl.constexpr, L4: gl.constexpr, BT: gl.constexpr, LANES: gl.constexpr = True):
        """One ring tile's Value half-ranges and centers in registers, widened to the [BT, 8] statistics layout (also
        the folded Values', whose codes `_fold_values` reads: `VF_SWIZZLE`'s rows are not for `_smem_value_codes`)."""
        flat2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        vh = _widen(vhb._reinterpret(vhb.dtype, [BT, 4], flat2).load(L4), VW, BT, LANES)
        vcen = _widen(vzb._reinterpret(vzb.dtype, [BT, 4], flat2).load(L4), VW, BT, LANES)
        return vh, vcen

    @gluon.jit
    def _smem_key_codes(kb, KW: gl.constexpr, BT: gl.constexpr, KBITS: gl.constexpr, KP: gl.constexpr):
        """A ring tile's Key code rows into registers (also InnerQ's codes-only ring)."""
        flat3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
        flat2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        if KBITS == 1:   # word b of each token; the block a is its half (shifted by the caller)
            kwords = gl.expand_dims(kb._reinterpret(gl.int32, [BT, 4], flat2).permute([1, 0]).load(
                gl.SliceLayout(0, KW)), 0)
        else:            # word a + (KBITS / KBW) b, i.e. [BT, 4 (b), NA (a)]
            kwords = kb._reinterpret(gl.int32, [BT, 4, 32 // KP], flat3).permute([2, 1, 0]).load(KW)
        return kwords

    @gluon.jit
    def _smem_value_codes(vb, VW: gl.constexpr, VW3: gl.constexpr, L4: gl.constexpr, BT: gl.constexpr,
                          VBITS: gl.constexpr, LANES: gl.constexpr = True):
        """A ring tile's Value code rows into registers (also InnerQ's codes-only ring)."""
        flat3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
        flat2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        if VBITS == 4:
            vwords = vb._reinterpret(gl.int32, [BT, 8, 2], flat3).load(VW3)
        elif VBITS == 2:
            vwords = gl.expand_dims(vb._reinterpret(gl.int32, [BT, 8], flat2).load(VW), 2)
        else:
            vwords = gl.expand_dims(_widen(vb._reinterpret(gl.int32, [BT, 4], flat2).load(L4), VW, BT, LANES), 2)
        return vwords

    @gluon.jit
    def _post_logits(kwords, kh, zsrc, qT, qaT, negm, kdummy, sscale, cinv, a_l: gl.constexpr, b_l: gl.constexpr,
                     mma: gl.constexpr, BT: gl.constexpr, KBITS: gl.constexpr, KP: gl.constexpr,
                     IS_BF16: gl.constexpr, QZROWS: gl.constexpr, KSUB: gl.constexpr = False, KSW: gl.constexpr = 7):
        """Base-2 logits^T [BT, 8] of one tile of post-scaled KIVI Keys (`_kivi_decode_kernel` KPOST):
        e @ q'^T, q'^T = (q a 2^(E - b))^T * half (qaT: (q a 2^(E - b))^T), from q . z: zsrc is, with QZROWS, the
        shared-memory row of the tile's Key group (`_qz_rows`), else its centers [NA, 4, KP] (the offsets
        z = center - half from them); bf16 adds -128 sum q' (negm: the codes' magic number), unless KSUB (the codes
        bf16 subnormals: q . z scaled by cinv = 2^(SUB_E - 133) as fp16's by 2^(E - 24))."""
        if not QZROWS:
            zsrc = _offset(kh, zsrc, IS_BF16)
        wb, _ = gl.broadcast(gl.expand_dims(kwords, 2), kdummy)                  # [NA, 4, KP, BT]
        kv = _unpack_kq(wb, KBITS, KP, IS_BF16, KSUB, KSW)
        kvT = gl.convert_layout(_kred_t(kv, KP, BT), a_l)   # [BT, 128]
        hk = gl.convert_layout(_kred(_sigma(kh, KP), KP), gl.SliceLayout(1, b_l))
        if not IS_BF16:  # q a 2^E <= 2^8 times a half-range of 256 or more would pass 65504: such a tile
            # takes q a 2^(E - b - g) (exact), g from the exponent of its largest half-range (so that
            # hmax 2^-g < 256: q' <= 2^8 * 255.875 = 65504), its initial accumulator 2^-g, its logits 2^g;
            # integer ops on the float's bits, and 16 multiplies of q^T (the half-ranges' registers repeat)
            hbits = gl.max(hk, 0).to(gl.float32).to(gl.int32, bitcast=True)   # hmax < 2^(e - 126)
            g = gl.maximum(((hbits >> 23) & 255) - 134, 0)
            tg = ((127 - g) << 23).to(gl.float32, bitcast=True)              # 2^-g
            qa2, hk2 = gl.broadcast(qaT * tg.to(qaT.dtype), gl.expand_dims(hk, 1))
        else:
            qa2, hk2 = gl.broadcast(qaT, gl.expand_dims(hk, 1))
        qp = _mul(qa2, hk2, IS_BF16)
        if QZROWS:
            c, _ = gl.broadcast(gl.expand_dims(zsrc.load(gl.SliceLayout(0, mma)), 0),
                                gl.zeros([16, 8], gl.float32, mma))
        else:
            zk = gl.convert_layout(_kred(_sigma(zsrc, KP), KP), gl.SliceLayout(0, a_l))
            za, _ = gl.broadcast(gl.expand_dims(zk, 0), negm)
            c = mma_v2(za, qT, gl.zeros([16, 8], gl.float32, mma))
        if IS_BF16 and KSUB:   # with QZROWS the rows are stored times cinv (`_qz_refill`)
            s = mma_v2(kvT, qp, _rows(c if QZROWS else c * cinv, BT, mma)) * sscale
        elif IS_BF16:
            c = mma_v2(negm, qp, c)
            s = mma_v2(kvT, qp, _rows(c, BT, mma)) * sscale
        else:
            c = c * (cinv * tg)
            s = mma_v2(kvT, qp, _rows(c, BT, mma)) * (sscale / tg)
        return s

    @gluon.jit
    def _kivi_values_t(vwords, vh, vcen, vhi, vlo, vnegm, vshift, jdummy, a_l: gl.constexpr, BT: gl.constexpr,
                       VBITS: gl.constexpr, IS_BF16: gl.constexpr, VZ: gl.constexpr):
        """(v^T [128 (n = 8j + w), BT] in the A layout a_l, the offsets z [BT, 8]) of one KIVI Value tile (per-token
        groups); with VZ, v^T holds s * code alone (the fma's addend -M s, exact; vnegm: -M) and the caller adds z's
        share (`_zero_rows`)."""
        vs, vz = _scale_offset(vh, vcen, vhi, vlo, IS_BF16)
        if VBITS == 4:
            vw3 = vwords
        else:
            vw3 = vwords >> vshift                                                  # [BT, 8, 2]
        wv, _ = gl.broadcast(gl.expand_dims(vw3, 3), jdummy)                      # [BT, 8, 2, 8]
        wv, vs4 = gl.broadcast(wv, gl.expand_dims(gl.expand_dims(vs, 2), 3))
        if VZ:
            wv, vz4 = gl.broadcast(wv, gl.expand_dims(gl.expand_dims(_mul(vs, vnegm, IS_BF16), 2), 3))
            vv = _unpack(wv, vs4, vz4, "vz", VBITS, 16, IS_BF16)
        else:
            wv, vz4 = gl.broadcast(wv, gl.expand_dims(gl.expand_dims(vz, 2), 3))
            vv = _unpack(wv, vs4, vz4, "v", VBITS, 16, IS_BF16)
        return gl.convert_layout(vv.permute([0, 2, 3, 1]).reshape([BT, 128]).permute([1, 0]), a_l), vz

    @gluon.jit
    def _load_tile(kc_base, KHALF, KCEN, vc_base, VHALF, VCEN, ks_base, vs_base, t0, stop, S: gl.constexpr, koff,
                   schan, kt, voff, vsoff, vt, BT: gl.constexpr, D: gl.constexpr, KW_: gl.constexpr,
                   VW_: gl.constexpr, VBITS: gl.constexpr, WT: gl.constexpr = False):
        """Packed words and raw statistics of the tile at t0 (positions >= stop load 0; WT: none, `_whole_tiles`);
        Value words as [BT, 8, 2] at 4 bits, else [BT, 8] broadcast to [BT, 8, 2] (both chunks of a word)."""
        kvalid = _before(t0 + kt, stop, WT)
        kwords = gl.load(kc_base + t0 * KW_ + koff, mask=gl.expand_dims(gl.expand_dims(kvalid, 0), 0), other=0)
        grow = (t0 - S) // 32
        srow = ks_base + grow * D + schan
        kh = gl.load(KHALF + srow)  # t0 < stop: the tile's group row is written
        kcen = gl.load(KCEN + srow)
        vvalid = gl.expand_dims(_before(t0 + vt, stop, WT), 1)
        if VBITS == 4:
            vwords = gl.load(vc_base + t0 * VW_ + voff, mask=gl.expand_dims(vvalid, 2), other=0)
        else:
            vwords = gl.expand_dims(gl.load(vc_base + t0 * VW_ + voff, mask=vvalid, other=0), 2)
        vh = gl.load(VHALF + vs_base + t0 * 4 + vsoff, mask=vvalid, other=0.0)
        vcen = gl.load(VCEN + vs_base + t0 * 4 + vsoff, mask=vvalid, other=0.0)
        return kwords, kh, kcen, vwords, vh, vcen

    @gluon.jit
    def _load_inner_tile(kc_base, KHALF, KCEN, vc_base, VHALF, VCEN, ks_base, vs_base, t0, stop,
                         S: gl.constexpr, koff, ksoff, kt, voff, vchan, vt, BT: gl.constexpr, D: gl.constexpr,
                         KW_: gl.constexpr, VW_: gl.constexpr, VBITS: gl.constexpr, WT: gl.constexpr = False):
        """InnerQ's tile at t0: packed words as `_load_tile` loads them; the Keys' raw statistics per token and
        group [4, BT] (positions >= stop load 0) and the Values' per channel of the tile's group row [8, 2, 8] (a
        hybrid group's half-range signed: `_hybrid_scale_offset`)."""
        kvalid = _before(t0 + kt, stop, WT)
        kwords = gl.load(kc_base + t0 * KW_ + koff, mask=gl.expand_dims(gl.expand_dims(kvalid, 0), 0), other=0)
        vvalid = gl.expand_dims(_before(t0 + vt, stop, WT), 1)
        if VBITS == 4:
            vwords = gl.load(vc_base + t0 * VW_ + voff, mask=gl.expand_dims(vvalid, 2), other=0)
        else:
            vwords = gl.expand_dims(gl.load(vc_base + t0 * VW_ + voff, mask=vvalid, other=0), 2)
        kh, kcen, vh, vcen = _load_inner_stats(KHALF, KCEN, VHALF, VCEN, ks_base, vs_base, t0, stop, S, ksoff, kt,
                                               vchan, D, WT)
        return kwords, vwords, kh, kcen, vh, vcen

    @gluon.jit
    def _load_inner_stats(KHALF, KCEN, VHALF, VCEN, ks_base, vs_base, t0, stop, S: gl.constexpr,
                          ksoff, kt, vchan, D: gl.constexpr, WT: gl.constexpr = False):
        """InnerQ's raw statistics of the tile at t0 (`_load_inner_tile`'s; the codes-only ring loads these alone;
        WT: `_load_tile`'s)."""
        kvalid = _before(t0 + kt, stop, WT)
        kvalid2 = gl.expand_dims(kvalid, 0) & (ksoff >= 0)   # [4, BT]
        ksrow = ks_base + t0 * 4 + ksoff
        kh = gl.load(KHALF + ksrow, mask=kvalid2, other=0.0)
        kcen = gl.load(KCEN + ksrow, mask=kvalid2, other=0.0)
        vsrow = vs_base + (t0 - S) // 32 * D + vchan   # t0 < stop: the tile's group row is written
        vh = gl.load(VHALF + vsrow)
        vcen = gl.load(VCEN + vsrow)
        return kh, kcen, vh, vcen

    @gluon.jit
    def _lut_regs(LEV, e, IS_BF16: gl.constexpr):
        """Table register e (0-7, any layout) of `lut_table`, built from the store's 16 fp32 levels rounded to the
        cache dtype: byte k of register e is the low (e < 4) or high byte of level 4 (e % 4) + k."""
        dt: gl.constexpr = gl.bfloat16 if IS_BF16 else gl.float16
        tab = e * 0
        for k in gl.static_range(4):
            bits = gl.load(LEV + 4 * (e % 4) + k).to(dt).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
            tab = tab | (gl.where(e < 4, bits & 0xFF, bits >> 8) << (8 * k))
        return tab

    @gluon.jit
    def _lut_unpack(words, s, z, tab, SIDE: gl.constexpr, IS_BF16: gl.constexpr):
        """level(code) * s + z (cache dtype) from packed 4-bit words broadcast over their codes and the table
        registers (`_lut_key_asm`: 8 codes per block, `_lut_value_asm`: 16, two tokens)."""
        PACK: gl.constexpr = 8 if SIDE == "k" else 16
        if IS_BF16:
            x = gl.inline_asm_elementwise(_asm(SIDE, "lut", True), _lut_cons(PACK), [words, s, z, tab],
                                          dtype=gl.bfloat16, is_pure=True, pack=PACK)
        else:
            x = gl.inline_asm_elementwise(_asm(SIDE, "lut", False), _lut_cons(PACK), [words, s, z, tab],
                                          dtype=gl.float16, is_pure=True, pack=PACK)
        return x

    @gluon.jit
    def _rope_pairs(x, y, c, s, SIGN: gl.constexpr, IS_BF16: gl.constexpr):
        """x * c + SIGN * y * s on packed pairs (`_rope_asm`)."""
        if IS_BF16:
            r = gl.inline_asm_elementwise(_asm("rope", SIGN, True), "=r,r,r,r,r", [x, y, c, s], dtype=gl.bfloat16,
                                          is_pure=True, pack=2)
        else:
            r = gl.inline_asm_elementwise(_asm("rope", SIGN, False), "=r,r,r,r,r", [x, y, c, s], dtype=gl.float16,
                                          is_pure=True, pack=2)
        return r

    @gluon.jit
    def _halves(x, BT: gl.constexpr):
        """[4 (a), 4, 8, BT] -> the blocks a < 2 and a >= 2 (channels c and their RoPE partners c + 64)."""
        return gl.split(x.reshape([2, 2, 4, 8, BT]).permute([1, 2, 3, 4, 0]))

    @gluon.jit
    def _rotate(k, cos, sin, IS_BF16: gl.constexpr, BT: gl.constexpr):
        """RoPE after dequantization on Keys laid out as `_lut_chan` with ROPE: k * cos + rotate_half(k) * sin,
        rotate_half(k)[c] = -k[c + 64] (c < 64), k[c - 64] (c >= 64); partners sit in blocks a and a + 2."""
        klo, khi = _halves(k, BT)
        clo, chi = _halves(cos, BT)
        slo, shi = _halves(sin, BT)
        lo = _rope_pairs(klo, khi, clo, slo, -1, IS_BF16)
        hi = _rope_pairs(khi, klo, chi, shi, 1, IS_BF16)
        return gl.join(lo, hi).permute([4, 0, 1, 2, 3]).reshape([4, 4, 8, BT])

    @gluon.jit
    def _lut_chan(a, b, c, ROPE: gl.constexpr):
        """Key channel of code c of asm block a of lane group b: 32 b + 8 a + c; with RoPE 64 (a // 2) + 16 b +
        8 (a % 2) + c, so that a lane holds every channel's rotation partner (c + 64) in block a + 2."""
        if ROPE:
            return 64 * (a // 2) + 16 * b + 8 * (a % 2) + c
        return 32 * b + 8 * a + c

    @gluon.constexpr_function
    def _lut_words_layout(bt):
        """The Key words' layout of `_lut_decode_kernel` with RoPE (`_key_layout(bt, 8)` without its codes c) with
        the block a = 2 a1 + a0 as two dimensions: [a1(2), a0(2), b(4), t(bt)], word 8 a1 + 2 b + a0 (`_lut_chan`).
        It reads the TMA ring's [t, 16 words] rows through a permuted view; reshaped, it is the kernel's own."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1, 0, 0], [1, 0, 0, 0]] + [[0, 0, 0, 8 << i] for i in range(bt.bit_length() - 4)],
            lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]],
            warp_bases=[], block_bases=[], shape=[2, 2, 4, bt])

    @gluon.jit
    def _lut_smem_kwords(kb, KW: gl.constexpr, BT: gl.constexpr, ROPE: gl.constexpr):
        """A ring slot's Key words [BT, 16] into the layout KW [4 (a), 4 (b), BT] of the plain loads."""
        if ROPE:   # word 8 a1 + 2 b + a0
            flat4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[3, 2, 1, 0])
            w = kb._reinterpret(gl.int32, [BT, 2, 4, 2], flat4).permute([1, 3, 2, 0]).load(_lut_words_layout(BT))
            return gl.convert_layout(w.reshape([4, 4, BT]), KW)
        else:      # word 4 b + a
            flat3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
            return kb._reinterpret(gl.int32, [BT, 4, 4], flat3).permute([2, 1, 0]).load(KW)

    @gluon.jit
    def _lut_decode_kernel(
            Q, stride_qb, stride_qh, KC, KCEN, KHALF, KLEV, KOIDX, KOVAL, VC, VCEN, VHALF, VLEV, VOIDX, VOVAL, COS, SIN,
            POS, AMASK, stride_mb, OUT_M, OUT_L, OUT_ACC, scale, T, NSPLIT,
            H: gl.constexpr, REP: gl.constexpr, S: gl.constexpr, R: gl.constexpr, MASK_KIND: gl.constexpr,
            IS_BF16: gl.constexpr, BT: gl.constexpr, ROPE: gl.constexpr, KNOUT: gl.constexpr, VNOUT: gl.constexpr,
            NWIN: gl.constexpr, PDL: gl.constexpr, TMA: gl.constexpr = False, NST: gl.constexpr = 2):
        """Decode over kvquant's layout: 4-bit codebook Keys with one static range per channel (optionally stored
        before RoPE) and 4-bit codebook Values with one range per token, each with KNOUT / VNOUT dense-and-sparse
        outliers per token (exact values at stored channel indices; kvquant-4, kvquant-4-1%):
            k[t, c] = RoPE_t(lev_k[code] * half_k[c] + center_k[c], or the outlier value at its channel)
            v[t, c] = lev_v[code] * half_v[t] + center_v[t], or the outlier value at its channel
        The KIVI kernel's structure at 4 bits (one warp, the same mma layouts and online softmax) with BT-token
        tiles (`LUT_BT`),
        with the codebook looked up in registers (`_lut_key_asm` / `_lut_value_asm`: two `prmt` from 8 table
        registers per 4 codes) and RoPE applied to the dequantized pairs (c, c + 64) in registers, with the tile's
        cos / sin rows of the model-level table [B, T, 128].
        TMA: KC and VC are TMA descriptors of the codes as [rows, 16 words]: a ring of NST tiles in shared memory,
        each tile's Key and Value rows copied NST tiles ahead (rows past the slice are read as they are: their
        logits are masked, their Values' statistics load as 0). The statistics, the outliers and the RoPE table's
        rows take plain loads."""
        bh = gl.program_id(0)
        split = gl.program_id(1)
        b = bh // H
        h = bh % H
        dt: gl.constexpr = gl.bfloat16 if IS_BF16 else gl.float16
        D: gl.constexpr = D_
        start, stop, n_iter = _slice(POS, split, NSPLIT, S, R, 1, 1, BT, PDL, 0, 0)

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        PK: gl.constexpr = _key_layout(BT, 8)      # [4 (a), 4 (b), 8 (c), BT]
        KW: gl.constexpr = gl.SliceLayout(2, PK)   # words [4, 4, BT]
        KS: gl.constexpr = gl.SliceLayout(3, PK)   # per channel [4, 4, 8]
        PV: gl.constexpr = _value_layout(BT)       # [BT, 8 (w), 2 (jh), 8 (jl)]
        VW3: gl.constexpr = gl.SliceLayout(3, PV)  # words [BT, 8, 2]
        VW: gl.constexpr = gl.SliceLayout(2, VW3)  # per token [BT, 8]
        bh64 = bh.to(gl.int64)

        # Key words: block a of lane group b is word (its channel) // 8; the static per-channel statistics and
        # the table registers (8, one per code of a block) are loaded once
        ka = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, KW)))
        kb = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, KW)))
        kt = gl.arange(0, BT, layout=gl.SliceLayout(0, gl.SliceLayout(0, KW)))
        kword = _lut_chan(gl.expand_dims(ka, 1), gl.expand_dims(kb, 0), 0, ROPE) // 8
        kword3 = gl.expand_dims(kword, 2)                                                            # [4, 4, 1]
        sa = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, KS)))
        sb = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, KS)))
        sc = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, KS)))
        schan = _lut_chan(gl.expand_dims(gl.expand_dims(sa, 1), 2), gl.expand_dims(gl.expand_dims(sb, 0), 2),
                          gl.expand_dims(gl.expand_dims(sc, 0), 0), ROPE)                           # [4, 4, 8]
        ksoff = bh64 * D + schan
        ktab = gl.expand_dims(gl.expand_dims(gl.expand_dims(_lut_regs(KLEV, sc, IS_BF16), 0), 0), 3)  # [1, 1, 8, 1]
        if not TMA:
            kc_base = KC + bh64 * T * 16
        kchan4 = gl.expand_dims(schan, 3)                                                            # [4, 4, 8, 1]
        if ROPE:
            rbase = b.to(gl.int64) * T * D
        # Value words: chunk (w, jh) of token t is word 2w + jh (channels 16w + 8jh + jl); one range per token
        vt = gl.arange(0, BT, layout=gl.SliceLayout(1, VW))
        vw = gl.arange(0, 8, layout=gl.SliceLayout(0, VW))
        jh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, VW3)))
        voff = gl.expand_dims(gl.expand_dims(vt, 1) * 16 + gl.expand_dims(vw * 2, 0), 2) + \
            gl.expand_dims(gl.expand_dims(jh, 0), 0)                                                 # [BT, 8, 2]
        vsoff = gl.expand_dims(vt, 1) + gl.expand_dims(vw * 0, 0)                                    # [BT, 8]
        jl = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, PV))))
        vtab = gl.expand_dims(gl.expand_dims(gl.expand_dims(_lut_regs(VLEV, jl, IS_BF16), 0), 0), 0)  # [1, 1, 1, 8]
        if not TMA:
            vc_base = VC + bh64 * T * 16
        vs_base = bh64 * T
        vchan4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(vw * 16, 0), 2), 3) + \
            gl.expand_dims(gl.expand_dims(gl.expand_dims(jh * 8, 0), 0), 3) + \
            gl.expand_dims(gl.expand_dims(gl.expand_dims(jl, 0), 0), 0)                               # [1, 8, 2, 8]

        # q^T [128, 8] in the Key mma's reduction order k = 64 a1 + 32 a0 + 16 c2 + 8 c1 + 4 b1 + 2 b0 + c0
        tk = gl.arange(0, 128, layout=gl.SliceLayout(1, b_l))
        qT = _load_qT(Q, b, h, stride_qb, stride_qh,
                      _lut_chan((tk >> 5) & 3, (tk >> 1) & 3, ((tk >> 3) & 3) * 2 + (tk & 1), ROPE), REP, b_l)

        qscale = scale * 1.4426950408889634   # log2(e): the softmax runs in base 2
        trow, tcol, m8, lacc, acc = _softmax_state(BT, mma)

        if TMA:  # the codes' ring: Key and Value rows of NST tiles
            kbuf = gl.allocate_shared_memory(gl.int32, [NST, BT, 16], KC.layout)
            vbuf = gl.allocate_shared_memory(gl.int32, [NST, BT, 16], VC.layout)
            bars = gl.allocate_shared_memory(gl.int64, [NST, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(NST):
                mbarrier.init(bars.index(i), count=1)
            for i in gl.static_range(NST):
                _issue_codes(KC, VC, kbuf, vbuf, bars.index(i), i, bh * T + start + i * BT, i < n_iter, BT * 128)

        for it in range(0, n_iter):
            t0 = start + it * BT
            # Keys (and RoPE rows) past the slice: the last row of the slice instead, unmasked (their logits are
            # masked); Value rows past it load zero statistics (a masked token's p is 0, its value must be finite)
            krow = gl.expand_dims(gl.expand_dims(gl.minimum(t0 + kt, stop - 1), 0), 0)               # [1, 1, BT]
            if TMA:
                st = it % NST
                mbarrier.wait(bars.index(st), (it // NST) & 1)
                kwords = _lut_smem_kwords(kbuf.index(st), KW, BT, ROPE)
            else:
                kwords = gl.load(kc_base + krow * 16 + kword3)
            # the static statistics are read per tile (L1 hits): held across the loop they cost 32 registers
            wb, ks4 = gl.broadcast(gl.expand_dims(kwords, 2), gl.expand_dims(gl.load(KHALF + ksoff), 3))
            wb, kz4 = gl.broadcast(wb, gl.expand_dims(gl.load(KCEN + ksoff), 3))
            wb, kt4 = gl.broadcast(wb, ktab)
            kv = _lut_unpack(wb, ks4, kz4, kt4, "k", IS_BF16)                                       # [4, 4, 8, BT]
            for j in gl.static_range(KNOUT):   # outliers replace their channels (before RoPE)
                orow = gl.expand_dims(krow, 2) * KNOUT + j                                           # [1, 1, 1, BT]
                oidx = gl.load(KOIDX + bh64 * T * KNOUT + orow).to(gl.int32)
                kv = gl.where(kchan4 == oidx, gl.load(KOVAL + bh64 * T * KNOUT + orow), kv)
            if ROPE:
                rrow = gl.expand_dims(krow, 2) * D
                cos = gl.load(COS + rbase + rrow + kchan4)
                sin = gl.load(SIN + rbase + rrow + kchan4)
                kv = _rotate(kv, cos, sin, IS_BF16, BT)
            kvT = gl.convert_layout(_kred_t(kv, 8, BT), a_l)                                      # [BT, 128]
            s = mma_v2(kvT, qT, gl.zeros([BT, 8], gl.float32, mma)) * qscale
            s, allowed = _mask_scores(s, trow, tcol, t0, stop, AMASK, b.to(gl.int64) * stride_mb, REP, MASK_KIND)
            p, alpha8, m8, lacc = _softmax_step(s, allowed, m8, lacc)

            vvalid = gl.expand_dims((t0 + vt) < stop, 1)
            if TMA:   # rows past the slice as they are: their statistics load as 0 below
                flat3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
                vwords = vbuf.index(st)._reinterpret(gl.int32, [BT, 8, 2], flat3).load(VW3)
            else:
                vwords = gl.load(vc_base + t0 * 16 + voff, mask=gl.expand_dims(vvalid, 2), other=0)  # [BT, 8, 2]
            if VNOUT > 0:
                vrow4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.minimum(t0 + vt, stop - 1), 1), 2), 3)
            vh = gl.load(VHALF + vs_base + t0 + vsoff, mask=vvalid, other=0.0)                       # [BT, 8]
            vcen = gl.load(VCEN + vs_base + t0 + vsoff, mask=vvalid, other=0.0)
            wv, vt4 = gl.broadcast(gl.expand_dims(vwords, 3), vtab)                                 # [BT, 8, 2, 8]
            wv, vs4 = gl.broadcast(wv, gl.expand_dims(gl.expand_dims(vh, 2), 3))
            wv, vz4 = gl.broadcast(wv, gl.expand_dims(gl.expand_dims(vcen, 2), 3))
            vv = _lut_unpack(wv, vs4, vz4, vt4, "v", IS_BF16)
            for j in gl.static_range(VNOUT):   # rows past the slice: the slice's last (finite; their p is 0)
                orow = vrow4 * VNOUT + j                                                              # [BT, 1, 1, 1]
                oidx = gl.load(VOIDX + bh64 * T * VNOUT + orow).to(gl.int32)
                vv = gl.where(vchan4 == oidx, gl.load(VOVAL + bh64 * T * VNOUT + orow), vv)
            vv = vv.permute([0, 2, 3, 1]).reshape([BT, 128]).permute([1, 0])          # v^T [128 (n = 8j + w), BT]
            vv = gl.convert_layout(vv, a_l)
            acc = mma_v2(vv, _p_transposed(p.to(dt), b_l, BT, IS_BF16), acc * gl.expand_dims(alpha8, 0))
            if TMA:  # the ring slot just read takes the tile NST ahead
                _issue_codes(KC, VC, kbuf, vbuf, bars.index(st), st, bh * T + t0 + NST * BT, it + NST < n_iter,
                             BT * 128)

        _store_partials(OUT_M, OUT_L, OUT_ACC, bh, split, NSPLIT, NWIN, m8, gl.sum(lacc, 0), acc, REP, mma)

    @gluon.constexpr_function
    def _value8_layout(bt):
        """Values as [t(bt), w(8), jh(2), jl2(2), jl01(4)]: `_value_layout` with its code index jl = 4 jl2 + jl01 split,
        so that its [bt, 8, 2, 2] slice holds one 32-bit word (4 codes) per (token, w, jh, jl2): two per chunk half."""
        return gl.DistributedLinearLayout(
            reg_bases=[[1, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 1, 0], [0, 0, 1, 0, 0]]
            + [[8 << i, 0, 0, 0, 0] for i in range(bt.bit_length() - 4)],
            lane_bases=[[2, 0, 0, 0, 0], [4, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 2, 0, 0, 0], [0, 4, 0, 0, 0]],
            warp_bases=[], block_bases=[], shape=[bt, 8, 2, 2, 4])

    @gluon.jit
    def _sym8_unpack(words, s, SIDE: gl.constexpr, IS_BF16: gl.constexpr):
        """int8's blocks (`_sym8_key_asm`: code - 127 in fp16, 4 per word; `_sym8_value_asm`: s * (code - 127) in the
        cache dtype, 16 per block of two tokens)."""
        if SIDE == "k":
            x = gl.inline_asm_elementwise(_asm("k", "sym8", False), "=r,=r,r,r,r,r", [words], dtype=gl.float16,
                                          is_pure=True, pack=4)
        elif IS_BF16:
            x = gl.inline_asm_elementwise(_asm("v", "sym8", True), _sym8_value_cons(),
                                          [words, s], dtype=gl.bfloat16, is_pure=True, pack=16)
        else:
            x = gl.inline_asm_elementwise(_asm("v", "sym8", False), _sym8_value_cons(),
                                          [words, s], dtype=gl.float16, is_pure=True, pack=16)
        return x

    @gluon.jit
    def _sym8_decode_kernel(
            Q, stride_qb, stride_qh, KC, KHALF, VC, VHALF, POS, AMASK, stride_mb, OUT_M, OUT_L, OUT_ACC, scale, T,
            NSPLIT, H: gl.constexpr, REP: gl.constexpr, S: gl.constexpr, R: gl.constexpr, MASK_KIND: gl.constexpr,
            IS_BF16: gl.constexpr, BT: gl.constexpr, NWIN: gl.constexpr, PDL: gl.constexpr):
        """Decode over int8's layout: symmetric 8-bit Keys and Values with one scale per token vector,
            k[t, c] = s_k[t] (code - 127)    v[t, c] = s_v[t] (code - 127)    s = half / 127.
        Keys post-scaled: the mma takes fp16 (code - 127) straight from a `prmt` and an `add` against q in fp16 (a
        bf16 q is scaled by a power of two first if it exceeds 2^14), and s_k[t] multiplies row t of the transposed logits.
        Values are dequantized in the cache dtype (`_sym8_value_asm`) for the transposed p @ V of the KIVI kernel
        (in fp16 a token's scale half / 127 is subnormal below half ~ 7.8e-3 and carries fewer bits there).
        The KIVI kernel's structure otherwise (one warp, BT-token tiles, the same mma layouts and online softmax)."""
        bh = gl.program_id(0)
        split = gl.program_id(1)
        b = bh // H
        h = bh % H
        dt: gl.constexpr = gl.bfloat16 if IS_BF16 else gl.float16
        start, stop, n_iter = _slice(POS, split, NSPLIT, S, R, 1, 1, BT, PDL, 0, 0)

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        PK: gl.constexpr = _key_layout(BT, 4)      # [8 (a), 4 (b), 4 (c), BT]: channel 32b + 4a + c, word 8b + a
        KW: gl.constexpr = gl.SliceLayout(2, PK)   # words [8, 4, BT]
        PV: gl.constexpr = _value8_layout(BT)      # [BT, 8 (w), 2 (jh), 2 (jl2), 4 (jl01)]
        VW: gl.constexpr = gl.SliceLayout(4, PV)   # words [BT, 8, 2, 2]: word 4w + 2jh + jl2 of token t
        bh64 = bh.to(gl.int64)

        ka = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, KW)))
        kb = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, KW)))
        kt = gl.arange(0, BT, layout=gl.SliceLayout(0, gl.SliceLayout(0, KW)))
        kword3 = gl.expand_dims(gl.expand_dims(ka, 1) + gl.expand_dims(kb * 8, 0), 2)                # [8, 4, 1]
        c4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, PK))))
        cdummy = gl.expand_dims(gl.expand_dims(gl.expand_dims(c4, 0), 0), 3)                         # [1, 1, 4, 1]
        kc_base = KC + bh64 * T * 32
        vt = gl.arange(0, BT, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, VW))))
        vw = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, VW))))
        vjh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, VW))))
        vj2 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, VW))))
        voff = gl.expand_dims(gl.expand_dims(gl.expand_dims(vt * 32, 1) + gl.expand_dims(vw * 4, 0), 2)
                              + gl.expand_dims(gl.expand_dims(vjh * 2, 0), 0), 3) \
            + gl.expand_dims(gl.expand_dims(gl.expand_dims(vj2, 0), 0), 0)                           # [BT, 8, 2, 2]
        j4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, PV)))))
        jdummy = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(j4, 0), 0), 0), 0)      # [1, 1, 1, 1, 4]
        vc_base = VC + bh64 * T * 32
        vs_base = bh64 * T

        # q^T [128, 8] in the Key mma's reduction order (the KIVI kernel's, x = 4a + c), in fp16
        tk = gl.arange(0, 128, layout=gl.SliceLayout(1, b_l))
        tc = (tk & 1) + ((tk >> 3) & 1) * 2 + ((tk >> 4) & 1) * 4 + ((tk >> 5) & 1) * 8
        qT = _load_qT(Q, b, h, stride_qb, stride_qh, 16 * ((tk >> 6) & 1) + 32 * ((tk >> 1) & 3) + tc, REP, b_l)
        if IS_BF16:  # fp16 holds |q| < 65504: a bf16 q above 2^14 is scaled by 2^-e to |q| <= 2^14 (exact), the
            # logits by 2^e
            qf = qT.to(gl.float32)
            qmax = gl.max(gl.max(gl.abs(qf), 1), 0)
            qfac = gl.exp2(-gl.maximum(gl.ceil(gl.log2(gl.maximum(qmax, 1.0) / 16384.0)), 0.0))
            qT = (qf * qfac).to(gl.float16)
            qscale = scale * 1.4426950408889634 / qfac
        else:
            qscale = scale * 1.4426950408889634   # log2(e): the softmax runs in base 2
        trow, tcol, m8, lacc, acc = _softmax_state(BT, mma)

        for it in range(0, n_iter):
            t0 = start + it * BT
            # Keys past the slice: the slice's last row, unmasked (their logits are masked)
            krow = gl.expand_dims(gl.expand_dims(gl.minimum(t0 + kt, stop - 1), 0), 0)               # [1, 1, BT]
            kwords, _ = gl.broadcast(gl.expand_dims(gl.load(kc_base + krow * 32 + kword3), 2), cdummy)
            kv = _sym8_unpack(kwords, kwords, "k", IS_BF16)                                        # [8, 4, 4, BT]
            # [a2, a1, a0, b1, b0, c1, c0] -> k = 64 a2 + 32 a1 + 16 a0 + 8 c1 + 4 b1 + 2 b0 + c0, transposed
            kvT = kv.reshape([2, 2, 2, 2, 2, 2, 2, BT]).permute([7, 0, 1, 2, 5, 3, 4, 6]).reshape([BT, 128])
            kvT = gl.convert_layout(kvT, a_l)
            ksc = gl.load(KHALF + bh64 * T + gl.minimum(t0 + trow, stop - 1)).to(gl.float32) * (qscale / 127.0)
            s = mma_v2(kvT, qT, gl.zeros([BT, 8], gl.float32, mma)) * gl.expand_dims(ksc, 1)
            s, allowed = _mask_scores(s, trow, tcol, t0, stop, AMASK, b.to(gl.int64) * stride_mb, REP, MASK_KIND)
            p, alpha8, m8, lacc = _softmax_step(s, allowed, m8, lacc)

            vvalid = (t0 + vt) < stop
            vwords = gl.load(vc_base + t0 * 32 + voff, mask=gl.expand_dims(gl.expand_dims(gl.expand_dims(
                vvalid, 1), 2), 3), other=0)                                                         # [BT, 8, 2, 2]
            vsc = (gl.load(VHALF + vs_base + t0 + vt, mask=vvalid, other=0.0).to(gl.float32) / 127.0).to(dt)
            wv, vs5 = gl.broadcast(gl.expand_dims(vwords, 4), jdummy)
            wv, vs5 = gl.broadcast(wv, gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(vsc, 1), 2), 3), 4))
            vv = _sym8_unpack(wv, vs5, "v", IS_BF16).reshape([BT, 8, 2, 8])
            vv = vv.permute([0, 2, 3, 1]).reshape([BT, 128]).permute([1, 0])          # v^T [128 (n = 8j + w), BT]
            vv = gl.convert_layout(vv, a_l)
            acc = mma_v2(vv, _p_transposed(p.to(dt), b_l, BT, IS_BF16), acc * gl.expand_dims(alpha8, 0))

        _store_partials(OUT_M, OUT_L, OUT_ACC, bh, split, NSPLIT, NWIN, m8, gl.sum(lacc, 0), acc, REP, mma)


_POST = dict(BITS=1, AXIS=1, GS=0, NG=1, SYM=0, LUT=False, NOUT=0, NORM=False, TPG=1)
_INNER_K = dict(AXIS=0, GS=32, LUT=False, NOUT=0, TPG=1)     # and SYM 0 or 2 (hybrid), either NORM
_INNER_V = dict(AXIS=1, GS=32, LUT=False, NOUT=0, TPG=32)


_LUT_K = dict(BITS=4, AXIS=1, GS=0, NG=1, SYM=0, LUT=True, NORM=False, TPG=1)
_LUT_V = dict(BITS=4, AXIS=0, SYM=0, LUT=True, TPG=1)   # and one range per token vector: GS = head_dim
_LUT_BUFFERS = ("codes", "cen", "half", "lev", "oidx", "oval")   # per side, in `_lut_decode_kernel`'s order
_SYM8 = dict(BITS=8, AXIS=0, SYM=1, LUT=False, NOUT=0, TPG=1)   # and one scale per token vector: GS = head_dim
SYM8_BT = 16       # tokens per tile of `_sym8_decode_kernel`: 123 (fp16) / 127 (bf16) registers, 16 programs per SM
                   # (156 / 167 at 32; sm_90 compile of session 17, `bench/sass_gluon.py`)
KIVI_BT = 32       # tokens per tile of `_kivi_decode_kernel`: a Key group (32) or half of one (16: 123-128 registers
                   # on the TMA path, 16 programs per SM, but ~30% more instructions per token; 1-14% slower at
                   # batch 8-32 on an H100, bench/lut_variants.py, bench/RESULTS.md session 13)
LUT_BT = 16        # tokens per tile of `_lut_decode_kernel`: faster than 32 at every shape of session 12 (at the cap,
                   # 6-14%; bench/RESULTS.md), which spills twice as much there (48 bytes against 24)
MASK_SLICE = 512   # KIVI's and InnerQ's launches with a bool mask: each program checks its slice's mask bytes, this
                   # many a step, and runs a copy of its tile loop built without the mask where they allow it all
                   # (`_kivi_decode_kernel` MOK; 0: one loop, the mask read per tile). Session 43 predicated the
                   # tiles' loads off instead (one copy): slower (`bench/debug/mask_slice_tried.patch`)
LUT_NO_MASK_AS_BOOL = True   # without a mask and without outliers, run the bool-mask build (MASK_KIND 3: its mask
                   # load predicated off): ptxas schedules the no-mask build of `_lut_decode_kernel` slower (kvquant-4
                   # 177.2 against 138.9 us at (32, 4096), bit-equal output; with outliers (kvquant-4-1%) the two
                   # are within 3%, the no-mask build ahead; H100, bench/RESULTS.md session 19)
LUT_MAXNREG = 168  # its register cap: 12 programs per SM instead of 8 (176 registers uncapped with RoPE), 8 bytes of
                   # stack (64 at 32-token tiles; sm_90 compile of session 17, `bench/sass_gluon.py`); 1.26-1.35x
                   # faster than uncapped at batch >= 8 on an H100, even at batch 1 (session 12, before the logits
                   # were transposed). The codes' TMA ring (182 uncapped, bench/debug/lut_tma_sass.py) fits it
                   # without spills; under 128 (16 programs per SM) it spilled 12 registers and was 13-20% slower
                   # (H100, bench/RESULTS.md session 23)


def layout_kind(kc: dict, vc: dict, head_dim: int = D) -> str | None:
    """"kivi": KIVI's layout at 1, 2 or 4 bits (`_kivi_decode_kernel`); "inner": InnerQ's at 1, 2 or 4 bits, Keys
    per token in groups of 32 channels and Values per channel in groups of 32 tokens, asymmetric or hybrid (innerq-2;
    the same kernel); "post": 1-bit channel-wise Keys and
    Values with one static range per channel, calibquant-1 (`_post_decode_kernel`); "lut": kvquant's 4-bit
    codebooks, Keys with one static range per channel, Values one range per token, with or without outliers
    (kvquant-4, kvquant-4-1%: `_lut_decode_kernel`); "sym8": symmetric 8-bit codes with one scale per token vector on
    both sides (int8, `_sym8_decode_kernel`); None: none of them. head_dim: the store's (the kernels
    themselves take 128 only, `supports`)."""
    key = dict(AXIS=1, GS=32, SYM=0, LUT=False, NOUT=0, NORM=False, TPG=32)
    val = dict(AXIS=0, GS=32, SYM=0, LUT=False, NOUT=0)
    if kc["BITS"] in BITS and vc["BITS"] in BITS and all(kc[n] == v for n, v in key.items()) \
            and all(vc[n] == v for n, v in val.items()):
        return "kivi"
    # InnerQ's: the other way round, asymmetric or hybrid (not at 1 bit: no 0-bit asymmetric half), any Key norm
    if kc["BITS"] in BITS and vc["BITS"] in BITS and all(kc[n] == v for n, v in _INNER_K.items()) \
            and all(vc[n] == v for n, v in _INNER_V.items()) \
            and all(c["SYM"] == 0 or (c["SYM"] == 2 and c["BITS"] > 1) for c in (kc, vc)):
        return "inner"
    if all(kc[n] == v for n, v in _POST.items()) and all(vc[n] == v for n, v in _POST.items()):
        return "post"
    if all(kc[n] == v for n, v in _LUT_K.items()) and all(vc[n] == v for n, v in _LUT_V.items()) \
            and vc["GS"] == head_dim:
        return "lut"
    if all(c[n] == v for c in (kc, vc) for n, v in _SYM8.items()) and not kc["NORM"] \
            and kc["GS"] == vc["GS"] == head_dim:
        return "sym8"
    return None


def supports(query, rep: int, kc: dict, vc: dict, kp: dict, rope: bool, mask_kind: int, mask_shared: bool,
             is_causal: bool, tau) -> str | None:
    """None when one of this module's kernels serves the layer's quantized region, else why not (the Triton
    template does)."""
    import torch

    kind = layout_kind(kc, vc, query.shape[-1])
    if kind is None:
        return ("the store is in none of KIVI's or InnerQ's layouts at 1, 2 or 4 bits, calibquant's 1-bit channel-wise one and "
                "kvquant's 4-bit codebooks and int8's per-token 8-bit codes")
    if query.shape[-1] != D:
        return "needs head_dim 128"
    if rep > 8:
        return "needs at most 8 query heads per KV head"
    if (rope and kind != "lut") or is_causal or (tau is not None and kind != "post") or \
            (mask_kind != 0 and not mask_shared):
        return ("RoPE after dequantization (but kvquant's layout), is_causal, calibrated softmax (but calibquant's "
                "layout) or a per-head mask")
    if query.dtype not in (torch.float16, torch.bfloat16) or kp["half"].dtype != query.dtype:
        return "needs fp16 or bf16 queries and statistics of the same dtype"
    if not query.is_cuda or torch.cuda.get_device_capability(query.device) < (8, 0):
        return "needs an NVIDIA GPU of compute capability 8.0 or newer"
    if query.dtype == torch.bfloat16 and kind in ("kivi", "inner") and \
            torch.cuda.get_device_capability(query.device) < (9, 0):
        # their inline PTX adds and multiplies bf16x2 pairs (`add` / `mul.rn.bf16x2`: sm_90; the build fails on
        # sm_80, checked offline); kvquant's, calibquant's and int8's bf16 blocks use `fma` only
        return "bf16 in KIVI's or InnerQ's layout needs compute capability 9.0 (packed bf16 add and multiply)"
    if not HAVE_GLUON:
        return "triton.experimental.gluon is not available"
    return None


@functools.lru_cache(maxsize=None)
def enabled() -> bool:
    """KVQ_GLUON=0 turns the kernel off (every layout then runs the Triton template); read once per process."""
    return HAVE_GLUON and os.environ.get("KVQ_GLUON", "1") != "0"


NSTAGES = 2       # ring slots of the TMA path: 2 was best of 2 / 3 / 4 (bench/RESULTS.md, session 10)
# KIVI's layout: post-scaled Keys (`_kivi_decode_kernel` KPOST); KVQ_KEY_POST=0 turns them off (read at import)
KEY_POST = os.environ.get("KVQ_KEY_POST", "1") != "0"
QZ_ROWS = True  # KIVI's layout with post-scaled Keys through the TMA ring: q . z of QZ_N Key groups per mma
                # (`_kivi_decode_kernel` QZROWS), not one per tile: 3.8-6.6% faster (kivi-2), 1.7-5.0% (kivi-4), 2.3-6.4%
                # (xquant-1.38) at batch x context >= 64k with a bool mask (H200, bench/RESULTS.md session 25). Not on
                # the plain-load path: there it takes 181 / 184 registers against 168 (bf16, 2 / 4 bits; 8 programs
                # per SM instead of 12, sm_90 compile), not measured
VALUE_ZERO_APART = True  # KIVI's Values in bf16: s * code in the registers, the offsets by one small mma per tile
                         # (`_kivi_decode_kernel` VZ): one instruction fewer per Value register; 1.2-2.6% faster
                         # (kivi-2, kivi-4, xquant-1.38 at batch x context >= 64k, bool mask, H200, bench/RESULTS.md
                         # session 27); 4 / 4 / 6 more registers (153 / 162 / 157 at 2 / 4 / 1 bits, TMA build,
                         # before `WIDEN_IN_LANES`: 151 / 160 / 153 with it)
PAIR_SOFTMAX = True   # KIVI's ring with two tiles a slot: one online-softmax step per slot (PAIR), in slices of
# whole slots: kivi-2 3.0-4.9% faster at batch x context >= 512k, 0.9% slower at (1, 65536) (H200, bool mask, session
# 29, call 5; 558 SASS instructions a tile against 595)
BF16_SUBNORMAL_KEYS = True   # KIVI's post-scaled bf16 Keys as bf16 subnormals (code 2^(b - 133), `_kpost_asm` sub):
# no magic 128, so no -128 sum q' mma per tile (8 of a tile's 42 HMMA): kivi-2 2.7-4.7% faster, kivi-4 1.1-4.2%,
# xquant-1.38 1.2-4.7% at batch x context >= 64k (H200, session 30, calls 8-9)
VALUE_FOLD = True   # KIVI's 4-, 2- and 1-bit bf16 Values through the ring (`VALUE_FOLD_BITS`): each group's scale folded
# into p (`_kivi_decode_kernel` VF): the codes bare from `ldmatrix.trans`, 4 mma per tile (one per group) against p'
# scaled per group. Offline sm_90 (kivi-4, `SUB_WINDOW` 8): 649 -> 567 SASS instructions a tile, 128 -> 168 registers
# (16 -> 12 programs per SM); 5.2-13.2% less time at batch x context >= 64k (H200, bench/RESULTS.md session 31, call
# 4; call 1, window 7 and unswizzled rows: 0.0-3.2%). kivi-2 (one softmax step per slot, the byte exchange of
# `_fold_chunk2`): 534 -> 469 instructions a tile, 161 -> 156 registers, 4.4-8.0% less time (session 32, call 1);
# k2v1 (xquant-1.38's 1-bit Value layers, the nibble transpose of `_fold_chunk1`): 570 -> 470, 158 -> 156 registers,
# xquant-1.38 8.8-12.3% less time (call 2)
VALUE_FOLD_BITS = (1, 2, 4)   # the Value widths VALUE_FOLD takes (2 and 1 bits: `_fold_chunk2`, `_fold_chunk1`, one
# softmax step per tile or per slot)
VF_SWIZZLE = {1: 0, 2: 32, 4: 64}   # the folded Values' code rows (32 / 64 bytes) in the ring, swizzled by bits: `ldmatrix`
# reads 8 rows of 16 bytes at once, which unswizzled fall on the same banks 2 / 4 ways; kivi-4 0.9-4.5% faster with
# 64 than with 0 (H200, session 31, call 2); kivi-2 the same with 32 as with 0 (within 0.7% at six shapes, session 32,
# call 1: 156 registers against 162)
RING_TILES = {1: 2, 2: 2, 4: 1}   # tiles per slot of KIVI's TMA ring (`_kivi_decode_kernel` TPS), by the wider
# side's bits: one set of copies per slot. At 4 bits two tiles a slot take 20 KB of shared memory (11 programs per SM
# instead of 12, offline sm_90 compile)
WHOLE_TILES = True  # KIVI's and InnerQ's launches skip the per-tile position masks where `whole_tiles` holds (WT)
WIDEN_IN_LANES = True   # the TMA ring's Value statistics (and 1-bit Value words) widened over a lane bit (`_widen`
                        # LANES; `_kivi_decode_kernel` / `_post_decode_kernel` WL): 739 -> 693 SASS instructions per
                        # 32-token tile (kivi-2, bf16, `VZ`; PRMT 84 -> 44, SHFL 14 -> 6), output bit-equal; kivi-2
                        # 4.7-7.3%, kivi-4 3.0-3.5%, calibquant-1 2.5-5.3% faster (H200, bench/RESULTS.md session 27)
QZ_N = 8        # Key groups per refill: 149 / 158 registers (bf16, 2 / 4 bits, TMA; session 25, before `VZ` and
                # `WIDEN_IN_LANES`); 16 took 168 (sm_90 compile)
WINDOW_INSIDE = True  # calibquant's Gluon launches attend the exact windows themselves (`window_inside`)
POST_WCOST = {1: 2, 2: 2}  # calibquant with its windows inside: an exact-window tile counts as this many slice tiles
                          # of its pass (`_slice` WCOST), so the programs that take window tiles take shorter slices
POST_MAXNREG = {1: 80, 2: 128}  # register caps of calibquant's passes (by phase) with the windows inside. The
                     # attention pass takes 138 registers uncapped (12 programs per SM), 115 under 128 (16; 125 with
                     # POST_WCOST, session 22); the range
                     # pass 82 (bf16; fp16 128) uncapped, 80 under 80 (24 programs per SM; fp16 spills 144 bytes, none
                     # in the loop). Offline sm_90 compile with the launch's argument specializations. Of five cap
                     # pairs timed on an H100 these were the fastest at 4 of 6 shapes, 0.5-2.4% behind {1: 80, 2: 96}
                     # at the other two, which spills and was 10% slower at batch 1 (bench/RESULTS.md, session 21)
USE_TMA = None    # the TMA path: None = on compute capability 9.0+ while capturing a CUDA graph (check_gluon.py flips it)
INNER_TMA = True  # InnerQ's launch reads its codes through the TMA ring (where `USE_TMA` does), its statistics by
                  # plain loads: innerq-2 6.8-10.2% faster at batch x context >= 64k (bool mask; slices sized for the
                  # plain build), 1.1-1.8% less GPU time per decode step end to end (H100, bench/RESULTS.md session
                  # 24); session 15's ring with the statistics too was 0-3% slower than plain loads
INNER_KEY_ZERO_APART = True  # InnerQ's Keys in bf16: s * code in the registers, the offsets by one small mma per tile
                             # (`_kivi_decode_kernel` KZA: no `add` per register)
POST_TMA = True   # calibquant's launches take the TMA path too (where `USE_TMA` does): 2.73 against 2.75-2.76 ms per
                  # decode step at (32, 4096) end to end; the kernel 0.4-3.5% faster at four of the six shapes of
                  # batch x context >= 64k, 1.1% / 4.8% slower at (8, 65536) / (1, 65536) (means of two runs; H100,
                  # bench/RESULTS.md session 23)


def descriptors(kp: dict, vp: dict, kbits: int, vbits: int, tps: int = 1, vswizzle: int = 0) -> list:
    """Host TMA descriptors of the store, in the kernel's argument order (KC, KCEN, KHALF, VC, VCEN, VHALF): codes
    as [rows, words per token] (a box: tps tiles' rows), the Keys' statistics as [group rows, 128] (tps rows: one per
    32-token tile), the Values' as flat [T * 4] (tps tiles' 128 entries, 8 bytes a token: a box must start 16-byte
    aligned, so tiles must start at even rows; `_use_tma` takes plain loads for an odd sink or cache length). tps:
    the tiles of a ring slot of `_kivi_decode_kernel` (TPS); at most 2 (a box has at most 256 entries a dimension),
    and 1 with 16-token tiles (two of them share a Key statistics row). vswizzle: the Value codes' shared-memory
    swizzle in bytes (`vf_swizzle`: `VF_SWIZZLE` for the folded Values' `ldmatrix`, 0 elsewhere)."""
    import torch

    def desc(t, block, bits, swizzle=0):
        layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=bits, rank=len(block))
        return TensorDescriptor.from_tensor(t, block, layout)

    sbits = 16 if kp["half"].dtype in (torch.float16, torch.bfloat16) else 32
    if not 1 <= tps * KIVI_BT * 4 <= 256 or KIVI_BT * tps > 256:
        raise ValueError(f"a TMA box holds at most 256 entries a dimension: {tps} tiles of {KIVI_BT} tokens do not fit")
    if tps > 1 and KIVI_BT != 32:
        raise ValueError(f"{tps} tiles a ring slot need 32-token tiles (one Key statistics row each), not {KIVI_BT}")
    return [desc(kp["codes"].view(-1, 4 * kbits), [tps * KIVI_BT, 4 * kbits], 32),
            desc(kp["cen"].view(-1, D), [tps, D], sbits), desc(kp["half"].view(-1, D), [tps, D], sbits),
            desc(vp["codes"].view(-1, 4 * vbits), [tps * KIVI_BT, 4 * vbits], 32, vswizzle),
            desc(vp["cen"].view(-1), [tps * KIVI_BT * 4], sbits),
            desc(vp["half"].view(-1), [tps * KIVI_BT * 4], sbits)]


def row_descriptors(kp: dict, vp: dict, words: int, bt: int, vwords: int | None = None) -> list:
    """Host TMA descriptors (KC, VC) of a layout with one row of `words` int32 per token and side (kvquant's 16,
    calibquant's 4; InnerQ's 4 * bits, the Values' `vwords` where they differ): the Key and Value codes as [rows,
    words], a block one tile's bt rows (rows of 16, 32 or 64 bytes: a tile may start at any row)."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return [TensorDescriptor.from_tensor(p["codes"].view(-1, w), [bt, w], layout)
            for p, w in ((kp, words), (vp, words if vwords is None else vwords))]


def _use_tma(query, sink: int, T: int, use_tma: bool | None, kind: str = "kivi") -> bool:
    """Whether the launch of layout `kind` streams its tiles through the TMA ring (see `launch`): the one decision
    that `_plan` builds and `resident_programs` sizes. KIVI's ("kivi") and kvquant's ("lut") take it where the
    device does (`_ring_device`), calibquant's ("post") with `POST_TMA`, InnerQ's ("inner") with `INNER_TMA`; int8's
    ("sym8") never."""
    if kind not in ("kivi", "lut", "post", "inner") or (kind == "post" and not POST_TMA) or \
            (kind == "inner" and not INNER_TMA) or not _ring_device(query, use_tma):
        return False
    # a TMA box starts 16-byte aligned in its innermost dimension: the Values' statistics (8 bytes a token) need an
    # even first row, i.e. an even sink and cache length (an odd start faults with an illegal instruction); kvquant's,
    # calibquant's and InnerQ's rings hold whole rows of codes (16 to 64 bytes) only
    return kind != "kivi" or (sink % 2 == 0 and T % 2 == 0)


def _ring_device(query, use_tma: bool | None) -> bool:
    """Whether the device and the moment allow the TMA ring: sm_90+ with Gluon's TMA, and use_tma (None: `USE_TMA`,
    whose None means while a CUDA graph is being captured)."""
    import torch

    if not query.is_cuda:
        return False
    if use_tma is None:
        use_tma = USE_TMA
    if use_tma is None:  # only where the launch is recorded into a CUDA graph: building KIVI's six host descriptors
        # takes ~50 us of Python per call (measured on the 2-core CI machine), plus their encoding at every launch;
        # a graph replay pays neither, a host-bound decode step would pay it per layer
        use_tma = torch.cuda.is_current_stream_capturing()
    return bool(use_tma and HAVE_TMA and torch.cuda.get_device_capability(query.device) >= (9, 0))


def _plan(query, kp: dict, vp: dict, positions, amask, smb: int, mask_kind: int, m_buf, l_buf, acc_buf,
          scale: float, T: int, ng_k: int, nsplit: int, nwin: int, H: int, rep: int, sink: int, recent: int,
          tpg_v: int, kbits: int, vbits: int, kind: str, use_tma: bool | None, phase: int, temp, rope,
          nout: tuple = (0, 0), pdl: bool = False, logits=None, exact=None, ranges=None, trace=None):
    """(kernel, arguments, keywords) of the quantized-region launch (see `launch`)."""
    import torch

    bf16 = query.dtype == torch.bfloat16
    if kind == "sym8":  # int8: plain loads
        return _sym8_decode_kernel, (
            query, query.stride(0), query.stride(1), kp["codes"], kp["half"], vp["codes"], vp["half"], positions,
            amask, smb, m_buf, l_buf, acc_buf, float(scale), T, nsplit), dict(
            H=H, REP=rep, S=sink, R=recent, MASK_KIND=mask_kind, IS_BF16=bf16, BT=SYM8_BT, NWIN=nwin, PDL=pdl,
            num_warps=1)
    if kind == "lut":  # kvquant; rope = (cos, sin) tables [B, T, 128] or None
        cos, sin = rope if rope is not None else (query, query)
        if mask_kind == 0 and LUT_NO_MASK_AS_BOOL and tuple(nout) == (0, 0):
            mask_kind = 3
        side = [p[n] for p in (kp, vp) for n in _LUT_BUFFERS]
        tma_on = _use_tma(query, sink, T, use_tma, kind)
        if tma_on:   # the codes through the TMA ring
            side[0], side[len(_LUT_BUFFERS)] = row_descriptors(kp, vp, 16, LUT_BT)
        return _lut_decode_kernel, (
            query, query.stride(0), query.stride(1), *side, cos, sin,
            positions, amask, smb, m_buf, l_buf, acc_buf, float(scale), T, nsplit), dict(
            H=H, REP=rep, S=sink, R=recent, MASK_KIND=mask_kind, IS_BF16=bf16, BT=LUT_BT, ROPE=rope is not None,
            KNOUT=nout[0], VNOUT=nout[1], NWIN=nwin, PDL=pdl, TMA=tma_on, NST=NSTAGES,
            num_warps=1, maxnreg=LUT_MAXNREG)
    if kind == "post":  # calibquant: 4 words per token and side, no per-tile statistics
        if phase and logits is None:
            raise ValueError("calibquant's Gluon launch needs the logits buffer in calibrated-softmax phases 1 and 2")
        win = exact is not None
        tma_on = _use_tma(query, sink, T, use_tma, kind)
        kc, vc = row_descriptors(kp, vp, 4, BT) if tma_on else (kp["codes"], vp["codes"])
        return _post_decode_kernel, (
            query, query.stride(0), query.stride(1), kc, kp["cen"], kp["half"], vc, vp["cen"],
            vp["half"], positions, amask, smb, query if temp is None else temp, query if logits is None else logits,
            m_buf, l_buf, acc_buf, float(scale), T, nsplit, *_exact_args(query, exact),
            *(ranges if ranges is not None else (query, query, 2, 0.0))), dict(
            H=H, REP=rep, S=sink, R=recent, MASK_KIND=mask_kind, IS_BF16=bf16, BT=BT, TAU_PHASE=phase, NWIN=nwin,
            PDL=pdl, WIN=win, WCOST=POST_WCOST.get(phase, 0) if win else 0,
            WR_K=exact["k"]["ring"].shape[2] if win else 0,
            WR_V=exact["v"]["ring"].shape[2] if win else 0, TMA=tma_on, NST=NSTAGES, WL=WIDEN_IN_LANES, num_warps=1,
            **({"maxnreg": POST_MAXNREG[phase]} if win and POST_MAXNREG.get(phase) else {}))
    if kind not in ("kivi", "inner") or phase:
        raise ValueError(f"no Gluon launch for layout {kind!r} with calibrated-softmax phase {phase}")
    if mask_kind == 1 and MASK_SLICE and (MASK_SLICE < 32 or MASK_SLICE & (MASK_SLICE - 1)):
        raise ValueError(f"MASK_SLICE must be 0 or a power of two >= 32 (bytes a step, a whole number a lane), not "
                         f"{MASK_SLICE}")
    stores = [kp["codes"], kp["cen"], kp["half"], vp["codes"], vp["cen"], vp["half"]]
    extra = [query, kp["half"], kp["cen"]]   # KNORM: InnerQ's only; KHROWS, KCROWS
    if kind == "inner":  # ng_k: the Values' group rows; hybrid: the spacing of symmetric levels
        khyb, vhyb, norm = inner_flags(kp, vp)
        tma_on = _use_tma(query, sink, T, use_tma, kind)
        if tma_on:   # the codes through the TMA ring, the statistics by plain loads
            stores[0], stores[3] = row_descriptors(kp, vp, 4 * kbits, KIVI_BT, 4 * vbits)
        ka_hi, ka_lo = split_scale(2.0 / (2 ** kbits - (2 if khyb else 1)), bf16)
        va_hi, va_lo = split_scale(2.0 / (2 ** vbits - (2 if vhyb else 1)), bf16)
        extra = [kp["norm"] if norm else query, query, query]
        return _kivi_decode_kernel, (
            query, query.stride(0), query.stride(1), *stores, positions, amask, smb, m_buf, l_buf, acc_buf,
            float(scale), T, ng_k, nsplit, *extra), dict(
            H=H, REP=rep, S=sink, R=recent, TPG_K=1, TPG_V=32, MASK_KIND=mask_kind, IS_BF16=bf16, BT=KIVI_BT,
            KBITS=kbits, VBITS=vbits, KA_HI=ka_hi, KA_LO=ka_lo, VA_HI=va_hi, VA_LO=va_lo, NWIN=nwin, TMA=tma_on,
            NST=NSTAGES, PDL=pdl, INNER=True, KHYB=khyb, VHYB=vhyb, NORM=norm, WL=WIDEN_IN_LANES,
            KZA=INNER_KEY_ZERO_APART and bf16,
            WT=WHOLE_TILES and whole_tiles(recent, 1, 32, KIVI_BT), MOK=MASK_SLICE if mask_kind == 1 else 0,
            **_trace_kw(trace), num_warps=1)
    ka_hi, ka_lo = split_scale(2.0 / (2 ** kbits - 1), bf16)
    va_hi, va_lo = split_scale(2.0 / (2 ** vbits - 1), bf16)
    use_tma = _use_tma(query, sink, T, use_tma)
    tps = RING_TILES.get(max(kbits, vbits), 1) if use_tma and KIVI_BT == 32 else 1
    wt = WHOLE_TILES and whole_tiles(recent, 32, tpg_v, KIVI_BT)
    qz = KEY_POST and QZ_ROWS and use_tma
    pair = pair_flags(tps, KEY_POST, wt, recent, qz)
    fold = fold_flags(use_tma, bf16, vbits, pair["PAIR"])
    if use_tma:
        stores = descriptors(kp, vp, kbits, vbits, tps, vf_swizzle(fold["VF"], vbits))
    return _kivi_decode_kernel, (
        query, query.stride(0), query.stride(1), *stores, positions, amask, smb, m_buf, l_buf, acc_buf,
        float(scale), T, ng_k, nsplit, *extra), dict(
        H=H, REP=rep, S=sink, R=recent, TPG_K=32, TPG_V=tpg_v, MASK_KIND=mask_kind,
        IS_BF16=bf16, BT=KIVI_BT, KBITS=kbits, VBITS=vbits, KA_HI=ka_hi, KA_LO=ka_lo, VA_HI=va_hi, VA_LO=va_lo,
        NWIN=nwin, TMA=use_tma, NST=NSTAGES, PDL=pdl, KPOST=KEY_POST, QZROWS=qz, QZ_N=QZ_N,
        VZ=VALUE_ZERO_APART and bf16, WL=WIDEN_IN_LANES, WT=wt, TPS=tps,
        KSUB=BF16_SUBNORMAL_KEYS and KEY_POST and bf16, KSW=SUB_WINDOW, **pair, **fold, MOK=MASK_SLICE if mask_kind == 1 else 0,
        **_trace_kw(trace), num_warps=1)


def _trace_kw(trace) -> dict:
    """The KIVI-layout kernel's debug keywords (TRACE): its record buffer where `trace` is one, else none at all, so
    that the kernel builds as without them."""
    return {} if trace is None else dict(TRB=trace, TRACE=True)


def pair_flags(tps: int, key_post: bool, wt: bool, recent: int, qz_rows: bool) -> dict:
    """The KIVI kernel's PAIR constexpr as `_plan` passes it, from its TPS, KPOST, WT, R and QZROWS (offline builds
    take it from here too): one online-softmax step per two-tile ring slot, where a masked second tile lies below
    the current position (a recent window of a tile or more) and refills fall on a slot's first tile."""
    ok = tps == 2 and key_post and wt and recent >= KIVI_BT and (QZ_N % 2 == 0 or not qz_rows)
    return dict(PAIR=bool(PAIR_SOFTMAX and ok))


def fold_flags(tma: bool, bf16: bool, vbits: int, pair: bool) -> dict:
    """The KIVI kernel's VF constexpr as `_plan` passes it (offline builds take it from here too): bf16 Values of
    `VALUE_FOLD_BITS` through the ring, each group's scale folded into p (`VALUE_FOLD`), with their offsets by their
    own mma (VZ); at 4 bits with one softmax step per tile (two-tile slots and PAIR are 2- and 1-bit ones)."""
    return dict(VF=bool(VALUE_FOLD and VALUE_ZERO_APART and tma and bf16 and vbits in VALUE_FOLD_BITS
                        and (vbits < 4 or not pair)))


def vf_swizzle(vf: bool, vbits: int) -> int:
    """The Value codes' shared-memory swizzle of a ring build (`descriptors` vswizzle): `VF_SWIZZLE` where VF."""
    return VF_SWIZZLE[vbits] if vf else 0


def window_inside(kind: str | None, kc: dict, vc: dict, tau) -> bool:
    """Whether the layout's Gluon launches attend the exact windows themselves (`_post_decode_kernel` WIN, into the
    window launch's slots; no window launch then follows them): calibquant's layout with its calibrated softmax (tau:
    the config's `softmax_tau`), whose sides are both quantized a token at a time and keep an exact ring of the
    recent tokens (`_window`); its attention pass then computes the temperatures too (`_temperatures`). Without the
    calibrated softmax (phase 0) the window code would raise the kernel's registers from 128 to about 145 (12
    programs per SM instead of 16; offline sm_90 compile), so the window launch stays. `WINDOW_INSIDE` False turns it
    off."""
    return WINDOW_INSIDE and kind == "post" and tau is not None and kc["TPG"] == vc["TPG"] == 1 and kc["WR"] > 0 \
        and vc["WR"] > 0


def _exact_args(query, exact) -> tuple:
    """The window arguments of `_post_decode_kernel` (K/VSINK, K/VRING, K/VCHUNK and the chunks' batch and head
    strides) from `exact` = {"k": {"sink", "ring", "chunk"}, "v": ...} (the store's buffers [B, H, n, 128] and
    the attention's key / value input [B, H, 1, 128]); stand-ins when None."""
    if exact is None:
        return (query, query, query, 0, 0) * 2
    return tuple(x for side in ("k", "v") for x in (
        exact[side]["sink"], exact[side]["ring"], exact[side]["chunk"], exact[side]["chunk"].stride(0),
        exact[side]["chunk"].stride(1)))


def inner_flags(kp: dict, vp: dict) -> tuple[bool, bool, bool]:
    """(Keys hybrid, Values hybrid, Key normalization) of an InnerQ-layout store (`decode_attention._side_args`:
    its "hybrid" flags, and the side's `half` where the norm buffer is absent)."""
    return kp["hybrid"], vp["hybrid"], kp["norm"] is not kp["half"]


def launch(query, kp: dict, vp: dict, positions, amask, smb: int, mask_kind: int, m_buf, l_buf, acc_buf,
           scale: float, T: int, ng_k: int, nsplit: int, nwin: int, H: int, rep: int, sink: int, recent: int,
           tpg_v: int, kbits: int, vbits: int, *, kind: str, use_tma: bool | None = None, phase: int = 0,
           temp=None, rope=None, nout: tuple = (0, 0), pdl: bool = False, logits=None, exact=None, ranges=None,
           trace=None):
    """Run the quantized-region launch into slots [0, nsplit) of the partial buffers (grid (B * H, nsplit); each
    row has nsplit + nwin slots, the last nwin the window launch's). kind: `layout_kind` of the store. ng_k: the
    statistics rows per KV head of the token-grouped side (KIVI's Keys, InnerQ's Values). use_tma (KIVI's, InnerQ's,
    kvquant's and calibquant's layouts): stream the tiles (InnerQ, kvquant, calibquant: their codes) through shared
    memory with the tensor-memory accelerator (None: `USE_TMA`, whose None means on sm_90+ inside CUDA-graph capture;
    KIVI's never for an odd sink or cache length; calibquant's only with `POST_TMA`, InnerQ's with `INNER_TMA`). phase, temp: the
    calibrated softmax's phase (calibquant only), in phase 2 its per-row temperatures, and in both phases the logits
    that phase 1 writes and phase 2 reads (fp32 [B * H, T, rep]). rope (kvquant's layout only): the (cos, sin)
    tables [B, T, 128] of Keys stored before RoPE, else None; nout (the same): outliers per token of the Keys and the
    Values. pdl: let the window launch that follows start at once (`griddepcontrol`, sm_90+ only:
    `decode_attention._use_pdl`). exact (calibquant's layout, `window_inside`): the exact windows' buffers, which
    this launch then attends too, into the last nwin slots (`_exact_args`), else None; with it, phase 2 takes
    ranges = (the range pass's max and min buffers, their slots per row, tau1 + tau2) instead of temp and computes
    the temperatures itself (with pdl it is then launched as the range pass's programmatic dependent). trace (debug,
    KIVI's and InnerQ's layouts only): an int64 buffer of 8 per program for the kernel's TRACE records, else None."""
    if kind == "post" and phase == 2 and exact is not None and ranges is None:
        raise ValueError("calibquant's attention pass with the windows inside needs the range pass's results (ranges)")
    if trace is not None and kind not in ("kivi", "inner"):
        raise ValueError(f"TRACE records come from the KIVI-layout kernel only, not layout {kind!r}")
    fn, args, kw = _plan(query, kp, vp, positions, amask, smb, mask_kind, m_buf, l_buf, acc_buf, scale, T, ng_k,
                         nsplit, nwin, H, rep, sink, recent, tpg_v, kbits, vbits, kind, use_tma, phase, temp, rope,
                         nout, pdl, logits, exact, ranges, trace)
    if kind == "post" and phase == 2 and exact is not None and pdl:
        kw = dict(kw, launch_pdl=True)
    return fn[(query.shape[0] * H, nsplit)](*args, **kw)


_RESIDENT: dict = {}
_MAX_BLOCKS = {(8, 0): 32, (8, 6): 16, (8, 7): 16, (8, 9): 24, (9, 0): 32, (10, 0): 32, (12, 0): 24}


def programs_per_sm(n_regs: int, shared: int, cc: tuple, regs_sm: int = 65536, smem_sm: int = 233472) -> int:
    """One-warp programs an SM of compute capability cc holds at once: registers (allocated per warp in units of 256,
    from each of the SM's four schedulers' register files), shared memory (128-byte units plus 1 KiB reserved per
    block) and CUDA's blocks-per-SM limit (16 where the capability is not in the table)."""
    per_warp = max(-(-n_regs * 32 // 256) * 256, 256)
    limit = _MAX_BLOCKS.get(tuple(cc), 16)
    by_regs = regs_sm // 4 // per_warp * 4
    by_smem = smem_sm // (-(-shared // 128) * 128 + 1024) if shared else limit
    return max(1, min(limit, by_regs, by_smem))


def resident_programs(query, kp: dict, vp: dict, positions, amask, smb: int, mask_kind: int, T: int, ng_k: int,
                      nwin: int, H: int, rep: int, sink: int, recent: int, tpg_v: int, kbits: int, vbits: int, *,
                      kind: str, use_tma: bool | None = None, phase: int = 0, rope=None,
                      nout: tuple = (0, 0), pdl: bool = False, exact=None) -> int:
    """How many programs of this launch (in calibrated-softmax `phase`) one SM holds at once: its compiled kernel's
    registers and shared memory against the SM's, and CUDA's blocks-per-SM limit (one-warp programs). Compiles the
    kernel if needed (Triton's warmup, no launch); cached per configuration (the constexprs) and device. Triton also
    specializes on argument values (a 1, multiples of 16) that the key leaves out: those variants of one
    configuration can differ by a few registers, which moves the count only across an allocation boundary."""
    import torch

    dev = query.device
    tma = _use_tma(query, sink, T, use_tma, kind)
    key = (kind, inner_flags(kp, vp) if kind == "inner" else None, dev.index, query.dtype, amask.dtype, mask_kind, kbits, vbits, H, rep, sink, recent, tpg_v, nwin,
           tma, NSTAGES, phase, rope is not None, tuple(nout), LUT_BT, LUT_MAXNREG, LUT_NO_MASK_AS_BOOL, SYM8_BT, KIVI_BT, pdl,
           KEY_POST, QZ_ROWS, QZ_N, VALUE_ZERO_APART, WIDEN_IN_LANES, WHOLE_TILES, tuple(sorted(RING_TILES.items())), PAIR_SOFTMAX, BF16_SUBNORMAL_KEYS, SUB_WINDOW, VALUE_FOLD, VALUE_FOLD_BITS, tuple(sorted(VF_SWIZZLE.items())), None if exact is None else tuple(exact[s]["ring"].shape[2] for s in ("k", "v")),
           tuple(sorted(POST_MAXNREG.items())), tuple(sorted(POST_WCOST.items())), MASK_SLICE)
    if key not in _RESIDENT:
        one = torch.empty(1, dtype=torch.float32, device=dev)   # stand-ins: partial buffers, temperatures, logits
        props = torch.cuda.get_device_properties(dev)
        try:
            # the launched variant's argument types: calibquant's attention pass with the windows inside takes the
            # range pass's buffers (fp32) and no temperatures (the query stands in), the others temperatures
            ranges = (one, one, 2, 0.0) if exact is not None and phase == 2 else None
            fn, args, kw = _plan(query, kp, vp, positions, amask, smb, mask_kind, one, one, one, 1.0, T, ng_k, 2,
                                 nwin, H, rep, sink, recent, tpg_v, kbits, vbits, kind, tma, phase,
                                 one if phase == 2 and ranges is None else None, rope, nout, pdl,
                                 one if phase else None, exact, ranges)
            k = fn.warmup(*args, grid=(1,), **kw)
            k._init_handles()   # Triton's loader: reads the kernel's register count (n_regs)
            n = programs_per_sm(k.n_regs, k.metadata.shared, (props.major, props.minor),
                                getattr(props, "regs_per_multiprocessor", 65536),
                                getattr(props, "shared_memory_per_multiprocessor", 233472))
        except Exception as e:  # noqa: BLE001  a Triton without these internals: session 10's 8 per SM
            import logging

            logging.getLogger("kvq_compile").warning("kvq: could not size the Gluon launch from its compiled "
                                                     "kernel (%s: %s); assuming 8 programs per SM",
                                                     type(e).__name__, e)
            n = 8
        _RESIDENT[key] = n
    return _RESIDENT[key]
