"""SASS of the append kernel (`templates/quantize_append.py`) for Hopper (sm_90), compiled on a machine without a GPU
(debug): per preset, with the channel split of a batch of 8 KV heads a sequence (`_chunks`), the instruction count,
registers and the 14 most common opcodes. For comparing variants of the append offline (run it on each) before a
device call.

    [DUMP=dir] python bench/debug/append_sass.py [presets] [batch]     e.g. kivi-2,innerq-2 32
"""
from __future__ import annotations

import collections
import os
import sys

import torch

from kvq_compile import KVQConfig
from kvq_compile import store as st
from kvq_compile.templates import quantize_append as qa

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from sm90_sass import _instructions, _opcode, compile_sm90  # noqa: E402

TY = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int32: "*i32",
      torch.int64: "*i64", torch.uint8: "*u8", torch.int16: "*i16", torch.bool: "*i1"}


def sass_of(preset: str, batch: int, sms: int = 132, kv_heads: int = 8):
    """(instruction count, opcode counter, registers, SASS text) of the append kernel of `preset` with the channel
    split of batch x kv_heads rows on `sms` SMs (pointers not marked 16-byte aligned, as the JIT would: for
    comparing variants, not absolute counts)."""
    got = {}

    class Capture:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def run(*args, num_warps=4, enable_fp_fusion=True, **consts):
                sig = {n: (TY[a.dtype] if isinstance(a, torch.Tensor) else "fp32" if isinstance(a, float) else "i32")
                       for n, a in zip(self.fn.arg_names, args)}
                got["build"] = compile_sm90(self.fn, sig, consts, (), num_warps=num_warps,
                                            enable_fp_fusion=enable_fp_fusion)
            return run

    real, count = qa._append_kernel, qa._sm_count
    qa._append_kernel, qa._sm_count = Capture(real), lambda device: sms
    try:
        cfg = KVQConfig.preset(preset)
        geo = st.Geometry(batch, kv_heads, 4096, 128, "bfloat16")
        lay = st.ModelStore(cfg, 2, geo, "cpu").layers[-1]
        kv = torch.zeros(batch, kv_heads, 1, 128, dtype=torch.bfloat16)
        cs = (torch.zeros(1, 1, 128, dtype=torch.bfloat16),) * 2 if cfg.keys_before_rope else (None, None)
        is_cuda = torch.Tensor.is_cuda
        torch.Tensor.is_cuda = property(lambda self: True)   # the launcher asks for the SM count on CUDA tensors only
        try:
            qa.append_decode(lay.buffers | lay.rope, cfg, lay.spec, geo, kv, kv, torch.tensor([5]), *cs)
        finally:
            torch.Tensor.is_cuda = is_cuda
    finally:
        qa._append_kernel, qa._sm_count = real, count
    build = got["build"]
    lines, _ = _instructions(build.sass)
    ops = collections.Counter(_opcode(ln) for ln in lines)
    return sum(ops.values()), ops, build.regs, build.sass


def main():
    presets = (sys.argv[1] if len(sys.argv) > 1 else "kivi-2,kivi-4,xquant-1.38,innerq-2").split(",")
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    for p in presets:
        n, ops, regs, sass = sass_of(p, batch)
        if os.environ.get("DUMP"):   # DUMP=dir: each preset's SASS written there
            with open(os.path.join(os.environ["DUMP"], f"{p}_B{batch}.sass"), "w") as f:
                f.write(sass)
        top = ", ".join(f"{o} {c}" for o, c in ops.most_common(14))
        print(f"{p:13s} B={batch:3d}  {n:5d} SASS instructions, {regs} registers: {top}")


if __name__ == "__main__":
    main()
