"""The window launch's sm_90 registers and shared memory, offline: `_decode_kernel` (WINDOW=True) with the arguments
`decode_attention` passes it for a preset's layer on the Gluon path (bf16, bool mask, PDL, no early trigger: batch
32's case), captured on the CPU with the Gluon launch stubbed, then compiled for sm_90 (`tests/sm90_sass.py`).
Session 34 used it to weigh the guess that the window launch's programs fit beside 8 KIVI programs per SM, not 10.

    python bench/debug/window_regs.py [PRESET]      e.g. kivi-4   (no TRITON_INTERPRET; no GPU needed; with
    kvq_compile/passes and kvq_compile/templates linked to passes/ and templates/, as bench/device_call.sh does)
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

from kvq_compile import KVQConfig  # noqa: E402
from kvq_compile import store as st  # noqa: E402
from kvq_compile.templates import decode_attention as da  # noqa: E402
from kvq_compile.templates import decode_attention_gluon as dag  # noqa: E402
from sm90_sass import _instructions, compile_sm90  # noqa: E402

TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
         torch.int64: "*i64", torch.uint8: "*u8", torch.bool: "*i1", torch.int8: "*i8", torch.int16: "*i16"}


class _Record:
    """Stands in for a Triton kernel: `kernel[grid](...)` records (grid, args, kwargs) and launches nothing."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((grid, args, kw))


def window_launch(preset: str, B: int = 2, H: int = 8, T: int = 1024) -> tuple:
    """(grid, args, kwargs) of the window launch `decode_attention` makes for `preset`'s first layer."""
    calls = []
    da._decode_kernel, da._combine_kernel = _Record(calls), _Record([])
    dag.supports = lambda *a, **k: None
    dag.resident_programs = lambda *a, **k: 12
    dag.launch = lambda *a, **k: None
    da._fill_splits = lambda bh, max_len, device, resident: resident   # no GPU to count the SMs of
    da._use_pdl = lambda q: True
    da._window_triggers = lambda programs, device, kivi_programs=None: False
    cfg = KVQConfig.preset(preset)
    ms = st.ModelStore(cfg, 1, st.Geometry(B, H, T, 128, "bfloat16"), "cpu")
    lay = ms.layers[0]
    bufs = dict(zip(*lay.attend_tensors()))
    q = torch.randn(B, 4 * H, 1, 128).bfloat16()
    k, v = (torch.randn(B, H, 1, 128).bfloat16() for _ in range(2))
    am = torch.ones(B, 1, 1, T, dtype=torch.bool)
    da.decode_attention(q, bufs, k, v, torch.tensor([T - 100]), am, 0.1, False, cfg, lay.spec, ms.geo, gluon=True)
    (launch,) = [c for c in calls if c[2].get("WINDOW")]
    return launch


def main(preset: str) -> None:
    kernel = da._decode_kernel
    grid, args, kw = window_launch(preset)
    params = [p for p in kernel.params if not p.is_constexpr]
    sig = {}
    for p, a in zip(params, args):
        if isinstance(a, torch.Tensor):
            sig[p.name] = TYPES[a.dtype]
        else:
            sig[p.name] = "i1" if isinstance(a, bool) else "i32" if isinstance(a, int) else "fp32"
    options = {n: kw[n] for n in ("num_warps", "num_stages") if n in kw}
    cx = {n: x for n, x in kw.items() if n not in ("num_warps", "num_stages", "launch_pdl")}
    cx.update({p.name: p.default for p in kernel.params if p.is_constexpr and p.name not in cx and p.has_default})
    pointers = [kernel.arg_names.index(n) for n, t in sig.items() if t.startswith("*")]
    b = compile_sm90(kernel, sig, cx, pointers, **options)
    print(f"{preset}: window launch grid {grid}, {options.get('num_warps')} warps: {b.regs} registers, stack "
          f"{b.stack} B, {b.shared} B shared, {len(_instructions(b.sass)[0])} SASS instructions")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "kivi-2")
