"""A tiny interpreter for the inline-PTX blocks of templates/decode_attention_gluon.py, so that their bit tricks
run in the CPU CI (Gluon kernels have no interpreter): the instructions those blocks use, on 32-bit registers,
with f16x2 / bf16x2 arithmetic rounded as the GPU does (one rounding of the exact result)."""
from __future__ import annotations

import re

import numpy as np
import torch


def _halves(x: int, ty: str) -> list[float]:
    lo, hi = x & 0xFFFF, x >> 16
    if ty == "f16x2":
        return [float(np.array(v, dtype=np.uint16).view(np.float16)) for v in (lo, hi)]
    return [float(np.array(v << 16, dtype=np.uint32).view(np.float32)) for v in (lo, hi)]


def _pack(vals, ty: str) -> int:
    dt = torch.float16 if ty == "f16x2" else torch.bfloat16
    bits = [int(torch.tensor(v, dtype=torch.float64).to(dt).view(torch.int16)) & 0xFFFF for v in vals]
    return bits[0] | bits[1] << 16


def _instructions(asm: str) -> list[str]:
    body = asm.replace("{", ";").replace("}", ";").replace("\n", ";")
    return [x for x in (x.strip() for x in body.split(";")) if x and not x.startswith(".reg")]


def run(asm: str, operands: dict[int, int]) -> dict[int, int]:
    """Execute `asm` with $i = operands[i] (uint32); returns every $i afterwards (outputs included)."""
    return run_warp(asm, [operands])[0]


def run_warp(asm: str, operands: list[dict[int, int]]) -> list[dict[int, int]]:
    """`run` over the lanes of a warp in lockstep (operands[lane]), so that `shfl.sync.bfly.b32` (every lane taking
    part) reads the partner lane's register as it was before the instruction."""
    lanes = [{f"${i}": v & 0xFFFFFFFF for i, v in ops.items()} for ops in operands]
    for ins in _instructions(asm):
        op, args = ins.split(None, 1)
        a = [t.strip() for t in args.split(",")]
        if op == "shfl.sync.bfly.b32":   # d, a, lane mask, clamp, member mask
            if len(lanes) != 32 or _val(lanes[0], a[4]) != 0xFFFFFFFF or _val(lanes[0], a[3]) != 0x1F:
                raise NotImplementedError(f"{ins}: a butterfly shuffle needs the whole warp")
            src = [_val(r, a[1]) for r in lanes]
            for lane, r in enumerate(lanes):
                r[a[0]] = src[lane ^ _val(r, a[2])]
            continue
        for r in lanes:
            r[a[0]] = _exec(ins, op, a, r) & 0xFFFFFFFF
    return lanes


def _val(regs: dict, tok: str) -> int:
    tok = tok.strip()
    if tok in regs:
        return regs[tok]
    if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok):
        return int(tok, 0) & 0xFFFFFFFF
    raise KeyError(f"register {tok} read before written")


def _exec(ins: str, op: str, a: list[str], regs: dict) -> int:
    """The value instruction `ins` (opcode op, operands a) writes to a[0], on one lane's registers."""
    def val(tok: str) -> int:
        return _val(regs, tok)

    if op == "mov.b32":
        out = val(a[1])
    elif op == "prmt.b32":
        src = val(a[1]).to_bytes(4, "little") + val(a[2]).to_bytes(4, "little")
        sel = val(a[3])

        def byte(k):   # selector nibble k: a byte of (a, b), or with bit 3 its sign replicated over the byte
            nib = (sel >> 4 * k) & 0xF
            x = src[nib & 7]
            return (0xFF if x & 0x80 else 0) if nib & 8 else x

        out = int.from_bytes(bytes(byte(k) for k in range(4)), "little")
    elif op == "lop3.b32":
        x, y, z, lut = val(a[1]), val(a[2]), val(a[3]), val(a[4])
        out = 0
        for bit in range(32):
            i = ((x >> bit) & 1) << 2 | ((y >> bit) & 1) << 1 | ((z >> bit) & 1)
            out |= ((lut >> i) & 1) << bit
    elif op in ("add.f32", "sub.f32"):   # fp32, rounded to nearest (the blocks' uses are exact)
        x, y = (np.array(val(t), dtype=np.uint32).view(np.float32) for t in a[1:3])
        r = np.float32(x + y if op == "add.f32" else x - y)
        out = int(np.array(r, dtype=np.float32).view(np.uint32))
    elif op == "shf.r.wrap.b32":   # funnel shift right of (b:a) by c mod 32, the low word
        x = val(a[2]) << 32 | val(a[1])
        out = x >> (val(a[3]) & 31)
    elif op == "and.b32":
        out = val(a[1]) & val(a[2])
    elif op == "shr.b32":
        out = val(a[1]) >> val(a[2])
    elif op.split(".")[0] in ("add", "mul", "fma") and op.endswith("x2"):
        ty = op.split(".")[-1]
        xs = [_halves(val(t), ty) for t in a[1:]]
        kind = op.split(".")[0]
        res = [(x[0] + x[1]) if kind == "add" else (x[0] * x[1]) if kind == "mul" else (x[0] * x[1] + x[2])
               for x in zip(*xs)]
        out = _pack(res, ty)
    else:
        raise NotImplementedError(ins)
    return out
