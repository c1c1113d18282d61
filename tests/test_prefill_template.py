"""The prefill template (a chunk of n query tokens over the stored prefix plus the chunk) against the reference
`kvq::attend` (CPU CI: TRITON_INTERPRET=1; GPU: compiled). Each case appends a prefix through the reference
`kvq::append` (one or two chunks), then the chunk under test, and compares every query row."""
import pytest
import torch

from kvq_compile import KVQConfig, QuantizerSpec
from kvq_compile import store as st
from kvq_compile.config import Axis, Symmetry
from kvq_compile.ops import attend_cpu_reference, attend_reference
from kvq_compile.presets import PRESETS
from models import append_every_layer, small_windows

triton = pytest.importorskip("triton")
from kvq_compile.templates.prefill_attention import prefill_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: IEEE dots; half precision: against the reference over the same rounded K / V (the template rounds the
# dequantized tiles and the probabilities to the cache dtype for its tensor-core dots, as SDPA's kernels do)
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def check(cfg, B=2, H=2, rep=3, D=64, T=48, prefix=(21,), n=5, dtype=torch.float32, layers=1, layer=0,
          mask="bool", causal=False, block_m=None, block_t=16, seed=0):
    """Max |template - reference| for a chunk of n tokens after the prefix chunks (raises on a mismatch)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=DEVICE).to(dtype)  # noqa: E731
    geo = st.Geometry(B, H, T, D, st.dtype_name(dtype))
    ms = st.ModelStore(cfg, layers, geo, DEVICE)

    p0 = 0
    for m in prefix:
        append_every_layer(ms, cfg, rnd(B, H, m, D) * 2, rnd(B, H, m, D), p0)
        p0 += m
    k, v = rnd(B, H, n, D), rnd(B, H, n, D)
    append_every_layer(ms, cfg, k, v, p0)
    k, v = k + layer, v - layer
    lay = ms.layers[layer]
    names, tensors = lay.attend_tensors()
    q = rnd(B, H * rep, n, D)
    L = p0 + n
    am = None
    if mask == "bool":  # row 1 left-padded by 3, chunk-causal, row 0 of batch 0 sees nothing
        am = torch.ones(B, 1, n, T, dtype=torch.bool, device=DEVICE).tril(p0)
        am[1:, :, :, :3] = False
        am[0, :, 0] = False
    elif mask == "additive":  # per-head float bias, chunk-causal, -inf on a few positions
        am = rnd(B, H * rep, n, T).float().to(dtype) * 0.5
        am[:, :, :, 5:7] = float("-inf")
        am.masked_fill_(~torch.ones(n, T, dtype=torch.bool, device=DEVICE).tril(p0), float("-inf"))
    elif mask == "rows":  # one mask row for every query token ([B, 1, 1, T])
        am = torch.ones(B, 1, 1, T, dtype=torch.bool, device=DEVICE)
        am[:, :, :, 2:4] = False
    pos = torch.arange(p0, L, device=DEVICE)
    scale = D ** -0.5
    out = prefill_attention(q, dict(zip(names, tensors)), k, v, pos, am, scale, causal, cfg, lay.spec, geo,
                            block_m=block_m, block_t=block_t)
    if dtype == torch.float32:
        ref = attend_cpu_reference(q, tensors, k, v, pos, am, scale, causal, lay.descriptor(names))
    else:
        kp, vp = st.read(dict(zip(names, tensors)), cfg, lay.spec, D, L, p0)
        ref = attend_reference(q, kp.to(dtype).float(), vp.to(dtype).float(), k, v, am, scale, causal,
                               cfg.softmax_tau)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if mask == "bool":
        assert out[0, :, 0].abs().max() == 0  # a fully masked row gives zeros
    return (out.float() - ref.float()).abs().max().item()


@pytest.mark.interpreter
@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_matches_reference(name):
    check(small_windows(name))


@pytest.mark.interpreter
@pytest.mark.parametrize("mask,causal", [(None, False), (None, True), ("additive", False), ("rows", False),
                                         ("bool", True)])
def test_masks(mask, causal):
    check(small_windows("kivi-2"), mask=mask, causal=causal, seed=1)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["kivi-2", "kvquant-4-1%", "innerq-2"])
def test_half_precision(name, dtype):
    check(small_windows(name), dtype=dtype, seed=2)


@pytest.mark.interpreter
@pytest.mark.parametrize("rep,D,block_m", [(1, 128, None), (4, 64, 8), (5, 32, 4)])
def test_gqa_head_dim_blocks(rep, D, block_m):
    """Several programs per sequence (n > block_m), several tiles, a GQA group padded to a power of two."""
    check(small_windows("kivi-4"), rep=rep, D=D, n=19, prefix=(9, 14), block_m=block_m, T=64, mask="additive")


@pytest.mark.interpreter
def test_chunk_longer_than_the_windows():
    """A chunk that flushes several token groups at once: the store reads its prefix at length p0 + n."""
    cfg = KVQConfig(key=QuantizerSpec(bits=2, axis=Axis.CHANNEL, group_size=8),
                    value=QuantizerSpec(bits=2, axis=Axis.TOKEN, group_size=16, symmetry=Symmetry.HYBRID),
                    sink=2, recent=8)
    check(cfg, prefix=(13,), n=29, T=64, causal=True, mask=None)


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["kivi-2", "calibquant-1"])
def test_empty_prefix_is_exact_attention_on_the_chunk(name):
    """p0 = 0 (the op sends it to SDPA, but the template must agree): no store reads, no CalibQuant temperature."""
    check(small_windows(name), prefix=(), n=11, causal=True, mask=None)


@pytest.mark.interpreter
def test_calibquant_tau_and_xquant_shared_codes():
    cfg = small_windows("calibquant-1")
    cfg.softmax_tau = (1.0, 2.0)
    check(cfg, mask="additive")
    cfg = small_windows("xquant-1.38")
    sharing = [i for i, s in enumerate(cfg.resolve(4)) if s.share_value_codes_from is not None]
    check(cfg, layers=4, layer=sharing[-1])


def test_bad_inputs_are_refused():
    cfg = small_windows("kivi-2")
    geo = st.Geometry(1, 2, 32, 32, "float32")
    lay = st.ModelStore(cfg, 1, geo, "cpu").layers[0]
    bufs = dict(zip(*lay.attend_tensors()))
    q, kv, pos = torch.zeros(1, 6, 3, 32), torch.zeros(1, 2, 3, 32), torch.arange(4, 7)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        prefill_attention(torch.zeros(1, 5, 3, 32), bufs, kv, kv, pos, None, 1.0, False, cfg, lay.spec, geo)
    with pytest.raises(ValueError, match="block_m"):
        prefill_attention(q, bufs, kv, kv, pos, None, 1.0, False, cfg, lay.spec, geo, block_m=2)
    with pytest.raises(ValueError, match="block_t"):
        prefill_attention(q, bufs, kv, kv, pos, None, 1.0, False, cfg, lay.spec, geo, block_t=24)
    with pytest.raises(ValueError, match=r"\[B, H, n, D\]"):
        prefill_attention(q, bufs, kv[:, :, :2], kv, pos, None, 1.0, False, cfg, lay.spec, geo)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_op_runs_the_template_for_chunks_over_a_prefix(monkeypatch):
    """On CUDA with KVQ_PREFILL=triton, `kvq::attend` sends a chunk over a stored prefix to this template (the
    same numbers, bit for bit)."""
    monkeypatch.setenv("KVQ_PREFILL", "triton")
    cfg = small_windows("kivi-2")
    geo = st.Geometry(2, 2, 48, 64, "bfloat16")
    lay = st.ModelStore(cfg, 1, geo, "cuda").layers[0]
    an, at = lay.append_tensors()
    names, tensors = lay.attend_tensors()
    kv = torch.randn(2, 2, 2, 26, 64, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(2, 6, 5, 64, device="cuda", dtype=torch.bfloat16)
    for p0, m in ((0, 21), (21, 5)):
        pos = torch.arange(p0, p0 + m, device="cuda")
        torch.ops.kvq.append(at, kv[0, :, :, p0:p0 + m], kv[1, :, :, p0:p0 + m], pos, None, None,
                             lay.descriptor(an))
    k, v = kv[0, :, :, 21:], kv[1, :, :, 21:]
    args = (k, v, torch.arange(21, 26, device="cuda"), None, 0.125, True)
    out = torch.ops.kvq.attend(q, tensors, *args, lay.descriptor(names))
    assert torch.equal(out, prefill_attention(q, dict(zip(names, tensors)), *args, cfg, lay.spec, geo))


@pytest.mark.parametrize("name,n,choice", [("kivi-2", 16, "triton"), ("kivi-2", 128, "triton"), ("kivi-2", 129, "sdpa"),
                                           ("int8", 64, "triton"), ("kvquant-4-1%", 16, "sdpa"),
                                           ("innerq-2", 16, "sdpa"), ("calibquant-1", 512, "triton")])
def test_prefill_choice(name, n, choice, monkeypatch):
    """KVQ_PREFILL=auto (the default) takes the template for short chunks of layouts without per-element
    dequantization and always for CalibQuant (whose SDPA path is the float32 reference); sdpa / triton force."""
    from kvq_compile.ops import _prefill_choice

    cfg = KVQConfig.preset(name)
    lay = st.ModelStore(cfg, 1, st.Geometry(1, 2, 1024, 64, "float16"), "cpu").layers[0]
    layout = lay.descriptor(lay.attend_tensors()[0])
    monkeypatch.delenv("KVQ_PREFILL", raising=False)
    assert _prefill_choice(n, layout) == choice
    for forced in ("sdpa", "triton"):
        monkeypatch.setenv("KVQ_PREFILL", forced)
        assert _prefill_choice(n, layout) == forced
    monkeypatch.setenv("KVQ_PREFILL", "fused")
    with pytest.raises(ValueError, match="KVQ_PREFILL='fused'"):
        _prefill_choice(n, layout)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["kivi-2", "kvquant-4-1%", "calibquant-1"])
def test_chunked_prefill_generate_template_equals_sdpa(name, monkeypatch):
    """HF generate with prefill_chunk_size through KVQCache: the template (KVQ_PREFILL=triton) and SDPA over the
    dequantized prefix give the same logits (float32 model: IEEE dots in the template)."""
    from kvq_compile.hf import KVQCache
    from models import hf_model, prompts

    model = hf_model("llama", kv_heads=2, gqa=4, head_dim=128, layers=2).cuda()
    ids, mask = (t.cuda() for t in prompts(3, 45, pad=(0, 5, 2)))
    logits = {}
    for choice in ("sdpa", "triton"):
        monkeypatch.setenv("KVQ_PREFILL", choice)
        cache = KVQCache(model, small_windows(name), batch_size=3, max_cache_len=64)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, past_key_values=cache, prefill_chunk_size=16,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
        logits[choice] = torch.stack(out.logits)
    torch.testing.assert_close(logits["triton"], logits["sdpa"], atol=1e-3, rtol=1e-3)
