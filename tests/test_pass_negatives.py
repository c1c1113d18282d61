"""Patterns the pass must leave unchanged, each with a recorded reason (acceptance f)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvq_compile import KVQBackend, KVQConfig, explain, kvq_backend
from models import compile_config, hf_model, prompts


class CacheAttention(nn.Module):
    """One attention over a gpt-fast-style cache, with knobs that break the pattern."""

    def __init__(self, dtype=torch.float32, dropout=0.0, append=True, leak=False, size_read=False):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 2, 16, 32, dtype=dtype))
        self.register_buffer("v", torch.zeros(1, 2, 16, 32, dtype=dtype))
        self.dropout, self.append, self.leak, self.size_read = dropout, append, leak, size_read

    def forward(self, q, k_new, v_new, pos):
        if self.append:
            self.k[:, :, pos] = k_new
            self.v[:, :, pos] = v_new
        n = self.k.size(2) if self.size_read else 16  # a metadata read of the cache (HF's mask code on GPU)
        mask = (torch.arange(n) <= pos[-1])[None, None, None, :]
        out = F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, dropout_p=self.dropout)
        return out + self.k.sum() if self.leak else out


def _report(module, dtype=torch.float32):
    args = (torch.randn(1, 2, 1, 32, dtype=dtype), torch.randn(1, 2, 1, 32, dtype=dtype),
            torch.randn(1, 2, 1, 32, dtype=dtype), torch.tensor([3]))
    return explain(module, *args, cfg="int8")


def test_positive_control_is_rewritten():
    assert "1 attention layer(s) rewritten" in _report(CacheAttention())


def test_metadata_read_of_cache_is_not_a_blocker():
    assert "1 attention layer(s) rewritten" in _report(CacheAttention(size_read=True))


def test_dropout_left_unchanged():
    text = _report(CacheAttention(dropout=0.1).train())
    assert "0 attention layer(s) rewritten" in text and "dropout_p=0.1" in text


def test_cross_attention_left_unchanged():
    text = _report(CacheAttention(append=False))
    assert "0 attention layer(s) rewritten" in text and "not appended to" in text


def test_cache_read_elsewhere_left_unchanged():
    text = _report(CacheAttention(leak=True))
    assert "0 attention layer(s) rewritten" in text and "is also used by" in text


def test_unsupported_dtype_left_unchanged():
    text = _report(CacheAttention(dtype=torch.float64), dtype=torch.float64)
    assert "0 attention layer(s) rewritten" in text and "unsupported cache dtype torch.float64" in text


def test_unchanged_graph_still_runs_and_matches():
    module = CacheAttention(leak=True)
    ref = CacheAttention(leak=True)
    args = (torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32), torch.tensor([2]))
    out = torch.compile(module, backend=kvq_backend("kivi-2"))(*args)
    torch.testing.assert_close(out, ref(*args))


def test_sliding_window_attention_left_unchanged():
    model = hf_model("mistral", kv_heads=1, gqa=2, head_dim=64, layers=2, sliding_window=4)
    ids, mask = prompts(1, 6)
    be = kvq_backend(KVQConfig.preset("int8"))
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, cache_implementation="static")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, cache_implementation="static",
                         compile_config=compile_config(be))
    assert torch.equal(ref, out)
    assert isinstance(be, KVQBackend) and be.reports and all(not r.rewritten for r in be.reports), explain(be)
    assert all(r.skipped for r in be.reports), explain(be)


class PatternProbe(nn.Module):
    """One decode attention over a 16-slot cache with 2 KV heads and 4 query heads, broken in one way (`kind`)."""

    def __init__(self, kind: str):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 2, 16, 32))
        self.register_buffer("v", torch.zeros(1, 2, 16, 32))
        self.kind = kind

    def forward(self, q, k_new, v_new, pos):
        slot = pos
        if self.kind == "ring":          # a ring buffer: 8 slots reused, in three spellings
            slot = pos % 8
        elif self.kind == "ring_div":
            slot = pos - torch.div(pos, 8, rounding_mode="floor") * 8
        elif self.kind == "ring_table":
            slot = (torch.arange(16) % 8)[pos]
        self.k[:, :, slot] = k_new
        if self.kind != "tied":
            self.v[:, :, slot] = v_new
        mask = (torch.arange(16) <= pos[-1])[None, None, None, :]
        kr, vr = self.k.repeat_interleave(2, dim=1), self.v.repeat_interleave(2, dim=1)
        if self.kind == "repeat_read":   # the repeated heads also feed other code
            return F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask) + (q @ kr.transpose(-1, -2)).amax(-1, True)
        if self.kind == "two_readers":   # two attentions over one repeated cache
            return (F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
                    + F.scaled_dot_product_attention(2 * q, kr, vr, attn_mask=mask))
        if self.kind == "tied":          # one cache as keys and values
            return F.scaled_dot_product_attention(q, kr, kr, attn_mask=mask)
        if self.kind == "no_mask":       # reads every slot, written or not
            return F.scaled_dot_product_attention(q, kr, vr)
        return F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)


@pytest.mark.parametrize("kind,reason", [
    ("ring", "not only offsets, ranges and casts"), ("ring_div", "not only offsets, ranges and casts"),
    ("ring_table", "not only offsets, ranges and casts"), ("repeat_read", "repeated cache"),
    ("two_readers", "repeated cache"), ("tied", "serves as both keys and values"),
    ("no_mask", "without a mask or is_causal")])
def test_patterns_that_change_meaning_left_unchanged(kind, reason):
    """Rewriting these changed the outputs or failed the compile (found by audits, session 43: a ring buffer's
    wrapped positions, in three spellings, read as the written length; other readers of the repeated heads left with
    a cache that no longer receives tokens; two attentions erasing one append twice; unwritten slots no longer
    attended), or rewrote on luck (one cache as keys and values: the append erased twice): each is left unchanged
    with its reason, and the compiled steps match the uncompiled module, past the ring's first wrap."""
    text = explain(PatternProbe(kind), *_probe_args(3), cfg="fp16")
    assert "0 attention layer(s) rewritten" in text and reason in text, text
    torch.manual_seed(0)
    module, ref = PatternProbe(kind), PatternProbe(kind)
    step = torch.compile(module, backend=kvq_backend("fp16"))
    for p in range(11):
        args = _probe_args(p)
        torch.testing.assert_close(step(*args), ref(*args), atol=1e-5, rtol=1e-5)


def test_positive_probe_is_rewritten_and_matches():
    """The probe without a break: rewritten, and equal to the uncompiled module (fp16 preset: no quantization)."""
    assert "1 attention layer(s) rewritten" in explain(PatternProbe("plain"), *_probe_args(3), cfg="fp16")
    module, ref = PatternProbe("plain"), PatternProbe("plain")
    step = torch.compile(module, backend=kvq_backend("fp16"))
    for p in range(11):
        args = _probe_args(p)
        torch.testing.assert_close(step(*args), ref(*args), atol=1e-5, rtol=1e-5)


def _probe_args(p: int):
    return torch.randn(1, 4, 1, 32), torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32), torch.tensor([p])


def test_every_compiler_runs_the_same_rewrite():
    """kvq_backend(compiler=...): Inductor, aot_eager and eager run the same rewritten step (int8: quantized, so a
    step that skipped the rewrite would differ from these by its rounding) over eleven decode positions, to within
    float rounding of each other; an unknown compiler is refused; mode / options under aot_eager are logged as
    ignored, once."""
    import logging

    outs = {}
    for compiler in ("eager", "aot_eager", "inductor"):
        torch._dynamo.reset()
        module = PatternProbe("plain")
        be = kvq_backend("int8", compiler=compiler)
        step = torch.compile(module, backend=be, mode="max-autotune-no-cudagraphs" if compiler == "aot_eager" else None)
        torch.manual_seed(5)
        outs[compiler] = [step(*_probe_args(p)) for p in range(11)]
        assert "1 attention layer(s) rewritten" in explain(be), compiler
    torch.manual_seed(5)
    ref = PatternProbe("plain")
    plain = [ref(*_probe_args(p)) for p in range(11)]
    assert max((a - b).abs().max().item() for a, b in zip(outs["eager"], plain)) > 1e-4   # int8 moved the outputs
    for compiler in ("aot_eager", "inductor"):
        for a, b in zip(outs["eager"], outs[compiler]):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=lambda m: f"{compiler}: {m}")
    with pytest.raises(ValueError, match="compiler must be one of 'inductor', 'aot_eager', 'eager', got 'cuda'"):
        kvq_backend("int8", compiler="cuda")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("kvq_compile")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        torch._dynamo.reset()
        be = kvq_backend("int8", compiler="aot_eager")
        step = torch.compile(PatternProbe("plain"), backend=be, options={"max_autotune": True})
        step(*_probe_args(3))
        torch._dynamo.reset()
        step = torch.compile(PatternProbe("plain"), backend=be, options={"max_autotune": True})
        step(*_probe_args(4))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    said = [r.getMessage() for r in records if "ignores torch.compile's mode" in r.getMessage()]
    assert len(said) == 1 and "'max_autotune': True" in said[0], said


class _DeviceLayer(nn.Module):
    """One attention over its own cache, run on its cache's device (what accelerate's hooks do for a split model)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 2, 16, 32))
        self.register_buffer("v", torch.zeros(1, 2, 16, 32))

    def forward(self, q, k_new, v_new, pos):
        q, k_new, v_new, pos = (t.to(self.k.device) for t in (q, k_new, v_new, pos))
        self.k[:, :, pos] = k_new
        self.v[:, :, pos] = v_new
        mask = (torch.arange(16, device=self.k.device) <= pos[-1])[None, None, None, :]
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask)


class _TwoDevices(nn.Module):
    def __init__(self, second: str):
        super().__init__()
        self.a, self.b = _DeviceLayer(), _DeviceLayer().to(second)

    def forward(self, q, k_new, v_new, pos):
        return self.a(q, k_new, v_new, pos), self.b(q, k_new, v_new, pos)


def test_model_split_across_devices_left_unchanged():
    """One store serves one device: layers whose caches lie on several devices are left alone with the reason (the
    "meta" layer stands in for a second GPU); on one device both are rewritten. Before, both were rewritten into one
    store on the first layer's device."""
    args = (torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32), torch.tensor([3]))
    assert "2 attention layer(s) rewritten" in explain(_TwoDevices("cpu"), *args, cfg="int8")
    text = explain(_TwoDevices("meta"), *args, cfg="int8")
    assert "0 attention layer(s) rewritten, 2 left unchanged" in text
    assert text.count("lie on several devices (a model split across devices: ['cpu', 'meta'])") == 2


class _ProjectedAttention(CacheAttention):
    """CacheAttention with a trainable projection of the query (a parameter that requires grad)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, q, k_new, v_new, pos):
        return super().forward(self.proj(q), k_new, v_new, pos)


def test_inference_tensors_and_grad_mode_left_unchanged():
    """Caches made under torch.inference_mode() carry no version counter (kvq sees eager writes by it), and the kvq
    ops have no backward: both leave the step unchanged with the reason, and it still matches the module (before,
    the first failed at run time, the second at compile time, neither saying why)."""
    args = (torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32), torch.tensor([3]))
    with torch.inference_mode():
        text = explain(CacheAttention(), *args, cfg="int8")
    assert "0 attention layer(s) rewritten" in text and "inference tensors" in text and "torch.no_grad()" in text
    m = _ProjectedAttention()
    text = explain(m, *args, cfg="int8")
    assert "0 attention layer(s) rewritten" in text and "gradients are enabled" in text
    with torch.no_grad():
        assert "1 attention layer(s) rewritten" in explain(_ProjectedAttention(), *args, cfg="int8")
    ref = _ProjectedAttention()
    ref.load_state_dict(m.state_dict())
    ref.k.zero_(), ref.v.zero_()
    m.k.zero_(), m.v.zero_()
    out = torch.compile(m, backend=kvq_backend("int8", compiler="aot_eager"))(*args)
    assert out.requires_grad and torch.allclose(out, ref(*args), atol=1e-6)


def test_per_layer_settings_need_every_layer_in_model_order():
    """A config that treats layers by index (layer_bits here; codebooks, XQuant's pattern and sharing alike) is
    refused where the graph's rewritten layers are not the model's layers 0 .. n-1: a hybrid model whose first layer
    is a sliding one (left unchanged) would have given model layer 1 the settings of layer 0 and layer 2 those of 1.
    A uniform config is still served there; a plain model takes the per-layer config."""
    from models import small_windows

    cfg = small_windows("kivi-2")
    per_layer = KVQConfig.from_dict({**cfg.to_dict(), "layer_bits": {1: (8, 8)}})
    hybrid = hf_model("qwen2", kv_heads=1, gqa=2, head_dim=64, layers=3, use_sliding_window=True, sliding_window=4,
                      layer_types=["sliding_attention", "full_attention", "full_attention"])
    ids, mask = prompts(1, 6)
    gen = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, cache_implementation="static")
    for c, rewritten in ((per_layer, 0), (cfg, 2)):
        be = kvq_backend(c, compiler="aot_eager")
        hybrid.generate(ids, compile_config=compile_config(be), **gen)
        text = explain(be)
        assert f"kvq rewrite: {rewritten} attention layer(s) rewritten" in text
        assert ("per-layer settings" in text) == (rewritten == 0)
    be = kvq_backend(per_layer, compiler="aot_eager")
    hf_model("llama", kv_heads=1, gqa=2, head_dim=64, layers=2).generate(ids, compile_config=compile_config(be), **gen)
    lines = {ln.split(":")[1].strip(): ln for ln in explain(be).splitlines() if ln.startswith("  rewritten: layer")}
    # (the cache's placeholder is l_kwargs_cache_layers_1_keys here, l_kwargs_past_key_values_... on torch 2.11)
    assert "layers_0_keys" in lines["layer 0"] and "(2-bit K, 2-bit V)" in lines["layer 0"]
    assert "layers_1_keys" in lines["layer 1"] and "(8-bit K, 8-bit V)" in lines["layer 1"]
