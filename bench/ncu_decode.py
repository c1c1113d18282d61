"""Decode-attention calls for Nsight Compute (or the torch profiler): one store per (preset, batch, context),
each call made twice (the first warms up). Run under ncu to read where the Gluon kernel's time goes:

    ncu --clock-control none -k regex:"kivi|post_decode|_decode_kernel|combine" --section ... \
        python bench/ncu_decode.py kivi-2:32x16384:tma kivi-4:32x16384:ldg ...
    python bench/ncu_decode.py --torch-profile calibquant-1:32x4096     (each kernel's time, torch profiler)

A spec is preset:BxCTX[:tma|ldg] (tma: the shared-memory ring forced on; ldg: plain loads)."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode_attention import pick_layer, random_store  # noqa: E402

from kvq_compile import KVQConfig  # noqa: E402
from kvq_compile.templates import decode_attention_gluon as dag  # noqa: E402
from kvq_compile.templates.decode_attention import decode_attention  # noqa: E402


def call(spec: str):
    preset, shape, *rest = spec.split(":")
    B, ctx = map(int, shape.split("x"))
    cfg = KVQConfig.preset(preset)
    li = pick_layer(cfg)
    dtype = torch.bfloat16
    ms = random_store(cfg, li, li + 1, B, ctx, dtype)
    lay = ms.layers[li]
    names, tensors = lay.attend_tensors()
    bufs = dict(zip(names, tensors))
    q = torch.randn(B, 32, 1, 128, device="cuda", dtype=dtype)
    kc = torch.randn(B, 8, 1, 128, device="cuda", dtype=dtype)
    am = torch.ones(B, 1, 1, ctx, dtype=torch.bool, device="cuda")
    pos = torch.tensor([ctx - 1], device="cuda")
    dag.USE_TMA = {"tma": True, "ldg": False}.get(rest[0] if rest else "", None)
    return lambda: decode_attention(q, bufs, kc, kc, pos, am, 128 ** -0.5, False, cfg, lay.spec, ms.geo)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    for spec in args:
        fn = call(spec)
        if "--torch-profile" in sys.argv:
            from torch.profiler import ProfilerActivity, profile

            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            print(f"{spec}: " + ", ".join(f"{e.key[:40]} x{e.count // 20} {e.device_time_total / 20:.1f} us"
                                          for e in prof.key_averages() if e.device_type.name == "CUDA" and e.count),
                  flush=True)
        else:
            print(f"== {spec}", flush=True)
            fn()
            fn()
            torch.cuda.synchronize()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
