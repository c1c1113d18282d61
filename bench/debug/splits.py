"""The Gluon launch's split count around its default (`decode_attention._gluon_splits`: as many programs as the SMs
hold at once, at most 8 per SM for KIVI's layout where those slices would be short), CUDA-graph timed (debug).

    python bench/debug/splits.py [presets] [shapes] [factors]     e.g. kivi-2 8x8192 0.5,0.75,1,1.5,2
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from bench_decode_attention import graph_time  # noqa: E402
from check_gluon import decode_call  # noqa: E402

from kvq_compile.templates import decode_attention as da  # noqa: E402


def main():
    presets = (sys.argv[1] if len(sys.argv) > 1 else "kivi-2,kivi-4").split(",")
    shapes = [tuple(map(int, s.split("x"))) for s in (sys.argv[2] if len(sys.argv) > 2 else
                                                       "1x16384,8x8192,32x4096,32x16384").split(",")]
    factors = [float(f) for f in (sys.argv[3] if len(sys.argv) > 3 else "0.5,0.75,1,1.25,1.5,2").split(",")]
    print(f"device {torch.cuda.get_device_name()}", flush=True)
    for preset in presets:
        for B, ctx in shapes:
            fn, _ = decode_call(preset, B, ctx)
            fn()
            base = da.LAST_KERNELS["splits"]
            res = {}
            for f in factors:
                n = max(1, round(base * f))
                if n not in res:
                    res[n] = graph_time(lambda: fn(num_splits=n))
            best = min(res, key=res.get)
            print(f"{preset} B={B} ctx={ctx} default {base}: " + ", ".join(f"{n} {t:.1f}" for n, t in res.items())
                  + f" us; best {best} ({res[base] / res[best]:.3f}x)", flush=True)
            fn = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
