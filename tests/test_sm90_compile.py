"""The Triton templates compile for Hopper (sm_90) on a machine without a GPU: the CPU CI runs the kernels
under the interpreter, which accepts code the GPU compiler refuses (a non-constexpr global, say). Each launch
of a few presets is captured and compiled with triton.compile for sm_90 (ptxas ships with triton), in a
subprocess without TRITON_INTERPRET."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import sys, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import kvq_compile.templates.decode_attention as da
    import kvq_compile.templates.prefill_attention as pa
    import kvq_compile.templates.quantize_append as qa
    from kvq_compile import KVQConfig, store as st

    TY = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int32: "*i32",
          torch.int64: "*i64", torch.uint8: "*u8", torch.int16: "*i16", torch.bool: "*i1"}
    compiled = []

    class Capture:
        def __init__(self, fn):
            self.fn = fn
        def __getitem__(self, grid):
            def run(*args, num_warps=4, num_stages=2, launch_pdl=False, enable_fp_fusion=True, **consts):
                sig = {n: (TY[a.dtype] if isinstance(a, torch.Tensor) else "fp32" if isinstance(a, float) else "i32")
                       for n, a in zip(self.fn.arg_names, args)}
                sig.update({n: "constexpr" for n in consts})
                k = triton.compile(ASTSource(fn=self.fn, signature=sig, constexprs=consts),
                                   target=GPUTarget("cuda", 90, 32),
                                   options=dict(num_warps=num_warps, num_stages=num_stages, launch_pdl=launch_pdl,
                                                enable_fp_fusion=enable_fp_fusion))
                compiled.append((self.fn.__name__, len(k.asm["cubin"])))
            return run

    for mod, name in ((da, "_decode_kernel"), (da, "_combine_kernel"), (da, "_temperature_kernel"),
                      (da, "_fused_decode_kernel"),
                      (qa, "_append_kernel"), (pa, "_prefill_kernel")):
        setattr(mod, name, Capture(getattr(mod, name)))
    for i, preset in enumerate(sys.argv[1:]):
        da._use_pdl = lambda q, on=i % 2 == 1: on   # every other preset's decode launches as on sm_90 (PDL)
        # the first of those with the window's early trigger
        da._window_triggers = lambda n, dev, kivi=None, on=i % 4 == 1: on
        cfg = KVQConfig.preset(preset)
        geo = st.Geometry(2, 2, 256, 128, "bfloat16")
        lay = st.ModelStore(cfg, 4, geo, "cpu").layers[-1]
        kv = torch.zeros(2, 2, 1, 128, dtype=torch.bfloat16)
        cs = (torch.zeros(1, 1, 128, dtype=torch.bfloat16),) * 2 if cfg.keys_before_rope else (None, None)
        qa.append_decode(lay.buffers | lay.rope, cfg, lay.spec, geo, kv, kv, torch.tensor([5]), *cs)
        names, tensors = lay.attend_tensors()
        q = torch.zeros(2, 8, 1, 128, dtype=torch.bfloat16)
        da.decode_attention(q, dict(zip(names, tensors)), kv, kv, torch.tensor([5]), None, 0.1, False, cfg,
                            lay.spec, geo)
        if cfg.softmax_tau is None:   # the one-launch kernel of the Inductor template (head_dim 64 too: triton 3.6
            # once asserted compiling its merge there)
            for D, dt in ((128, torch.bfloat16), (64, torch.float16)):
                g = st.Geometry(2, 2, 256, D, st.dtype_name(dt))
                l2 = st.ModelStore(cfg, 4, g, "cpu").layers[-1]
                n2, t2 = l2.attend_tensors()
                kv2 = torch.zeros(2, 2, 1, D, dtype=dt)
                da.decode_attention(torch.zeros(2, 6, 1, D, dtype=dt), dict(zip(n2, t2)), kv2, kv2,
                                    torch.tensor([5]), torch.ones(2, 1, 1, 256, dtype=torch.bool), 0.1, False, cfg,
                                    l2.spec, g, fused=True)
        q3, kv3 = torch.zeros(2, 8, 3, 128, dtype=torch.bfloat16), torch.zeros(2, 2, 3, 128, dtype=torch.bfloat16)
        masks = (None, torch.ones(2, 1, 3, 256, dtype=torch.bool), torch.zeros(2, 8, 3, 256, dtype=torch.bfloat16))
        for mask, causal in zip(masks, (True, False, False)):
            pa.prefill_attention(q3, dict(zip(names, tensors)), kv3, kv3, torch.arange(5, 8), mask, 0.1, causal,
                                 cfg, lay.spec, geo)
    print(compiled)
''')


@pytest.mark.parametrize("presets", [("kivi-2", "innerq-2", "int8"), ("kvquant-4-1%", "calibquant-1", "xquant-1.38", "kivi-4")])
def test_templates_compile_for_sm90(presets):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, *presets], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    compiled = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307  (our own repr of a list of tuples)
    kinds = {name for name, _ in compiled}
    want = {"_decode_kernel", "_combine_kernel", "_append_kernel", "_prefill_kernel", "_fused_decode_kernel"}
    if "calibquant-1" in presets:  # its calibrated softmax: the temperature between the two passes
        want.add("_temperature_kernel")
    assert kinds == want, compiled
    assert all(size > 1000 for _, size in compiled), compiled
