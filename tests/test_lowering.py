"""The Inductor lowering of kvq::attend (kvq_compile/lowering.py) and the compile-cache key pass.

On the CPU the lowering falls back to the opaque op; with "cpu" added to `lowering.DEVICES` the autotuned
extern kernels run the Triton template under TRITON_INTERPRET=1, so the whole path (lowering, choices,
autotune_select_algorithm, generated call) is checked in CI against the reference path."""
import dataclasses
import os

import pytest
import torch

from kvq_compile import compat, kvq_backend, lowering
from kvq_compile import store as st
from kvq_compile.ops import attend_cpu_reference
from models import compile_config, hf_model, prompts, small_windows

triton = pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _filled_store(cfg, B=2, H=2, D=64, T=40, prefill=27, dtype=torch.float16, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    ms = st.ModelStore(cfg, 1, st.Geometry(B, H, T, D, st.dtype_name(dtype)), DEVICE)
    lay = ms.layers[0]
    names, tensors = lay.append_tensors()
    k = torch.randn(B, H, prefill, D, generator=gen, device=DEVICE).to(dtype)
    v = torch.randn(B, H, prefill, D, generator=gen, device=DEVICE).to(dtype)
    torch.ops.kvq.append(tensors, k[:, :, :-1], v[:, :, :-1], torch.arange(prefill - 1, device=DEVICE), None, None,
                         lay.descriptor(names))
    torch.ops.kvq.append(tensors, k[:, :, -1:], v[:, :, -1:], torch.tensor([prefill - 1], device=DEVICE), None, None,
                         lay.descriptor(names))
    return lay, k[:, :, -1:], v[:, :, -1:], gen


@pytest.mark.interpreter
@pytest.mark.parametrize("config", [lowering.LaunchConfig(16, 4, 2, 16), lowering.LaunchConfig(32, 8, 3, 1)])
@pytest.mark.parametrize("name,mask", [("kivi-2", True), ("innerq-2", False)])
def test_extern_kernel_of_each_choice_matches_reference(config, name, mask):
    cfg = small_windows(name)
    lay, k, v, gen = _filled_store(cfg)
    names, tensors = lay.attend_tensors()
    q = torch.randn(2, 6, 1, 64, generator=gen, device=DEVICE).to(torch.float16)
    pos = torch.tensor([26], device=DEVICE)
    am = None
    if mask:
        am = torch.ones(2, 1, 1, 40, dtype=torch.bool, device=DEVICE)
        am[1, :, :, :5] = False
    layout = lay.descriptor(names)
    ref = attend_cpu_reference(q, tensors, k, v, pos, am, 0.125, False, layout)
    out = torch.full_like(q, float("nan"))
    kernel = lowering._choice().to_callable()
    kernel(q, k, v, pos, *tensors, *([am] if mask else []), out=out, kvq_layout=layout, scale=0.125, is_causal=False,
           n_store=len(tensors), has_mask=mask, **dataclasses.asdict(config))
    torch.testing.assert_close(out.float(), ref.float(), atol=4e-3, rtol=4e-3)


def test_configs_are_distinct_and_default_first():
    assert lowering.CONFIGS[0] == lowering.DEFAULT_CONFIG
    assert len(set(lowering.MAX_AUTOTUNE_CONFIGS)) == len(lowering.MAX_AUTOTUNE_CONFIGS) > len(lowering.CONFIGS)


@pytest.mark.interpreter
@pytest.mark.parametrize("configs", [1, 2])
def test_compiled_generate_through_the_lowering_matches_opaque_op(configs, monkeypatch):
    """kivi-2 generate compiled with kvq_backend, kvq::attend lowered to autotuned extern kernels (two choices:
    Inductor benchmarks them), equals the same generate with the op left opaque (the reference op on the CPU,
    the template's default launch on CUDA)."""
    model = hf_model("llama", kv_heads=1, gqa=2, head_dim=64, layers=2).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in prompts(2, 9, pad=(0, 2)))
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static",
              output_logits=True, return_dict_in_generate=True)
    cfg = small_windows("kivi-2")
    monkeypatch.setattr(lowering, "DEVICES", set())
    ref = model.generate(ids, compile_config=compile_config(kvq_backend(cfg)), **kw)
    torch._dynamo.reset()
    monkeypatch.setattr(lowering, "DEVICES", {"cuda", "cpu"})  # part of the compile cache key: no stale hit
    monkeypatch.setattr(lowering, "TEMPLATE", False)   # the extern choices only (the template: the test below)
    monkeypatch.setattr(lowering, "SELECTED", [])
    monkeypatch.setattr(lowering, "CONFIGS", (lowering.LaunchConfig(16, 4, 2, 16),
                                              lowering.LaunchConfig(32, 4, 2, 4))[:configs])
    calls = []
    real_launch = lowering.launch
    monkeypatch.setattr(lowering, "launch", lambda *a, **k: (calls.append(k["block_t"]), real_launch(*a, **k)))
    out = model.generate(ids, compile_config=compile_config(kvq_backend(cfg)), **kw)
    assert calls, "the compiled steps did not call the lowered kernel"
    # filled when Inductor lowers the graph (not when its compile cache serves it, as in a second test run)
    assert all(chosen in lowering.CONFIGS for _, chosen in lowering.SELECTED)
    assert torch.equal(out.sequences, ref.sequences)
    tol = 1e-4 if DEVICE == "cpu" else 1e-3
    for a, b in zip(ref.logits, out.logits):
        torch.testing.assert_close(b, a, atol=tol, rtol=tol)


@pytest.mark.skipif(DEVICE != "cuda", reason="Inductor generates Triton templates for GPUs only")
@pytest.mark.parametrize("name,head_dim,gqa,dtype,autotune", [
    ("kivi-2", 64, 3, torch.float16, False), ("kivi-2", 128, 4, torch.bfloat16, True),
    ("kvquant-4", 128, 4, torch.float16, False), ("kvquant-4-1%", 64, 2, torch.bfloat16, False),
    ("innerq-2", 128, 3, torch.bfloat16, False), ("int8", 64, 4, torch.float16, False),
    ("xquant-1.38", 128, 1, torch.float16, False)])
def test_template_generate_matches_opaque_op_on_gpu(name, head_dim, gqa, dtype, autotune, monkeypatch):
    """generate compiled with kvq_backend, kvq::attend lowered to the one-launch TritonTemplate (TEMPLATE True: the
    only choice, or under max_autotune one of several with the extern launches), against the same generate with the
    op left opaque (the hand-written launches of the Triton kernel the template calls). Odd GQA ratios, padded rows
    (the mask), both head dims, layouts with codebooks, outliers, RoPE after dequantization, InnerQ's groups and
    XQuant's shared codes."""
    from torch._inductor import config as inductor_config

    from kvq_compile.templates import decode_attention_gluon as dag

    model = hf_model("llama", kv_heads=2, gqa=gqa, head_dim=head_dim, layers=2, dtype=dtype).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in prompts(3, 11, pad=(0, 3, 1)))
    kw = dict(attention_mask=mask, max_new_tokens=7, do_sample=False, cache_implementation="static",
              output_logits=True, return_dict_in_generate=True)
    cfg = small_windows(name)
    monkeypatch.setattr(lowering, "DEVICES", set())
    with monkeypatch.context() as m:   # the reference: the op's own launches of the same Triton kernel (no Gluon)
        m.setattr(dag, "enabled", lambda: False)
        ref = model.generate(ids, compile_config=compile_config(kvq_backend(cfg)), **kw)
    torch._dynamo.reset()
    monkeypatch.setattr(lowering, "DEVICES", {"cuda"})
    monkeypatch.setattr(lowering, "TEMPLATE", True)
    monkeypatch.setattr(lowering, "SELECTED", [])
    monkeypatch.setattr(lowering, "NOT_OFFERED", [])
    monkeypatch.setattr(inductor_config, "max_autotune", autotune)
    out = model.generate(ids, compile_config=compile_config(kvq_backend(cfg)), **kw)
    torch._dynamo.reset()
    picks = [c for _, c in lowering.SELECTED]
    assert picks and (autotune or all(c == "template" for c in picks)), (picks, lowering.NOT_OFFERED)
    assert not lowering.NOT_OFFERED
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for a, b in zip(ref.logits, out.logits):
        torch.testing.assert_close(b.float(), a.float(), atol=tol, rtol=tol)
    assert torch.equal(out.sequences, ref.sequences)


def test_lowering_is_registered_by_the_backend():
    model = hf_model("llama", kv_heads=1, gqa=2, head_dim=64, layers=1)
    ids, mask = prompts(1, 5)
    model.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation="static",
                   compile_config=compile_config(kvq_backend(small_windows("kivi-2"))))
    assert lowering.register() and compat.has_lowering(torch.ops.kvq.attend.default)


def test_append_beside_only_where_the_lowering_picks_the_default_launch(monkeypatch):
    """`KVQBackend.beside`: decode steps' (append, attention) pairs become kvq::append_attend (an op Inductor leaves
    opaque) on CUDA, unless the lowering of kvq::attend could choose anything but the opaque kernel's own launch
    (max_autotune in the compile's options or Inductor's config, the template, other launch configurations) or
    KVQ_APPEND_BESIDE=0; never on the CPU; append_beside overrides."""
    from torch._inductor import config as inductor_config

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    be = kvq_backend("kivi-2")
    monkeypatch.setattr(lowering, "TEMPLATE", False)
    with inductor_config.patch(max_autotune=False):   # (not monkeypatch: Inductor's config module lost the key)
        assert be.beside(cuda, {}) and not be.beside(cpu, {})
        assert not be.beside(cuda, {"max_autotune": True})
        assert not be.beside(cuda, compat.inductor_config_patches("max-autotune", None))
    with inductor_config.patch(max_autotune=True):
        assert not be.beside(cuda, {}) and be.beside(cuda, {"max_autotune": False})
    off = {"max_autotune": False}
    for template in (True, None):
        with monkeypatch.context() as m:
            m.setattr(lowering, "TEMPLATE", template)
            assert not be.beside(cuda, off)
    with monkeypatch.context() as m:
        m.setattr(lowering, "CONFIGS", (lowering.LaunchConfig(32, 4, 2, 16),))
        assert not be.beside(cuda, off)
    with monkeypatch.context() as m:
        m.setenv("KVQ_APPEND_BESIDE", "0")
        assert not be.beside(cuda, off)
        m.setenv("KVQ_APPEND_BESIDE", "yes")
        with pytest.raises(ValueError, match="KVQ_APPEND_BESIDE"):
            be.beside(cuda, off)
    assert kvq_backend("kivi-2", append_beside=True).beside(cpu, {"max_autotune": True})
    assert not kvq_backend("kivi-2", append_beside=False).beside(cuda, {})


def test_cache_key_pass_hashes_sources_and_chains(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 2\n")
    first = compat.source_hash_pass((str(a), str(b))).uuid()
    assert compat.source_hash_pass((str(b), str(a))).uuid() == first  # order-free
    b.write_text("y = 3\n")
    assert compat.source_hash_pass((str(a), str(b))).uuid() != first
    seen = []

    class Theirs:
        def __call__(self, graph):
            seen.append(graph)

        def uuid(self):
            return "theirs-1"

    chained = compat.source_hash_pass((str(a),), Theirs())
    chained("g")
    assert seen == ["g"] and chained.uuid().endswith("theirs-1")
    assert compat.source_hash_pass((str(a),), lambda g: None).uuid() is None  # uncacheable stays uncacheable
    assert set(lowering.source_files()) >= {os.path.realpath(lowering.__file__)}
    assert any(f.endswith("decode_attention.py") for f in lowering.source_files())


def test_mark_cacheable_calls_marks_the_package_s_functions_only():
    """AOTAutograd's cache bypasses a graph with a call_function target it does not know unless the node carries
    `is_wrapped` and a `user_cache_hash`: the package's helpers get both, torch's functions and ops nothing, and
    without a hash (a user's pass without uuid: Inductor skips its caches) nothing is marked. The marked graph,
    recompiled (its code then registers the wrapped function, as fx.wrap's does), computes what it did."""
    from kvq_compile import store as st

    def f(mask, x):
        return torch.ops.aten.mul(torch.sin(x), 2), st.attended_slots(mask)

    def graph():
        g = torch.fx.Graph()
        mask, x = g.placeholder("mask"), g.placeholder("x")
        g.output((g.call_function(torch.ops.aten.mul.Tensor, (g.call_function(torch.sin, (x,)), 2)),
                  g.call_function(st.attended_slots, (mask,))))
        return torch.fx.GraphModule(torch.nn.Module(), g)

    gm = graph()
    assert compat.mark_cacheable_calls(gm, None, "kvq_compile") == 0
    assert compat.mark_cacheable_calls(gm, "abc", "kvq_compile") == 1
    marked = {n.target: n.meta.get("user_cache_hash") for n in gm.graph.nodes if n.op == "call_function"}
    assert marked == {torch.sin: None, torch.ops.aten.mul.Tensor: None, st.attended_slots: "abc"}
    assert next(n for n in gm.graph.nodes if n.target is st.attended_slots).meta["is_wrapped"]
    gm.recompile()
    mask = torch.zeros(2, 1, 3, 5, dtype=torch.bool)
    mask[0, 0, -1, 2:] = True
    x = torch.randn(4)
    for a, b in zip(gm(mask, x), f(mask, x)):   # the marked graph computes what it did
        assert torch.equal(a, b)


def test_backend_and_kvqcache_install_the_cache_key_pass(monkeypatch):
    before = lowering.cache_key_pass().uuid()
    monkeypatch.setattr(lowering, "DEVICES", {"cuda", "cpu"})
    assert lowering.cache_key_pass().uuid() != before  # what the lowering emits changed: so does the key
    seen = []
    monkeypatch.setattr(compat, "compile_fx", lambda gm, inputs, patches: (seen.append(patches), gm.forward)[1])
    torch.compile(lambda x: x * 2, backend=kvq_backend("kivi-2"))(torch.ones(3))
    assert seen and seen[0]["post_grad_custom_post_pass"].uuid() == lowering.cache_key_pass().uuid()
    # the global install (KVQCache on CUDA) chains the user's pass once, however often it runs
    from torch._inductor import config

    class Theirs:
        def __call__(self, graph):
            pass

        def uuid(self):
            return "theirs-2"

    saved = config.post_grad_custom_post_pass   # (a CUDA KVQCache of an earlier test may have installed ours)
    with config.patch(post_grad_custom_post_pass=Theirs()):  # (monkeypatch breaks Inductor's config module)
        lowering.install_cache_key_pass()
        lowering.install_cache_key_pass()
        installed = config.post_grad_custom_post_pass
        assert installed.kvq and isinstance(installed.previous, Theirs) and installed.uuid().endswith("theirs-2")
    assert config.post_grad_custom_post_pass is saved   # the patch's installs undone with it


@pytest.mark.parametrize("name,dropped", [("kivi-2", lowering.LaunchConfig(64, 4, 2, 16)),
                                          ("kvquant-4", lowering.LaunchConfig(32, 4, 2, 16)),
                                          ("innerq-2", lowering.LaunchConfig(32, 4, 2, 16))])
def test_launches_equal_to_the_default_tile_are_benchmarked_once(name, dropped):
    """The default launch resolves its tile per layout (64 tokens, or 32 where a side dequantizes element by
    element); the explicit configuration equal to it is not offered again, and the tile the lowering resolves
    from buffer names is the one the launcher resolves from the tensors."""
    from kvq_compile import KVQConfig
    from kvq_compile import store as st
    from kvq_compile.templates.decode_attention import _side_args, default_block_t, layout_block_t

    cfg = KVQConfig.preset(name)
    geo = st.Geometry(1, 2, 256, 64, "float16")
    lay = st.ModelStore(cfg, 1, geo, "cpu").layers[0]
    names, tensors = lay.attend_tensors()
    kc, vc = (_side_args(dict(zip(names, tensors)), s, q, geo, cfg)[1] for s, q in (("k", lay.spec.key),
                                                                                     ("v", lay.spec.value)))
    assert layout_block_t(cfg, lay.spec, names) == default_block_t(kc, vc, cfg.keys_before_rope) == dropped.block_t
    launches = lowering.distinct_launches(lowering.TUNED_CONFIGS, lay.descriptor(names))
    assert dropped in lowering.TUNED_CONFIGS and launches == tuple(c for c in lowering.TUNED_CONFIGS if c != dropped)
    assert lowering.distinct_launches(lowering.CONFIGS, lay.descriptor(names)) == (lowering.DEFAULT_CONFIG,)
    wide = lowering.distinct_launches(lowering.MAX_AUTOTUNE_CONFIGS, lay.descriptor(names))
    assert wide[0] == lowering.DEFAULT_CONFIG and dropped not in wide


def test_layout_tile_matches_the_launcher_for_every_preset():
    from kvq_compile import KVQConfig
    from kvq_compile import store as st
    from kvq_compile.presets import PRESETS
    from kvq_compile.templates.decode_attention import _side_args, default_block_t, layout_block_t

    geo = st.Geometry(1, 2, 256, 64, "float16")
    for name in PRESETS:
        cfg = KVQConfig.preset(name)
        for lay in st.ModelStore(cfg, 4, geo, "cpu").layers:
            names, tensors = lay.attend_tensors()
            kc, vc = (_side_args(dict(zip(names, tensors)), s, q, geo, cfg)[1]
                      for s, q in (("k", lay.spec.key), ("v", lay.spec.value)))
            want = default_block_t(kc, vc, cfg.keys_before_rope and lay.spec.key.quantized)
            assert layout_block_t(cfg, lay.spec, names) == want, (name, lay.spec)


@pytest.mark.interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU graph's template under TRITON_INTERPRET, for CPU-only "
                    "machines (the CI): on the H200 (torch 2.11, no interpreter) Inductor handed it to its C++ backend, "
                    "which asserted in CppScheduler.codegen_template (CUDA or torch 2.11: not told apart); the product "
                    "offers the template on CUDA only, test_template_generate_matches_opaque_op_on_gpu runs it there")
@pytest.mark.parametrize("name", ["kvquant-4-1%", "xquant-1.38"])
def test_template_source_names_every_planned_argument(name, monkeypatch):
    """The template's source as the lowering renders it for a compiled generate (on the CPU, Inductor cannot build
    the Triton kernel itself, so the extern choice then serves the op; its tokens must not change): one argument
    per `_fused_decode` parameter, every store tensor and scratch buffer named, the mask passed."""
    from kvq_compile.templates import decode_attention as da

    model = hf_model("llama", kv_heads=1, gqa=3, head_dim=64, layers=2)
    ids, mask = prompts(2, 9, pad=(0, 2))
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, cache_implementation="static")
    cfg = small_windows(name)
    monkeypatch.setattr(lowering, "DEVICES", set())
    ref = model.generate(ids, compile_config=compile_config(kvq_backend(cfg)), **kw)
    torch._dynamo.reset()
    sources = []
    real = lowering._template_source
    monkeypatch.setattr(lowering, "_template_source", lambda args, names: sources.append((args, names)) or
                        real(args, names))
    monkeypatch.setattr(lowering, "use_template", lambda *a, **k: None)
    monkeypatch.setattr(lowering, "DEVICES", {"cpu"})
    monkeypatch.setattr(lowering, "TEMPLATE", True)  # part of the compile cache key: no stale hit
    from torch._inductor import config as inductor_config
    # and no hit from an earlier run on this machine either (the same graph with TEMPLATE on renders no source)
    with inductor_config.patch(force_disable_caches=True):
        out = model.generate(ids, compile_config=compile_config(kvq_backend(cfg)), **kw)
    torch._dynamo.reset()
    assert torch.equal(out, ref)
    assert sources
    for args, names in sources:
        assert len(args) == len(da._fused_decode.arg_names) - 1
        assert names[:4] == ["Q", "KCH", "VCH", "POS"] and names[-5:] == ["AMASK", "OUT_M", "OUT_L", "OUT_ACC", "CNT"]
        assert set(names) - {"Q"} <= set(args), (args, names)   # every input but the query (loaded apart) is read
