"""Compile a Triton kernel for Hopper (sm_90) on a machine without a GPU and count its SASS instructions.

    from sass_stats import compile_sm90, loop_ops
    k = compile_sm90(kernel, signature, constexprs, num_warps=4)
    n, ops = loop_ops(k)      # instructions of the kernel's longest loop body, by opcode

Uses the ptxas / cuobjdump bundled with the triton wheel. Static counts: a loop body's instruction count per
element processed is what bounds an unpack-heavy kernel (one warp instruction per scheduler and clock).
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 2, aligned=()):
    """`aligned`: argument indices marked 16-divisible, as the JIT specializes aligned pointers and integers at
    launch; without it loads are not vectorized and the counts include per-byte address arithmetic."""
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def compile_gluon_sm90(fn, signature: dict, constexprs: dict, num_warps: int = 4, aligned=()):
    """A Gluon kernel compiled for sm_90; `aligned`: argument indices marked 16-byte divisible, as the JIT does
    for aligned pointers at launch (without it the loads are not vectorized)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    src = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs,
                         attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


def sass(kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    try:
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def loop_ops(kernel) -> tuple[int, collections.Counter]:
    """(instruction count, opcode counter) of the longest backward branch's body."""
    listing = sass(kernel).splitlines()
    rows = [(int(m.group(1), 16), m.group(2)) for m in map(_LINE.match, listing) if m]
    best: list = []
    for line in listing:
        m = _LINE.match(line)
        b = re.search(r"BRA\s+0x([0-9a-f]+)", line)
        if m and b and int(b.group(1), 16) < int(m.group(1), 16):
            lo, hi = int(b.group(1), 16), int(m.group(1), 16)
            body = [op for a, op in rows if lo <= a <= hi]
            if len(body) > len(best):
                best = body
    return len(best), collections.Counter(best)
