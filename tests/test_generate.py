"""End to end: HuggingFace generate and a gpt-fast-style model compiled with kvq_backend (acceptance a-e)."""
import pytest
import torch

from kvq_compile import KVQConfig, kvq_backend
from kvq_compile import backend as bk
from kvq_compile import store as st
from kvq_compile.simulate import HFSimulation, quantized_view
from models import (CHECK_COMPILER, LAYOUT_PRESETS, GptFastModel, compile_config, hf_model, prompts, small_windows,
                    snr_db)

GEN = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _compiler(case, inductor_cases):
    """Inductor for `inductor_cases` (what the compiled generate must survive: its codegen, its ordering of the kvq
    ops' mutations, the lowerings' fallbacks), `models.CHECK_COMPILER` for the other cases of a test."""
    return "inductor" if case in inductor_cases else CHECK_COMPILER


@pytest.fixture
def stores(monkeypatch):
    """(fp16 cache tensor, store) of every compile of this test, in order, for the tests that check the cache
    tensors themselves (the store alone: `backend.stores()`). `bk._STORES` holds the caches weakly, and an entry
    goes with its cache tensor: torch 2.11 frees generate's StaticCache as soon as generate returns, torch 2.13 keeps
    it in a reference cycle until gc runs (both seen on the CPU, session 24), so `_STORES` may be empty after
    generate."""
    made = []
    real = bk._store_for

    def spy(cache, *args):
        store = real(cache, *args)
        made.append((cache, store))
        return store

    monkeypatch.setattr(bk, "_store_for", spy)
    return made


def _generate(model, ids, mask, backend=None, new=8):
    kw = dict(GEN, attention_mask=mask, max_new_tokens=new, cache_implementation="static")
    if backend is not None:
        kw["compile_config"] = compile_config(backend)
    return model.generate(ids, **kw)


@pytest.mark.parametrize("arch,kv_heads,gqa,head_dim", [
    ("llama", 2, 4, 64), ("mistral", 1, 1, 128), ("qwen2", 1, 3, 64), ("qwen3", 1, 4, 128)])
def test_every_layer_rewritten_and_fp16_exact(arch, kv_heads, gqa, head_dim):
    model = hf_model(arch, kv_heads=kv_heads, gqa=gqa, head_dim=head_dim, layers=3)
    ids, mask = prompts(1, 7)
    ref = _generate(model, ids, mask)
    be = kvq_backend("fp16", compiler=_compiler(arch, ("llama", "qwen3")))
    out = _generate(model, ids, mask, be)
    assert len(be.reports[0].rewritten) == 3, str(be.reports[0])
    assert torch.equal(ref.sequences, out.sequences)
    for step, (a, b) in enumerate(zip(ref.logits, out.logits)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=lambda m: f"{arch} step {step}: {m}")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_fp16_preset_batch3_left_padding(dtype, tol):
    model = hf_model("llama", kv_heads=1, gqa=3, head_dim=64, layers=2, dtype=dtype)
    ids, mask = prompts(3, 9, pad=(0, 3, 5))
    ref = _generate(model, ids, mask, new=10)
    be = kvq_backend("fp16", compiler=_compiler(dtype, (torch.bfloat16,)))
    out = _generate(model, ids, mask, be, new=10)
    layer = be.stores()[-1].layers[0]
    assert layer.buffers["k.data"].dtype == dtype  # fp16 preset keeps the cache dtype
    steps = len(ref.logits)
    if dtype == torch.float32:
        assert torch.equal(ref.sequences, out.sequences)
    else:  # bf16 rounds differently in compiled and eager code; a random model's near-ties can flip a token
        diverged = (ref.sequences != out.sequences).any(0).nonzero()
        steps = int(diverged[0]) - ids.shape[1] + 1 if len(diverged) else steps
        assert steps >= 2
    for a, b in zip(ref.logits[:steps], out.logits[:steps]):
        torch.testing.assert_close(b.float(), a.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("name,min_snr", [("int8", 35.0), ("kivi-4", 18.0)])
def test_int8_and_kivi4_snr_and_bytes(name, min_snr):
    # SNR of the per-step logits against fp16. int8 noise is ~2^-8 of each range: > 35 dB leaves margin for
    # the softmax; 4-bit (2^-4, plus KIVI's per-channel key groups) is about 24 dB lower.
    model = hf_model("llama", kv_heads=2, gqa=2, head_dim=64, layers=2)
    ids, mask = prompts(2, 100, pad=(0, 4))
    ref = _generate(model, ids, mask, new=12)
    cfg = KVQConfig.preset(name)
    cfg.recent = min(cfg.recent, 32)  # whole 32-token key groups; most of the context is quantized
    be = kvq_backend(cfg, compiler=_compiler(name, ("kivi-4",)))
    out = _generate(model, ids, mask, be, new=12)
    for step, (a, b) in enumerate(zip(ref.logits, out.logits)):
        assert snr_db(a, b) > min_snr, f"{name} step {step}: {snr_db(a, b):.1f} dB"
    store = be.stores()[-1]
    B, H, T, D = 2, 2, store.geo.max_len, 64
    bits = cfg.equivalent_bits(2, H, D, T, batch=B, dtype_bytes=4)
    assert store.nbytes() == pytest.approx(bits * 2 * 2 * B * H * T * D / 8)


@pytest.mark.parametrize("name", LAYOUT_PRESETS)
def test_preset_matches_eager_simulation(name):
    model = hf_model("llama", kv_heads=1, gqa=2, head_dim=64, layers=4)
    cfg = small_windows(name)
    ids, mask = prompts(2, 9, pad=(2, 0))
    sim = HFSimulation(model, cfg).generate(ids, attention_mask=mask, max_new_tokens=10, **GEN)
    be = kvq_backend(cfg, compiler=_compiler(name, ("kivi-2", "kvquant-3-1%")))
    out = _generate(model, ids, mask, be, new=10)
    assert len(be.reports[0].rewritten) == 4
    # The first decode step reads only what eager code wrote: identical inputs, so float tolerance.
    torch.testing.assert_close(out.logits[1], sim.logits[1], atol=1e-5, rtol=1e-5)
    # Later steps quantize K/V computed by compiled code, which differ from eager in the last bit and can
    # move a value across a rounding boundary; the store itself is checked exactly in the next test.
    for a, b in zip(sim.logits, out.logits):
        torch.testing.assert_close(b, a, atol=2e-2, rtol=0)


@pytest.mark.parametrize("name", ["kivi-2", "innerq-2", "xquant-1.38", "kvquant-3-1%", "calibquant-1"])
def test_compiled_store_equals_simulation_of_its_inputs(name, monkeypatch):
    """Every K/V the compiled steps appended, replayed through the direct simulation: exactly the store (with the
    first chunk's real-token slots that its append took, for the static ranges' percentiles)."""
    model = hf_model("llama", kv_heads=1, gqa=2, head_dim=64, layers=4)
    cfg = small_windows(name)
    cfg.keys_before_rope = False
    seen = {}
    real_append = st.append

    first_slots = {}

    def spy(bufs, cfg_, spec, geo, key, value, p0, cos=None, sin=None, slots=None):
        seen.setdefault(id(bufs["v.half"]), []).append((key.clone(), value.clone()))
        if p0 == 0 and slots is not None:
            first_slots[id(bufs["v.half"])] = slots[..., :key.shape[2]].clone()
        return real_append(bufs, cfg_, spec, geo, key, value, p0, cos, sin, slots)

    real_decode = st.append_decode

    def spy_decode(bufs, cfg_, spec, geo, key, value, positions, cos=None, sin=None):
        seen.setdefault(id(bufs["v.half"]), []).append((key.clone(), value.clone()))
        return real_decode(bufs, cfg_, spec, geo, key, value, positions, cos, sin)

    monkeypatch.setattr(st, "append", spy)
    monkeypatch.setattr(st, "append_decode", spy_decode)
    ids, mask = prompts(2, 9, pad=(2, 0))
    be = kvq_backend(cfg)   # Inductor: aot_eager hands the ops clones of the buffers it mutates (the spy's ids)
    _generate(model, ids, mask, be, new=14)
    store = be.stores()[-1]
    for i, layer in enumerate(store.layers):
        names, tensors = layer.attend_tensors()
        bufs = dict(zip(names, tensors))
        hist = {j: [torch.cat(x, 2) for x in zip(*seen[id(store.layers[j].buffers["v.half"])])] for j in (i, i - 1)
                if j >= 0}
        K, V = hist[i]
        L = K.shape[2]
        k, v = st.read(bufs, cfg, store.specs[i], 64, L, L)
        spec = store.specs[i]
        src_k = hist[i - 1][0] if spec.share_key_codes_from is not None else None
        src_v = hist[i - 1][1] if spec.share_value_codes_from is not None else None
        valid = first_slots.get(id(layer.buffers["v.half"]))
        torch.testing.assert_close(k, quantized_view(K, spec.key, cfg, L, 9, src_k, is_key=True, valid=valid), atol=0,
                                   rtol=0)
        torch.testing.assert_close(v, quantized_view(V, spec.value, cfg, L, 9, src_v, valid=valid), atol=0, rtol=0)
    if name == "kvquant-3-1%":   # the padded row's slots reached the first append
        assert first_slots and all(not bool(s.all()) for s in first_slots.values())


def test_append_beside_keeps_the_pair_without_a_recent_window():
    """int8 has no recent window: its attention may read what its append writes, so append_beside keeps the pair.
    (Until session 43 an int8 case of the test below compared two compiles of this one configuration: in two CI runs
    of one commit, in some test orders, 48 of 192 logits differed by up to 5.7e-5 between them; not understood, see
    the session 43 note. The comparison is of the op against the pair, which int8 does not have.)"""
    model = hf_model("llama", kv_heads=1, gqa=2, head_dim=64, layers=4).to(DEVICE)
    cfg = small_windows("int8")
    assert not st.attention_independent(cfg)
    ids, mask = (t.to(DEVICE) for t in prompts(2, 9, pad=(2, 0)))
    be = kvq_backend(cfg, append_beside=True)
    _generate(model, ids, mask, be, new=4)
    ops = "\n".join(map(str, be.reports))
    assert "kvq::append + kvq::attend" in ops and "kvq::append_attend" not in ops, ops


@pytest.mark.parametrize("name", ["kivi-2", "xquant-1.38", "innerq-2", "calibquant-1"])
def test_append_beside_op_matches_the_pair(name):
    """`append_beside` (the CUDA default, forced here on the CPU): a decode step's (append, attention) pair becomes
    one kvq::append_attend where the attention reads nothing its append writes (a recent window; int8, without one,
    keeps the pair: the test above). The logits and every store buffer equal the pair's: the op writes no codes
    shared from an earlier layer (xquant-1.38's odd layers), and an XQuant layer's attention reads the codes its
    source layer's op wrote in the same step's graph. On a CUDA machine the model runs there: the op's CUDA kernel
    (the append beside the attention; calibquant-1's first) against the pair's kernels (first run there in session
    43: 5 passed, int8 included)."""
    model = hf_model("llama", kv_heads=1, gqa=2, head_dim=64, layers=4).to(DEVICE)
    cfg = small_windows(name)
    ids, mask = (t.to(DEVICE) for t in prompts(2, 9, pad=(2, 0)))
    runs = []
    for beside in (False, True):
        be = kvq_backend(cfg, append_beside=beside, compiler=_compiler(name, ("xquant-1.38", "calibquant-1")))
        runs.append((_generate(model, ids, mask, be, new=12), be))
    (pair, be_pair), (fused, be_fused) = runs
    ops = "\n".join(map(str, be_fused.reports))
    assert ("kvq::append_attend" in ops) is st.attention_independent(cfg), ops
    assert "kvq::append_attend" not in "\n".join(map(str, be_pair.reports))
    for a, b in zip(pair.logits, fused.logits):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    for la, lb in zip(be_pair.stores()[-1].layers, be_fused.stores()[-1].layers):
        for n, t in la.buffers.items():
            torch.testing.assert_close(lb.buffers[n], t, atol=0, rtol=0, msg=n)


def test_fp16_cache_released_and_generate_twice(stores):
    model = hf_model("llama", kv_heads=1, gqa=2, head_dim=64, layers=2)
    be = kvq_backend(small_windows("kivi-2"))
    ids1, m1 = prompts(2, 11, pad=(0, 2), seed=5)
    ids2, m2 = prompts(2, 11, pad=(3, 0), seed=6)
    first = _generate(model, ids1, m1, be)
    second = _generate(model, ids2, m2, be)
    again = _generate(model, ids1, m1, be)
    assert torch.equal(first.sequences, again.sequences)
    for a, b in zip(first.logits, again.logits):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert not torch.equal(first.sequences, second.sequences)
    # The first generate compiled twice (the released cache's zero strides recompile) and found one store again;
    # the later ones reuse those graphs. Torch 2.11 frees generate's StaticCache when it returns, 2.13 keeps it in a
    # reference cycle until gc runs, so `bk._STORES` may be empty here: the fixture holds the caches instead.
    assert len(stores) == 2 and stores[0][1] is stores[1][1], [(id(c), id(s)) for c, s in stores]
    assert len(be.stores()) == 1 and be.stores()[0] is stores[0][1]
    for t, _ in stores:  # every fp16 cache tensor the backend has seen now holds no memory
        assert bk.released(t) and t.untyped_storage().nbytes() <= t.element_size()


def test_opt_out_keeps_fp16_cache(stores):
    model = hf_model("llama", kv_heads=1, gqa=2, head_dim=64, layers=2)
    be = kvq_backend("int8", release_fp16_cache=False)
    ids, mask = prompts(1, 6)
    _generate(model, ids, mask, be)
    t = stores[-1][0]
    assert not bk.released(t) and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_generate_calls_of_other_sizes_get_stores_of_their_size():
    """One backend serving generate calls of other batch sizes and lengths (a server): Dynamo's automatic dynamic
    shapes (CompileConfig's default) compiled the second size's graph symbolic in the cache's sizes, and later calls
    ran it over the store of the size it was compiled with (a review: "store holds 19 positions: cannot append 30
    more" at a 37-position cache, another error on a batch change; on CUDA a device assertion). The cache's sizes
    are now specialized (`backend._specialize_cache_shapes`): every size gets graphs and a store of its own, and the
    fp16 preset equals HF's static cache at each call."""
    model = hf_model("llama", kv_heads=1, gqa=2, head_dim=64, layers=2)
    be = kvq_backend("fp16", compiler="aot_eager")
    for i, (b, n, pad) in enumerate([(1, 7, (0,)), (1, 12, (0,)), (2, 30, (0, 3)), (1, 14, (0,))]):
        ids, mask = prompts(b, n, pad=pad, seed=20 + i)
        kw = dict(attention_mask=mask, max_new_tokens=6, cache_implementation="static", **GEN)
        ref = model.generate(ids, **kw)
        out = model.generate(ids, compile_config=compile_config(be), **kw)
        assert torch.equal(ref.sequences, out.sequences), i
        assert max((x - y).abs().max().item() for x, y in zip(ref.logits, out.logits)) < 1e-5, i
        sizes = [(s.geo.batch, s.geo.max_len) for s in be.stores()]
        assert sizes[-1][0] == b and sizes[-1][1] >= n + 5, (i, sizes)   # (the last token takes no slot)
    assert len(set(sizes)) == 4, sizes   # (HF keeps its cache length between calls: the last call takes call 3's)


def _kvq_warnings(fn):
    """fn()'s result and the warnings of logger "kvq_compile" while it ran (the suite runs with -p no:logging: no
    caplog)."""
    import logging

    seen = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("kvq_compile").addHandler(handler)
    try:
        return fn(), seen
    finally:
        logging.getLogger("kvq_compile").removeHandler(handler)


def test_a_graph_left_unchanged_is_said_once_as_a_warning():
    """A model whose attention the pass does not recognize (HF's eager attention: softmax by hand) compiles with its
    caches in fp16: said as a warning once a backend (it was an INFO log: a user saw no memory saved and no reason),
    over two calls of two graphs, with the results HF's. A compile that Dynamo restarts (`CompileConfig(dynamic=True)`:
    its first trace of a decode step stops on a tensor attention scale, and the graph traced again is rewritten) leaves
    neither a warning nor a report (a review saw a false warning and a phantom report there)."""
    from transformers import CompileConfig

    model = hf_model("llama", kv_heads=1, gqa=2, head_dim=64, layers=2, attn_implementation="eager")
    be = kvq_backend("kivi-2", compiler="aot_eager")

    def two_calls():
        outs = []
        for n in (7, 9):
            ids, mask = prompts(1, n)
            kw = dict(attention_mask=mask, max_new_tokens=4, cache_implementation="static", **GEN)
            outs.append((model.generate(ids, compile_config=compile_config(be), **kw), model.generate(ids, **kw)))
        return outs

    outs, seen = _kvq_warnings(two_calls)
    assert all(torch.equal(out.sequences, ref.sequences) for out, ref in outs)
    assert len(be.reports) >= 2 and not any(r.rewritten for r in be.reports)
    assert len([m for m in seen if "were all left unchanged, so its caches stay fp16" in m]) == 1, seen

    sdpa = hf_model("llama", kv_heads=1, gqa=2, head_dim=64, layers=2)
    ids, mask = prompts(1, 7)
    dyn = kvq_backend(small_windows("kivi-2"), compiler="aot_eager")
    cc = CompileConfig(backend=dyn, fullgraph=True, dynamic=True)
    cc._compile_all_devices = True
    torch._dynamo.reset()
    _, seen = _kvq_warnings(lambda: sdpa.generate(ids, attention_mask=mask, max_new_tokens=4,
                                                  cache_implementation="static", compile_config=cc, **GEN))
    assert dyn.reports and all(len(r.rewritten) == 2 for r in dyn.reports), [str(r) for r in dyn.reports]
    assert not any("left unchanged" in m for m in seen), seen


def test_caches_marked_dynamic_are_left_unchanged_with_the_reason():
    """`torch._dynamo.mark_dynamic` on a cache forbids the specialization a store needs: the graph is left unchanged
    with kvq's reason (it failed with Dynamo's ConstraintViolationError, which named no kvq cause); with
    `maybe_mark_dynamic` each cache size gets its own store."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    weights = [torch.randn(64, 3 * 64) * 0.1 for _ in range(2)]

    def step(x, pos, kcs, vcs):
        for w, kc, vc in zip(weights, kcs, vcs):
            q, k, v = (x @ w).view(x.shape[0], x.shape[1], 3, 2, 32).permute(2, 0, 3, 1, 4)
            kc.index_copy_(2, pos, k)
            vc.index_copy_(2, pos, v)
            mask = torch.arange(kc.shape[2]) <= pos[:, None]
            x = x + F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask).transpose(1, 2).reshape(x.shape)
        return x

    for mark, expect in ((torch._dynamo.mark_dynamic, 0), (torch._dynamo.maybe_mark_dynamic, 2)):
        torch._dynamo.reset()
        be = kvq_backend("fp16", compiler="aot_eager")
        f = torch.compile(step, backend=be, fullgraph=True)
        for L in (32, 48):
            kcs, vcs = ([torch.zeros(2, 2, L, 32) for _ in range(2)] for _ in range(2))
            kr, vr = [t.clone() for t in kcs], [t.clone() for t in vcs]
            for t in kcs + vcs:
                mark(t, 2)
            with torch.no_grad():
                for p0, n in ((0, 6), (6, 1), (7, 1)):
                    x = torch.randn(2, n, 64)
                    pos = torch.arange(p0, p0 + n)
                    torch.testing.assert_close(f(x, pos, kcs, vcs), step(x, pos, kr, vr), atol=1e-5, rtol=1e-5)
        assert all(len(r.rewritten) == expect for r in be.reports), [str(r) for r in be.reports]
        if expect == 0:
            assert all("marked dynamic (torch._dynamo.mark_dynamic)" in r.skipped[0][1] for r in be.reports)
        else:
            assert sorted(s.geo.max_len for s in be.stores()) == [32, 48]


@pytest.mark.parametrize("first", ["maskless", "unseated"])
def test_a_maskless_first_chunk_resets_the_seats_a_padded_sequence_left(first):
    """A sink config on a gpt-fast-style model: a left-padded sequence seats its rows (its sink holds each row's
    first real tokens, `store.seating`), and later masks are read through those seats. A new sequence whose first
    chunk attends by is_causal (no mask, so no `kvq::seat_chunk` before) kept them: its decode steps read their
    masks through the earlier sequence's seats (README listed it as not detected): where a later mask hides a token
    (here slot 4 of row 1), another slot was hidden (logits apart); where the masks hide nothing, the permuted
    columns were all True alike. "unseated": a masked first chunk that the rewrite does not seat (here its layers
    read different mask nodes) kept them too, and read its own mask through them (a review: 1.21 apart). A chunk
    graph not seated by its mask now takes the op without one, which makes a first chunk's seats the identity
    before any mask is read through them: the second sequence equals a fresh model's."""
    class MaybeCausal(GptFastModel):   # its attention takes is_causal where no mask is given
        def forward(self, idx, input_pos, mask=None, split=False):
            x = self.embed(idx)
            for i, layer in enumerate(self.layers):   # split: layer 1 reads another mask node (`mask & True`)
                x = x + layer(x, mask & True if split and i else mask, input_pos)
            return self.out(x)

    cfg = small_windows("innerq-2")
    assert cfg.sink > 0
    T, pad = 40, 3
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(7))
    slots = torch.arange(T)

    def mask(pos, padded):   # [2, 1, n, T]: causal over the slots; row 1's first `pad` slots masked where padded,
        m = slots[None, None, None, :] <= pos[None, None, :, None]   # else its slot 4 (a mask that hides a token)
        m = m.expand(2, 1, pos.numel(), T).clone()
        if padded:
            m[1, :, :, :pad] = False
        else:
            m[1, :, :, 4] = False
        return m

    def second_sequence(step):
        if first == "maskless":   # an is_causal first chunk
            outs = [step(ids[:, :10], torch.arange(10))]
        else:
            outs = [step(ids[:, :10], torch.arange(10), mask(torch.arange(10), False), True)]
        for p in range(10, 14):
            pos = torch.tensor([p])
            outs.append(step(ids[:, p:p + 1], pos, mask(pos, False)))
        return outs

    def fresh_model(be):
        torch._dynamo.reset()
        torch.manual_seed(0)
        return torch.compile(MaybeCausal(batch=2, max_len=T), backend=be, fullgraph=True)

    with torch.no_grad():
        fresh = second_sequence(fresh_model(kvq_backend(cfg, compiler="aot_eager")))
        be = kvq_backend(cfg, compiler="aot_eager")
        step = fresh_model(be)
        step(ids[:, :10], torch.arange(10), mask(torch.arange(10), True))   # a left-padded first sequence
        for p in range(10, 13):
            pos = torch.tensor([p])
            step(ids[:, p:p + 1], pos, mask(pos, True))
        seats = be.stores()[0].seats
        assert not torch.equal(seats[1], slots)   # row 1 seated (its pads moved out of the sink)
        again = second_sequence(step)
    assert torch.equal(seats, slots.expand(2, T))
    assert all(len(r.rewritten) == 2 for r in be.reports), [str(r) for r in be.reports]
    for a, b in zip(again, fresh):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["fp16", "int8"])
def test_gpt_fast_style_model(name):
    torch.manual_seed(0)
    ref_model = GptFastModel(batch=2)
    model = GptFastModel(batch=2)
    model.load_state_dict(ref_model.state_dict())
    be = kvq_backend(name)
    compiled = torch.compile(model, backend=be, fullgraph=True)
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        ref = ref_model(ids[:, :5], torch.arange(5))
        out = compiled(ids[:, :5], torch.arange(5))  # compiled prefill: p0 = 0, nothing eager to absorb
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        for p in range(5, 12):
            ref = ref_model(ids[:, p:p + 1], torch.tensor([p]))
            out = compiled(ids[:, p:p + 1], torch.tensor([p]))
            tol = 1e-5 if name == "fp16" else 3e-2
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    assert all(len(r.rewritten) == 2 for r in be.reports), "\n".join(map(str, be.reports))


def _rollback_config(name: str) -> KVQConfig:
    """small_windows(name); "kvquant-4/after-rope": with its Keys stored after RoPE (GptFastModel has no RoPE, and
    the pass leaves Keys stored before RoPE unchanged where it finds none)."""
    base, _, variant = name.partition("/")
    cfg = small_windows(base)
    if variant == "after-rope":
        cfg.keys_before_rope = False
    return cfg


def _gpt_fast_steps(cfg, ids, steps, prefill=10):
    """A fresh gpt-fast-style model compiled through kvq_backend(cfg) (aot_eager): a `prefill`-token chunk, then
    one-token steps at `steps` [(position, token column)]; the logits of every step. Checks that both layers were
    rewritten."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    be = kvq_backend(cfg, compiler="aot_eager")
    step = torch.compile(GptFastModel(batch=2, max_len=40), backend=be, fullgraph=True)
    with torch.no_grad():
        step(ids[:, :prefill], torch.arange(prefill))
        out = [step(ids[:, c:c + 1], torch.tensor([p])) for p, c in steps]
    assert be.reports and all(len(r.rewritten) == 2 for r in be.reports), "\n".join(map(str, be.reports))
    return out


@pytest.mark.parametrize("name", ["kivi-2", "innerq-2", "calibquant-1", "kvquant-4/after-rope"])
def test_a_step_behind_the_frontier_is_refused_where_the_store_cannot_take_it_back(name):
    """Going back to an earlier position (speculative decoding's rollback, HF's assisted generation) over a store
    with a recent window: its ring no longer holds the tokens that the later ones overwrote, and reading it as if it
    did gave logits 0.02-0.15 apart from a fresh run of the same tokens here (kivi-2, innerq-2, calibquant-1, 2 to 5
    positions back; one back happened to be exact). kvquant's static Key ranges come from its first chunk: a step
    back into it left results that depend on the rejected tokens (0.02 apart, a review's script). Now refused
    before anything is written, by the first layer's append: one position back or more, by a decode step or a
    chunk; a new sequence at 0 and the next position still run."""
    cfg = _rollback_config(name)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(5))
    fresh = _gpt_fast_steps(cfg, ids, [(p, p) for p in range(10, 17)])
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GptFastModel(batch=2, max_len=40)
    be = kvq_backend(cfg, compiler="aot_eager")
    step = torch.compile(model, backend=be, fullgraph=True)
    with torch.no_grad():
        step(ids[:, :10], torch.arange(10))
        for p in range(10, 16):
            step(ids[:, p:p + 1], torch.tensor([p]))
        store = be.stores()[0]
        before = [t.clone() for layer in store.layers for t in layer.append_tensors()[1]]
        for p in (15, 5):
            with pytest.raises(ValueError, match=f"cannot append at position {p}: positions up to 15 are written, "
                                                 "and this store cannot take back tokens"):
                step(ids[:, p:p + 1], torch.tensor([p]))
        with pytest.raises(ValueError, match="cannot append at position 14: positions up to 15 are written"):
            step(ids[:, 14:16], torch.arange(14, 16))   # a chunk (HF's assisted generation verifies in chunks)
        after = [t for layer in store.layers for t in layer.append_tensors()[1]]
        assert all(torch.equal(a, b) for a, b in zip(before, after))   # nothing written by the refused steps
        # the next position runs and equals a run without the refused steps
        assert torch.equal(step(ids[:, 16:17], torch.tensor([16])), fresh[-1])
        # a new sequence from 0 on the same store runs as on a fresh model
        step(ids[:, :10], torch.arange(10))
        assert all(torch.equal(step(ids[:, p:p + 1], torch.tensor([p])), fresh[p - 10]) for p in range(10, 13))
    assert be.stores() == [store] and all(len(r.rewritten) == 2 for r in be.reports)


@pytest.mark.parametrize("name", ["int8", "fp16"])
def test_a_store_that_takes_any_order_takes_positions_back_exactly(name):
    """Stores that code every token from itself alone and keep it nowhere else (`store.any_order`: int8, fp16):
    going back to an earlier position, even into the prefill, and writing other tokens there gives what a fresh run
    of the final tokens gives, bit for bit, so they take it (no frontier is kept)."""
    cfg = small_windows(name)
    assert st.any_order(cfg, cfg.check_model(2, 32, 40))
    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, 96, (2, 24), generator=g)
    for back in (1, 3, 5, 14):   # (14: into the 10-token prefill)
        b = a.clone()
        b[:, 20 - back:] = torch.randint(0, 96, (2, 4 + back), generator=g)
        both = torch.cat([a[:, :20], b[:, 20 - back:]], 1)   # columns: a's 20 tokens, then b's from 20 - back on
        rolled = _gpt_fast_steps(cfg, both, [(p, p) for p in range(10, 20)]
                                 + [(p, p + back) for p in range(20 - back, 24)])
        # the fresh run writes the same positions by steps (a chunk attends its own tokens exactly, a step the
        # stored ones: not the same numbers): back into the prefill, its prefill ends where the rolled run goes back
        start = min(20 - back, 10)
        fresh = _gpt_fast_steps(cfg, b, [(p, p) for p in range(start, 24)], prefill=start)
        k = 4 + back   # the steps at positions 20 - back .. 23 of each
        for x, y in zip(rolled[-k:], fresh[-k:], strict=True):
            if start == 10:
                assert torch.equal(x, y), back
            else:   # (their first 6 tokens came through a 10- and a 6-token chunk: float rounding apart)
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_hf_assisted_generation_over_a_windowed_store_is_refused():
    """HF's assisted generation crops its StaticCache after rejected draft tokens and verifies the next draft from
    the earlier position: over kivi-2 kvq refuses it with its error (it read overwritten ring slots before); over
    int8 (no window) it runs, and greedy equals plain greedy generation through kvq_backend to float rounding."""
    model = hf_model("llama", kv_heads=1, gqa=2, head_dim=64, layers=2)
    draft = hf_model("llama", kv_heads=1, gqa=2, head_dim=64, layers=1, seed=3)
    ids, _ = prompts(1, 12)

    def run(cfg, **kw):
        torch._dynamo.reset()
        cc = compile_config(kvq_backend(cfg, compiler="aot_eager"))
        return model.generate(ids, max_new_tokens=16, cache_implementation="static", compile_config=cc, **kw, **GEN)

    with pytest.raises(ValueError, match="this store cannot take back tokens"):
        run(small_windows("kivi-2"), assistant_model=draft)
    plain, assisted = run("int8"), run("int8", assistant_model=draft)
    assert torch.equal(plain.sequences, assisted.sequences)
    assert max((x - y).abs().max().item() for x, y in zip(plain.logits, assisted.logits)) < 1e-5
