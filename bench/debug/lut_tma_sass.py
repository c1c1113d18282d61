"""Offline sm_90 builds of `_lut_decode_kernel`: plain loads against the codes' TMA ring (`TMA`), under the
register cap and uncapped: registers, spills, shared memory and the main loop's memory instructions. Run without
TRITON_INTERPRET:
    env -u TRITON_INTERPRET PYTHONPATH=tests python bench/debug/lut_tma_sass.py"""
import torch
from triton.runtime.jit import mangle_type

from kvq_compile.templates import decode_attention_gluon as dag
from sm90_sass import compile_sm90, main_loop

for bf16, mask in ((True, 1), (False, 1), (True, 3)):
    for tma in (False, True):
        for cap in (dag.LUT_MAXNREG, None):
            ty = "*bf16" if bf16 else "*fp16"
            kc = vc = "*i32"
            if tma:
                codes = dict(codes=torch.zeros(2, 2, 64, 16, dtype=torch.int32))
                kc, vc = map(mangle_type, dag.row_descriptors(codes, codes, 16, dag.LUT_BT))
            sig = dict(Q=ty, stride_qb="i32", stride_qh="i32", KC=kc, KCEN=ty, KHALF=ty, KLEV="*fp32", KOIDX="*u8",
                       KOVAL=ty, VC=vc, VCEN=ty, VHALF=ty, VLEV="*fp32", VOIDX="*u8", VOVAL=ty, COS=ty, SIN=ty,
                       POS="*i64", AMASK="*i1" if mask in (1, 3) else ty, stride_mb="i32", OUT_M="*fp32",
                       OUT_L="*fp32", OUT_ACC="*fp32", scale="fp32", T="i32", NSPLIT="i32")
            cx = dict(H=8, REP=4, S=1, R=0, MASK_KIND=mask, IS_BF16=bf16, BT=dag.LUT_BT, ROPE=True, KNOUT=0,
                      VNOUT=0, NWIN=2, PDL=True, TMA=tma, NST=dag.NSTAGES)
            ptrs = [i for i in range(0, 17) if i not in (1, 2) and not (tma and i in (3, 9))]
            b = compile_sm90(dag._lut_decode_kernel, sig, cx, ptrs, **({"maxnreg": cap} if cap else {}))
            ops = main_loop(b.sass)
            print(f"bf16={bf16} mask={mask} tma={tma} cap={cap}: regs {b.regs} stack {b.stack} shared {b.shared} "
                  f"LDG {ops['LDG']} LDS {ops['LDS']} LDL {ops['LDL']} STL {ops['STL']} HMMA {ops['HMMA']} "
                  f"UTMALDG {b.sass.count('UTMALDG')}", flush=True)
