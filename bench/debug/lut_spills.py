"""kvquant-4's `_lut_decode_kernel` compiled for sm_90 (no GPU needed; run with TRITON_INTERPRET unset) at
MASK_KIND 0 (no mask), 1 (bool mask) and 3 (no mask through the bool build, `LUT_NO_MASK_AS_BOOL`): registers, stack, main-loop instructions and local loads / stores (debug).

    env -u TRITON_INTERPRET python bench/debug/lut_spills.py
"""
from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from sm90_sass import compile_sm90, main_loop  # noqa: E402

from kvq_compile.templates import decode_attention_gluon as dag  # noqa: E402


def main():
    ty = "*bf16"   # kvquant-4's preset: Keys before RoPE, no outliers
    for mask in (0, 1, 3):
        sig = dict(Q=ty, stride_qb="i32", stride_qh="i32", KC="*i32", KCEN=ty, KHALF=ty, KLEV="*fp32", KOIDX="*u8",
                   KOVAL=ty, VC="*i32", VCEN=ty, VHALF=ty, VLEV="*fp32", VOIDX="*u8", VOVAL=ty, COS=ty, SIN=ty,
                   POS="*i64", AMASK="*i1" if mask == 1 else ty, stride_mb="i32", OUT_M="*fp32", OUT_L="*fp32",
                   OUT_ACC="*fp32", scale="fp32", T="i32", NSPLIT="i32")
        cx = dict(H=8, REP=4, S=1, R=128, MASK_KIND=mask, IS_BF16=True, BT=dag.LUT_BT, ROPE=True, KNOUT=0, VNOUT=0,
                  NWIN=2, PDL=True)
        b = compile_sm90(dag._lut_decode_kernel, sig, cx, [i for i in range(0, 17) if i not in (1, 2)],
                         maxnreg=dag.LUT_MAXNREG)
        ops = main_loop(b.sass)
        print("MASK_KIND", mask, "regs", b[0], "stack", b.stack, "loop instructions", sum(ops.values()),
              "loop local", {k: v for k, v in ops.items() if k.startswith(("LDL", "STL"))},
              "all LDL", len(re.findall(r"\bLDL", b.sass)), "STL", len(re.findall(r"\bSTL", b.sass)), flush=True)


if __name__ == "__main__":
    main()
