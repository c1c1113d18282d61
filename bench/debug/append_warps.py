"""Session 14: the outlier + channel-group append config of tests/test_append_template.py at 2, 4 and 1 warps,
several seeds, on the GPU: which warp counts match the reference."""
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import test_append_template as t  # noqa: E402
from kvq_compile import KVQConfig  # noqa: E402
from kvq_compile.config import Axis, Levels  # noqa: E402
from kvq_compile.templates import quantize_append as qa  # noqa: E402

base = qa.append_decode
for nw in (2, 4, 1):
    t.append_decode = functools.partial(base, num_warps=nw)
    k3 = t._q(3, Axis.CHANNEL, None, levels=Levels.NORMAL_FLOAT, outliers=0.03)
    for name, kq, vq in (("k3 static+out, v2 chan+out", k3, t._q(2, Axis.CHANNEL, 4, outliers=0.05)),
                         ("v2 chan+out only", t._q(2, Axis.TOKEN, 16), t._q(2, Axis.CHANNEL, 4, outliers=0.05)),
                         ("v2 chan, no outliers", t._q(2, Axis.TOKEN, 16), t._q(2, Axis.CHANNEL, 4)),
                         ("v2 token+out", t._q(2, Axis.TOKEN, 16), t._q(2, Axis.TOKEN, 16, outliers=0.05))):
        for seed in range(4):
            cfg = KVQConfig(key=kq, value=vq, sink=1, recent=4, keys_before_rope=kq.group_size is None)
            if kq.group_size is None:
                cfg.codebooks = {"0.key": torch.linspace(-1, 1, 8).pow(3).tolist()}
            try:
                t.check(cfg, D=64, steps=12, seed=seed)
                r = "ok"
            except AssertionError as e:
                r = "FAIL " + str(e).split("\n")[0][:120]
            print(f"warps {nw} {name:28s} seed {seed}: {r}", flush=True)
