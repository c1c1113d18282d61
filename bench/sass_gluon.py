"""The Gluon decode kernels compiled for Hopper (sm_90) without a GPU: registers, spill stack and the main loop's
SASS instructions (the longest backward branch), by opcode. kvquant's kernel at 16- and 32-token tiles, with its
168-register cap and without, and with one outlier per token (kvquant-4-1%); int8's kernel at 16- and 32-token
tiles, fp16 and bf16; the KIVI-layout kernel at 2 and 4 bits (fp16, bool mask, plain loads) with its Keys
post-scaled (the default) and dequantized, and its TMA build (bf16, the Values' offsets by their own mma where
`VALUE_ZERO_APART`) with q . z per tile or per QZ_N Key groups (`QZ_ROWS`), with the instructions it runs per
tile (`ring_tile`: the QZ refill left out, a slot's copies counted once per `RING_TILES` tiles); InnerQ's layout in
the same kernel;
calibquant's kernel (both phases).

    python bench/sass_gluon.py        (without TRITON_INTERPRET; ptxas and cuobjdump from the triton wheel)

Every constexpr with a kernel default (WL, WT, TPS) is passed as `_plan` passes it: an offline compile leaves one it is not
given falsy, not at the kernel's default (session 27: WL omitted compiled the register join that the launch no
longer uses). Except MOK: the KIVI kernel's bool-mask builds here hold one tile loop, where `_plan` builds it twice,
once without the mask (`MASK_SLICE`, session 48; `tests/test_decode_gluon.py::test_maskless_loop_copy_compiles_for_sm90`). calibquant's rows are its plain-load builds (outside CUDA graphs); its ring builds are in
`bench/debug/post_tma_sass.py`.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from sm90_sass import compile_sm90, main_loop, ring_tile  # noqa: E402

from kvq_compile.templates import decode_attention_gluon as dag  # noqa: E402


def main():
    ty = "*fp16"
    lut = dict(Q=ty, stride_qb="i32", stride_qh="i32", KC="*i32", KCEN=ty, KHALF=ty, KLEV="*fp32", KOIDX="*u8",
               KOVAL=ty, VC="*i32", VCEN=ty, VHALF=ty, VLEV="*fp32", VOIDX="*u8", VOVAL=ty, COS=ty, SIN=ty,
               POS="*i64", AMASK="*i1", stride_mb="i32", OUT_M="*fp32", OUT_L="*fp32", OUT_ACC="*fp32",
               scale="fp32", T="i32", NSPLIT="i32")
    for bt, cap, nout in ((16, dag.LUT_MAXNREG, 0), (16, None, 0), (32, dag.LUT_MAXNREG, 0), (32, None, 0),
                          (16, dag.LUT_MAXNREG, 1)):
        cx = dict(H=8, REP=4, S=1, R=0, MASK_KIND=1, IS_BF16=False, BT=bt, ROPE=True, KNOUT=nout, VNOUT=nout, NWIN=2,
                  PDL=True)
        b = compile_sm90(dag._lut_decode_kernel, lut, cx, [i for i in range(17) if i not in (1, 2)],
                                         **({"maxnreg": cap} if cap else {}))
        ops = main_loop(b.sass)
        print(f"kvquant-4{'-1%' if nout else ''} (RoPE) tile {bt} cap {cap}: {b.regs} registers, stack {b.stack} B, "
              f"loop {sum(ops.values())} instructions per {bt} tokens: {dict(ops.most_common(12))}", flush=True)
    for bf16 in (False, True):
        sty = "*bf16" if bf16 else ty
        sym8 = dict(Q=sty, stride_qb="i32", stride_qh="i32", KC="*i32", KHALF=sty, VC="*i32", VHALF=sty, POS="*i64",
                    AMASK="*i1", stride_mb="i32", OUT_M="*fp32", OUT_L="*fp32", OUT_ACC="*fp32", scale="fp32", T="i32",
                    NSPLIT="i32")
        for bt in (16, 32):
            cx = dict(H=8, REP=4, S=0, R=0, MASK_KIND=1, IS_BF16=bf16, BT=bt, NWIN=1, PDL=True)
            b = compile_sm90(dag._sym8_decode_kernel, sym8, cx, (0, 3, 4, 5, 6, 10, 11, 12))
            ops = main_loop(b.sass)
            print(f"int8 {'bf16' if bf16 else 'fp16'} tile {bt}: {b.regs} registers, stack {b.stack} B, loop "
                  f"{sum(ops.values())} instructions per {bt} tokens: {dict(ops.most_common(12))}", flush=True)
    kivi = dict(Q=ty, stride_qb="i32", stride_qh="i32", KC="*i32", KCEN=ty, KHALF=ty, VC="*i32", VCEN=ty, VHALF=ty,
                POS="*i64", AMASK="*i1", stride_mb="i32", OUT_M="*fp32", OUT_L="*fp32", OUT_ACC="*fp32",
                scale="fp32", T="i32", NG_K="i32", NSPLIT="i32", KNORM=ty,   # InnerQ's: unread
                KHROWS=ty, KCROWS=ty)
    for bits in (2, 4):
        for post in (True, False):
            a = dag.split_scale(2 / (2 ** bits - 1), False)
            cx = dict(H=8, REP=4, S=0, R=128, TPG_K=32, TPG_V=1, MASK_KIND=1, IS_BF16=False, BT=32, KBITS=bits,
                      VBITS=bits, KA_HI=a[0], KA_LO=a[1], VA_HI=a[0], VA_LO=a[1], NWIN=3, TMA=False, NST=2,
                      PDL=True, KPOST=post, WL=dag.WIDEN_IN_LANES, WT=dag.WHOLE_TILES, TPS=1)
            b = compile_sm90(dag._kivi_decode_kernel, kivi, cx, (0, 3, 4, 5, 6, 7, 8, 12, 13, 14))
            ops = main_loop(b.sass)
            print(f"KIVI layout {bits}-bit, Keys {'post-scaled' if post else 'dequantized'}: {b.regs} registers, "
                  f"stack {b.stack} B, loop {sum(ops.values())} instructions per 32 tokens: "
                  f"{dict(ops.most_common(12))}", flush=True)
    # the TMA build inside CUDA graphs on sm_90 (bf16, post-scaled Keys): q . z per tile against per QZ_N groups
    import torch
    from triton.runtime.jit import mangle_type

    for bits in (2, 4):
        tps = dag.RING_TILES.get(bits, 1)   # tiles per ring slot, as `_plan`
        z = dict(codes=torch.zeros(2, 2, 64, 4 * bits, dtype=torch.int32))
        kp = dict(z, cen=torch.zeros(2, 2, 2, 128, dtype=torch.bfloat16), half=torch.zeros(2, 2, 2, 128,
                                                                                             dtype=torch.bfloat16))
        vp = dict(z, cen=torch.zeros(2, 2, 64, 4, dtype=torch.bfloat16), half=torch.zeros(2, 2, 64, 4,
                                                                                           dtype=torch.bfloat16))
        a = dag.split_scale(2 / (2 ** bits - 1), True)
        for qz in (False, True):
            fold = dag.fold_flags(True, True, bits, dag.pair_flags(tps, True, dag.WHOLE_TILES, 128, qz)["PAIR"])
            stores = dict(zip(("KC", "KCEN", "KHALF", "VC", "VCEN", "VHALF"),
                              map(mangle_type, dag.descriptors(kp, vp, bits, bits, tps,
                                                               dag.vf_swizzle(fold["VF"], bits)))))
            sig = {n: (t.replace("fp16", "bf16") if isinstance(t, str) else t) for n, t in kivi.items()}
            sig.update(stores)
            cx = dict(H=8, REP=4, S=0, R=128, TPG_K=32, TPG_V=1, MASK_KIND=1, IS_BF16=True, BT=32, KBITS=bits,
                      VBITS=bits, KA_HI=a[0], KA_LO=a[1], VA_HI=a[0], VA_LO=a[1], NWIN=3, TMA=True, NST=dag.NSTAGES,
                      PDL=True, KPOST=True, QZROWS=qz, QZ_N=dag.QZ_N, VZ=dag.VALUE_ZERO_APART, WL=dag.WIDEN_IN_LANES,
                      WT=dag.WHOLE_TILES, TPS=tps, KSUB=dag.BF16_SUBNORMAL_KEYS, KSW=dag.SUB_WINDOW,
                      **dag.pair_flags(tps, True, dag.WHOLE_TILES, 128, qz))
            cx.update(fold)
            b = compile_sm90(dag._kivi_decode_kernel, sig, cx, (0, 12, 13, 14, 20, 21))
            # main_loop spans the mbarrier wait's retry branch here: its HMMA are the tile's, the refill's not
            run, ops = ring_tile(b.sass, 1 if cx["PAIR"] else cx["TPS"], refill=qz)
            run = run / 2 if cx["PAIR"] else run   # PAIR: the loop runs a slot (two tiles) a trip
            print(f"KIVI layout {bits}-bit, bf16, TMA, q . z {'per QZ_N groups' if qz else 'per tile'}: {b.regs} "
                  f"registers, stack {b.stack} B, shared {b.shared} B, HMMA per loop trip "
                  f"{main_loop(b.sass)['HMMA']} (in the code {b.sass.count('HMMA')}), TMA copies "
                  f"{b.sass.count('UTMALDG')}, about {run:.0f} "
                  f"instructions run per tile ({cx['TPS']} a ring slot): {dict(ops.most_common(10))}", flush=True)
    # InnerQ's layout (innerq-2: 2-bit hybrid groups on both sides, the Key norm) in the same kernel
    inner = dict(kivi, KNORM="*fp32")
    cx = dict(H=8, REP=4, S=32, R=96, TPG_K=1, TPG_V=32, MASK_KIND=1, IS_BF16=False, BT=32, KBITS=2, VBITS=2,
              KA_HI=1.0, KA_LO=0.0, VA_HI=1.0, VA_LO=0.0, NWIN=3, TMA=False, NST=2, PDL=True, INNER=True, KHYB=True,
              VHYB=True, NORM=True, WL=dag.WIDEN_IN_LANES, WT=dag.WHOLE_TILES, TPS=1)
    b = compile_sm90(dag._kivi_decode_kernel, inner, cx, (0, 3, 4, 5, 6, 7, 8, 12, 13, 14))
    ops = main_loop(b.sass)
    print(f"InnerQ layout 2-bit hybrid: {b.regs} registers, stack {b.stack} B, loop {sum(ops.values())} "
          f"instructions per 32 tokens: {dict(ops.most_common(12))}", flush=True)
    post = dict(Q=ty, stride_qb="i32", stride_qh="i32", KC="*i32", KCEN=ty, KHALF=ty, VC="*i32", VCEN=ty, VHALF=ty,
                POS="*i64", AMASK="*i1", stride_mb="i32", TEMP="*fp32", LOGITS="*fp32", OUT_M="*fp32", OUT_L="*fp32",
                OUT_ACC="*fp32", scale="fp32", T="i32", NSPLIT="i32", KSINK=ty, KRING=ty, KCHUNK=ty,
                stride_kcb="i32", stride_kch="i32", VSINK=ty, VRING=ty, VCHUNK=ty, stride_vcb="i32", stride_vch="i32",
                M1="*fp32", L1="*fp32", NS1="i32", tau_sum="fp32")
    for phase in (1, 2):   # calibquant: the range pass, then the calibrated attention, with the windows inside
        cx = dict(H=8, REP=4, S=0, R=128, MASK_KIND=1, IS_BF16=False, BT=32, TAU_PHASE=phase, NWIN=4,
                  PDL=phase != 1, WIN=True, WR_K=128, WR_V=128, WCOST=dag.POST_WCOST[phase], WL=dag.WIDEN_IN_LANES)
        b = compile_sm90(dag._post_decode_kernel, post, cx, [i for i in range(0, 9) if i not in (1, 2)],
                         maxnreg=dag.POST_MAXNREG[phase])
        ops = main_loop(b.sass, last=True)   # the slice's loop (the windows' loop comes first)
        print(f"calibquant phase {phase}: {b.regs} registers, stack {b.stack} B, loop {sum(ops.values())} "
              f"instructions per 32 tokens: {dict(ops.most_common(12))}", flush=True)


if __name__ == "__main__":
    main()
