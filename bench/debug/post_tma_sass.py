"""Offline sm_90 builds of `_post_decode_kernel` (calibquant-1's range pass, phase 1, and attention pass, phase 2,
with the exact windows inside under `POST_MAXNREG`): plain loads against the codes' TMA ring (`TMA`). Registers,
spills, shared memory, TMA copies. Run without TRITON_INTERPRET:
    env -u TRITON_INTERPRET PYTHONPATH=tests python bench/debug/post_tma_sass.py"""
import torch
from triton.runtime.jit import mangle_type

from kvq_compile.templates import decode_attention_gluon as dag
from sm90_sass import compile_sm90, main_loop

for bf16 in (True, False):
    for phase in (1, 2):
        for tma in (False, True):
            for cap in (dag.POST_MAXNREG[phase], None):
                ty = "*bf16" if bf16 else "*fp16"
                kc = vc = "*i32"
                if tma:
                    codes = dict(codes=torch.zeros(2, 2, 64, 4, dtype=torch.int32))
                    kc, vc = map(mangle_type, dag.row_descriptors(codes, codes, 4, 32))
                sig = dict(Q=ty, stride_qb="i32", stride_qh="i32", KC=kc, KCEN=ty, KHALF=ty, VC=vc, VCEN=ty,
                           VHALF=ty, POS="*i64", AMASK="*i1", stride_mb="i32", TEMP="*fp32", LOGITS="*fp32",
                           OUT_M="*fp32", OUT_L="*fp32", OUT_ACC="*fp32", scale="fp32", T="i32", NSPLIT="i32",
                           KSINK=ty, KRING=ty, KCHUNK=ty, stride_kcb="i32", stride_kch="i32", VSINK=ty, VRING=ty,
                           VCHUNK=ty, stride_vcb="i32", stride_vch="i32", M1="*fp32", L1="*fp32", NS1="i32",
                           tau_sum="fp32")
                cx = dict(H=8, REP=4, S=0, R=128, MASK_KIND=1, IS_BF16=bf16, BT=32, TAU_PHASE=phase, NWIN=4,
                          PDL=True, WIN=True, WR_K=128, WR_V=128, WCOST=dag.POST_WCOST[phase], TMA=tma,
                          NST=dag.NSTAGES, WL=dag.WIDEN_IN_LANES)   # as `_plan` passes them
                ptrs = [i for i in list(range(0, 9)) + list(range(20, 32)) if not (tma and i in (3, 6))]
                b = compile_sm90(dag._post_decode_kernel, sig, cx, ptrs, **({"maxnreg": cap} if cap else {}))
                ops = main_loop(b.sass, True)
                print(f"bf16={bf16} phase={phase} tma={tma} cap={cap}: regs {b.regs} stack {b.stack} "
                      f"local {b.local} shared {b.shared} UTMALDG {b.sass.count('UTMALDG')} "
                      f"loop HMMA {ops['HMMA']} LDG {ops['LDG']} LDS {ops['LDS']} LDL {ops['LDL']}", flush=True)
