"""Which SM runs each program of a one-dimensional grid of one-warp programs (the first wave), on this GPU: does
program c land on the SM of program c mod (number of SMs)? Session 56's LUT_COHEADS (`lut_coheads_tried.patch`)
relied on it to place the heads of one (row, slice) on one SM; on an H200 it does not (bench/RESULTS.md). Each
program records %smid and spins about 20 us, so that the wave stays resident (168-register cap, as kvquant's).

    python bench/debug/sm_dispatch.py [programs per SM ...]
"""
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _smid(OUT, SPIN: tl.constexpr):
    c = tl.program_id(0)
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    t = t0
    while t - t0 < SPIN:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(OUT + c, sm)


def main():
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    for per_sm in [int(x) for x in sys.argv[1:]] or [4, 8, 12]:
        n = nsm * per_sm
        out = torch.full((n,), -1, dtype=torch.int32, device="cuda")
        for _ in range(3):
            _smid[(n,)](out, SPIN=20000, num_warps=1, maxnreg=168)
        torch.cuda.synchronize()
        sm = out.cpu()
        first = sm[:nsm]
        same = (sm.view(per_sm, nsm)[1:] == first[None]).float().mean().item()   # (row 0 matches by definition)
        load = torch.bincount(sm.long(), minlength=nsm)
        print(f"{nsm} SMs, {per_sm} programs per SM ({n}): share of programs c on the SM of c mod {nsm}: "
              f"{same:.3f} (programs c >= {nsm}); distinct SMs in the first {nsm}: {first.unique().numel()}; "
              f"programs per SM {load.min().item()}-{load.max().item()}; first 16 SM ids {first[:16].tolist()}",
              flush=True)


if __name__ == "__main__":
    main()
