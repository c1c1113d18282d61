"""The Gluon decode kernels compiled for Hopper (sm_90) without a GPU: registers, spill stack and the main loop's
SASS instructions (the longest backward branch), by opcode. kvquant's kernel at 16- and 32-token tiles, with its
168-register cap and without, and with one outlier per token (kvquant-4-1%); int8's kernel at 16- and 32-token tiles, fp16 and bf16; the KIVI-layout kernel at 2
and 4 bits (fp16, bool mask, plain loads).

    python bench/sass_gluon.py        (without TRITON_INTERPRET; ptxas and cuobjdump from the triton wheel)
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from kvq_compile.templates import decode_attention_gluon as dag

TOOL = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_sm90(fn, sig: dict, cx: dict, pointers, **options):
    """(registers, stack bytes, SASS text) of `fn` compiled with these signature types and constexprs."""
    sig = dict(sig, **{n: "constexpr" for n in cx})
    src = GluonASTSource(fn=fn, signature=sig, constexprs=cx, attrs={(i,): [["tt.divisibility", 16]] for i in pointers})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1, **options))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    usage = subprocess.run([TOOL, "-res-usage", f.name], capture_output=True, text=True).stdout
    sass = subprocess.run([TOOL, "-sass", f.name], capture_output=True, text=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1)), sass


def main_loop(sass: str) -> collections.Counter:
    """Opcodes of the longest loop: the instructions from a backward branch's target to the branch."""
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]{4})\*/", ln).group(1), 16) for ln in lines]
    best = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s.*?0x([0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < addr[i] and int(m.group(1), 16) in addr:
            body = lines[addr.index(int(m.group(1), 16)):i + 1]
            best = body if len(body) > len(best) else best
    ops = collections.Counter()
    for ln in best:
        ins = re.sub(r"/\*.*?\*/", "", ln).split(";")[0].split()
        ops[(ins[1] if ins[0].startswith("@") else ins[0]).split(".")[0]] += 1
    return ops


def main():
    ty = "*fp16"
    lut = dict(Q=ty, stride_qb="i32", stride_qh="i32", KC="*i32", KCEN=ty, KHALF=ty, KLEV="*fp32", KOIDX="*u8",
               KOVAL=ty, VC="*i32", VCEN=ty, VHALF=ty, VLEV="*fp32", VOIDX="*u8", VOVAL=ty, COS=ty, SIN=ty,
               POS="*i64", AMASK="*i1", stride_mb="i32", OUT_M="*fp32", OUT_L="*fp32", OUT_ACC="*fp32",
               scale="fp32", T="i32", NSPLIT="i32")
    for bt, cap, nout in ((16, dag.LUT_MAXNREG, 0), (16, None, 0), (32, dag.LUT_MAXNREG, 0), (32, None, 0),
                          (16, dag.LUT_MAXNREG, 1)):
        cx = dict(H=8, REP=4, S=1, R=0, MASK_KIND=1, IS_BF16=False, BT=bt, ROPE=True, KNOUT=nout, VNOUT=nout, NWIN=2)
        regs, stack, sass = compile_sm90(dag._lut_decode_kernel, lut, cx, [i for i in range(17) if i not in (1, 2)],
                                         **({"maxnreg": cap} if cap else {}))
        ops = main_loop(sass)
        print(f"kvquant-4{'-1%' if nout else ''} (RoPE) tile {bt} cap {cap}: {regs} registers, stack {stack} B, loop "
              f"{sum(ops.values())} instructions per {bt} tokens: {dict(ops.most_common(12))}", flush=True)
    for bf16 in (False, True):
        sty = "*bf16" if bf16 else ty
        sym8 = dict(Q=sty, stride_qb="i32", stride_qh="i32", KC="*i32", KHALF=sty, VC="*i32", VHALF=sty, POS="*i64",
                    AMASK="*i1", stride_mb="i32", OUT_M="*fp32", OUT_L="*fp32", OUT_ACC="*fp32", scale="fp32", T="i32",
                    NSPLIT="i32")
        for bt in (16, 32):
            cx = dict(H=8, REP=4, S=0, R=0, MASK_KIND=1, IS_BF16=bf16, BT=bt, NWIN=1)
            regs, stack, sass = compile_sm90(dag._sym8_decode_kernel, sym8, cx, (0, 3, 4, 5, 6, 10, 11, 12))
            ops = main_loop(sass)
            print(f"int8 {'bf16' if bf16 else 'fp16'} tile {bt}: {regs} registers, stack {stack} B, loop "
                  f"{sum(ops.values())} instructions per {bt} tokens: {dict(ops.most_common(12))}", flush=True)
    kivi = dict(Q=ty, stride_qb="i32", stride_qh="i32", KC="*i32", KCEN=ty, KHALF=ty, VC="*i32", VCEN=ty, VHALF=ty,
                POS="*i64", AMASK="*i1", stride_mb="i32", OUT_M="*fp32", OUT_L="*fp32", OUT_ACC="*fp32",
                scale="fp32", T="i32", NG_K="i32", NSPLIT="i32")
    for bits in (2, 4):
        a = dag.split_scale(2 / (2 ** bits - 1), False)
        cx = dict(H=8, REP=4, S=0, R=128, TPG_K=32, TPG_V=1, MASK_KIND=1, IS_BF16=False, BT=32, KBITS=bits,
                  VBITS=bits, KA_HI=a[0], KA_LO=a[1], VA_HI=a[0], VA_LO=a[1], NWIN=3, TMA=False, NST=2)
        regs, stack, sass = compile_sm90(dag._kivi_decode_kernel, kivi, cx, (0, 3, 4, 5, 6, 7, 8, 12, 13, 14))
        ops = main_loop(sass)
        print(f"KIVI layout {bits}-bit: {regs} registers, stack {stack} B, loop {sum(ops.values())} instructions per "
              f"32 tokens: {dict(ops.most_common(12))}", flush=True)


if __name__ == "__main__":
    main()
