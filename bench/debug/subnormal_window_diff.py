"""How far apart two settings of a Gluon-kernel flag leave the decode-attention output (GPU): the relative norm
difference and the largest absolute difference of the ring build's output, per layout and test case, through the
GPU tests' own helper (`tests/test_decode_gluon.py::_outputs_by_flag`). Session 31: bf16 subnormal Keys with a code
window of 7 bits against 8 (`SUB_WINDOW`), which were expected bit-equal and were not in 4 of 12 cases.

    python bench/debug/subnormal_window_diff.py [FLAG CONSTEXPR OFF ON]     (default: SUB_WINDOW KSW 7 8)
"""
import ast
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import test_decode_gluon as t  # noqa: E402

flag, constexpr, off, on = (sys.argv[1:5] if len(sys.argv) > 4 else ("SUB_WINDOW", "KSW", "7", "8"))
values = (ast.literal_eval(off), ast.literal_eval(on))
for layout in ("kivi-2", "k1v1", "kivi-4"):
    for i in (0, 3, 7, 9):
        case = t.CASES[i]
        with pytest.MonkeyPatch.context() as mp:
            a, b = (x.float() for x in t._outputs_by_flag(layout, case, torch.bfloat16, case[0] * 41 + case[4], flag,
                                                           constexpr, mp, values=values))
        rel = ((b - a).norm() / a.norm()).item()
        print(f"{flag} {values[0]} -> {values[1]} {layout} case {i}: equal {torch.equal(a, b)}, relative {rel:.2e}, "
              f"max abs {(b - a).abs().max().item():.2e} (output max {a.abs().max().item():.2e})", flush=True)
