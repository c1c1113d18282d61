"""InnerQ's ring build of `_kivi_decode_kernel` compiled for sm_90 without a GPU: registers, spills and the main
loop's instructions, with the kernel constexprs given as NAME=VALUE off (False, 0) and as given (IA=True after
session 43's bench/debug/inner_ahead_tried.patch is applied; MOK=512: the bool-mask builds with the maskless loop
copy that `_plan` builds since session 48, `MASK_SLICE`, where `main_loop` spans more than one copy: read the
SASS); CAP=N (environment) sets a register cap. KIVI's ring build: kivi_ring_sass.py KBITS VBITS NAME=VALUE.
    env -u TRITON_INTERPRET PYTHONPATH=tests python bench/debug/inner_ring_sass.py MOK=512"""
import ast
import os
import sys

import torch
from triton.runtime.jit import mangle_type

from kvq_compile.templates import decode_attention_gluon as dag
from sm90_sass import compile_sm90, main_loop

override = {k: ast.literal_eval(v) for k, v in (a.split("=", 1) for a in sys.argv[1:])}
off = {k: type(v)() for k, v in override.items()}   # the same constexprs off (False, 0): an offline compile leaves
# a constexpr it is not given None, not at its default
cap = {"maxnreg": int(os.environ["CAP"])} if os.environ.get("CAP") else {}
for bf16, mask, kb, vb, hyb, norm in ((True, 1, 2, 2, True, True), (False, 1, 2, 2, True, True),
                                      (True, 1, 4, 1, False, False), (True, 0, 4, 1, False, False)):
    for extra in (off, override):
        ty = "*bf16" if bf16 else "*fp16"
        kc, vc = map(mangle_type, dag.row_descriptors(dict(codes=torch.zeros(2, 2, 64, 4 * kb, dtype=torch.int32)),
                                                      dict(codes=torch.zeros(2, 2, 64, 4 * vb, dtype=torch.int32)),
                                                      4 * kb, dag.KIVI_BT, 4 * vb))
        sig = dict(Q=ty, stride_qb="i32", stride_qh="i32", KC=kc, KCEN=ty, KHALF=ty, VC=vc, VCEN=ty, VHALF=ty,
                   POS="*i64", AMASK="*i1" if mask == 1 else ty, stride_mb="i32", OUT_M="*fp32", OUT_L="*fp32",
                   OUT_ACC="*fp32", scale="fp32", T="i32", NG_K="i32", NSPLIT="i32", KNORM="*fp32" if norm else ty, KHROWS=ty, KCROWS=ty)
        ka, va = (dag.split_scale(2 / (2 ** n - (2 if hyb else 1)), bf16) for n in (kb, vb))
        cx = dict(H=8, REP=4, S=32, R=128, TPG_K=1, TPG_V=32, MASK_KIND=mask, IS_BF16=bf16, BT=32, KBITS=kb,
                  VBITS=vb, KA_HI=ka[0], KA_LO=ka[1], VA_HI=va[0], VA_LO=va[1], NWIN=3, TMA=True, NST=dag.NSTAGES,
                  PDL=True, INNER=True, KHYB=hyb, VHYB=hyb, NORM=norm, WL=dag.WIDEN_IN_LANES, WT=dag.WHOLE_TILES,
                  TPS=1, **extra)
        b = compile_sm90(dag._kivi_decode_kernel, sig, cx, (0, 4, 5, 7, 8, 12, 13, 14), **cap)
        ops = main_loop(b.sass)
        print(f"bf16={bf16} mask={mask} k{kb}v{vb} hyb={hyb} {extra}: regs {b.regs} stack {b.stack} "
              f"loop {sum(ops.values())} LDG {ops['LDG']} ISETP {ops['ISETP']}", flush=True)
