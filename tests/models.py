"""Small random-weight models for the tests: HuggingFace architectures and a gpt-fast-style model."""
import dataclasses
import os

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (CompileConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from kvq_compile import KVQConfig

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def hf_model(arch="llama", kv_heads=1, gqa=2, head_dim=64, layers=2, dtype=torch.float32, seed=0, **extra):
    torch.manual_seed(seed)
    config_cls, model_cls = ARCHS[arch]
    heads = kv_heads * gqa
    config = config_cls(vocab_size=96, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                        max_position_embeddings=512, **extra)
    return model_cls(config).to(dtype).eval()


# What compiles the CPU suite's cache-semantics tests (chunks, pads, seats, statistics: most of
# tests/test_hf_cache.py): AOTAutograd's functionalized graph run op by op. The pass, its kvq ops and their mutations
# are what Inductor gets, without Inductor's codegen and C++ builds (one test 44 -> 18 s cold, session 57). Inductor
# is checked by the tests and cases that name it: most of tests/test_generate.py (its compiled generates against the
# reference), tests/test_store.py's compiled appends, and in tests/test_hf_cache.py the fp16 KVQCache against the
# static cache, test_chunked_prefill, the innerq-2 and kvquant-4-1% (Keys before RoPE) cases of the compiled first
# chunks, one backend-path case and the compiled overflow. The other compiled-chunk tests (pads, statistics, sinks,
# seats) run through aot_eager only. On a CUDA machine every test compiles through Inductor. KVQ_CHECK_COMPILER
# (inductor, aot_eager) overrides the choice, e.g. to run those tests through aot_eager on a GPU.
CHECK_COMPILER = os.environ.get("KVQ_CHECK_COMPILER") or ("inductor" if torch.cuda.is_available() else "aot_eager")
if CHECK_COMPILER not in ("inductor", "aot_eager"):
    raise ValueError(f"KVQ_CHECK_COMPILER must be inductor or aot_eager, got {CHECK_COMPILER!r}")


def compile_config(backend):
    cc = CompileConfig(backend=backend, fullgraph=True)
    cc._compile_all_devices = True  # generate() only compiles on accelerators unless told otherwise
    return cc


def _aot_eager(gm, example_inputs, mode=None, options=None):   # (generate passes its CompileConfig's mode)
    from kvq_compile import compat

    return compat.aot_eager(gm, example_inputs)


def plain_compile_config(compiler: str = CHECK_COMPILER):
    """generate's own compile (no kvq pass: a KVQCache's graphs), fullgraph, through `compiler`."""
    return compile_config("inductor" if compiler == "inductor" else _aot_eager)


def prompts(batch, length, vocab=96, pad=(0,), seed=1):
    """Random prompts; row i is left-padded by pad[i % len(pad)] positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for i in range(batch):
        mask[i, : pad[i % len(pad)]] = 0
    return ids, mask


def graph_of(fn):
    """(CUDA graph, its output): fn() warmed up once on a side stream, then captured (replay the graph to rerun)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


# One preset per store layout and quantizer kind, for the slow per-preset tests (compiled generate, the compiled
# append, the interpreter on real K/V, the append template): the six presets left out (kivi-4, kvquant-3, kvquant-2,
# kvquant-4-1%, kvquant-2-1%, calibquant-2) differ from one of these only in code width, which the per-width tests
# cover (bits 1, 2, 3, 4, 8). Unquantized; int8 (per-token symmetric); KIVI (per-channel Key groups, per-token Value
# groups); kvquant without and with outliers (codebooks, Keys before RoPE, a sink; 3 bits: 10 codes a word);
# calibquant (static per-channel ranges, the calibrated softmax); xquant (shared codes, mixed widths); InnerQ with
# hybrid groups and with 3-bit symmetric Keys (inner-dimension groups, the Key norm).
LAYOUT_PRESETS = ["fp16", "int8", "kivi-2", "kvquant-4", "kvquant-3-1%", "calibquant-1", "xquant-1.38", "innerq-2",
                  "innerq-k3v2"]


def small_windows(name: str) -> KVQConfig:
    """A preset with its windows and token groups shrunk so that short test sequences cross many flushes."""
    cfg = KVQConfig.preset(name)
    cfg.sink = min(cfg.sink, 2)
    for side in ("key", "value"):
        q = getattr(cfg, side)
        if q.tokens_per_group > 1:
            setattr(cfg, side, dataclasses.replace(q, group_size=4))
    cfg.recent = min(cfg.recent, 4)
    return cfg


class KVCache(nn.Module):
    """gpt-fast's KVCache: static buffers, `k_out[:, :, input_pos] = k_val`."""

    def __init__(self, batch, heads, max_len, head_dim, dtype):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(batch, heads, max_len, head_dim, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(batch, heads, max_len, head_dim, dtype=dtype))

    def update(self, input_pos, k_val, v_val):
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val
        return k_out, v_out


class GptFastAttention(nn.Module):
    """gpt-fast's attention over its KVCache: SDPA with the given mask, or is_causal where none is given."""

    def __init__(self, dim, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.wqkv = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, dim, bias=False)
        self.kv_cache = None

    def forward(self, x, mask, input_pos):
        b, n, _ = x.shape
        q, k, v = self.wqkv(x).split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                                      self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=mask is None)
        return self.wo(y.transpose(1, 2).reshape(b, n, -1))


class GptFastModel(nn.Module):
    """A tiny gpt-fast-style decoder (no RoPE): embeddings, attention blocks with their own KV caches."""

    def __init__(self, vocab=96, dim=128, heads=4, kv_heads=2, head_dim=32, layers=2, max_len=64, batch=2,
                 dtype=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(GptFastAttention(dim, heads, kv_heads, head_dim) for _ in range(layers))
        self.out = nn.Linear(dim, vocab, bias=False)
        for layer in self.layers:
            layer.kv_cache = KVCache(batch, kv_heads, max_len, head_dim, dtype)
        self.register_buffer("causal_mask", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)))
        self.to(dtype)

    def forward(self, idx, input_pos):
        mask = self.causal_mask[None, None, input_pos]
        x = self.embed(idx)
        for layer in self.layers:
            x = x + layer(x, mask, input_pos)
        return self.out(x)


def snr_db(ref, test):
    """Signal-to-quantization-noise ratio in dB (torchao's compute_error)."""
    return (20 * torch.log10(ref.norm() / (ref - test).norm())).item()


def rope_tables(B, n, p, D, dtype, device):
    """cos / sin [B, n, D] of positions p .. p + n - 1 (test frequencies, not a model's)."""
    ang = torch.arange(p, p + n, device=device).float()[:, None] * torch.linspace(0.05, 1.0, D, device=device)
    return ang.cos()[None].expand(B, n, D).to(dtype), ang.sin()[None].expand(B, n, D).to(dtype)


def append_every_layer(ms, cfg, k, v, p0):
    """kvq::append of the chunk k, v [B, H, n, D] at positions p0.. into every layer of the store `ms` (layer j
    gets k + j, v - j), so that shared codes (XQuant) exist; RoPE tables when keys are stored before RoPE."""
    B, _, n, D = k.shape
    cos, sin = rope_tables(B, n, p0, D, k.dtype, k.device) if cfg.keys_before_rope else (None, None)
    for j, lay in enumerate(ms.layers):
        names, tensors = lay.append_tensors()
        torch.ops.kvq.append(tensors, k + j, v - j, torch.arange(p0, p0 + n, device=k.device), cos, sin,
                             lay.descriptor(names))

