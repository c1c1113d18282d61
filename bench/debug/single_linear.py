"""A decode step's lone projections (o_proj, down_proj, lm_head) as one-weight `kvq::grouped_linear` launches against
cuBLAS (`F.linear`), bf16, CUDA-graph timed, at Llama-3-8B shapes (debug). Sweeps the launch's tile sizes through
`templates.grouped_linear.launch`'s overrides and prints the default configuration's time beside the best (the stages
as run: `fit_stages` may cut them), to decide whether the pass should take lone linears (`singles=`; bench/RESULTS.md,
session 54). L2 is not flushed between replays: a weight that fits in L2 (o_proj's 33.5 MB on an H200) may read high.

    python bench/debug/single_linear.py [M,...]       e.g. 1,8,32
"""
from __future__ import annotations

import sys

import torch
import triton
from skinny_gemm import copy_bandwidth, graph_us   # (this folder: the script's own)

from kvq_compile.templates import grouped_linear as gl


def main():
    Ms = [int(m) for m in (sys.argv[1] if len(sys.argv) > 1 else "1,8,32").split(",")]
    dev = "cuda"
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} copy {bw / 1e12:.2f} TB/s", flush=True)
    shapes = {"o": (4096, 4096), "down": (4096, 14336), "lm_head": (128256, 4096), "qkv-as-one": (6144, 4096)}
    configs = [dict(BN=bn, BK=bk, num_stages=st, num_warps=4) for bn in (16, 32, 64) for bk in (128, 256)
               for st in (3, 4, 6)]
    for M in Ms:
        for name, (N, K) in shapes.items():
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
            y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x, w)
            nbytes = N * K * 2
            t_cu = graph_us(lambda: torch.nn.functional.linear(x, w))
            gl.launch(x, [w], [y])
            err = (y.float() - ref.float()).abs().max().item()
            t_def = graph_us(lambda: gl.launch(x, [w], [y]))
            best = None
            for cfg in configs:
                try:
                    gl.launch(x, [w], [y], **cfg)
                    assert (y.float() - ref.float()).abs().max().item() < 2e-2 * ref.abs().max().item()
                    t = graph_us(lambda: gl.launch(x, [w], [y], **cfg))
                except Exception as e:  # noqa: BLE001
                    print(f"  {name} M={M} {cfg}: {type(e).__name__} {str(e)[:80]}")
                    continue
                if best is None or t < best[0]:
                    stages = gl.fit_stages(cfg["num_stages"], cfg["BN"], cfg["BK"], max(16, triton.next_power_of_2(M)),
                                           2, gl._shared_limit(torch.cuda.current_device()))
                    best = (t, dict(cfg, num_stages=stages))
            if best is None:
                print(f"M={M:3d} {name:10s}: no configuration ran")
                continue
            print(f"M={M:3d} {name:10s} N={N:6d} K={K:6d} cuBLAS {t_cu:7.2f} us ({nbytes / (t_cu * 1e-6) / bw:5.1%})  "
                  f"default {gl.config(M, K, (N,))} {t_def:7.2f} us ({nbytes / (t_def * 1e-6) / bw:5.1%}, max diff "
                  f"{err:.3g})  best {best[1]} {best[0]:7.2f} us ({nbytes / (best[0] * 1e-6) / bw:5.1%})", flush=True)


if __name__ == "__main__":
    main()
