"""The window launch's sm_90 registers and shared memory, offline: `_decode_kernel` (WINDOW=True) with the arguments
`decode_attention` passes it for a preset's layer on the Gluon path (bf16, bool mask, PDL, no early trigger: batch
32's case), captured on the CPU with the Gluon launch stubbed, then compiled for sm_90 (ptxas ships with triton).
Session 34 used it to weigh the guess that the window launch's programs fit beside 8 KIVI programs per SM, not 10.

    python bench/debug/window_regs.py [PRESET]      e.g. kivi-4   (no TRITON_INTERPRET; no GPU needed; with
    kvq_compile/passes and kvq_compile/templates linked to passes/ and templates/, as bench/device_call.sh does)
"""
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT); sys.path.insert(0, os.path.join(ROOT, "tests"))
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvq_compile import KVQConfig
from kvq_compile import store as st
from kvq_compile.templates import decode_attention as da
from kvq_compile.templates import decode_attention_gluon as dag

captured = []
class Rec:
    def __getitem__(self, grid):
        def call(*args, **kw):
            captured.append((grid, args, kw))
        return call
real_kernel = da._decode_kernel
da._decode_kernel = Rec()
dag.supports = lambda *a, **k: None
dag.resident_programs = lambda *a, **k: 12
dag.launch = lambda *a, **k: None
da._fill_splits = lambda bh, max_len, device, resident: resident
da._use_pdl = lambda q: True
da._window_triggers = lambda programs, device: False
da._combine_kernel = Rec()

preset = sys.argv[1] if len(sys.argv) > 1 else "kivi-2"
B, H, T = 2, 8, 1024
cfg = KVQConfig.preset(preset)
geo = st.Geometry(B, H, T, 128, "bfloat16")
ms = st.ModelStore(cfg, 1, geo, "cpu")
lay = ms.layers[0]
names, tensors = lay.attend_tensors()
bufs = dict(zip(names, tensors))
q = torch.randn(B, 32, 1, 128).bfloat16()
k = torch.randn(B, H, 1, 128).bfloat16(); v = torch.randn(B, H, 1, 128).bfloat16()
am = torch.ones(B, 1, 1, T, dtype=torch.bool)
da.decode_attention(q, bufs, k, v, torch.tensor([900]), am, 0.1, False, cfg, lay.spec, ms.geo, gluon=True)
(grid, args, kw), = [c for c in captured if c[2].get("WINDOW")]
fn = real_kernel
argnames = fn.arg_names
tymap = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
         torch.int64: "*i64", torch.uint8: "*u8", torch.bool: "*i1", torch.int8: "*i8", torch.int16: "*i16"}
sig, cx = {}, {}
consts = {n for n, p in zip(fn.arg_names, fn.params) if p.is_constexpr}
launch_opts = {"num_warps", "num_stages", "launch_pdl"}
for n, a in zip(argnames, list(args) + [None] * (len(argnames) - len(args))):
    if n in consts:
        continue
    if isinstance(a, torch.Tensor):
        sig[n] = tymap[a.dtype]
    elif isinstance(a, bool):
        sig[n] = "i1"
    elif isinstance(a, int):
        sig[n] = "i32"
    elif isinstance(a, float):
        sig[n] = "fp32"
    else:
        raise SystemExit(f"{n}: {type(a)}")
for n, x in kw.items():
    if n in launch_opts:
        continue
    cx[n] = x
for n in consts:
    if n not in cx:   # a constexpr the launch leaves at its default
        p = fn.params[fn.arg_names.index(n)]
        if p.has_default:
            cx[n] = p.default
sig.update({n: "constexpr" for n in cx})
src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(n),): v for n, v in cx.items()},
                attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(argnames) if sig.get(n, "").startswith("*")})
kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=kw.get("num_warps", 4), num_stages=1))
import subprocess, tempfile
with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
    f.write(kern.asm["cubin"])
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
print(preset, "grid", grid, "warps", kw.get("num_warps"), subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout.strip().splitlines()[-1], "shared", kern.metadata.shared)
