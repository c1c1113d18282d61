"""Device debug: a test_append_template case on CUDA; dump its inputs and both stores (to $OUT) for analysis.

    python bench/debug/append_dump.py BITS DTYPE      # test_bits_dtypes_channel_groups[DTYPE-BITS]
"""
import os
import sys

import torch

sys.path.insert(0, "tests")
import test_append_template as t  # noqa: E402
from kvq_compile import KVQConfig  # noqa: E402
from kvq_compile.config import Axis, Symmetry  # noqa: E402

bits, dtype = int(sys.argv[1]), getattr(torch, sys.argv[2])
inputs = []
randn = torch.randn


def rec(*a, **k):
    x = randn(*a, **k)
    inputs.append(x.detach().cpu().clone())
    return x


t.torch.randn = rec
diffs = []
t._codes_close = lambda name, a, b, spec, D, exact=True: diffs.append(name) if not torch.equal(a, b) else None
sym = Symmetry.SYMMETRIC if bits in (1, 4) else Symmetry.ASYMMETRIC
cfg = KVQConfig(key=t._q(bits, Axis.CHANNEL, 4, sym), value=t._q(bits, Axis.TOKEN, 16, sym), sink=1, recent=8)
try:
    mr, mt = t.check(cfg, dtype=dtype, seed=bits)
finally:
    torch.randn = randn
print("differing code buffers:", diffs[:5], len(diffs))
torch.save(dict(inputs=inputs, ref={n: x.cpu() for n, x in mr.layers[0].buffers.items()},
                tri={n: x.cpu() for n, x in mt.layers[0].buffers.items()}),
           os.path.join(os.environ.get("OUT", "/tmp"), f"append_dump_{bits}_{sys.argv[2]}.pt"))
