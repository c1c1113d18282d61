"""kvquant's decode attention without a mask, through the no-mask build of `_lut_decode_kernel` (MASK_KIND 0) and
through the bool-mask build with its mask load predicated off (MASK_KIND 3, `LUT_NO_MASK_AS_BOOL`), beside the call
with HF's bool mask; CUDA-graph time of the whole call, and whether the two no-mask outputs are equal bit for bit
(debug). Layouts with outliers (kvquant-4-1%) always take MASK_KIND 0 now (`_plan`), so for them both no-mask
columns time MASK_KIND 0; session 19's call 3 ran before that guard, and timed MASK_KIND 3 there too.

    python bench/debug/lut_nomask.py [presets] [shapes]     e.g. kvquant-4,kvquant-4-1% 8x8192,32x4096
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_decode_attention import bytes_read, copy_bandwidth, graph_time, pick_layer, random_store  # noqa: E402
from kvq_compile.config import KVQConfig  # noqa: E402
from kvq_compile.templates import decode_attention_gluon as dag  # noqa: E402
from kvq_compile.templates.decode_attention import decode_attention  # noqa: E402


def main():
    presets = (sys.argv[1] if len(sys.argv) > 1 else "kvquant-4,kvquant-4-1%").split(",")
    shapes = [tuple(map(int, s.split("x"))) for s in (sys.argv[2] if len(sys.argv) > 2 else
                                                       "1x16384,8x8192,32x4096,32x16384").split(",")]
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()} copy {bw / 1e12:.2f} TB/s", flush=True)
    dtype = torch.bfloat16
    for preset in presets:
        cfg = KVQConfig.preset(preset)
        li = pick_layer(cfg)
        for B, ctx in shapes:
            ms = random_store(cfg, li, li + 1, B, ctx, dtype)
            lay = ms.layers[li]
            bufs = dict(zip(*lay.attend_tensors()))
            q = torch.randn(B, 32, 1, 128, device="cuda", dtype=dtype)
            kc = torch.randn(B, 8, 1, 128, device="cuda", dtype=dtype)
            pos = torch.tensor([ctx - 1], device="cuda")
            am = torch.ones(B, 1, 1, ctx, dtype=torch.bool, device="cuda")
            res, outs = {}, {}
            for name, mask, as_bool in (("no mask, MASK_KIND 0", None, False), ("no mask, MASK_KIND 3", None, True),
                                        ("bool mask", am, True)):
                def fn():
                    return decode_attention(q, bufs, kc, kc, pos, mask, 128 ** -0.5, False, cfg, lay.spec, ms.geo)

                dag.LUT_NO_MASK_AS_BOOL = as_bool
                try:
                    outs[name] = fn().clone()
                    res[name] = graph_time(fn)
                finally:
                    dag.LUT_NO_MASK_AS_BOOL = True
            same = torch.equal(outs["no mask, MASK_KIND 0"], outs["no mask, MASK_KIND 3"])
            nbytes = bytes_read(lay, B, ctx, dtype)
            print(f"{preset} B={B} ctx={ctx} ({nbytes / 1e6:.1f} MB, floor {nbytes / bw * 1e6:.1f} us): "
                  + ", ".join(f"{k} {v:.1f} us" for k, v in res.items()) + f"; MASK_KIND 3 == 0: {same}", flush=True)
            ms = bufs = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
