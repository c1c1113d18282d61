"""Where the wall-clock of a kvq decode step inside HF's `generate` goes beyond its GPU time (debug): the median step
of a timed generate, then the torch profiler (CPU and CUDA) over 8 decode steps of another (`profiled_decode`), its
top host ops by self CPU time, Dynamo's counters (recompiles, graph breaks), and its GPU timeline: the GPU's busy
time (the union of kernel intervals) against the window's span, the longest idle gaps with the kernels on either side
and the host ops running during them, and the chrome trace (gzip) under $OUT. Written when kvquant-4's step at
(32, 4096) took 6.28 ms wall-clock against 3.30 ms of GPU time, while kivi-4's took 4.34 against 2.91 (session 19;
the timeline in session 20).

    python bench/debug/generate_cpu_profile.py [presets] [BxP]      e.g. kivi-4,kvquant-4 32x4096
"""
from __future__ import annotations

import gzip
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_generate import build, profiled_decode, timed_generate  # noqa: E402


def busy_and_gaps(prof, top: int = 12):
    """(window span, GPU busy time, the `top` longest idle gaps as (us, kernel before, kernel after, host ops
    overlapping the gap)), all in us, over the profiled window."""
    from torch.autograd import DeviceType

    evs = [e for e in prof.events() if e.time_range.end > e.time_range.start]
    gpu = sorted((e for e in evs if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    host = [e for e in evs if e.device_type == DeviceType.CPU]
    t0 = min(e.time_range.start for e in evs)
    t1 = max(e.time_range.end for e in evs)
    busy, end, gaps, prev = 0.0, None, [], None
    for e in gpu:
        s, f = e.time_range.start, e.time_range.end
        if end is None or s >= end:
            if end is not None:
                gaps.append((s - end, prev.name, e.name, end, s))
            busy += f - s
            end, prev = f, e
        elif f > end:
            busy += f - end
            end, prev = f, e
    gaps.sort(key=lambda g: -g[0])
    out = []
    for dt, a, b, s, f in gaps[:top]:
        during = sorted({h.name for h in host if h.time_range.start < f and h.time_range.end > s
                         and h.time_range.end - h.time_range.start < 5 * (f - s) + 1000})
        out.append((dt, a, b, during[:12]))
    return t1 - t0, busy, out, sum(g[0] for g in gaps), len(gaps)


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
        span, busy, gaps, idle, ngaps = busy_and_gaps(prof)
        print(f"== {preset} timeline of the 8 profiled steps: span {span / 8e3:.2f} ms/step, GPU busy "
              f"{busy / 8e3:.2f} ms/step, idle {idle / 8e3:.2f} ms/step in {ngaps} gaps", flush=True)
        for dt, a, b, during in gaps:
            print(f"  gap {dt:8.1f} us after {a[:60]!r} before {b[:60]!r}; host: {', '.join(x[:40] for x in during)}")
        if os.environ.get("OUT"):
            path = os.path.join(os.environ["OUT"], f"trace_{preset}_{B}x{P}.json")
            prof.export_chrome_trace(path)
            with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
                shutil.copyfileobj(f, g)
            os.remove(path)


if __name__ == "__main__":
    main()
