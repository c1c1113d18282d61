"""Session 45: the compiled chunk graph with kvq::seat_chunk on CUDA (a segfault in call 1), against KVQCache.
    python bench/debug/seat_chunk_cuda.py [--only v1,v2]   each variant in its own process (default: all)
    python bench/debug/seat_chunk_cuda.py VARIANT          one, here (DEVICE=cpu for a CPU run)"""
import os
import subprocess
import sys
import traceback

DEVICE = os.environ.get("DEVICE", "cuda")
VARIANTS = ["as_is", "kivi2", "no_static_launcher", "no_cudagraphs", "unseated", "unseated_no_cudagraphs", "no_chunks", "premade", "premade_unseated", "premade_early"]


def variant_line(line):
    return any(line.startswith(v + ":") or line.startswith(v + " seed") for v in VARIANTS)


def run(variant):
    if variant == "no_static_launcher":
        os.environ["TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER"] = "0"
    import torch
    sys.path.insert(0, "tests")
    from models import compile_config, hf_model, prompts, small_windows
    from transformers import StaticCache

    from kvq_compile import kvq_backend
    from kvq_compile.hf import KVQCache
    if "unseated" in variant:
        from kvq_compile.passes import kv_cache_attention as kca
        kca._chunk_seating = lambda *a, **k: None
    GEN = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)
    model = hf_model("llama", kv_heads=1, gqa=2, head_dim=64, layers=2).to(DEVICE)
    cfg = small_windows("kivi-2" if variant == "kivi2" else "innerq-2")
    if variant.startswith("premade"):   # call 1's test: a StaticCache of its own (lazily initialized in the first
        static = StaticCache(config=model.config, max_cache_len=32)   # graph), release off, reused
        be = kvq_backend(cfg, release_fp16_cache=False)
        if variant == "premade_early":   # HF: required where the prefill runs compiled (chunked prefill)
            static.early_initialization(2, 1, 64, torch.float32, DEVICE)
        for n, pad, seed in ((21, (0, 5), 1), (12, (3, 0), 2), (17, (0, 6), 3)):
            ids, mask = (t.to(DEVICE) for t in prompts(2, n, pad=pad, seed=seed))
            kvq = KVQCache(model, cfg, batch_size=2, max_cache_len=32)
            eager = model.generate(ids, attention_mask=mask, max_new_tokens=4, prefill_chunk_size=8,
                                   past_key_values=kvq, disable_compile=True, **GEN)
            static.reset()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=4, prefill_chunk_size=8,
                                 past_key_values=static, compile_config=compile_config(be), **GEN)
            d = max((a - b).abs().max().item() for a, b in zip(eager.logits, out.logits))
            print(f"{variant} seed {seed}: max logit difference to eager KVQCache {d:.3g}", flush=True)
        return
    be = kvq_backend(cfg)
    ids, mask = (t.to(DEVICE) for t in prompts(2, 21, pad=(0, 5), seed=1))
    chunk = None if variant == "no_chunks" else 8
    kvq = KVQCache(model, cfg, batch_size=2, max_cache_len=32)
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=6, prefill_chunk_size=chunk, past_key_values=kvq,
                           **GEN)
    cc = compile_config(be)
    if "no_cudagraphs" in variant:
        cc.mode = "default"
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, prefill_chunk_size=chunk, cache_implementation="static",
                         compile_config=cc, **GEN)
    d = max((a - b).abs().max().item() for a, b in zip(eager.logits, out.logits))
    print(f"{variant}: max logit difference to eager KVQCache {d:.3g}; seats row 1 "
          f"{be.stores()[0].seats[1, :10].tolist()}", flush=True)


if __name__ == "__main__":   # [variant] in this process, or [--only a,b] (default: all) each in its own
    if len(sys.argv) > 1 and sys.argv[1] != "--only":
        try:
            run(sys.argv[1])
        except Exception:
            traceback.print_exc()
            sys.exit(1)
    else:
        for v in sys.argv[2].split(",") if len(sys.argv) > 2 else VARIANTS:
            r = subprocess.run([sys.executable, __file__, v], capture_output=True, text=True, timeout=300)
            tail = (r.stdout + r.stderr).strip().splitlines()
            keep = [line for line in tail if "Error" in line or "Fatal" in line or variant_line(line)]
            print(f"== {v}: rc {r.returncode}")
            print("\n".join((keep or tail)[-8:]), flush=True)
