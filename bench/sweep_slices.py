"""Decode attention (CUDA-graph timed, bool mask) at small batch with the Gluon launch's slices at least k tiles long
(k = 4: the shortest slice `_fill_splits` makes): is a longer slice better where the SMs would hold more programs?

    python bench/sweep_slices.py
"""
import sys; sys.path.insert(0, "bench")
import torch
from check_gluon import decode_call
from bench_decode_attention import graph_time
from kvq_compile.templates import decode_attention as da
for preset in ("kivi-2", "kivi-4", "calibquant-1"):
    for B, ctx in ((1, 16384), (1, 65536), (8, 8192), (2, 16384), (4, 8192)):
        fn, _ = decode_call(preset, B, ctx)
        fn(); fill = da.LAST_KERNELS["splits"]
        line = []
        for k in (2, 3, 4, 6, 8):
            ns = max(1, min(fill, ctx // (k * 32)))
            line.append(f"min{k}t ({ns}) {graph_time(lambda: fn(num_splits=ns)):.1f}")
        print(f"{preset} B={B} ctx={ctx} fill={fill}: " + ", ".join(line), flush=True)
        fn = None
        torch.cuda.empty_cache()
