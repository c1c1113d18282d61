"""kvquant-4's Gluon kernel (`_lut_decode_kernel`) on a GPU: CUDA-graph time of one decode-attention call at the
issue's shapes (HF's bool mask) with 16- and 32-token tiles under register caps (168: the default, 12 programs per
SM; 128: 16; none), next to the Triton template; and where one call's GPU time goes.

    python bench/lut_variants.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from bench_decode_attention import copy_bandwidth, graph_time  # noqa: E402
from check_gluon import decode_call, kernel_times  # noqa: E402

from kvq_compile.templates import decode_attention as da  # noqa: E402
from kvq_compile.templates import decode_attention_gluon as dag  # noqa: E402


def main(shapes=((1, 16384), (8, 8192), (32, 4096), (32, 16384))):
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()} copy {bw / 1e12:.2f} TB/s")
    plan, bt0 = dag._plan, dag.LUT_BT

    def capped(maxnreg):
        def p(*a, **k):
            fn, args, kw = plan(*a, **k)
            kw = dict(kw)
            if maxnreg:
                kw["maxnreg"] = maxnreg
            else:
                kw.pop("maxnreg", None)
            return fn, args, kw
        return p

    for B, ctx in shapes:
        fn, nbytes = decode_call("kvquant-4", B, ctx)
        line = []
        try:
            for bt, cap in ((16, 168), (16, 128), (16, None), (32, 168), (32, None)):
                dag.LUT_BT, dag._plan = bt, capped(cap)
                dag._RESIDENT.clear()
                try:
                    t = graph_time(fn)
                    k = da.LAST_KERNELS["main"]
                    line.append(f"tile {bt} cap {cap}: {t:.1f} us {nbytes / (t * 1e-6) / bw * 100:.0f}% "
                                f"({da.LAST_KERNELS['splits']} slices, {getattr(k, 'n_regs', '?')} regs, "
                                f"{getattr(k, 'n_spills', '?')} spills)")
                except Exception as e:  # noqa: BLE001
                    line.append(f"tile {bt} cap {cap}: {type(e).__name__}: {str(e)[:300]}")
        finally:
            dag.LUT_BT, dag._plan = bt0, plan
            dag._RESIDENT.clear()
        t = graph_time(lambda: fn(gluon=False))
        line.append(f"triton {t:.1f} us")
        print(f"kvquant-4 B={B} ctx={ctx}: " + " | ".join(line), flush=True)
        if B == 8:
            print("  profile (default): " + kernel_times(fn))
        fn = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
