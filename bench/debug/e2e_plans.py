"""Which quantized-region launches a compiled `generate` records (debug): the Gluon kernel's constexprs and grid per
layer kind, from `bench_generate.py`'s model (random Llama-3-8B-shaped, bf16) against the kernel benchmark's call
(`bench_decode_attention.py`'s store) at the same (batch, context). Each unique build printed once.

    python bench/debug/e2e_plans.py [preset] [BxP]      e.g. xquant-1.38 32x4096
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from bench_generate import build, timed_generate  # noqa: E402
from check_gluon import decode_call  # noqa: E402

from kvq_compile.templates import decode_attention_gluon as dag  # noqa: E402

KEYS = ("KBITS", "VBITS", "MASK_KIND", "TMA", "VF", "PAIR", "TPS", "WT", "QZROWS", "S", "R", "BT", "NWIN", "PDL")


def main():
    preset = sys.argv[1] if len(sys.argv) > 1 else "xquant-1.38"
    B, P = map(int, (sys.argv[2] if len(sys.argv) > 2 else "32x4096").split("x"))
    seen = {}
    plan = dag._plan

    def spy(*args, **kwargs):
        fn, a, kws = plan(*args, **kwargs)
        if args[7].numel() <= 1:   # `resident_programs` sizing the launch (placeholder buffers): not a launch
            return fn, a, kws
        key = (getattr(fn, "__name__", str(fn)), f"T={args[11]}", f"B={args[0].shape[0]}", f"nsplit={args[13]}",
               tuple((k, kws.get(k)) for k in KEYS), f"kp codes {tuple(args[1]['codes'].shape)}")
        seen[key] = seen.get(key, 0) + 1
        return fn, a, kws

    dag._plan = spy
    fn, _ = decode_call(preset, B, P)
    fn()
    torch.cuda.synchronize()
    seen.clear()
    g = torch.cuda.CUDAGraph()   # the benchmark times CUDA-graph replays: the ring builds
    with torch.cuda.graph(g):
        fn()
    print("kernel benchmark's call (captured):")
    for k, n in seen.items():
        print(f"  {n}x {k}")
    seen.clear()
    from transformers import CompileConfig

    from kvq_compile import kvq_backend, lowering
    lowering.DEVICES.add("cuda")
    model = build(8)
    ids = torch.randint(100, 120000, (B, P), device="cuda")
    timed_generate(model, ids, 6, cache_implementation="static",
                   compile_config=CompileConfig(backend=kvq_backend(preset), fullgraph=True))
    print("compiled generate:")
    for k, n in seen.items():
        print(f"  {n}x {k}")


if __name__ == "__main__":
    main()
