"""Chunk attention over a stored prefix: the fused prefill template against SDPA over the dequantized prefix.

    python bench/bench_prefill.py

For each preset at (batch, stored prefix p0, chunk n), Llama-3-8B attention shapes (32 query heads, 8 KV heads,
head_dim 128), bf16, a chunk-causal boolean mask [B, 1, n, L] as HuggingFace passes it:
  fused   `templates/prefill_attention.py` (what the CUDA op runs for such a chunk when `ops._prefill_choice`
          picks it, or with KVQ_PREFILL=triton)
  sdpa    `ops.attend_chunk`: `store.read` dequantizes the prefix, torch's SDPA over it and the chunk;
          CalibQuant's calibrated softmax takes the float32 reference there
  fp16    torch's SDPA over bf16 K/V of the same length (no cache quantization at all)
Median time by triton.testing.do_bench (host launch included: these are millisecond calls), the extra peak
memory of one call over what the store and inputs already hold, and max |fused - sdpa|.
"""
from __future__ import annotations

import os
import sys

import torch
import triton.testing as tt

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode_attention import D, H, HQ, pick_layer, random_store  # noqa: E402

from kvq_compile import KVQConfig  # noqa: E402
from kvq_compile.ops import attend_chunk  # noqa: E402
from kvq_compile.templates.prefill_attention import prefill_attention  # noqa: E402

PRESETS = ["int8", "kivi-4", "kivi-2", "kvquant-4", "innerq-2", "xquant-1.38", "calibquant-1"]
SHAPES = [(1, 16384, 512), (8, 4096, 512), (4, 8192, 128)]


def peak_extra(fn) -> float:
    """MiB allocated by one fn() call beyond what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def main():
    dtype = torch.bfloat16
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for B, p0, n in SHAPES:
        L = p0 + n
        mask = torch.ones(B, 1, n, L, dtype=torch.bool, device="cuda").tril(p0)
        q = torch.randn(B, HQ, n, D, device="cuda", dtype=dtype)
        kf = torch.randn(B, H, L, D, device="cuda", dtype=dtype)
        vf = torch.randn(B, H, L, D, device="cuda", dtype=dtype)
        sd = lambda: torch.nn.functional.scaled_dot_product_attention(q, kf, vf, attn_mask=mask,  # noqa: E731
                                                                      enable_gqa=True)
        t16 = tt.do_bench(sd, warmup=10, rep=100, return_mode="median")
        print(f"B={B} p0={p0} n={n}: fp16 SDPA {t16 * 1e3:8.1f} us, extra {peak_extra(sd):7.1f} MiB", flush=True)
        for name in PRESETS:
            cfg = KVQConfig.preset(name)
            li = pick_layer(cfg)
            ms = random_store(cfg, li, li + 1, B, L + 64, dtype)
            lay = ms.layers[li]
            names, tensors = lay.attend_tensors()
            bufs = dict(zip(names, tensors))
            k, v = kf[:, :, p0:], vf[:, :, p0:]
            pos = torch.arange(p0, L, device="cuda")
            args = (q, k, v, pos, mask, D ** -0.5, False)
            fused = lambda: prefill_attention(q, bufs, *args[1:], cfg, lay.spec, ms.geo)  # noqa: E731
            sdpa = lambda: attend_chunk(q, tensors, *args[1:], lay.descriptor(names))  # noqa: E731
            err = (fused().float() - sdpa().float()).abs().max().item()
            tf = tt.do_bench(fused, warmup=5, rep=50, return_mode="median")
            ts = tt.do_bench(sdpa, warmup=5, rep=50, return_mode="median")
            print(f"  {name:13s} fused {tf * 1e3:9.1f} us  sdpa path {ts * 1e3:9.1f} us  ({ts / tf:5.2f}x)  "
                  f"extra memory fused {peak_extra(fused):7.1f} MiB  sdpa path {peak_extra(sdpa):7.1f} MiB  "
                  f"max|fused - sdpa| {err:.3g}", flush=True)
            del ms, bufs, tensors
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
