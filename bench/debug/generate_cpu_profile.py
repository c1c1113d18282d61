"""Where the wall-clock of a kvq decode step inside HF's `generate` goes beyond its GPU time (debug): the median step
of a timed generate, then the torch profiler (CPU and CUDA) over 8 decode steps of another (`profiled_decode`), its
top host ops by self CPU time, and Dynamo's counters (recompiles, graph breaks). Written when kvquant-4's step at
(32, 4096) took 6.28 ms wall-clock against 3.30 ms of GPU time, while kivi-4's took 4.34 against 2.91 (session 19).

    python bench/debug/generate_cpu_profile.py [presets] [BxP]      e.g. kivi-4,kvquant-4 32x4096
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_generate import build, profiled_decode, timed_generate  # noqa: E402


def main():
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    from kvq_compile import kvq_backend

    presets = (sys.argv[1] if len(sys.argv) > 1 else "kivi-4,kvquant-4").split(",")
    B, P = map(int, (sys.argv[2] if len(sys.argv) > 2 else "32x4096").split("x"))
    model = build(8)
    ids = torch.randint(100, 120000, (B, P), device="cuda")
    for preset in presets:
        torch._dynamo.reset()
        counters.clear()
        kw = dict(cache_implementation="static",
                  compile_config=CompileConfig(backend=kvq_backend(preset), fullgraph=True))
        step, n = timed_generate(model, ids, 32, **kw)
        prof = profiled_decode(model, ids, 8, 32, cpu=True, **kw)
        print(f"== {preset} B={B} P={P}: median step {step * 1e3:.2f} ms over {n} steps; dynamo counters "
              f"{ {k: dict(v) for k, v in counters.items() if k in ('stats', 'recompiles', 'graph_break', 'inductor')} }",
              flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70),
              flush=True)


if __name__ == "__main__":
    main()
