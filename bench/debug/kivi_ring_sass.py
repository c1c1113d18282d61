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

from kvq_compile.templates import decode_attention_gluon as dag  # noqa: E402
from sm90_sass import compile_sm90, kivi_ring_build, ring_tile  # noqa: E402


def main(argv):
    nums = [a for a in argv if "=" not in a]
    kbits = int(nums[0])
    vbits = int(nums[1]) if len(nums) > 1 else kbits
    overrides = {k: ast.literal_eval(v) for k, v in (a.split("=", 1) for a in argv if "=" in a)}
    tps = dag.RING_TILES.get(max(kbits, vbits), 1)
    pair = dag.pair_flags(tps, True, dag.WHOLE_TILES, 128, dag.QZ_ROWS)
    fold = dag.fold_flags(True, True, vbits, pair["PAIR"])
    sig, cx = kivi_ring_build(kbits, vbits, tps, fold["VF"])
    cx.update(fold)
    cx.update(overrides)
    b = compile_sm90(dag._kivi_decode_kernel, sig, cx, (0, 12, 13, 14, 20, 21))
    trip = 2 if cx["PAIR"] else 1
    run, ops = ring_tile(b.sass, 1 if cx["PAIR"] else tps, refill=cx["QZROWS"])
    with open(f"/tmp/kivi_ring_{kbits}{vbits}.sass", "w") as f:
        f.write(b.sass)
    print(f"k{kbits}v{vbits} {overrides or ''}: {b.regs} registers, stack {b.stack} B, {run / trip:.1f} instructions "
          f"a tile (PAIR {cx['PAIR']}, TPS {tps}), {dag.programs_per_sm(b.regs, b.shared, (9, 0))} programs per SM; "
          f"loop opcodes a trip: {dict(ops.most_common(10))}")


if __name__ == "__main__":
    main(sys.argv[1:])
