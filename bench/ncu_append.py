"""Quantize-on-append calls for Nsight Compute: a KIVI step that flushes a Key group, per channel split and warp
count, each call made twice (the first warms up).

    ncu --clock-control none -k regex:_append_kernel --section SpeedOfLight --section WarpStateStats \
        python bench/ncu_append.py kivi-2:32x4096:32:4 kivi-2:32x4096:128:4 ...

A spec is preset:BxCTX:channels_per_program:warps[:quiet] (quiet: the step after the flush, which completes no
group)."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_append import append_setup  # noqa: E402

from kvq_compile.templates import quantize_append as qa  # noqa: E402


def main():
    for spec in sys.argv[1:]:
        preset, shape, ch, nw, *quiet = spec.split(":")
        if quiet not in ([], ["quiet"]):
            raise SystemExit(f"{spec}: the fifth field can only be 'quiet'")
        B, ctx = map(int, shape.split("x"))
        cfg, ms, lay, bufs, k, v, flush = append_setup(preset, B, ctx)
        qa.FLUSH_CHANNELS = int(ch)
        print(f"== {spec}", flush=True)
        for _ in range(2):
            pos = torch.tensor([flush + bool(quiet)], device="cuda")
            qa.append_decode(bufs, cfg, lay.spec, ms.geo, k, v, pos, num_warps=int(nw))
        torch.cuda.synchronize()
        del ms, bufs


if __name__ == "__main__":
    main()
