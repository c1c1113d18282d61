"""kvquant's decode attention without a mask, through the no-mask build of `_lut_decode_kernel` (MASK_KIND 0) and
through the bool-mask build with its mask load predicated off (MASK_KIND 3, `LUT_NO_MASK_AS_BOOL`), beside the call
with HF's bool mask (over another random store of the same shape); CUDA-graph time of the whole call, and whether the
two no-mask outputs are equal bit for bit (debug). Layouts with outliers (kvquant-4-1%) always take MASK_KIND 0 now
(`_plan`), so for them both no-mask columns time MASK_KIND 0; session 19's call 3 ran before that guard, and timed
MASK_KIND 3 there too.

    python bench/debug/lut_nomask.py [presets] [shapes]     e.g. kvquant-4,kvquant-4-1% 8x8192,32x4096
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_decode_attention import copy_bandwidth, graph_time  # noqa: E402
from check_gluon import decode_call  # noqa: E402

from kvq_compile.templates import decode_attention_gluon as dag  # noqa: E402


def main():
    presets = (sys.argv[1] if len(sys.argv) > 1 else "kvquant-4,kvquant-4-1%").split(",")
    shapes = [tuple(map(int, s.split("x"))) for s in (sys.argv[2] if len(sys.argv) > 2 else
                                                       "1x16384,8x8192,32x4096,32x16384").split(",")]
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()} copy {bw / 1e12:.2f} TB/s", flush=True)
    for preset in presets:
        for B, ctx in shapes:
            res, outs = {}, {}
            for mask in (False, True):
                fn, nbytes = decode_call(preset, B, ctx, mask=mask)
                for name, as_bool in (((("bool mask", True),) if mask else
                                       (("no mask, MASK_KIND 0", False), ("no mask, MASK_KIND 3", True)))):
                    dag.LUT_NO_MASK_AS_BOOL = as_bool
                    try:
                        outs[name] = fn().clone()
                        res[name] = graph_time(fn)
                    finally:
                        dag.LUT_NO_MASK_AS_BOOL = True
                fn = None
                torch.cuda.empty_cache()
            same = torch.equal(outs["no mask, MASK_KIND 0"], outs["no mask, MASK_KIND 3"])
            print(f"{preset} B={B} ctx={ctx} ({nbytes / 1e6:.1f} MB, floor {nbytes / bw * 1e6:.1f} us): "
                  + ", ".join(f"{k} {v:.1f} us" for k, v in res.items()) + f"; MASK_KIND 3 == 0: {same}", flush=True)


if __name__ == "__main__":
    main()
