"""Probe: which way of turning packed codes into tensor-core operands keeps decode attention memory bound.

    python bench/probe_unpack.py            (CUDA: times every mode)
    python bench/probe_unpack.py --sass [--bits 2]   (no GPU needed: SASS instructions per element of each mode)
    python bench/probe_unpack.py --modes raw,joinmag,asmword --bits 2 --bt 128     (CUDA: a subset)

One side of decode attention, stripped down: programs (b*H + h, split) stream their slice of a [T, W] int32
word array (W = D * BITS / 32 words per token), unpack each [BT, W] tile into a [BT, D] operand and either
multiply it with a [16, D] query (keys, `s = q @ codes^T`) or with [16, BT] probabilities (values,
`acc += p @ codes`). Modes:
  raw      load the words and reduce them (no unpack, no dot): the memory ceiling of this program shape
  gather   every code loads its word (per-element gather) and converts with int -> float
  join     whole-word loads split by a tl.join tree, int -> float conversion (the shipped kernel)
  joinmag  join tree, then the float built from bits: (code | 0x6400) as fp16 = 1024 + code
  bcast    words broadcast to [BT, CPW, W] and shifted (channel order j*W + w: the query is permuted
           instead), int -> float conversion
  bcastmag broadcast + the bit-built float
  bc3mag   words broadcast to [BT, W, CPW] (natural channel order), bit-built float
  masks    whole words; each code masked in place (no shift per code) into the mantissa of 1024.0 and scaled
           back exactly in fp16, one tl.join tree (natural channel order)
  bshift   words broadcast over their codes ([BT, W, CPW] -> [BT, D]), per-element shift, bit-built float
  asmelem  as bshift, the shift/mask/float done by elementwise inline PTX two codes at a time (exact in any layout)
  asmword  2-bit only, TIMING ONLY (values wrong): one inline-PTX block turns a broadcast word into 16 fp16 codes
           (pack=16). Triton then converts the *words* into the dot-operand layout and unpacks in the operand
           registers (1.9 SASS instructions per element instead of ~5), but it groups the 16 elements of a
           block by its own register layout (codes of 4 different words), so the block would have to know that
           layout to be correct: the case for a kernel with explicit layouts (Gluon) or a CUDA kernel.
The bit-built float never touches the conversion unit (I2F runs at 1/8 of the FP32 rate on Hopper).
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

try:
    from kvq_compile import compat
    compat.fix_triton_interpreter()
except ImportError:
    pass


@triton.jit
def _j8(p0, p1, p2, p3, p4, p5, p6, p7):
    """[.., 8] with element i = piece i (a nested tl.join puts its newest dimension last, so the pieces go in
    bit-reversed order)."""
    return tl.join(tl.join(tl.join(p0, p4), tl.join(p2, p6)), tl.join(tl.join(p1, p5), tl.join(p3, p7)))


@triton.jit
def _join_tree(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15, N: tl.constexpr):
    """Join the first N pieces [..] into [.., N] (natural order: element i is piece i)."""
    if N == 2:
        return tl.join(p0, p1)
    elif N == 4:
        return tl.join(tl.join(p0, p2), tl.join(p1, p3))
    elif N == 8:
        return _j8(p0, p1, p2, p3, p4, p5, p6, p7)
    else:
        return tl.join(_j8(p0, p2, p4, p6, p8, p10, p12, p14), _j8(p1, p3, p5, p7, p9, p11, p13, p15))


@triton.jit
def _piece(x, j: tl.constexpr, BITS: tl.constexpr):
    """fp16 [..] of code j (0 <= j < 32 // BITS) of each word: the code's bits masked in place and OR-ed
    into the mantissa of 1024.0 (0x6400), then scaled back exactly; no shift per code, no int->float."""
    HALF: tl.constexpr = 16 // BITS
    jj: tl.constexpr = j % HALF
    S: tl.constexpr = (jj * BITS) // 8 * 8          # byte shift
    K: tl.constexpr = jj * BITS - S                  # bit offset inside the byte
    M: tl.constexpr = ((1 << BITS) - 1) << K
    y = x >> S if S > 0 else x
    pr = (y & (M | (M << 16))) | 0x64006400
    if j < HALF:
        v = pr.to(tl.int16).to(tl.float16, bitcast=True)
    else:
        v = (pr >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    SC: tl.constexpr = 1.0 / (1 << K)
    return v * SC - 1024.0 * SC


@triton.jit
def _asm_word2(xb):
    """fp16 [.., 16] from 2-bit words broadcast to [.., 16] (pack=16: one PTX block per word): register m holds
    codes (m, m + 8) of the word, built in place (mask into the mantissa of 1024.0, one byte shift for m >= 4)
    and made exact by one f16x2 FMA; element order (m, half) is a fixed permutation of the word's codes."""
    return tl.inline_asm_elementwise(
        asm="""{ .reg .b32 w, h, s, o, t;
        mov.b32 w, $8;
        shr.u32 h, w, 8;
        lop3.b32 t, w, 0x00030003, 0x64006400, 0xea; mov.b32 s, 0x3C003C00; mov.b32 o, 0xE400E400; fma.rn.f16x2 $0, t, s, o;
        lop3.b32 t, w, 0x000C000C, 0x64006400, 0xea; mov.b32 s, 0x34003400; mov.b32 o, 0xDC00DC00; fma.rn.f16x2 $1, t, s, o;
        lop3.b32 t, w, 0x00300030, 0x64006400, 0xea; mov.b32 s, 0x2C002C00; mov.b32 o, 0xD400D400; fma.rn.f16x2 $2, t, s, o;
        lop3.b32 t, w, 0x00C000C0, 0x64006400, 0xea; mov.b32 s, 0x24002400; mov.b32 o, 0xCC00CC00; fma.rn.f16x2 $3, t, s, o;
        lop3.b32 t, h, 0x00030003, 0x64006400, 0xea; mov.b32 s, 0x3C003C00; mov.b32 o, 0xE400E400; fma.rn.f16x2 $4, t, s, o;
        lop3.b32 t, h, 0x000C000C, 0x64006400, 0xea; mov.b32 s, 0x34003400; mov.b32 o, 0xDC00DC00; fma.rn.f16x2 $5, t, s, o;
        lop3.b32 t, h, 0x00300030, 0x64006400, 0xea; mov.b32 s, 0x2C002C00; mov.b32 o, 0xD400D400; fma.rn.f16x2 $6, t, s, o;
        lop3.b32 t, h, 0x00C000C0, 0x64006400, 0xea; mov.b32 s, 0x24002400; mov.b32 o, 0xCC00CC00; fma.rn.f16x2 $7, t, s, o;
        }""",
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r", args=[xb], dtype=tl.float16, is_pure=True,
        pack=16)


@triton.jit
def _asm_codes(xb, sh, BITS: tl.constexpr):
    """fp16 code of every element: (word >> shift) & mask, built into the mantissa of 1024.0 two at a time
    (shr, shr, prmt, lop3, sub.f16x2 per pair). Elementwise in (word, shift), so correct in any layout."""
    M2: tl.constexpr = ((1 << BITS) - 1) * 0x10001
    return tl.inline_asm_elementwise(
        asm=f"""{{ .reg .b32 a, b, t, m;
        shr.u32 a, $1, $3;
        shr.u32 b, $2, $4;
        prmt.b32 t, a, b, 0x5410;
        lop3.b32 t, t, {M2}, 0x64006400, 0xea;
        mov.b32 m, 0x64006400;
        sub.f16x2 $0, t, m;
        }}""",
        constraints="=r,r,r,r,r", args=[xb, sh], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _codes(base, t, D: tl.constexpr, BITS: tl.constexpr, BT: tl.constexpr, MODE: tl.constexpr):
    CPW: tl.constexpr = 32 // BITS
    W: tl.constexpr = D // CPW
    M: tl.constexpr = (1 << BITS) - 1
    if MODE == 1:  # gather
        d = tl.arange(0, D)
        words = tl.load(base + t[:, None] * W + (d // CPW)[None, :])
        c = (words >> ((d % CPW) * BITS)[None, :]) & M
        return c.to(tl.float16)
    elif MODE == 2 or MODE == 3:  # join tree
        x = tl.load(base + t[:, None] * W + tl.arange(0, W)[None, :])
        if BITS <= 16:
            x = tl.join(x & 0xFFFF, (x >> 16) & 0xFFFF)
        if BITS <= 8:
            x = tl.join(x & 0xFF, (x >> 8) & 0xFF)
        if BITS <= 4:
            x = tl.join(x & 0xF, (x >> 4) & 0xF)
        if BITS <= 2:
            x = tl.join(x & 0x3, (x >> 2) & 0x3)
        if BITS <= 1:
            x = tl.join(x & 0x1, (x >> 1) & 0x1)
        c = tl.reshape(x, [BT, D])
        if MODE == 2:
            return c.to(tl.float16)
        return (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    elif MODE == 4 or MODE == 5:  # broadcast shift [BT, CPW, W]
        x = tl.load(base + t[:, None] * W + tl.arange(0, W)[None, :])
        sh = tl.arange(0, CPW) * BITS
        c = (x[:, None, :] >> sh[None, :, None]) & M
        c = tl.reshape(c, [BT, D])
        if MODE == 4:
            return c.to(tl.float16)
        return (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    elif MODE == 10:  # whole words, per-code masks into fp16 mantissas, one join tree (natural order)
        x = tl.load(base + t[:, None] * W + tl.arange(0, W)[None, :])
        p0 = _piece(x, 0, BITS)
        p1 = _piece(x, 1 % CPW, BITS)
        p2 = _piece(x, 2 % CPW, BITS)
        p3 = _piece(x, 3 % CPW, BITS)
        p4 = _piece(x, 4 % CPW, BITS)
        p5 = _piece(x, 5 % CPW, BITS)
        p6 = _piece(x, 6 % CPW, BITS)
        p7 = _piece(x, 7 % CPW, BITS)
        p8 = _piece(x, 8 % CPW, BITS)
        p9 = _piece(x, 9 % CPW, BITS)
        p10 = _piece(x, 10 % CPW, BITS)
        p11 = _piece(x, 11 % CPW, BITS)
        p12 = _piece(x, 12 % CPW, BITS)
        p13 = _piece(x, 13 % CPW, BITS)
        p14 = _piece(x, 14 % CPW, BITS)
        p15 = _piece(x, 15 % CPW, BITS)
        if CPW <= 16:
            c = _join_tree(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15, CPW)
        else:  # 1 bit: 32 codes per word
            q0 = _piece(x, 16, BITS)
            q1 = _piece(x, 17, BITS)
            q2 = _piece(x, 18, BITS)
            q3 = _piece(x, 19, BITS)
            q4 = _piece(x, 20, BITS)
            q5 = _piece(x, 21, BITS)
            q6 = _piece(x, 22, BITS)
            q7 = _piece(x, 23, BITS)
            q8 = _piece(x, 24, BITS)
            q9 = _piece(x, 25, BITS)
            q10 = _piece(x, 26, BITS)
            q11 = _piece(x, 27, BITS)
            q12 = _piece(x, 28, BITS)
            q13 = _piece(x, 29, BITS)
            q14 = _piece(x, 30, BITS)
            q15 = _piece(x, 31, BITS)
            a = _join_tree(p0, p2, p4, p6, p8, p10, p12, p14, q0, q2, q4, q6, q8, q10, q12, q14, 16)
            b = _join_tree(p1, p3, p5, p7, p9, p11, p13, p15, q1, q3, q5, q7, q9, q11, q13, q15, 16)
            c = tl.join(a, b)
        return tl.reshape(c, [BT, D])
    elif MODE == 14:  # words broadcast over their codes, then per-element shift (pure Triton)
        x = tl.load(base + t[:, None] * W + tl.arange(0, W)[None, :])
        xb = tl.reshape(tl.broadcast_to(x[:, :, None], [BT, W, CPW]), [BT, D])
        sh = (tl.arange(0, D) % CPW) * BITS
        c = (xb >> sh[None, :]) & M
        return (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    elif MODE == 16:  # words broadcast over their codes, elementwise inline PTX with per-element shifts
        x = tl.load(base + t[:, None] * W + tl.arange(0, W)[None, :])
        xb = tl.reshape(tl.broadcast_to(x[:, :, None], [BT, W, CPW]), [BT, D])
        sh = tl.broadcast_to(((tl.arange(0, D) % CPW) * BITS)[None, :], [BT, D])
        return _asm_codes(xb, sh, BITS)
    elif MODE == 13:  # inline PTX, one block per 2-bit word (pack=16)
        x = tl.load(base + t[:, None] * W + tl.arange(0, W)[None, :])
        xb = tl.reshape(tl.broadcast_to(x[:, :, None], [BT, W, 16]), [BT, D])
        return _asm_word2(xb)
    else:  # MODE 6: broadcast shift [BT, W, CPW]
        x = tl.load(base + t[:, None] * W + tl.arange(0, W)[None, :])
        sh = tl.arange(0, CPW) * BITS
        c = (x[:, :, None] >> sh[None, None, :]) & M
        c = tl.reshape(c, [BT, D])
        return (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _probe(WORDS, Q, P, OUT, T, NSPLIT, D: tl.constexpr, BITS: tl.constexpr, BT: tl.constexpr,
           MODE: tl.constexpr, SIDE: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    CPW: tl.constexpr = 32 // BITS
    W: tl.constexpr = D // CPW
    per = T // NSPLIT
    start = split * per
    r = tl.arange(0, 16)
    base = WORDS + bh.to(tl.int64) * T * W
    if SIDE == 0:
        q = tl.load(Q + r[:, None] * D + tl.arange(0, D)[None, :])
        acc = tl.zeros([16, BT], tl.float32)
    else:
        p = tl.load(P + r[:, None] * BT + tl.arange(0, BT)[None, :])
        acc = tl.zeros([16, D], tl.float32)
    racc = tl.zeros([BT, W], tl.int32)
    for it in range(0, per // BT):
        t = start + it * BT + tl.arange(0, BT)
        if MODE == 0:
            racc += tl.load(base + t[:, None] * W + tl.arange(0, W)[None, :])
        else:
            c = _codes(base, t, D, BITS, BT, MODE)
            if SIDE == 0:
                acc += tl.dot(q, tl.trans(c))
            else:
                acc += tl.dot(p, c)
    if MODE == 0:
        tl.store(OUT + bh * NSPLIT + split, tl.sum(tl.sum(racc, 1), 0).to(tl.float32))
    else:
        tl.store(OUT + bh * NSPLIT + split, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _codes_out(WORDS, OUT, D: tl.constexpr, BITS: tl.constexpr, BT: tl.constexpr, MODE: tl.constexpr):
    t = tl.arange(0, BT)
    c = _codes(WORDS, t, D, BITS, BT, MODE)
    tl.store(OUT + t[:, None] * D + tl.arange(0, D)[None, :], c.to(tl.float32))


def check_exact(device, modes, bits_list=(1, 2, 4, 8), D=128, BT=64):
    """{(mode, bits): every code equal to the reference unpack} (asmword is expected to fail: timing only)."""
    from kvq_compile.reference import unpack_bits

    out = {}
    for mode in modes:
        for bits in bits_list:
            if mode == 13 and bits != 2:
                continue
            words = torch.randint(-2 ** 31, 2 ** 31 - 1, (BT, D * bits // 32), dtype=torch.int32, device=device)
            got = torch.zeros(BT, D, device=device)
            _codes_out[(1,)](words, got, D=D, BITS=bits, BT=BT, MODE=mode)
            out[(mode, bits)] = bool((got == unpack_bits(words, bits, D).float()).all())
    return out


def sass_report():
    """Without a GPU: compile each mode for sm_90 and count the SASS instructions of its main loop per element
    (bench/sass_stats.py)."""
    from sass_stats import compile_sm90, loop_ops

    sig = dict(WORDS="*i32", Q="*fp16", P="*fp16", OUT="*fp32", T="i32", NSPLIT="i32", D="constexpr",
               BITS="constexpr", BT="constexpr", MODE="constexpr", SIDE="constexpr")
    bit_list = sys.argv[sys.argv.index("--bits") + 1].split(",") if "--bits" in sys.argv else "1,2,4,8".split(",")
    for bits in map(int, bit_list):
        for mode in (2, 3, 10, 14, 16, 13):
            if mode == 13 and bits != 2:
                continue
            for side in (0, 1):
                k = compile_sm90(_probe, sig, dict(D=128, BITS=bits, BT=128, MODE=mode, SIDE=side),
                                 aligned=(0, 1, 2, 3, 4))
                n, ops = loop_ops(k)
                print(f"bits={bits} mode={mode} side={'KV'[side]}: {n} instructions per 128x128 tile and thread = "
                      f"{n / 128:.2f} per element; " + ", ".join(f"{o} {c}" for o, c in ops.most_common(8)))


def main():
    import triton.testing as tt

    if "--sass" in sys.argv:
        return sass_report()

    x = torch.empty(2 ** 29, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = tt.do_bench(lambda: y.copy_(x), warmup=20, rep=100, return_mode="median")
    bw = 2 * x.numel() * 2 / (ms * 1e-3)
    del x, y
    print(f"{torch.cuda.get_device_name()} copy {bw / 1e12:.2f} TB/s", flush=True)
    D = 128
    q = torch.randn(16, D, device="cuda", dtype=torch.float16)
    names = {0: "raw", 1: "gather", 2: "join", 3: "joinmag", 4: "bcast", 5: "bcastmag", 6: "bc3mag", 10: "masks",
             14: "bshift", 16: "asmelem", 13: "asmword"}
    arg = lambda flag, default: sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else default  # noqa: E731
    only = [m for m, n in names.items() if n in arg("--modes", ",".join(names.values())).split(",")]
    bit_list = [int(b) for b in arg("--bits", "1,2,4,8").split(",")]
    bt_list = [int(b) for b in arg("--bt", "64,128").split(",")]
    exact = check_exact("cuda", [m for m in only if m != 0])
    print("exact codes:", {f"{names[m]}/{b}": ok for (m, b), ok in exact.items()}, flush=True)
    for BH, T in ((256, 16384),):
        for bits in bit_list:
            W = D * bits // 32
            words = torch.randint(-2 ** 31, 2 ** 31 - 1, (BH, T, W), device="cuda", dtype=torch.int32)
            nbytes = words.numel() * 4
            for side in (0, 1):
                for bt in bt_list:
                    p = torch.rand(16, bt, device="cuda", dtype=torch.float16)
                    line = []
                    for ns in (max(1, 2112 // BH),):
                        out = torch.empty(BH * ns, device="cuda")
                        for mode in only:
                            if mode == 13 and bits != 2:
                                continue
                            for nw in (4, 8):
                                fn = lambda: _probe[(BH, ns)](words, q, p, out, T, ns, D=D, BITS=bits, BT=bt,  # noqa
                                                              MODE=mode, SIDE=side, num_warps=nw, num_stages=2)
                                try:
                                    t = tt.do_bench(fn, warmup=5, rep=30, return_mode="median")
                                    line.append((nbytes / (t * 1e-3) / bw, names[mode], ns, nw))
                                except Exception as e:  # noqa
                                    print(f"  fail {names[mode]} bits={bits} bt={bt}: {type(e).__name__} {str(e)[:80]}")
                    best = {}
                    for frac, name, ns, nw in line:
                        if name not in best or frac > best[name][0]:
                            best[name] = (frac, ns, nw)
                    print(f"BH={BH} T={T} bits={bits} side={'KV'[side]} bt={bt}: " +
                          "  ".join(f"{n} {v[0] * 100:.0f}%(s{v[1]},w{v[2]})" for n, v in best.items()), flush=True)
            del words
    sys.stdout.flush()


if __name__ == "__main__":
    main()
