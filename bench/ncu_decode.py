"""Decode-attention calls for Nsight Compute (or the torch profiler): one store per (preset, batch, context),
each call made twice (the first warms up). Run under ncu to read where the Gluon kernel's time goes:

    ncu --clock-control none -k regex:"_decode_kernel|_temperature|_combine" --section ... \
        python bench/ncu_decode.py kivi-2:32x16384:tma kivi-4:32x16384:ldg ...
    python bench/ncu_decode.py --torch-profile calibquant-1:32x4096     (each kernel's time, torch profiler)

A spec is preset:BxCTX[:tma|ldg] (tma: the shared-memory ring forced on; ldg: plain loads)."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from check_gluon import decode_call, kernel_times  # noqa: E402

from kvq_compile.templates import decode_attention_gluon as dag  # noqa: E402


def call(spec: str):
    preset, shape, *rest = spec.split(":")
    B, ctx = map(int, shape.split("x"))
    dag.USE_TMA = {"tma": True, "ldg": False}.get(rest[0] if rest else "", None)
    return decode_call(preset, B, ctx)[0]


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    fn = None
    for spec in args:
        del fn   # the last store goes before the next one is built
        torch.cuda.empty_cache()
        fn = call(spec)
        if "--torch-profile" in sys.argv:
            print(f"{spec}: {kernel_times(fn)}", flush=True)
        else:
            print(f"== {spec}", flush=True)
            fn()
            fn()
            torch.cuda.synchronize()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
