"""`quantize_append._div_by` (a shared reciprocal and one correction step) against tl.math.div_rn on the GPU (debug):
every float32 numerator significand, in each binade [2^e, 2^(e+1)) for e in -30..3 and both signs (a power of two
scales the whole division exactly, so the binades repeat the same significand pairs: what varies is only where the
steps' results land), over a set of divisors h (random half-widths from 1e-6 to 1e4, half of them bfloat16-rounded,
and six fixed ones), and the count of quotients whose bits differ. Numerators below 2^-100, where `_div_by` may
differ (its docstring), are not in this range; so no quotient here is subnormal.

    python bench/debug/div_by_check.py [divisors]      (default 64, plus the six fixed ones)
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from kvq_compile.templates.quantize_append import LAUNCH_OPTIONS, _div_by


@triton.jit
def _check_kernel(H, BASE, SIGN, COUNT, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.load(H + tl.program_id(1))
    a = (tl.load(BASE) + i).to(tl.float32, bitcast=True) * SIGN
    want = tl.math.div_rn(a, h)
    got = _div_by(a, h)
    normal = tl.abs(want) >= 1.1754943508222875e-38
    differ = got.to(tl.int32, bitcast=True) != want.to(tl.int32, bitcast=True)
    tl.atomic_add(COUNT + 0, tl.sum((differ & normal).to(tl.int64), 0))
    tl.atomic_add(COUNT + 1, tl.sum((differ & ~normal).to(tl.int64), 0))
    tl.atomic_add(COUNT + 2, tl.sum(normal.to(tl.int64), 0))


def main():
    n_div = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    g = torch.Generator().manual_seed(0)
    h = torch.exp(torch.empty(n_div, dtype=torch.float64).uniform_(-13.8, 9.2, generator=g)).float()
    h[: n_div // 2] = h[: n_div // 2].bfloat16().float()
    h = torch.cat([h, torch.tensor([1e-6, 1.0, 1.5, 3.0, 0.1, 2.0 ** -20])]).cuda()
    count = torch.zeros(3, dtype=torch.int64, device="cuda")
    block, per_binade = 1024, 1 << 23
    total = 0
    for e in range(-30, 4):
        base = torch.tensor([(e + 127) << 23], dtype=torch.int32, device="cuda")
        for sign in (1.0, -1.0):
            _check_kernel[(per_binade // block, h.numel())](h, base, sign, count, BLOCK=block, **LAUNCH_OPTIONS)
            total += per_binade * h.numel()
    torch.cuda.synchronize()
    bad, bad_sub, normal = count.tolist()
    print(f"{torch.cuda.get_device_name()}: {total} quotients ({h.numel()} divisors x every float32 numerator in "
          f"[2^-30, 2^4), both signs: each divisor against every numerator significand, 68 times): {bad} of {normal} "
          f"normal-range quotients differ from div_rn, {bad_sub} of {total - normal} subnormal ones")


if __name__ == "__main__":
    main()
