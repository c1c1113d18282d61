"""Probe (session 8): 2-bit codes unpacked by *byte slices* instead of a join tree, for decode attention's dots.

    python bench/probe_slices.py          (CUDA: checks each mode's sum against torch, times it against the
                                           shipped join unpack of bench/probe_unpack.py)
    python bench/probe_slices.py --sass   (no GPU: SASS instructions per element of each mode's loop)

A token's D 2-bit codes are D/4 bytes; byte b holds channels 4b + j (j = 0..3) at bits 2j (the store's order:
little-endian codes in int32 words, read as bytes). Slice j of a [BT, D/4] byte tile is channels {4b + j}: one
dot per slice, with the query's channels permuted to match (K side, s = q @ codes^T, K-dim D/4) or one
accumulator per slice (V side, acc_j += p @ slice_j, N = D/4, columns permuted back at the end). No join, no
reshape: every op is elementwise on the byte tile, so Triton moves the layout conversion onto the bytes (one
byte per 4 codes through shared memory) and unpacks in the dot-operand registers. Modes:
  join    the shipped unpack (probe_unpack.py mode 2, int32 words, join tree, int -> float): the baseline
  slice   one inline-PTX block per 4 bytes and slice: shr, 2 prmt (bytes to 16-bit halves), 2 lop3 (mask into
          the mantissa of 1024.0), 2 sub.f16x2 (exact code)
  slice4  one block per 4 bytes for all 4 slices: 2 prmt + 8 lop3 + 8 fma per 16 codes (codes masked in place
          into 1024.0's mantissa, then scaled back exactly). An earlier version left the 1024 offset in the
          operands and subtracted it once per tile: right for K, wrong for V (the check failed on the H100, most
          likely the offset, ~1e6 after the 32 tiles of a split, accumulated in the dot's accumulator), so every
          mode now hands exact codes to the dot.
Statistics (scale/zero) are left out: this measures the unpack and dot-operand path alone, like probe_unpack.py.
Session 8 also put slices into the decode template (commit 4e0b2ee, reverted in dd88d56): the statistics made
them slower there (bench/RESULTS.md).
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))


@triton.jit
def _slice_codes(x, J: tl.constexpr):
    """fp16 code J of each byte of x (uint8, 4 bytes per PTX block: elementwise, right in any layout)."""
    return tl.inline_asm_elementwise(
        asm=f"""{{ .reg .b32 s, a, b, m;
        shr.u32 s, $2, {2 * J};
        prmt.b32 a, s, 0, 0x4140;
        prmt.b32 b, s, 0, 0x4342;
        lop3.b32 a, a, 0x00030003, 0x64006400, 0xea;
        lop3.b32 b, b, 0x00030003, 0x64006400, 0xea;
        mov.b32 m, 0x64006400;
        sub.f16x2 $0, a, m;
        sub.f16x2 $1, b, m;
        }}""",
        constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _slices_inplace(x):
    """(c0, c1, c2, c3) exact fp16 codes of each byte, for all 4 slices in one block: 2 prmt spread 4 bytes to
    16-bit halves, then per slice one lop3 masks field j in place into the mantissa of 1024.0 (1024 + c * 4^j,
    exact) and one f16x2 fma scales back exactly (c = m * 4^-j - 1024 * 4^-j): 18 instructions per 16 codes."""
    return tl.inline_asm_elementwise(
        asm="""{ .reg .b32 a, b, t, s, o;
        prmt.b32 a, $8, 0, 0x4140;
        prmt.b32 b, $8, 0, 0x4342;
        mov.b32 s, 0x3C003C00; mov.b32 o, 0xE400E400;
        lop3.b32 t, a, 0x00030003, 0x64006400, 0xea; fma.rn.f16x2 $0, t, s, o;
        lop3.b32 t, b, 0x00030003, 0x64006400, 0xea; fma.rn.f16x2 $1, t, s, o;
        mov.b32 s, 0x34003400; mov.b32 o, 0xDC00DC00;
        lop3.b32 t, a, 0x000C000C, 0x64006400, 0xea; fma.rn.f16x2 $2, t, s, o;
        lop3.b32 t, b, 0x000C000C, 0x64006400, 0xea; fma.rn.f16x2 $3, t, s, o;
        mov.b32 s, 0x2C002C00; mov.b32 o, 0xD400D400;
        lop3.b32 t, a, 0x00300030, 0x64006400, 0xea; fma.rn.f16x2 $4, t, s, o;
        lop3.b32 t, b, 0x00300030, 0x64006400, 0xea; fma.rn.f16x2 $5, t, s, o;
        mov.b32 s, 0x24002400; mov.b32 o, 0xCC00CC00;
        lop3.b32 t, a, 0x00C000C0, 0x64006400, 0xea; fma.rn.f16x2 $6, t, s, o;
        lop3.b32 t, b, 0x00C000C0, 0x64006400, 0xea; fma.rn.f16x2 $7, t, s, o;
        }""",
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[x], dtype=(tl.float16,) * 4, is_pure=True, pack=4)


@triton.jit
def _probe(CODES, Q, P, OUT, T, NSPLIT, D: tl.constexpr, BT: tl.constexpr, SIDE: tl.constexpr,
           MODE: tl.constexpr):
    """Program (bh, split) streams its T / NSPLIT tokens of head bh; stores the sum of its result (K: scores,
    V: accumulator) for the check."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    NB: tl.constexpr = D // 4
    per = T // NSPLIT
    start = split * per
    r = tl.arange(0, 16)
    kb = tl.arange(0, NB)
    base = CODES + bh.to(tl.int64) * T * NB
    if SIDE == 0:
        q0 = tl.load(Q + r[:, None] * D + kb[None, :] * 4 + 0)
        q1 = tl.load(Q + r[:, None] * D + kb[None, :] * 4 + 1)
        q2 = tl.load(Q + r[:, None] * D + kb[None, :] * 4 + 2)
        q3 = tl.load(Q + r[:, None] * D + kb[None, :] * 4 + 3)
        acc = tl.zeros([16, BT], tl.float32)
    else:
        p = tl.load(P + r[:, None] * BT + tl.arange(0, BT)[None, :])
        a0 = tl.zeros([16, NB], tl.float32)
        a1 = tl.zeros([16, NB], tl.float32)
        a2 = tl.zeros([16, NB], tl.float32)
        a3 = tl.zeros([16, NB], tl.float32)
    for it in range(0, per // BT):
        t = start + it * BT + tl.arange(0, BT)
        x = tl.load(base + t[:, None] * NB + kb[None, :])
        if MODE == 1:
            m0 = _slice_codes(x, 0)
            m1 = _slice_codes(x, 1)
            m2 = _slice_codes(x, 2)
            m3 = _slice_codes(x, 3)
        else:
            m0, m1, m2, m3 = _slices_inplace(x)
        if SIDE == 0:
            s = tl.dot(q0, tl.trans(m0))
            s = tl.dot(q1, tl.trans(m1), s)
            s = tl.dot(q2, tl.trans(m2), s)
            s = tl.dot(q3, tl.trans(m3), s)
            acc += s
        else:
            a0 = tl.dot(p, m0, a0)
            a1 = tl.dot(p, m1, a1)
            a2 = tl.dot(p, m2, a2)
            a3 = tl.dot(p, m3, a3)
    if SIDE == 0:
        tl.store(OUT + bh * NSPLIT + split, tl.sum(tl.sum(acc, 1), 0))
    else:
        tl.store(OUT + bh * NSPLIT + split, tl.sum(tl.sum(a0 + a1 + a2 + a3, 1), 0))


SIG = dict(CODES="*u8", Q="*fp16", P="*fp16", OUT="*fp32", T="i32", NSPLIT="i32", D="constexpr", BT="constexpr",
           SIDE="constexpr", MODE="constexpr")


def sass_report():
    from sass_stats import compile_sm90, loop_ops

    for mode in (1, 2):
        for side in (0, 1):
            for bt, nw in ((64, 4), (128, 4), (128, 8)):
                k = compile_sm90(_probe, SIG, dict(D=128, BT=bt, SIDE=side, MODE=mode), num_warps=nw,
                                 aligned=(0, 1, 2, 3, 4))
                n, ops = loop_ops(k)
                print(f"{['', 'slice', 'slice4'][mode]} side={'KV'[side]} bt={bt} warps={nw}: "
                      f"{n * 32 * nw / (bt * 128):.2f} SASS per element; "
                      + ", ".join(f"{o} {c}" for o, c in ops.most_common(8)), flush=True)


def main():
    import triton.testing as tt
    from probe_unpack import _probe as _join_probe

    if "--sass" in sys.argv:
        return sass_report()
    from bench_decode_attention import copy_bandwidth

    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} copy {bw / 1e12:.2f} TB/s", flush=True)
    D, BH, T = 128, 256, 16384
    codes = torch.randint(0, 256, (BH, T, D // 4), device="cuda", dtype=torch.uint8)
    words = codes.view(torch.int32)  # the same bytes as int32 words (little-endian: channel order kept)
    unpacked = torch.stack([(codes >> (2 * j)) & 3 for j in range(4)], -1).reshape(BH, T, D).half()
    q = torch.randn(16, D, device="cuda", dtype=torch.float16)
    nbytes = codes.numel()
    for side in (0, 1):
        for bt in (64, 128):
            p = torch.rand(16, bt, device="cuda", dtype=torch.float16)
            ns = 8
            if side == 0:
                want = (q.float() @ unpacked.float().reshape(BH, T, D).transpose(1, 2)).sum().item()
            else:
                want = torch.einsum("rt,hntc->", p.float(), unpacked.float().reshape(BH, T // bt, bt, D)).item()
            line = []
            for name, mode in (("join", 0), ("slice", 1), ("slice4", 2)):
                out = torch.empty(BH * ns, device="cuda")
                for nw in (4, 8):
                    if mode == 0:
                        fn = lambda: _join_probe[(BH, ns)](words, q, p, out, T, ns, D=D, BITS=2, BT=bt,  # noqa
                                                           MODE=2, SIDE=side, num_warps=nw, num_stages=2)
                    else:
                        fn = lambda: _probe[(BH, ns)](codes, q, p, out, T, ns, D=D, BT=bt, SIDE=side,  # noqa
                                                      MODE=mode, num_warps=nw, num_stages=2)
                    fn()
                    got = out.sum().item()
                    ok = abs(got - want) <= 2e-3 * abs(want)
                    t = tt.do_bench(fn, warmup=5, rep=30, return_mode="median")
                    line.append(f"{name}/w{nw} {nbytes / (t * 1e-3) / bw * 100:.0f}% {'ok' if ok else 'WRONG'}")
            print(f"side={'KV'[side]} bt={bt} 2-bit {BH} heads x {T} tokens (% of copy bw): " + "  ".join(line),
                  flush=True)


if __name__ == "__main__":
    main()
