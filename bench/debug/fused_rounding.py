"""Does the GPU compiler's multiply-add fusion move `_uniform_code` off the reference? The near-tie inputs of
tests/test_append_template.py::test_uniform_code_near_ties, coded with the append's launch options
(`quantize_append.LAUNCH_OPTIONS`: fusion off) and with Triton's default (fusion on); prints the codes that
differ from the reference per level count.   python bench/debug/fused_rounding.py   (a CUDA device)"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import test_append_template as t  # noqa: E402

from kvq_compile import reference as ref  # noqa: E402
from kvq_compile.templates.quantize_append import LAUNCH_OPTIONS  # noqa: E402


def main():
    for levels in (4, 8, 15, 16, 255, 256):
        x = t.near_ties(levels).cuda()
        n = x.numel()
        want = ref.nearest_level(x, ref.uniform_levels(levels, "cuda"), uniform=True)
        row = []
        for label, opts in (("append's options", LAUNCH_OPTIONS), ("fusion on", dict(enable_fp_fusion=True))):
            y = torch.empty(n, dtype=torch.int32, device="cuda")
            t._code_kernel[(1,)](x, y, N=n, LEVELS=levels, **opts)
            row.append(f"{label}: {(y != want).sum().item()} of {n} codes differ")
        print(f"levels {levels:3d}  " + "; ".join(row), flush=True)


if __name__ == "__main__":
    main()
