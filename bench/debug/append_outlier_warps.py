"""Whether the append template stays exact with outliers at 1, 2 and 4 warps, and what the warps cost.
Since session 15 a side with outliers launches with 4 warps: at 1 and 2 the H100 miscomputed a channel-grouped
side's codes with outliers. Session 40 found the outlier choice itself broken at RING_VEC 0 (argmax over scores
reshaped to [GP, WP * CP]) and replaced it with a max and a min over the slots; this checks whether 4 warps are
still needed: tests/test_append_template.py's outlier cases (`check`, every buffer after every step, codes
exactly on the GPU) at each warp count, then the kvquant outlier presets' step and flush-step times (CUDA graphs
of 20 appends, `bench_decode_attention.graph_time`) at each warp count.
usage: python bench/debug/append_outlier_warps.py"""
import functools
import os
import sys

import torch

sys.path.insert(0, "tests")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import test_append_template as t  # noqa: E402
from bench_append import append_setup, completes  # noqa: E402
from bench_decode_attention import graph_time  # noqa: E402
from models import small_windows  # noqa: E402

from kvq_compile import KVQConfig  # noqa: E402
from kvq_compile.config import Axis, Levels  # noqa: E402
from kvq_compile.templates import quantize_append as qa  # noqa: E402


def cases():
    yield "chgrp-4bit-out", dict(cfg=KVQConfig(key=t._q(4, Axis.CHANNEL, 4, outliers=0.05),
                                               value=t._q(2, Axis.CHANNEL, 4), sink=1, recent=4), D=64, steps=12)
    cfg = KVQConfig(key=t._q(3, Axis.CHANNEL, None, levels=Levels.NORMAL_FLOAT, outliers=0.03),
                    value=t._q(2, Axis.CHANNEL, 4, outliers=0.05), sink=1, recent=4, keys_before_rope=True)
    cfg.codebooks = {"0.key": torch.linspace(-1, 1, 8).pow(3).tolist()}
    yield "codebook-static-and-grouped-out", dict(cfg=cfg, D=64, steps=12)
    yield "kvquant-4-1%-strided", dict(cfg=small_windows("kvquant-4-1%"), strided=True)
    yield "kvquant-3-1%", dict(cfg=small_windows("kvquant-3-1%"), D=128)
    yield "chgrp-2bit-out-D128", dict(cfg=KVQConfig(key=t._q(2, Axis.CHANNEL, 8, outliers=0.02),
                                                    value=t._q(4, Axis.TOKEN, 32, outliers=0.02), sink=1,
                                                    recent=8), D=128, steps=24, dtype=torch.bfloat16)


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    original = qa.append_decode
    for nw in (1, 2, 4):
        t.append_decode = functools.partial(original, num_warps=nw)
        for vec in (0, 2):
            qa.RING_VEC = vec
            for name, kw in cases():
                for seed in range(3):
                    try:
                        t.check(seed=seed, **kw)
                        res = "exact"
                    except AssertionError as e:
                        res = "DIFFERS: " + str(e).splitlines()[0][:150]
                    print(f"warps {nw} ring_vec {vec} {name:32s} seed {seed}: {res}", flush=True)
    t.append_decode, qa.RING_VEC = original, 2
    for name in ("kvquant-4-1%", "kvquant-3-1%"):
        for B, ctx in ((8, 8192), (32, 4096)):
            cfg, ms, lay, bufs, k, v, flush = append_setup(name, B, ctx)
            quiet = next((p for p in range(ctx, ctx + 64) if not completes(cfg, p)), ctx)
            cs = (torch.randn(B, 1, 128, device="cuda", dtype=torch.bfloat16),) * 2
            for nw in (1, 2, 4):
                ts = []
                for p in (quiet, flush):
                    pos = torch.tensor([p], device="cuda")
                    ts.append(graph_time(lambda: original(bufs, cfg, lay.spec, ms.geo, k, v, pos, *cs,
                                                          num_warps=nw)))
                print(f"time {name:13s} B={B:2d} ctx={ctx:5d} warps {nw}: step {ts[0]:6.2f} us  flush {ts[1]:6.2f} us",
                      flush=True)
            del ms, bufs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
