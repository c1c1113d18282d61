"""The store's incremental append (ring buffer, group flushes, packing) against the direct simulation."""
import dataclasses

import pytest
import torch

from kvq_compile import Axis, KVQConfig, QuantizerSpec, Symmetry
from kvq_compile import reference as ref
from kvq_compile import store as st
from kvq_compile.presets import PRESETS
from kvq_compile.simulate import quantized_view
from models import LAYOUT_PRESETS, small_windows

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _run(cfg, dtype, chunks, B=2, H=3, D=64, T=None, seed=0):
    torch.manual_seed(seed)
    total = sum(chunks)
    T = T or total + 3
    specs = cfg.check_model(2, D, T)
    geo = st.Geometry(B, H, T, D, st.dtype_name(dtype))
    ms = st.ModelStore(cfg, 2, geo, "cpu")
    hist = [(torch.randn(B, H, total, D) * (1 + 3 * torch.rand(1, H, 1, D))).to(dtype) for _ in range(4)]
    p0 = 0
    for n in chunks:
        for i, layer in enumerate(ms.layers):
            names, tensors = layer.append_tensors()
            st.append(dict(zip(names, tensors)), cfg, specs[i], geo, hist[2 * i][:, :, p0:p0 + n],
                      hist[2 * i + 1][:, :, p0:p0 + n], p0)
        p0 += n
        for i, layer in enumerate(ms.layers):
            names, tensors = layer.attend_tensors()
            k, v = st.read(dict(zip(names, tensors)), cfg, specs[i], D, p0, p0)
            src_k = hist[0] if specs[i].share_key_codes_from is not None else None
            src_v = hist[1] if specs[i].share_value_codes_from is not None else None
            ek = quantized_view(hist[2 * i], specs[i].key, cfg, p0, chunks[0], src_k, is_key=True,
                                levels=tensors[names.index("k.levels")] if "k.levels" in names else None)
            ev = quantized_view(hist[2 * i + 1], specs[i].value, cfg, p0, chunks[0], src_v)
            tol = TOL[dtype]
            torch.testing.assert_close(k, ek, atol=tol, rtol=tol, msg=lambda m: f"K layer {i} len {p0}: {m}")
            torch.testing.assert_close(v, ev, atol=tol, rtol=tol, msg=lambda m: f"V layer {i} len {p0}: {m}")
    return ms


PRESET_NAMES = [n for n in PRESETS if n != "xquant-1.38"]


@pytest.mark.parametrize("name", PRESET_NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_presets_incremental_equals_simulation(name, dtype):
    cfg = KVQConfig.preset(name)
    cfg.recent = min(cfg.recent, 32)
    cfg.sink = min(cfg.sink, 3)
    cfg.keys_before_rope = False  # RoPE re-application is covered by the op tests
    # a prefill, decode steps crossing several group flushes, then a multi-token chunk
    _run(cfg, dtype, [37] + [1] * 41 + [5, 1])


@pytest.mark.parametrize("name", ["kivi-2", "innerq-2", "xquant-1.38", "kvquant-3-1%", "int8"])
def test_groups_coded_when_complete_read_as_coded_late(name, monkeypatch):
    """`store.EAGER_GROUPS`: coding a group on the step that completes it, not when it leaves the recent window, changes
    what is written when, not what is read: every read of a prefill, decode steps across several flushes and a
    chunk is bit-equal with the rule on and off (xquant-1.38: layers sharing codes)."""
    cfg = small_windows(name)
    cfg.keys_before_rope = False
    geo = st.Geometry(2, 2, 80, 64, "bfloat16")
    gen = torch.Generator().manual_seed(5)
    steps = [9] + [1] * 23 + [6, 1, 1]
    kv = torch.randn(2, 4, 2, 2, sum(steps), 64, generator=gen).bfloat16()
    reads = []
    for eager in (True, False):
        monkeypatch.setattr(st, "EAGER_GROUPS", eager)
        ms = st.ModelStore(cfg, 4, geo, "cpu")
        seen, p0 = [], 0
        for n in steps:
            for i, lay in enumerate(ms.layers):
                names, tensors = lay.append_tensors()
                bufs = dict(zip(names, tensors))
                x = kv[:, i, :, :, p0:p0 + n]
                if n == 1:
                    st.append_decode(bufs, cfg, lay.spec, geo, x[0], x[1], torch.tensor([p0]))
                else:
                    st.append(bufs, cfg, lay.spec, geo, x[0], x[1], p0)
            p0 += n
            for lay in ms.layers:
                names, tensors = lay.attend_tensors()
                seen.append(st.read(dict(zip(names, tensors)), cfg, lay.spec, 64, p0, p0))
        reads.append(seen)
    for (ka, va), (kb, vb) in zip(*reads):
        torch.testing.assert_close(ka, kb, atol=0, rtol=0)
        torch.testing.assert_close(va, vb, atol=0, rtol=0)


def test_xquant_sharing_layers():
    cfg = KVQConfig(key=QuantizerSpec(bits=1, axis=Axis.CHANNEL, group_size=8),
                    value=QuantizerSpec(bits=1, axis=Axis.TOKEN, group_size=16), recent=8,
                    eta={1: 1 / 6}, share_key_codes_from_layer=1, share_value_codes_from_layer=1)
    specs = cfg.resolve(2)
    assert specs[1].share_key_codes_from == 0 and specs[1].share_value_codes_from == 0
    ms = _run(cfg, torch.float32, [21] + [1] * 19)
    assert "k.codes" not in ms.layers[1].buffers and ms.layers[1].shared["k.codes"] is ms.layers[0].buffers["k.codes"]


@pytest.mark.parametrize("symmetry", list(Symmetry))
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_odd_schemes(symmetry, bits):
    if symmetry is Symmetry.HYBRID and bits == 1:
        pytest.skip("hybrid needs 2 bits")
    cfg = KVQConfig(key=QuantizerSpec(bits=bits, axis=Axis.CHANNEL, group_size=4, symmetry=symmetry),
                    value=QuantizerSpec(bits=bits, axis=Axis.TOKEN, group_size=16, symmetry=symmetry,
                                        outlier_fraction=0.02 if symmetry is not Symmetry.HYBRID else 0),
                    sink=2, recent=4)
    _run(cfg, torch.float32, [1, 1, 9] + [1] * 13, D=48)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_hybrid_choice_is_the_sign_of_half(dtype):
    """innerq-2's hybrid groups keep their choice (symmetric levels or not) in the sign of their stored half-range:
    no mask buffer; both choices occur, and the stored statistics are the reference's with the sign applied."""
    from kvq_compile import reference as ref

    torch.manual_seed(3)
    cfg = KVQConfig.preset("innerq-2")
    cfg.sink, cfg.recent = 0, 0
    B, H, T, D = 2, 3, 64, 64
    geo = st.Geometry(B, H, T, D, st.dtype_name(dtype))
    spec = cfg.check_model(1, D, T)[0]
    layer = st.ModelStore(cfg, 1, geo, "cpu").layers[0]
    assert not any(n.endswith("mask") for n in layer.buffers)
    # Gaussian groups (symmetric levels win) and two-valued groups off zero, 3 +- 1 (asymmetric ones win): the Keys'
    # groups are 32 channels of a token (the odd tokens two-valued), the Values' 32 tokens of a channel (odd channels)
    two = 3 + torch.randint(0, 2, (B, H, T, D)).float() * 2 - 1
    odd = torch.arange(T).view(1, 1, T, 1) % 2 == 1
    k = torch.where(odd, two, torch.randn(B, H, T, D)).to(dtype)
    v = torch.where(odd.transpose(-1, -2)[..., :D], two, torch.randn(B, H, T, D)).to(dtype)
    names, tensors = layer.append_tensors()
    st.append(dict(zip(names, tensors)), cfg, spec, geo, k, v, 0)
    b = layer.buffers
    qk = ref.quantize_block(k.float() / b["k.norm"], spec.key, ref.levels_for(spec.key), dtype)
    qv = ref.quantize_block(v[:, :, :32].float(), spec.value, ref.levels_for(spec.value), dtype)
    for name, qb, stored in (("k", qk, b["k.half"]), ("v", qv, b["v.half"][:, :, :1])):
        assert qb.mask.any() and (~qb.mask).any(), name
        torch.testing.assert_close(stored, torch.where(qb.mask, -qb.half, qb.half), rtol=0, atol=0)
        half, mask = st.split_half(stored, getattr(spec, {"k": "key", "v": "value"}[name]))
        assert torch.equal(mask, qb.mask) and torch.equal(half, qb.half) and (half > 0).all(), name


def test_store_bytes_match_equivalent_bits():
    for name in PRESETS:
        cfg = KVQConfig.preset(name)
        geo = st.Geometry(3, 2, 256, 64, "float16")
        ms = st.ModelStore(cfg, 4, geo, "cpu")
        bits = cfg.equivalent_bits(4, 2, 64, 256, batch=3)
        assert ms.nbytes() * 8 == pytest.approx(bits * 2 * 4 * 3 * 2 * 256 * 64), name


def test_quantized_store_is_smaller_than_fp16():
    cfg = KVQConfig.preset("kivi-2")
    T = 16384
    # 2-bit codes + fp16 (center, half) per 32 elements + fp16 rings (K: 128 + 31 tokens, V: 128)
    expected = 2 + 32 / 32 + 16 * ((128 + 31) + 128) / (2 * T)
    assert cfg.equivalent_bits(32, 8, 128, T) == pytest.approx(expected)
    assert KVQConfig.preset("fp16").equivalent_bits(32, 8, 128, 16384) == 16


@pytest.mark.parametrize("prefill", [9, 1])
@pytest.mark.parametrize("name", list(PRESETS))
def test_sync_free_decode_append_is_bit_exact(name, prefill):
    """`append_decode` (device-side positions, masked writes) leaves every buffer exactly as the reference
    `append` does, across flushes of token groups, the sink, the ring, and shared-code layers."""
    cfg = small_windows(name)
    B, H, T, D = 2, 2, 40, 64
    geo = st.Geometry(B, H, T, D, "float32")
    ref_store, dec_store = st.ModelStore(cfg, 4, geo, "cpu"), st.ModelStore(cfg, 4, geo, "cpu")
    gen = torch.Generator().manual_seed(7)

    def chunk(n):
        kv = torch.randn(B, H, n, D, generator=gen), torch.randn(B, H, n, D, generator=gen)
        cs = (torch.randn(B, n, D, generator=gen), torch.randn(B, n, D, generator=gen)) if cfg.keys_before_rope \
            else (None, None)
        return kv, cs

    (k, v), cs = chunk(prefill)
    for a, b in zip(ref_store.layers, dec_store.layers):
        st.append(dict(zip(*a.append_tensors())), cfg, a.spec, geo, k, v, 0, *cs)
        if prefill == 1:  # a one-token first chunk goes through the decode path too (the op routes n == 1 there)
            st.append_decode(dict(zip(*b.append_tensors())), cfg, b.spec, geo, k, v, torch.tensor([0]), *cs)
        else:
            st.append(dict(zip(*b.append_tensors())), cfg, b.spec, geo, k, v, 0, *cs)
    for p in range(prefill, T):
        (k, v), cs = chunk(1)
        for a, b in zip(ref_store.layers, dec_store.layers):
            st.append(dict(zip(*a.append_tensors())), cfg, a.spec, geo, k, v, p, *cs)
            st.append_decode(dict(zip(*b.append_tensors())), cfg, b.spec, geo, k, v, torch.tensor([p]), *cs)
    for i, (a, b) in enumerate(zip(ref_store.layers, dec_store.layers)):
        for n in a.buffers:
            assert torch.equal(a.buffers[n], b.buffers[n]), f"layer {i} {n}"


@pytest.mark.parametrize("name", LAYOUT_PRESETS)
def test_compiled_decode_append_matches_reference(name):
    """What the CUDA op runs: `append_decode` compiled by Inductor (fullgraph), here on the CPU."""
    _compare_compiled_append(name, "cpu", B=2, H=2, T=24, D=64, steps=14, dtype="float32", tol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", LAYOUT_PRESETS + ["kivi-4"])
def test_compiled_decode_append_is_exact_on_gpu(name):
    """The same on the GPU, bfloat16, every buffer exactly: Inductor's Triton kernels fuse multiply-adds
    and divide approximately unless compiled with `compat.eager_numerics_options`, and either moves codes
    near a tie between two levels to the other level (int8 has ties every 1/127 of a group's range)."""
    _compare_compiled_append(name, "cuda", B=4, H=8, T=80, D=128, steps=72, dtype="bfloat16", tol=0)


def _compare_compiled_append(name, device, B, H, T, D, steps, dtype, tol):
    from kvq_compile.ops import compiled_decode_append

    cfg = small_windows(name)
    geo = st.Geometry(B, H, T, D, dtype)
    ref_store, cmp_store = st.ModelStore(cfg, 1, geo, device), st.ModelStore(cfg, 1, geo, device)
    gen = torch.Generator(device).manual_seed(3)
    a, b = ref_store.layers[0], cmp_store.layers[0]
    names, _ = b.append_tensors()
    fn = compiled_decode_append(b.descriptor(names), compile=True)
    scale = 1 + 3 * torch.rand(1, H, 1, D, generator=gen, device=device)  # channels of unequal range

    def randn(*shape, scale=scale):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(getattr(torch, dtype))

    for p in range(steps):
        k, v = randn(B, H, 1, D), randn(B, H, 1, D)
        cs = (randn(B, 1, D, scale=1), randn(B, 1, D, scale=1)) if cfg.keys_before_rope else (None, None)
        st.append(dict(zip(*a.append_tensors())), cfg, a.spec, geo, k, v, p, *cs)
        fn(dict(zip(*b.append_tensors())), k, v, torch.tensor([p], device=device), *cs)
    for n in a.buffers:  # CPU: the eager reference's float32 sqrt is an ulp off (InnerQ's key norm, halves)
        t = tol if a.buffers[n].is_floating_point() else 0
        torch.testing.assert_close(b.buffers[n], a.buffers[n], atol=t, rtol=t, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("edge", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["innerq-2", "calibquant-1", "kivi-2"])
def test_chunks_while_the_prefix_is_exact_append_as_one_piece(name, dtype, edge):
    """A chunked prefill whose earlier tokens all still sit exact in the sink and the ring (no token has left the
    recent window) leaves every buffer as one append of the whole prefill does: the statistics kept from the
    first chunk (InnerQ's Key norm, CalibQuant's static ranges) are widened over it (`append_side`). Once a token
    has left the window they stay as the last widening chunk left them. A chunk at S + R (edge 0; Q = S for the
    single-token groups that keep them) is the last that widens; one at S + R + 1 (edge 1) does not."""
    cfg = KVQConfig.preset(name)
    cfg.sink, cfg.recent = min(cfg.sink, 5), 37
    B, H, T, D = 2, 3, 96, 64
    geo = st.Geometry(B, H, T, D, st.dtype_name(dtype))
    gen = torch.Generator().manual_seed(11)
    x = [torch.randn(B, H, T, D, generator=gen).mul_(torch.rand(D, generator=gen) * 3).to(dtype) for _ in (0, 1)]
    E = cfg.sink + cfg.recent + edge
    last = E + 2 if edge == 0 else E   # the end of the last chunk that widens
    cuts = [0, 7, 20, E, E + 2, 90]

    def build(spans):
        layer = st.ModelStore(cfg, 1, geo, "cpu").layers[0]
        for a, b in spans:
            st.append(dict(zip(*layer.append_tensors())), cfg, layer.spec, geo, x[0][:, :, a:b], x[1][:, :, a:b], a)
        return layer

    chunked = build(zip(cuts, cuts[1:]))
    whole = build([(0, last)] + [(a, b) for a, b in zip(cuts, cuts[1:]) if a >= last])
    for n in chunked.buffers:
        a, b = chunked.buffers[n], whole.buffers[n]
        if n.endswith("ring"):   # the slots of the window's tokens (the others hold tokens that left it)
            q = getattr(cfg, "key" if n.startswith("k.") else "value")
            live = torch.arange(st.fill_boundary(90, cfg.sink, cfg.recent, q.tokens_per_group), 90)
            a, b = (t[:, :, live % t.shape[2]] for t in (a, b))
        assert torch.equal(a, b), n
    firsts = [n for n in chunked.buffers if n.endswith(("norm", "center", "half"))
              and chunked.buffers[n].shape[2] == 1]
    assert bool(firsts) == (name != "kivi-2")
    # the first-chunk statistics are those of [0, last) in one piece: not of the first chunk alone, not of more
    one, first = build([(0, last)]), build([(0, 7)])
    for n in firsts:
        assert torch.equal(chunked.buffers[n], one.buffers[n]), n
        assert not torch.equal(chunked.buffers[n], first.buffers[n]), n


def test_widened_statistics_leave_out_pads():
    """With left padding the widened statistics come from the real tokens only: a row whose first chunk held only
    pads (left raw there: nothing to copy) ends with the statistics of one append of its neutralized prefill, and
    other pad values change nothing (`attended` marks the pads; `neutralized` replaces them)."""
    cfg = KVQConfig.preset("calibquant-1")
    cfg.recent = 40
    B, H, T, D = 2, 2, 64, 64
    geo = st.Geometry(B, H, T, D, "float32")
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(B, H, 30, D, generator=gen) * 2, torch.randn(B, H, 30, D, generator=gen)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, :13] = False   # row 1: 13 pads, more than the first chunk's 8 tokens
    stats = []
    for scale in (1.0, 50.0):
        kp, vp = k.clone(), v.clone()
        kp[1, :, :13] *= scale
        vp[1, :, :13] *= scale
        layer = st.ModelStore(cfg, 1, geo, "cpu").layers[0]
        bufs = dict(zip(*layer.append_tensors()))
        for a, b in ((0, 8), (8, 19), (19, 30)):   # each chunk's own pads neutralized, as KVQCache does
            ka, va = st.neutralized(keep[:, a:b], kp[:, :, a:b], vp[:, :, a:b])
            st.append(bufs, cfg, layer.spec, geo, ka, va, a, slots=keep)
        stats.append({n: layer.buffers[n].clone() for n in ("k.center", "k.half", "v.center", "v.half")})
    one = st.ModelStore(cfg, 1, geo, "cpu").layers[0]
    st.append(dict(zip(*one.append_tensors())), cfg, one.spec, geo, *st.neutralized(keep[:, :30], k, v), 0)
    for n, t in stats[0].items():
        assert torch.equal(stats[1][n], t), n
        assert torch.equal(one.buffers[n], t), n


def test_widening_stays_in_the_cache_dtype():
    """The widened prefix is appended in the cache dtype: float16 inputs near their maximum into a bfloat16 cache
    (65504 rounds to 65536 there, past float16's range) leave finite statistics, equal to one piece of the inputs
    rounded to the cache dtype (found by session 46's review: the prefix was cast to the input dtype)."""
    cfg = KVQConfig.preset("innerq-2")
    cfg.sink, cfg.recent = 3, 30
    B, H, T, D = 1, 2, 40, 64
    geo = st.Geometry(B, H, T, D, "bfloat16")
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(B, H, 24, D, generator=gen).to(torch.float16) for _ in (0, 1))
    k[..., 5, :] = 65504.0
    chunked, one = (st.ModelStore(cfg, 1, geo, "cpu").layers[0] for _ in (0, 1))
    for a, b in ((0, 9), (9, 24)):
        st.append(dict(zip(*chunked.append_tensors())), cfg, chunked.spec, geo, k[:, :, a:b], v[:, :, a:b], a)
    st.append(dict(zip(*one.append_tensors())), cfg, one.spec, geo, k.to(torch.bfloat16), v.to(torch.bfloat16), 0)
    assert torch.isfinite(chunked.buffers["k.norm"]).all()
    for n in ("k.norm", "k.codes", "k.half", "k.sink"):
        assert torch.equal(chunked.buffers[n], one.buffers[n]), n


@pytest.mark.parametrize("name", ["kvquant-4", "innerq-2", "fp16"])
def test_a_fresh_row_takes_its_sink_from_the_chunk_its_real_tokens_start_in(name):
    """A later chunk (at 16, 16 tokens) in which row 1 attends its first real tokens (from 21; its first chunk held
    only pads): `store.append` copies its first `sink` real tokens into its sink (and, Keys stored before RoPE,
    their RoPE table rows), also after the widening re-append of a config with a recent window (innerq-2) and into
    the plain slots of unquantized sides (fp16); row 0 (real tokens before the chunk) keeps its sink. And
    `seat_fresh_rows` trades the same slots' mask columns: row 1 reads slot j as column 21 + j and slot 21 + j as
    the pad column j, its chunk's own mask read as before (the identity)."""
    torch.manual_seed(3)
    cfg = KVQConfig.preset(name)
    cfg.sink, cfg.recent = 4, min(cfg.recent, 36)   # innerq-2: the chunk at 16 widens (all still exact)
    B, H, T, D = 2, 2, 48, 64
    geo = st.Geometry(B, H, T, D, "float32")
    ms = st.ModelStore(cfg, 1, geo, "cpu")
    names, tensors = ms.layers[0].append_tensors()
    bufs = dict(zip(names, tensors))
    slots = torch.ones(B, T, dtype=torch.bool)
    slots[1, :21] = False
    k, v = (torch.randn(B, H, 32, D) for _ in range(2))
    cos, sin = (torch.randn(1, 32, D) for _ in range(2))
    for p0 in (0, 16):
        st.append(bufs, cfg, ms.layers[0].spec, geo, k[:, :, p0:p0 + 16], v[:, :, p0:p0 + 16], p0,
                  cos[:, p0:p0 + 16], sin[:, p0:p0 + 16], slots[:, :p0 + 16])
    for side, x in (("k", k), ("v", v)):
        sink = bufs[f"{side}.sink"] if f"{side}.sink" in bufs else bufs[f"{side}.data"]
        torch.testing.assert_close(sink[1, :, :4], x[1, :, 21:25], atol=0, rtol=0)
        torch.testing.assert_close(sink[0, :, :4], x[0, :, :4], atol=0, rtol=0)
    if cfg.keys_before_rope:
        for tab, x in (("rope.cos", cos), ("rope.sin", sin)):
            torch.testing.assert_close(bufs[tab][1, :4], x[0, 21:25], atol=0, rtol=0)
            torch.testing.assert_close(bufs[tab][0, :4], x[0, :4], atol=0, rtol=0)
    seats = ms.seats.clone()
    read = st.seat_fresh_rows(seats, slots[:, None, None, :], 16, 16, cfg.sink)
    assert torch.equal(read, torch.arange(T).expand(B, T))
    want = torch.arange(T).expand(B, T).clone()
    want[1, :4], want[1, 21:25] = torch.arange(21, 25), torch.arange(4)
    assert torch.equal(seats, want)
    again = seats.clone()   # every layer calls it: the same result from the swapped seats
    assert torch.equal(st.seat_fresh_rows(again, slots[:, None, None, :], 16, 16, cfg.sink), read)
    assert torch.equal(again, want)


def test_a_sink_partly_held_by_pads_takes_the_next_chunk_s_first_real_tokens():
    """Row 1's first chunk (8 tokens, 6 pads) was seated with its 2 real tokens in sink slots 0 and 1 and pads in
    2 and 3; the next chunk (at 8) fills slots 2 and 3 with its first 2 real tokens (`sink_fill`; row 0, whose
    sink is full, keeps it): `store.append` copies them there and `seat_fresh_rows` trades those slots' mask
    columns with the tokens' own (slot 2 <-> 9, 3 <-> 10: the chunk's first real tokens, its first a pad), its
    chunk's own mask read through the seats before the trade, and a second call (every layer calls it) gives the
    same read and leaves the seats as the first left them."""
    torch.manual_seed(5)
    cfg = KVQConfig.preset("int8")
    cfg.sink, cfg.recent = 4, 0
    B, H, T, D = 2, 2, 24, 32
    geo = st.Geometry(B, H, T, D, "float32")
    ms = st.ModelStore(cfg, 1, geo, "cpu")
    bufs = dict(zip(*ms.layers[0].append_tensors()))
    raw = torch.ones(B, T, dtype=torch.bool)
    raw[1, :6] = False
    raw[1, 8] = False   # a pad inside the second chunk (as a mask may hold): skipped
    first = st.seating(raw[:, :8], cfg.sink)
    seats = ms.seats
    seats.copy_(torch.cat([first, torch.arange(8, T).expand(B, -1)], -1))
    assert first[1].tolist() == [6, 7, 0, 1, 2, 3, 4, 5]
    k, v = (torch.randn(B, H, 16, D) for _ in range(2))
    mask = raw[:, None, None, :]
    before = seats.clone()
    read = st.seat_fresh_rows(seats, mask, 8, 8, cfg.sink)
    assert torch.equal(read, before)
    want = before.clone()
    want[1, 2], want[1, 3], want[1, 9], want[1, 10] = 9, 10, 0, 1
    assert torch.equal(seats, want)
    again = seats.clone()
    assert torch.equal(st.seat_fresh_rows(again, mask, 8, 8, cfg.sink), read)
    assert torch.equal(again, want)
    slot_order = st.attended_slots(st.seated_mask(mask.float().log(), read))
    for p0, (a, b) in ((0, (0, 8)), (8, (8, 16))):
        kk, vv = k[:, :, a:b], v[:, :, a:b]
        if p0 == 0:
            kk, vv = (st.seat(x, first, 2) for x in (kk, vv))
        st.append(bufs, cfg, ms.layers[0].spec, geo, kk, vv, p0, slots=slot_order[:, :b])
    for side, x in (("k", k), ("v", v)):
        sink = bufs[f"{side}.sink"]
        torch.testing.assert_close(sink[1, :, :4], x[1, :, [6, 7, 9, 10]], atol=0, rtol=0)
        torch.testing.assert_close(sink[0, :, :4], x[0, :, :4], atol=0, rtol=0)


@pytest.mark.parametrize("name", ["int8", "innerq-2", "fp16", "kvquant-4"])
def test_a_chunk_that_starts_inside_the_sink_fills_it_with_its_tokens_past_the_sink(name):
    """A 12-token sink filled in 8-token chunks: the chunk at 8 starts inside it, writes its tokens 8-11 there in
    place and copies its real tokens past the sink into the sink's pad slots (its own pads there included:
    `sink_fill`), then the chunk at 16 fills what is left. Rows padded by 0, 6, 11 and 14, and one whose only pad
    is slot 9 (inside the chunk, in the sink: the first sink slot it fills is one of the chunk's own). Read through
    the seats, each row's sink holds its first min(12, real) real tokens, exact, as one piece seats them (Keys
    stored before RoPE, kvquant-4: their RoPE rows too); every
    layer's call of `seat_fresh_rows` reads and leaves the same seats; and the chunk's own mask, read through the
    seats it returns, attends each real token once. Before session 51 a chunk at p0 < sink wrote in place only:
    the rows of 6, 11 and 14 pads kept their real tokens 12-15 out of their sink, past it (quantized), and took
    later ones instead."""
    torch.manual_seed(8)
    cfg = KVQConfig.preset(name)
    cfg.sink, cfg.recent = 12, 0 if name == "int8" else min(cfg.recent, 8)
    pads = (0, 6, 11, 14)
    B, H, T, D = len(pads) + 1, 2, 24, 32
    geo = st.Geometry(B, H, T, D, "float32")
    ms = st.ModelStore(cfg, 1, geo, "cpu")
    bufs = dict(zip(*ms.layers[0].append_tensors()))
    real = torch.arange(T) >= torch.tensor(pads + (0,))[:, None]
    real[-1, 9] = False
    k = torch.randn(B, H, T, D) * torch.linspace(0.1, 5, D)
    cos, sin = (torch.randn(1, T, D) for _ in range(2))
    for p0 in (0, 8, 16):
        pos = torch.arange(p0, p0 + 8)
        allowed = real[:, None, :] & (torch.arange(T)[None, None] <= pos[None, :, None])
        mask = allowed[:, None]
        before = ms.seats.clone()
        chunk, read = st.seat_first_chunk(ms.seats, mask, pos, cfg.sink)
        if p0:   # a second layer's call: the same read, the seats as the first call left them
            after = ms.seats.clone()
            assert torch.equal(st.seat_fresh_rows(ms.seats, mask, p0, 8, cfg.sink), read)
            assert torch.equal(ms.seats, after)
            assert torch.equal(read, before)
        kk, vv, cc, ss = st.seated_chunk(st.attended(mask, pos), chunk, k[:, :, p0:p0 + 8], k[:, :, p0:p0 + 8],
                                         cos[:, p0:p0 + 8], sin[:, p0:p0 + 8], name != "fp16")
        slots = st.attended_slots(st.seated_mask(st.seated_mask(mask, read), chunk))
        st.append(bufs, cfg, ms.layers[0].spec, geo, kk, vv, p0, cc, ss, slots=slots)
        # the chunk's attention: each slot it attends (through `read`) holds that column's token, each column once
        # (the sink only where the rest is quantized)
        top = p0 + 8 if name == "fp16" else min(cfg.sink, p0 + 8)
        seen = slots[:, :top]
        ext = torch.arange(p0 + 8).expand(B, -1).clone()
        ext[:, :8] = chunk   # (a later chunk's: the identity)
        cols = read.gather(1, ext)   # the mask column that the chunk's attention reads slot s as
        assert torch.equal(cols.sort(-1).values, torch.arange(p0 + 8).expand(B, -1))
        assert torch.equal(slots[:, :p0 + 8], real.gather(1, cols))
        for side in ("k", "v"):
            held = bufs[f"{side}.sink"] if f"{side}.sink" in bufs else bufs[f"{side}.data"]
            for r in range(B):
                c = cols[r, :top][seen[r]]
                torch.testing.assert_close(held[r, :, :top][:, seen[r]], k[r, :, c], atol=0, rtol=0)
    cols = ms.seats[:, :cfg.sink]
    for r in range(B):
        first = real[r].nonzero()[:cfg.sink, 0]
        held = cols[r][real[r, cols[r]]]
        assert sorted(held.tolist()) == first.tolist(), (r, cols[r].tolist())
        for side in ("k", "v"):
            sink = bufs[f"{side}.sink"] if f"{side}.sink" in bufs else bufs[f"{side}.data"]
            at = real[r, cols[r]]
            torch.testing.assert_close(sink[r, :, :cfg.sink][:, at], k[r, :, cols[r][at]], atol=0, rtol=0)
        if cfg.keys_before_rope:
            for tab, x in (("rope.cos", cos), ("rope.sin", sin)):
                torch.testing.assert_close(bufs[tab][r, :cfg.sink][at], x[0, cols[r][at]], atol=0, rtol=0)


def _chunked_prefill(cfg, k, real, chunks, v=None, max_len=None):
    """A left-padded prefill of k [B, H, T, D] (and v, Keys where None) in `chunks` as the rewrite and KVQCache
    run one (`seat_first_chunk`, `seated_chunk`, the append's slots through the seats) into a store of `max_len`
    (T where None) tokens: the layer's buffers and the store (its seats; the identity without a sink)."""
    v = k if v is None else v
    B, H, T, D = k.shape
    geo = st.Geometry(B, H, max_len or T, D, "float32")
    ms = st.ModelStore(cfg, 1, geo, "cpu")
    if ms.seats is None:   # (no sink: nothing is seated)
        ms.seats = torch.arange(geo.max_len).expand(B, -1).clone()
    bufs = dict(zip(*ms.layers[0].append_tensors()))
    M = geo.max_len   # (a static cache's mask spans it)
    real = torch.cat([real, real.new_ones(B, M - T)], 1)
    p0 = 0
    for n in chunks:
        pos = torch.arange(p0, p0 + n)
        allowed = real[:, None, :] & (torch.arange(M)[None, None] <= pos[None, :, None])
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]
        chunk, read = st.seat_first_chunk(ms.seats, mask, pos, cfg.sink)
        kk, vv, _, _ = st.seated_chunk(st.attended(mask, pos), chunk, k[:, :, p0:p0 + n], v[:, :, p0:p0 + n],
                                       None, None)
        slots = st.attended_slots(st.seated_mask(st.seated_mask(mask, read), chunk))
        st.append(bufs, cfg, ms.layers[0].spec, geo, kk, vv, p0, slots=slots)
        p0 += n
    return bufs, ms


@pytest.mark.parametrize("name, chunks, pads, sink, recent, sides", [
    *[(name, [8, 10, 8], (0, 6, 9, 23, 24), 12, 12, "kv") for name in ("kivi-2", "innerq-2", "kvquant-4-1%")],
    *[(name, [6, 6, 6, 6, 2], (0, 7, 9, 22, 23), 12, 12, "kv") for name in ("kivi-2", "innerq-2", "kvquant-4-1%")],
    ("kivi-2", [11, 2], (0, 9), 2, 4, "kv"), ("innerq-2", [11, 2], (0, 9), 2, 4, "v"),
    ("kivi-2", [13, 2], (0, 13), 0, 4, "kv"), ("innerq-2", [13, 2], (0, 13), 0, 4, "v")])
def test_a_chunked_prefill_whose_boundaries_split_token_groups_equals_one_piece(name, chunks, pads, sink, recent,
                                                                                sides):
    """Token groups of 4 that chunk boundaries split (chunks of 8, 10, 8 and of 6, 6, 6, 6, 2 with a 12-token sink
    and window; 11, 2 and 13, 2 with a window of 4), rows padded so that later chunks fill their sink (`sink_fill`;
    rows of 22 to 24 pads hold 2 to 4 real tokens, all moved there), then 20 decode steps (more than the window and
    a group: the group still open after the prefill is coded by a decode step). Each real token's K and V as
    attention reads them, put back in its mask column, equal one piece's exactly (with a window of 4 the chunk at
    11 or 13 no longer widens InnerQ's Key norm, which then differs from one piece's by design: Values alone). A
    group coded at a chunk's append holds the ring's tokens of earlier chunks and this chunk's: its pads and the
    tokens moved into the sink become copies of its own real tokens (`store.append_side`); the group still open
    after a chunk takes its pads as one piece's (`store.neutralize_open_group`). Before session 52 (session 51's
    second review and session 52's): KIVI's Keys and InnerQ's Values (which keep no first-chunk statistics, so
    never append again as one piece) held in such groups copies of a token of another chunk or, where a chunk held
    no real token past the sink, the moved tokens themselves: 2.1-6.7 apart."""
    torch.manual_seed(13)
    cfg = small_windows(name)
    cfg.sink, cfg.recent, cfg.keys_before_rope = sink, recent, False
    B, H, D, P, L = len(pads), 2, 32, sum(chunks), sum(chunks) + 20
    k, v = (torch.randn(B, H, L, D) * torch.linspace(0.1, 5, D) for _ in range(2))
    real = torch.arange(L) >= torch.tensor(pads)[:, None]

    def read(parts):   # K, V [B, H, L, D] by mask column, pads 0
        bufs, ms = _chunked_prefill(cfg, k[:, :, :P], real[:, :P], parts, v[:, :, :P], L)
        geo = st.Geometry(B, H, L, D, "float32")
        spec = ms.layers[0].spec
        for p in range(P, L):
            st.append_decode(bufs, cfg, spec, geo, k[:, :, p:p + 1], v[:, :, p:p + 1], torch.tensor(p))
        seats = torch.cat([ms.seats[:, :P], torch.arange(P, L).expand(B, -1)], 1)
        out = []
        for x in st.read(bufs, cfg, spec, D, L, L):
            out.append(torch.zeros_like(x).scatter_(2, seats[:, None, :, None].expand_as(x), x))
            out[-1][~real[:, None, :, None].expand_as(x)] = 0
        return out

    for side, got, want in zip("kv", read(chunks), read([P])):
        if side in sides:
            torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["kvquant-4", "innerq-2"])
def test_a_row_whose_real_tokens_sit_in_its_sink_takes_its_statistics_over_them(name):
    """Row 1 holds 46 pads, then 18 real tokens, in chunks of 48 and 16 (a 4-token sink, no recent window): its
    first chunk's 2 real tokens are seated in its sink, its pads copies of one of them. Its statistics (KVQuant's static
    Key ranges, InnerQ's Key norm) come from those 2 (before session 50: from the copies, a point range of 1e-6 on
    every channel for kvquant-4), then, as its real tokens past the sink start in the second chunk, from that chunk's
    16 (the first 2 of which fill its sink's pad slots, `sink_fill`: counted, see the next test). Row 0 (no pads)
    keeps its first chunk's, taken past the sink."""
    torch.manual_seed(7)
    cfg = KVQConfig.preset(name)
    cfg.sink, cfg.recent = 4, 0
    B, H, T, D = 2, 2, 64, 32
    k = torch.randn(B, H, T, D) * torch.linspace(0.1, 5, D)
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, :46] = False
    spec = cfg.key
    one, _ = _chunked_prefill(cfg, k, real, [48])
    two, _ = _chunked_prefill(cfg, k, real, [48, 16])
    if name == "innerq-2":
        for bufs, r, toks in ((one, 1, k[1:, :, 46:48]), (two, 1, k[1:, :, 48:]), (two, 0, k[:1, :, 4:48])):
            torch.testing.assert_close(bufs["k.norm"][r:r + 1], ref.key_norm(toks), atol=0, rtol=0)
        return
    for bufs, r, toks in ((one, 1, k[1:, :, 46:48]), (two, 1, k[1:, :, 48:]), (two, 0, k[:1, :, 4:48])):
        c, h = ref.static_channel_range(toks, spec, torch.float32, cfg.eta_for(spec))
        torch.testing.assert_close(bufs["k.half"][r:r + 1], h, atol=0, rtol=0)
    assert (one["k.half"][1] > 0.01).all()


@pytest.mark.parametrize("chunks, pad", [([24], 19), ([8, 8, 8], 11)])
def test_a_row_with_one_real_token_past_its_sink_takes_no_point_range(chunks, pad):
    """kvquant-4's static Key ranges with a 4-token sink and a 4-token window. One piece with 19 pads: 5 real
    tokens, 4 in the sink and 1 past it. 8-token chunks with 11 pads: the chunk at 8 widens, its first 4 real tokens
    move into the sink (`sink_fill`), 1 stays past it, and the chunk at 16 no longer widens. A range over the one
    token past the sink would be a point (1e-6 on every channel, frozen; session 51's review: decode Keys off by up
    to 32.6); the row takes it over all its real tokens (`store.statistics_tokens`), here its 5 (of chunks: the
    first 5; the later ones come after the statistics are fixed)."""
    torch.manual_seed(12)
    cfg = KVQConfig.preset("kvquant-4")
    cfg.sink, cfg.recent = 4, 4
    B, H, T, D = 2, 2, 24, 32
    k = torch.randn(B, H, T, D) * torch.linspace(0.1, 5, D)
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, :pad] = False
    bufs, _ = _chunked_prefill(cfg, k, real, chunks)
    c, h = ref.static_channel_range(k[1:, :, pad:pad + 5], cfg.key, torch.float32, cfg.eta_for(cfg.key))
    torch.testing.assert_close(bufs["k.half"][1:], h, atol=0, rtol=0)
    assert (bufs["k.half"][1] > 0.01).all()


@pytest.mark.parametrize("pad", [20, 27])
@pytest.mark.parametrize("name", ["innerq-2", "kvquant-4"])
def test_a_fresh_row_past_the_window_takes_its_statistics_with_the_tokens_moved_into_its_sink(name, pad):
    """Two 16-token chunks, a 4-token sink and window: the chunk at 16 no longer widens (row 0's tokens 4-11 have
    left the window), and row 1, all pads before it, takes its statistics from it alone (InnerQ's Key norm,
    KVQuant's static Key ranges) while its first 4 real tokens move into its sink (`sink_fill`). They count: over
    all its real tokens of the chunk (20 pads: 12; 27 pads: 5). One piece would leave them out (its statistics
    come from every token past the sink); from one chunk's few tokens that gave narrower ranges, and session 52
    measured SmolLM2 kvquant-4 with 40 pads in 24-token chunks at 27.32 perplexity without them against 24.88
    with them (17.37 unchunked; bench/RESULTS.md). Row 0 keeps its first chunk's, past the sink."""
    torch.manual_seed(17)
    cfg = KVQConfig.preset(name)
    cfg.sink, cfg.recent = 4, 4
    B, H, T, D = 2, 2, 32, 32
    k = torch.randn(B, H, T, D) * torch.linspace(0.1, 5, D)
    k[1, :, pad] *= 6   # the row's first real token: outsized, as a BOS is
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, :pad] = False
    bufs, _ = _chunked_prefill(cfg, k, real, [16, 16])
    for r, toks in ((0, k[:1, :, 4:16]), (1, k[1:, :, pad:])):
        if name == "innerq-2":
            torch.testing.assert_close(bufs["k.norm"][r:r + 1], ref.key_norm(toks), atol=0, rtol=0)
        else:
            c, h = ref.static_channel_range(toks, cfg.key, torch.float32, cfg.eta_for(cfg.key))
            torch.testing.assert_close(bufs["k.half"][r:r + 1], h, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["innerq-2", "kvquant-4", "kvquant-4-1%"])
def test_statistics_of_a_row_whose_real_tokens_sit_in_its_sink_as_the_simulation_takes_them(name):
    """A first chunk of 12 tokens with a 4-token sink: row 0 all real, row 1 three real tokens (seated in its sink,
    9 pads), row 2 none; then 8 decode steps. Every decode token as attention reads it equals the independent
    simulation's (`simulate.quantized_view`, which takes the statistics by `store.statistics_tokens` too): exact.
    (The review of session 50: with the store alone changed, row 1's decode Keys were up to 12.7 apart.)"""
    torch.manual_seed(11)
    cfg = KVQConfig.preset(name)
    cfg.sink, cfg.recent, cfg.keys_before_rope = 4, 0, False
    B, H, D, n, T, L = 3, 2, 32, 12, 24, 20
    x = torch.randn(B, H, T, D) * torch.linspace(0.1, 5, D)
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, 3:n], real[2, :n] = False, False
    x[:, :, :n] = st.neutralized(real[:, :n], x[:, :, :n])[0]
    geo = st.Geometry(B, H, T, D, "float32")
    ms = st.ModelStore(cfg, 1, geo, "cpu")
    spec = ms.layers[0].spec
    bufs = dict(zip(*ms.layers[0].append_tensors()))
    st.append(bufs, cfg, spec, geo, x[:, :, :n], x[:, :, :n], 0, slots=real[:, :n])
    for p in range(n, L):
        st.append_decode(bufs, cfg, spec, geo, x[:, :, p:p + 1], x[:, :, p:p + 1], torch.tensor(p))
    k, v = st.read(bufs, cfg, spec, D, L, L)
    for got, q, is_key in ((k, spec.key, True), (v, spec.value, False)):
        want = quantized_view(x, q, cfg, L, n, is_key=is_key, valid=real[:, :n])
        torch.testing.assert_close(got[:, :, n:L], want[:, :, n:L], atol=0, rtol=0)
    if spec.key.axis is Axis.CHANNEL and spec.key.group_size is None:   # kvquant's static Key ranges: not a point
        assert (bufs["k.half"][1] > 0.01).all()


@pytest.mark.parametrize("extra", [1, 2])
@pytest.mark.parametrize("name", ["kvquant-4", "innerq-2"])
def test_a_prompt_one_token_past_the_sink_without_slots_takes_no_point_range(name, extra):
    """A first chunk of sink + `extra` tokens appended without slots (a gpt-fast-style model: no mask). With one
    token past the sink its statistics were that token's alone (until session 58): KVQuant's static Key ranges a
    point (1e-6 on every channel, frozen for the whole sequence), InnerQ's Key norm one token's magnitudes. Now, as
    a masked row with fewer than 2 real tokens past its sink (`store.statistics_tokens`), the whole chunk's; with 2
    past it, those 2 as before. Decode tokens as attention reads them equal the simulation's, exactly."""
    torch.manual_seed(23 + extra)
    cfg = KVQConfig.preset(name)
    cfg.sink, cfg.recent, cfg.keys_before_rope = 4, 0, False
    B, H, D, L = 2, 3, 32, 16
    n = cfg.sink + extra
    x = torch.randn(B, H, L, D) * torch.linspace(0.1, 5, D)
    geo = st.Geometry(B, H, L, D, "float32")
    ms = st.ModelStore(cfg, 1, geo, "cpu")
    spec = ms.layers[0].spec
    bufs = dict(zip(*ms.layers[0].append_tensors()))
    st.append(bufs, cfg, spec, geo, x[:, :, :n], x[:, :, :n], 0)
    stats = x[:, :, :n] if extra == 1 else x[:, :, cfg.sink:n]
    if name == "kvquant-4":
        c, h = ref.static_channel_range(stats, cfg.key, torch.float32, cfg.eta_for(cfg.key))
        torch.testing.assert_close(bufs["k.half"], h, atol=0, rtol=0)
        torch.testing.assert_close(bufs["k.center"], c, atol=0, rtol=0)
        assert (bufs["k.half"] > 1e-3).all()
    else:
        torch.testing.assert_close(bufs["k.norm"], ref.key_norm(stats), atol=0, rtol=0)
    for p in range(n, L):
        st.append_decode(bufs, cfg, spec, geo, x[:, :, p:p + 1], x[:, :, p:p + 1], torch.tensor(p))
    k, v = st.read(bufs, cfg, spec, D, L, L)
    for got, q, is_key in ((k, spec.key, True), (v, spec.value, False)):
        want = quantized_view(x, q, cfg, L, n, is_key=is_key)
        torch.testing.assert_close(got[:, :, n:L], want[:, :, n:L], atol=0, rtol=0)


def test_which_stores_take_positions_in_any_order():
    """`store.any_order`: only stores that code every token from itself alone and keep it nowhere else (int8,
    fp16) take a step back without a frontier; a recent window, static ranges from the first chunks (kvquant's,
    with or without a window) or InnerQ's Key norm keep one in the first layer's append buffers."""
    for name in PRESETS:
        cfg = KVQConfig.preset(name)
        ms = st.ModelStore(cfg, 2, st.Geometry(1, 1, 512, 64, "float32"), "cpu")
        takes = name in ("fp16", "int8")
        assert st.any_order(cfg, ms.specs) is takes and (ms.frontier is None) is takes, name
        names = ms.layers[0].append_tensors()[0]
        assert ("frontier" in names) is not takes and "frontier" not in ms.layers[0].attend_tensors()[0]
        assert ("frontier" in ms.layers[0].attend_tensors(control=True)[0]) is not takes
        assert all("frontier" not in lay.append_tensors()[0] for lay in ms.layers[1:])
