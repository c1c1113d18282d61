"""HF's compiled static cache inside `generate` against bench_decode_loop's tight loop (debug): the top CUDA kernels
of 8 decode steps of each, at one shape, in a fresh process. Written when bench_generate read 28 ms of GPU time per
step at (32, 4096) against the tight loop's 15: here both read 15.2 ms (session 18); the 28 ms came from running
that shape after another one in bench_generate's process (now one process per shape).

    python bench/debug/hf_profile.py [layers] [BxP]      e.g. 8 32x4096
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_decode_loop import decode_loop  # noqa: E402
from bench_generate import build, profiled_decode, timed_generate  # noqa: E402


def table(prof, title):
    print(title, flush=True)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=90),
          flush=True)


def main():
    from torch.profiler import ProfilerActivity, profile
    from transformers import CompileConfig

    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    B, P = map(int, (sys.argv[2] if len(sys.argv) > 2 else "32x4096").split("x"))
    model = build(layers)
    ids = torch.randint(100, 120000, (B, P), device="cuda")
    kw = dict(cache_implementation="static", compile_config=CompileConfig())
    print(f"CompileConfig() defaults: {CompileConfig().to_dict()}", flush=True)
    timed_generate(model, ids, 18, **kw)
    table(profiled_decode(model, ids, 8, **kw), f"generate, HF compiled static cache, B={B} P={P}: 8 decode steps")
    torch._dynamo.reset()
    fn = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    prof = profile(activities=[ProfilerActivity.CUDA])
    decode_loop(model, ids, fn, 6, 8, prof=prof)
    table(prof, f"tight loop (bench_decode_loop), B={B} P={P}: 8 decode steps")


if __name__ == "__main__":
    main()
