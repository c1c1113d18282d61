"""The KIVI-layout Gluon kernel's TMA-ring build as `_plan` builds it (bf16, bool mask, post-scaled Keys, the ring's
descriptors; PAIR at 1 and 2 bits, one tile a slot at 4), compiled for sm_90 without a GPU: its registers and the
SASS instructions its tile loop runs a tile (`ring_tile`: the q . z refill block left out), with constexprs
overridden from the command line; the SASS is written to /tmp/kivi_ring_<kbits><vbits>.sass.

    python bench/debug/kivi_ring_sass.py KBITS [VBITS] [NAME=VALUE ...]     e.g. 2 2 MA=True   (no TRITON_INTERPRET)
"""
from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from kvq_compile.templates import decode_attention_gluon as dag  # noqa: E402
from sm90_sass import compile_sm90, ring_tile  # noqa: E402


def main(argv):
    nums = [a for a in argv if "=" not in a]
    kbits = int(nums[0])
    vbits = int(nums[1]) if len(nums) > 1 else kbits
    overrides = {k: ast.literal_eval(v) for k, v in (a.split("=", 1) for a in argv if "=" in a)}
    bf = torch.bfloat16
    kp = dict(codes=torch.zeros(2, 2, 64, 4 * kbits, dtype=torch.int32), cen=torch.zeros(2, 2, 2, 128, dtype=bf),
              half=torch.zeros(2, 2, 2, 128, dtype=bf))
    vp = dict(codes=torch.zeros(2, 2, 64, 4 * vbits, dtype=torch.int32), cen=torch.zeros(2, 2, 64, 4, dtype=bf),
              half=torch.zeros(2, 2, 64, 4, dtype=bf))
    tps = dag.RING_TILES.get(max(kbits, vbits), 1)
    pair = dag.pair_flags(tps, True, dag.WHOLE_TILES, 128, dag.QZ_ROWS)
    fold = dag.fold_flags(True, True, vbits, pair["PAIR"])
    descs = dag.descriptors(kp, vp, kbits, vbits, tps, dag.vf_swizzle(fold["VF"], vbits))
    ty = "*bf16"
    sig = dict(Q=ty, stride_qb="i32", stride_qh="i32",
               **dict(zip(("KC", "KCEN", "KHALF", "VC", "VCEN", "VHALF"), map(mangle_type, descs))),
               POS="*i64", AMASK="*i1", stride_mb="i32", OUT_M="*fp32", OUT_L="*fp32", OUT_ACC="*fp32",
               scale="fp32", T="i32", NG_K="i32", NSPLIT="i32", KMASK=ty, VMASK=ty, KNORM=ty, KHROWS=ty, KCROWS=ty)
    ka, va = (dag.split_scale(2 / (2 ** b - 1), True) for b in (kbits, vbits))
    cx = dict(H=8, REP=4, S=0, R=128, TPG_K=32, TPG_V=1, MASK_KIND=1, IS_BF16=True, BT=32, KBITS=kbits,
              VBITS=vbits, KA_HI=ka[0], KA_LO=ka[1], VA_HI=va[0], VA_LO=va[1], NWIN=3, TMA=True, NST=dag.NSTAGES,
              PDL=True, KPOST=True, QZROWS=dag.QZ_ROWS, QZ_N=dag.QZ_N, VZ=dag.VALUE_ZERO_APART,
              WL=dag.WIDEN_IN_LANES, WT=dag.WHOLE_TILES, TPS=tps, KSUB=dag.BF16_SUBNORMAL_KEYS, KSW=dag.SUB_WINDOW,
              **pair, **fold)
    cx.update(overrides)
    b = compile_sm90(dag._kivi_decode_kernel, sig, cx, (0, 12, 13, 14, 22, 23))
    trip = 2 if cx["PAIR"] else 1
    run, ops = ring_tile(b.sass, 1 if cx["PAIR"] else tps, refill=cx["QZROWS"])
    with open(f"/tmp/kivi_ring_{kbits}{vbits}.sass", "w") as f:
        f.write(b.sass)
    print(f"k{kbits}v{vbits} {overrides or ''}: {b.regs} registers, stack {b.stack} B, {run / trip:.1f} instructions "
          f"a tile (PAIR {cx['PAIR']}, TPS {tps}), {dag.programs_per_sm(b.regs, b.shared, (9, 0))} programs per SM; "
          f"loop opcodes a trip: {dict(ops.most_common(10))}")


if __name__ == "__main__":
    main(sys.argv[1:])
