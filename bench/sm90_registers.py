"""Registers and spill stack of the prefill template's launches, compiled for Hopper (sm_90) without a GPU.

    python bench/sm90_registers.py [--presets kivi-2,int8,...] [--block-m 16] [--block-t 16,32] [--warps 4,8]

Each launch of `prefill_attention` (head_dim 128, 32 query / 8 KV heads, bf16, with and without a boolean mask)
is captured and compiled by triton.compile for sm_90 (ptxas from the triton wheel); `cuobjdump -res-usage`
reports its registers per thread and its stack (bytes of spilled registers). Run without TRITON_INTERPRET.
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kvq_compile.templates.prefill_attention as pa
from kvq_compile import KVQConfig
from kvq_compile import store as st

TY = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int32: "*i32",
      torch.int64: "*i64", torch.uint8: "*u8", torch.int16: "*i16", torch.bool: "*i1"}


def resources(kernel) -> tuple[int, int]:
    """(registers per thread, stack bytes) of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    try:
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return int(re.search(r"REG:(\d+)", out).group(1)), int(re.search(r"STACK:(\d+)", out).group(1))


class Capture:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **consts)` compiles for sm_90 instead."""

    def __init__(self, fn):
        self.fn, self.last = fn, None

    def __getitem__(self, grid):
        def run(*args, num_warps=4, num_stages=2, **consts):
            sig = {n: (TY[a.dtype] if isinstance(a, torch.Tensor) else "fp32" if isinstance(a, float) else "i32")
                   for n, a in zip(self.fn.arg_names, args)}
            sig |= {n: "constexpr" for n in consts}
            self.last = triton.compile(ASTSource(fn=self.fn, signature=sig, constexprs=consts),
                                       target=GPUTarget("cuda", 90, 32),
                                       options=dict(num_warps=num_warps, num_stages=num_stages))
        return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="fp16,int8,kivi-4,kivi-2,kvquant-4,kvquant-2-1%,innerq-2,innerq-k3v2,"
                                          "xquant-1.38,calibquant-1")
    ap.add_argument("--block-m", default="16")
    ap.add_argument("--block-t", default="16")
    ap.add_argument("--warps", default="8")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1 (the kernels are compiled, not interpreted)")
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    cap = pa._prefill_kernel = Capture(pa._prefill_kernel)
    B, HQ, H, D, T, n = 2, 32, 8, 128, 256, 64
    print(f"prefill template for sm_90, triton {triton.__version__}, head_dim {D}, GQA {HQ // H}, bf16")
    for name in a.presets.split(","):
        cfg = KVQConfig.preset(name)
        geo = st.Geometry(B, H, T, D, "bfloat16")
        lay = st.ModelStore(cfg, 4, geo, "cpu").layers[-1]
        names, tensors = lay.attend_tensors()
        q = torch.zeros(B, HQ, n, D, dtype=torch.bfloat16)
        kv = torch.zeros(B, H, n, D, dtype=torch.bfloat16)
        bool_mask = torch.ones(B, 1, n, T, dtype=torch.bool)
        for bm, bt, w, mask in itertools.product(ints(a.block_m), ints(a.block_t), ints(a.warps), (None, bool_mask)):
            pa.prefill_attention(q, dict(zip(names, tensors)), kv, kv, torch.arange(5, 5 + n), mask, 0.1, False,
                                 cfg, lay.spec, geo, block_m=bm, block_t=bt, num_warps=w)
            regs, stack = resources(cap.last)
            print(f"  {name:13s} rows {bm * 4:3d} tile {bt:3d} warps {w} mask {'bool' if mask is not None else 'none'}:"
                  f" {regs:3d} registers, {stack:4d} bytes spilled", flush=True)


if __name__ == "__main__":
    main()
