"""Where one decode-attention call's time goes (debug): the CUDA-graph time of the whole call, of the call without
the window launch, without the final reduction, and of the quantized-region launch alone (outputs then wrong:
timing only), plus each kernel's own time (torch profiler, no graph). With a calibrated softmax (calibquant), also
without the range pass (TAU_PHASE 1: both its launches; the temperature then reads stale buffers). calibquant-1's
Gluon launches attend the windows themselves since session 21 (`decode_attention_gluon.window_inside`): there "no
window" skips nothing, and "no range pass" leaves its attention pass reading stale ranges.

    python bench/debug/parts.py [presets] [shapes] [dtype]     e.g. kivi-2,kivi-4 8x8192,32x4096 float16
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from bench_decode_attention import graph_time, copy_bandwidth  # noqa: E402
from check_gluon import decode_call, kernel_times  # noqa: E402

from kvq_compile import KVQConfig  # noqa: E402
from kvq_compile.templates import decode_attention as da  # noqa: E402


class _Skip:
    """Stands in for a Triton kernel: launches it unless `skip(kwargs)`."""

    def __init__(self, kernel, skip):
        self.kernel, self.skip = kernel, skip

    def __getitem__(self, grid):
        def run(*args, **kw):
            return None if self.skip(kw) else self.kernel[grid](*args, **kw)
        return run


def main():
    presets = (sys.argv[1] if len(sys.argv) > 1 else "kivi-2,kivi-4").split(",")
    shapes = [tuple(map(int, s.split("x"))) for s in (sys.argv[2] if len(sys.argv) > 2 else
                                                       "1x16384,8x8192,32x4096,32x16384").split(",")]
    dtype = getattr(torch, sys.argv[3] if len(sys.argv) > 3 else "bfloat16")
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()} copy {bw / 1e12:.2f} TB/s", flush=True)
    dk, ck, gl = da._decode_kernel, da._combine_kernel, da.dag.launch
    for preset in presets:
        for B, ctx in shapes:
            fn, nbytes = decode_call(preset, B, ctx, dtype)
            res = {}
            variants = [("all", False, False, False), ("no window", True, False, False),
                        ("no reduction", False, True, False), ("main only", True, True, False)]
            if KVQConfig.preset(preset).softmax_tau is not None:
                variants.append(("no range pass", False, False, True))
            for name, window, combine, no_range in variants:
                da._decode_kernel = _Skip(dk, lambda kw, w=window, r=no_range: (w and kw.get("WINDOW"))
                                          or (r and kw.get("TAU_PHASE") == 1))
                da._combine_kernel = _Skip(ck, lambda kw, c=combine: c)
                if no_range:
                    da.dag.launch = lambda *a, **kw: None if kw.get("phase") == 1 else gl(*a, **kw)
                try:
                    res[name] = graph_time(fn)
                finally:
                    da._decode_kernel, da._combine_kernel, da.dag.launch = dk, ck, gl
            print(f"{preset} {str(dtype)[6:]} B={B} ctx={ctx} splits {da.LAST_KERNELS['splits']} ({nbytes / 1e6:.1f} MB, floor "
                  f"{nbytes / bw * 1e6:.1f} us): " + ", ".join(f"{k} {v:.1f} us" for k, v in res.items()), flush=True)
            print("  profile: " + kernel_times(fn), flush=True)
            fn = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
