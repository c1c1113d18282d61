"""Host overhead of one decode step: a tiny model (2 layers, hidden 128) whose GPU work is negligible, so the step
time of `generate` is the Python of HF's loop, Dynamo's guards, CUDA-graph replay and kvq's step runner.

    python bench/host_overhead.py [presets]     e.g. fp16,kivi-2,kvquant-4 (the default: fp16,kivi-2)

Written in session 7 to locate the 2-3 ms of an H100 decode step that neither weights nor attention account for.
On an H100 (session 8, bench/RESULTS.md): 2.21 ms/step for HF's compiled static cache, 1.61 for kvq fp16, 1.51
for kvq kivi-2; HF's generate synchronizes every step, so this time adds to each step of a real model.
"""
import os
import sys
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from models import compile_config, hf_model, prompts, small_windows  # noqa: E402

from kvq_compile import kvq_backend  # noqa: E402


class Clock(LogitsProcessor):
    def __init__(self):
        self.t = []

    def __call__(self, ids, scores):
        self.t.append(time.perf_counter())
        return scores


def step_ms(model, ids, mask, **kw) -> float:
    c = Clock()
    model.generate(ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                   cache_implementation="static", logits_processor=LogitsProcessorList([c]), **kw)
    d = sorted(b - a for a, b in zip(c.t[5:], c.t[6:]))
    return d[len(d) // 2] * 1e3


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = hf_model("llama", kv_heads=1, gqa=2, head_dim=64, layers=2).to(dev)
    ids, mask = (t.to(dev) for t in prompts(1, 16))
    print(torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch.__version__)
    presets = (sys.argv[1] if len(sys.argv) > 1 else "fp16,kivi-2").split(",")
    for name, backend in [("hf static compiled (inductor)", "inductor")] + [
            (f"kvq {p}", kvq_backend(small_windows(p))) for p in presets]:
        torch._dynamo.reset()
        step_ms(model, ids, mask, compile_config=compile_config(backend))
        print(f"{name:32s} {step_ms(model, ids, mask, compile_config=compile_config(backend)):6.2f} ms/step", flush=True)


if __name__ == "__main__":
    main()
