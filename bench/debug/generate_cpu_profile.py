"""Where the wall-clock of a kvq decode step inside HF's `generate` goes beyond its GPU time (debug): the median step
of a timed generate, then the torch profiler (CPU and CUDA) over 8 decode steps of another, its top host ops by
self CPU time, and Dynamo's counters (recompiles, graph breaks). Written when kvquant-4's step at (32, 4096) took
6.28 ms wall-clock against 3.30 ms of GPU time, while kivi-4's took 4.34 against 2.91 (session 19).

    python bench/debug/generate_cpu_profile.py [presets] [BxP]      e.g. kivi-4,kvquant-4 32x4096
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_generate import build, timed_generate  # noqa: E402


class Window:
    """A logits processor: the profiler (CPU and CUDA) over generated tokens [8, 16)."""

    def __init__(self):
        from torch.profiler import ProfilerActivity, profile

        self.n = 0
        self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def __call__(self, ids, scores):
        if self.n == 8:
            torch.cuda.synchronize()
            self.prof.start()
        elif self.n == 16:
            torch.cuda.synchronize()
            self.prof.stop()
        self.n += 1
        return scores


def main():
    from torch._dynamo.utils import counters
    from transformers import CompileConfig, LogitsProcessorList

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
        win = Window()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                       do_sample=False, logits_processor=LogitsProcessorList([win]), **kw)
        print(f"== {preset} B={B} P={P}: median step {step * 1e3:.2f} ms over {n} steps; dynamo counters "
              f"{ {k: dict(v) for k, v in counters.items() if k in ('stats', 'recompiles', 'graph_break', 'inductor')} }",
              flush=True)
        print(win.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70),
              flush=True)


if __name__ == "__main__":
    main()
