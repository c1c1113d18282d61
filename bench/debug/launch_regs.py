"""Which build of each Gluon launch a decode-attention call runs (debug): registers and spills of the kernel of every
`decode_attention_gluon.launch` (per calibrated-softmax phase), with the call's CUDA-graph time. Written when the same
calibquant kernel source reported 96 registers in one device call and 128 in another, 5-12% apart (session 20).

    python bench/debug/launch_regs.py [presets] [shapes]      e.g. calibquant-1,kivi-2 1x65536,32x16384
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_decode_attention import graph_time  # noqa: E402
from check_gluon import decode_call  # noqa: E402

from kvq_compile.templates import decode_attention_gluon as dag  # noqa: E402


def main():
    presets = (sys.argv[1] if len(sys.argv) > 1 else "calibquant-1,kivi-2").split(",")
    shapes = [tuple(map(int, s.split("x")))
              for s in (sys.argv[2] if len(sys.argv) > 2 else "1x65536,32x16384").split(",")]
    launch, seen = dag.launch, {}

    def recorded(*args, **kw):
        k = launch(*args, **kw)
        seen[kw.get("phase", 0)] = (k.n_regs, k.n_spills, k.metadata.num_warps, getattr(k.metadata, "maxnreg", None))
        return k

    dag.launch = recorded
    for preset in presets:
        for B, ctx in shapes:
            fn, _ = decode_call(preset, B, ctx)
            t = graph_time(fn)
            print(f"{preset} B={B} ctx={ctx}: {t:.1f} us; per phase (regs, spills, warps, maxnreg): {seen}", flush=True)
            seen.clear()
            fn = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
