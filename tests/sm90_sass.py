"""What ptxas makes of a Gluon kernel for Hopper (sm_90), on a machine without a GPU: the kernel is compiled by
triton.compile (ptxas and cuobjdump ship with the triton wheel), then its resource usage and SASS are read back.
Used by tests/test_decode_gluon.py (in a subprocess without TRITON_INTERPRET) and bench/sass_gluon.py."""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from typing import NamedTuple


class Sm90Build(NamedTuple):
    regs: int      # registers per thread
    stack: int     # bytes of spilled registers
    local: int     # bytes of local memory
    shared: int    # bytes of shared memory (Triton's metadata)
    sass: str


def compile_sm90(fn, sig: dict, cx: dict, pointers, arch: int = 90, **options) -> Sm90Build:
    """`fn` (a Gluon kernel, or a plain Triton one) compiled for sm_90 (or `arch`) with these argument types,
    constexprs and options (num_warps 1 unless given); `pointers`: indices of the arguments declared 16-byte
    aligned."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    sig = dict(sig, **{n: "constexpr" for n in cx})
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    src = source(fn=fn, signature=sig, constexprs=cx, attrs={(i,): [["tt.divisibility", 16]] for i in pointers})
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(dict(num_warps=1), **options))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    n = {key: int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK", "LOCAL")}
    return Sm90Build(n["REG"], n["STACK"], n["LOCAL"], k.metadata.shared, sass)


def _instructions(sass: str) -> tuple[list, list]:
    """(the SASS instruction lines, their addresses)."""
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    return lines, [int(re.match(r"\s+/\*([0-9a-f]{4})\*/", ln).group(1), 16) for ln in lines]


def _opcode(line: str) -> str:
    """An instruction line's opcode without its modifiers or predicate (HMMA.16816.F32 -> HMMA)."""
    ins = re.sub(r"/\*.*?\*/", "", line).split(";")[0].split()
    return (ins[1] if ins[0].startswith("@") else ins[0]).split(".")[0]


def main_loop(sass: str, last: bool = False) -> collections.Counter:
    """Opcodes of the longest loop (last: of the last one in the code) : the instructions from a backward branch's
    target to the branch."""
    lines, addr = _instructions(sass)
    best = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s.*?0x([0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < addr[i] and int(m.group(1), 16) in addr:
            body = lines[addr.index(int(m.group(1), 16)):i + 1]
            best = body if (last or len(body) > len(best)) else best
    return collections.Counter(_opcode(ln) for ln in best)


def tile_loops(sass: str) -> list[int]:
    """Instructions of each tile loop in code order: the spans of the predicated backward branches over 4 KB of code
    (`ring_tile`'s loop; the mbarrier wait's retry branch is shorter). Two where the KIVI kernel builds its loop twice
    (MOK), four with PAIR's and the per-tile loops both built."""
    lines, addr = _instructions(sass)
    out = []
    for i, ln in enumerate(lines):
        m = re.search(r"@!?U?P\d+\s+BRA\s.*?0x([0-9a-f]+)", ln)
        if m and addr[i] - int(m.group(1), 16) > 0x1000:
            out.append(sum(1 for a in addr if int(m.group(1), 16) <= a <= addr[i]))
    return out


def ring_tile(sass: str, tps: int = 1, refill: bool = False) -> tuple[float, collections.Counter]:
    """(instructions run per tile, opcodes of the loop's code) of a TMA ring build's tile loop: the predicated
    backward branch spanning over 4 KB of code (the mbarrier wait's retry branch is shorter), with refill without
    the block that its first forward branch skips near the loop's top (`_kivi_decode_kernel`'s QZ_ROWS refill, run
    once per QZ_N Key groups), and with a block that a forward branch skips over the TMA copies counted once per tps
    tiles (a ring slot of tps tiles is refilled after its last one). An estimate: other branches count whole."""
    lines, addr = _instructions(sass)
    lo = hi = None
    for i, ln in enumerate(lines):
        m = re.search(r"@!?U?P\d+\s+BRA\s.*?0x([0-9a-f]+)", ln)
        if m and addr[i] - int(m.group(1), 16) > 0x1000:
            lo, hi = int(m.group(1), 16), addr[i]
            break
    if lo is None:
        raise ValueError("no tile loop (a predicated backward branch over 4 KB of code) in this SASS")
    body = [(a, ln) for a, ln in zip(addr, lines) if lo <= a <= hi]
    forward = [(a, int(m.group(1), 16)) for a, ln in body   # within the loop (not the wait's retry branch)
               for m in [re.search(r"BRA\s.*?0x([0-9a-f]+)", ln)] if m and a < int(m.group(1), 16) <= hi]
    start = lo
    if refill and forward and forward[0][0] - lo < 40 * 16:   # the refill block at the loop's top
        start = forward[0][1]
    issue = [(a, t) for a, t in forward if any(a < b < t and "UTMALDG" in ln for b, ln in body)]
    ops, run = collections.Counter(), 0.0
    for a, ln in body:
        if a < start:
            continue
        ops[_opcode(ln)] += 1
        run += 1.0 / tps if any(f < a < t for f, t in issue) else 1.0
    return run, ops


def kivi_ring_build(kbits: int, vbits: int, tps: int, vf: bool) -> tuple[dict, dict]:
    """(argument types, constexprs) of `_kivi_decode_kernel`'s TMA-ring build as `_plan` builds it for a bf16 cache
    with HF's bool mask, post-scaled Keys and a 128-token recent window, tps tiles a ring slot (PAIR as
    `pair_flags` gives it): the descriptors' types from small CPU tensors of the store's shapes, the Value codes
    swizzled for the fold where vf. The VF constexpr itself is the caller's to set. Its pointers: indices 0, 12, 13,
    14, 20, 21. One tile loop: MOK is left out, where `_plan` passes `MASK_SLICE` and the kernel builds the loop
    twice, once without the mask (`tile_loops`; pass MOK to build that)."""
    import torch
    from triton.runtime.jit import mangle_type

    from kvq_compile.templates import decode_attention_gluon as dag

    bf = torch.bfloat16
    kp = dict(codes=torch.zeros(2, 2, 64, 4 * kbits, dtype=torch.int32), cen=torch.zeros(2, 2, 2, 128, dtype=bf),
              half=torch.zeros(2, 2, 2, 128, dtype=bf))
    vp = dict(codes=torch.zeros(2, 2, 64, 4 * vbits, dtype=torch.int32), cen=torch.zeros(2, 2, 64, 4, dtype=bf),
              half=torch.zeros(2, 2, 64, 4, dtype=bf))
    descs = dag.descriptors(kp, vp, kbits, vbits, tps, dag.vf_swizzle(vf, vbits))
    ty = "*bf16"
    sig = dict(Q=ty, stride_qb="i32", stride_qh="i32",
               **dict(zip(("KC", "KCEN", "KHALF", "VC", "VCEN", "VHALF"), map(mangle_type, descs))),
               POS="*i64", AMASK="*i1", stride_mb="i32", OUT_M="*fp32", OUT_L="*fp32", OUT_ACC="*fp32",
               scale="fp32", T="i32", NG_K="i32", NSPLIT="i32", KNORM=ty, KHROWS=ty, KCROWS=ty)
    ka, va = (dag.split_scale(2 / (2 ** b - 1), True) for b in (kbits, vbits))
    cx = dict(H=8, REP=4, S=0, R=128, TPG_K=32, TPG_V=1, MASK_KIND=1, IS_BF16=True, BT=32, KBITS=kbits,
              VBITS=vbits, KA_HI=ka[0], KA_LO=ka[1], VA_HI=va[0], VA_LO=va[1], NWIN=3, TMA=True, NST=dag.NSTAGES,
              PDL=True, KPOST=True, QZROWS=dag.QZ_ROWS, QZ_N=dag.QZ_N, VZ=True, WL=dag.WIDEN_IN_LANES,
              WT=dag.WHOLE_TILES, TPS=tps, KSUB=dag.BF16_SUBNORMAL_KEYS, KSW=dag.SUB_WINDOW,
              **dag.pair_flags(tps, True, dag.WHOLE_TILES, 128, dag.QZ_ROWS))
    return sig, cx


def inner_ring_build() -> tuple[dict, dict]:
    """(argument types, constexprs) of `_kivi_decode_kernel`'s TMA-ring build for innerq-2 (2-bit hybrid groups on
    both sides, the Key norm, a sink of 32 and a recent window of 96) with a bf16 cache and HF's bool mask, as `_plan`
    builds it but for MOK and KZA, the caller's to set. Its pointers: indices 0, 4, 5, 7, 8, 12, 13, 14."""
    import torch
    from triton.runtime.jit import mangle_type

    from kvq_compile.templates import decode_attention_gluon as dag

    kc, vc = map(mangle_type, dag.row_descriptors(dict(codes=torch.zeros(2, 2, 64, 8, dtype=torch.int32)),
                                                  dict(codes=torch.zeros(2, 2, 64, 8, dtype=torch.int32)), 8,
                                                  dag.KIVI_BT, 8))
    ty = "*bf16"
    sig = dict(Q=ty, stride_qb="i32", stride_qh="i32", KC=kc, KCEN=ty, KHALF=ty, VC=vc, VCEN=ty, VHALF=ty,
               POS="*i64", AMASK="*i1", stride_mb="i32", OUT_M="*fp32", OUT_L="*fp32", OUT_ACC="*fp32",
               scale="fp32", T="i32", NG_K="i32", NSPLIT="i32", KNORM="*fp32", KHROWS=ty, KCROWS=ty)
    a = dag.split_scale(2 / 2, True)   # hybrid 2-bit groups: spacing 2 / (2^2 - 2)
    cx = dict(H=8, REP=4, S=32, R=96, TPG_K=1, TPG_V=32, MASK_KIND=1, IS_BF16=True, BT=32, KBITS=2, VBITS=2,
              KA_HI=a[0], KA_LO=a[1], VA_HI=a[0], VA_LO=a[1], NWIN=3, TMA=True, NST=dag.NSTAGES, PDL=True,
              INNER=True, KHYB=True, VHYB=True, NORM=True, WL=dag.WIDEN_IN_LANES, WT=dag.WHOLE_TILES, TPS=1)
    return sig, cx
