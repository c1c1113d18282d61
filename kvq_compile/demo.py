"""Demo: a small random-weight Llama decodes with several kvq presets on the CPU.

    python -m kvq_compile.demo

For each preset it prints the store's true bits per element at the demo's own length (224 tokens: mostly the fp16
sink and recent windows, so the low-bit presets look expensive there) and at 32k tokens of a Llama-3-8B-shaped
cache (32 layers, 8 KV heads, head_dim 128: what the codes cost once the context is long), the greedy agreement
with the fp16 run, the SNR of the decode logits, and how many attention layers the pass rewrote.
"""
from __future__ import annotations

import time

import torch

LONG = dict(num_layers=32, num_kv_heads=8, head_dim=128, max_len=32768)   # the second bits column's cache


def run(presets=("fp16", "int8", "kivi-4", "kivi-2", "kvquant-4-1%", "innerq-2", "xquant-1.38"), new_tokens: int = 24,
        out=print) -> list[dict]:
    """Decode with each preset against an uncompiled fp16 static-cache run; one dict per preset (also printed)."""
    from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

    from kvq_compile import KVQConfig, kvq_backend

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 256, (2, 200))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0  # left padding
    gen = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
               output_logits=True, return_dict_in_generate=True)
    ref = model.generate(ids, **gen)
    out("random weights: agreement and SNR show the plumbing, not model quality (see bench/ for real text)")
    out(f"{'preset':14s} {'bits/elem':>9s} {'@32k 8B':>8s} {'store MiB':>9s} {'greedy=':>8s} {'SNR dB':>7s} "
        f"{'layers':>6s} {'s':>5s}")
    rows = []
    for name in presets:
        cfg = KVQConfig.preset(name)
        backend = kvq_backend(cfg)
        cc = CompileConfig(backend=backend, fullgraph=True)
        cc._compile_all_devices = True  # generate() compiles only on accelerators unless told otherwise
        t0 = time.perf_counter()
        res = model.generate(ids, compile_config=cc, **gen)
        dt = time.perf_counter() - t0
        store = backend.stores()[-1]
        agree = (res.sequences[:, ids.shape[1]:] == ref.sequences[:, ids.shape[1]:]).float().mean().item()
        a, b = torch.stack(ref.logits[1:]), torch.stack(res.logits[1:])
        row = dict(preset=name, bits=cfg.equivalent_bits(4, 2, 64, store.geo.max_len, batch=2),
                   bits_long=cfg.equivalent_bits(**LONG), store_mib=store.nbytes() / 2**20, greedy=agree,
                   snr_db=20 * torch.log10(a.norm() / (a - b).norm().clamp_min(1e-12)).item(),
                   layers=len(backend.reports[0].rewritten), seconds=dt)
        rows.append(row)
        out(f"{name:14s} {row['bits']:9.2f} {row['bits_long']:8.2f} {row['store_mib']:9.2f} {agree:8.2f} "
            f"{row['snr_db']:7.1f} {row['layers']:6d} {dt:5.1f}")
        torch._dynamo.reset()
    return rows


def main():
    run()


if __name__ == "__main__":
    main()
