"""The Gluon kernels of kvquant's and int8's layouts on a GPU: CUDA-graph time of one decode-attention call at the
issue's shapes (HF's bool mask) under launch variants, next to the Triton template; and where one call's GPU time
goes. kvquant-4 (`_lut_decode_kernel`): 16- and 32-token tiles under register caps (168: the default, 12 programs
per SM; 128: 16; none). int8 (`_sym8_decode_kernel`): 16- and 32-token tiles. The KIVI layout
(`_kivi_decode_kernel`: kivi-2, kivi-4, xquant-1.38): 32- and 16-token tiles, through the TMA ring (the default inside
a CUDA graph) or plain loads. Each variant's output is compared with the default launch's (relative difference).

    python bench/lut_variants.py [kvquant-4 | int8 | kivi-2 | kivi-4 | xquant-1.38] ...
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

VARIANTS = {  # preset: (name, module constants, register cap or None for no cap, "default" to keep the launch's)
    "kvquant-4": [("tile 16 cap 168", dict(LUT_BT=16), "default"), ("tile 16 cap 128", dict(LUT_BT=16), 128),
                  ("tile 16 no cap", dict(LUT_BT=16), None), ("tile 32 cap 168", dict(LUT_BT=32), "default"),
                  ("tile 32 no cap", dict(LUT_BT=32), None)],
    "int8": [("tile 16", dict(SYM8_BT=16), "default"), ("tile 32", dict(SYM8_BT=32), "default")],
}
for _p in ("kivi-2", "kivi-4", "xquant-1.38"):
    VARIANTS[_p] = [("tile 32", dict(KIVI_BT=32, USE_TMA=True), "default"),
                    ("tile 16", dict(KIVI_BT=16, USE_TMA=True), "default"),
                    ("tile 32 plain loads", dict(KIVI_BT=32, USE_TMA=False), "default"),
                    ("tile 16 plain loads", dict(KIVI_BT=16, USE_TMA=False), "default")]


def main(preset: str = "kvquant-4", shapes=((1, 16384), (8, 8192), (32, 4096), (32, 16384))):
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()} copy {bw / 1e12:.2f} TB/s")
    plan = dag._plan
    saved = {n: getattr(dag, n) for _, consts, _ in VARIANTS[preset] for n in consts}

    def capped(maxnreg):
        def p(*a, **k):
            fn, args, kw = plan(*a, **k)
            kw = dict(kw)
            if maxnreg is None:
                kw.pop("maxnreg", None)
            elif maxnreg != "default":
                kw["maxnreg"] = maxnreg
            return fn, args, kw
        return p

    for B, ctx in shapes:
        fn, nbytes = decode_call(preset, B, ctx)
        ref = fn().float()
        line = []
        try:
            for name, consts, cap in VARIANTS[preset]:
                for n, v in consts.items():
                    setattr(dag, n, v)
                dag._plan = capped(cap)
                dag._RESIDENT.clear()
                try:
                    t = graph_time(fn)
                    diff = ((fn().float() - ref).norm() / ref.norm()).item()
                    k = da.LAST_KERNELS["main"]
                    line.append(f"{name}: {t:.1f} us {nbytes / (t * 1e-6) / bw * 100:.0f}% "
                                f"({da.LAST_KERNELS['splits']} slices, {getattr(k, 'n_regs', '?')} regs, "
                                f"{getattr(k, 'n_spills', '?')} spills, {diff:.1e} from default)")
                except Exception as e:  # noqa: BLE001
                    line.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
        finally:
            for n, v in saved.items():
                setattr(dag, n, v)
            dag._plan = plan
            dag._RESIDENT.clear()
        t = graph_time(lambda: fn(gluon=False))
        line.append(f"triton {t:.1f} us")
        print(f"{preset} B={B} ctx={ctx}: " + " | ".join(line), flush=True)
        if B == 8:
            print("  profile (default): " + kernel_times(fn))
        fn = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    torch.manual_seed(0)
    for name in sys.argv[1:] or ["kvquant-4"]:
        main(name)
