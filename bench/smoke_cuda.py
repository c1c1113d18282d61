"""Smoke run of kvq_backend on CUDA tensors (reference ops, no Triton templates yet): does a compiled HF
generate run and match fp16, with the default mode (reduce-overhead) and with mode="default"?"""
import sys

import torch
from transformers import CompileConfig

sys.path.insert(0, "tests")
from models import hf_model, prompts  # noqa: E402

from kvq_compile import kvq_backend  # noqa: E402

model = hf_model("llama", kv_heads=2, gqa=4, head_dim=128, layers=4, dtype=torch.float16).cuda()
ids, mask = prompts(2, 64, pad=(0, 5))
ids, mask = ids.cuda(), mask.cuda()
gen = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, cache_implementation="static",
           output_logits=True, return_dict_in_generate=True)
ref = model.generate(ids, **gen)
for preset in ("fp16", "int8", "kivi-4"):
    for mode in ("reduce-overhead", "default"):
        torch._dynamo.reset()
        try:
            out = model.generate(ids, compile_config=CompileConfig(backend=kvq_backend(preset), fullgraph=True,
                                                                   mode=mode), **gen)
            agree = (out.sequences == ref.sequences).float().mean().item()
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref.logits, out.logits))
            print(f"{preset:8s} {mode:16s} ok: token agreement {agree:.3f}, max |dlogit| {err:.3e}")
        except Exception as e:  # report, do not hide
            print(f"{preset:8s} {mode:16s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
