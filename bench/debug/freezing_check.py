"""Does kvq's rewrite survive Inductor's freezing (debug; `bench_generate.py --frozen`)? kivi-2 `generate` on a
small Llama (tests/models.py: hf_model, small windows, so the quantized region is attended) compiled by kvq_backend
with options {"freezing": True} against the same without: the tokens and the largest logit difference. Freezing
turns the weights into constants, so Inductor's patterns may concatenate same-input GEMMs (on CUDA; on CPU only with
config.cpp.enable_concat_linear); the KV store's buffers must stay inputs (they are mutated).

    python bench/debug/freezing_check.py          (CUDA if there is one, else CPU)
"""
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from models import hf_model, prompts, small_windows  # noqa: E402
from transformers import CompileConfig  # noqa: E402

from kvq_compile import kvq_backend  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if dev == "cuda" else torch.float32
model = hf_model("llama", kv_heads=2, gqa=4, head_dim=128, layers=2, dtype=dtype).to(dev)
ids, mask = (t.to(dev) for t in prompts(3, 40, pad=(0, 5)))
kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, cache_implementation="static",
          output_logits=True, return_dict_in_generate=True)


def config(options=None):
    c = CompileConfig(backend=kvq_backend(small_windows("kivi-2")), fullgraph=True, options=options,
                      mode=None if options else "reduce-overhead")
    c._compile_all_devices = True   # generate() compiles on accelerators only unless told otherwise
    return c


cudagraphs = {"triton.cudagraphs": True} if dev == "cuda" else {}
ref = model.generate(ids, compile_config=config(), **kw)
torch._dynamo.reset()
out = model.generate(ids, compile_config=config({"freezing": True, **cudagraphs}), **kw)
diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref.logits, out.logits))
scale = max(a.float().abs().max().item() for a in ref.logits)
print(f"{dev} {dtype}: tokens equal {torch.equal(out.sequences, ref.sequences)}, largest logit difference {diff:.3g} "
      f"(largest logit {scale:.3g})")
