"""Whether Inductor fuses the query's producers (HF's RoPE) into the kvq decode template as a prologue: compiles a
tiny HF model's generate with KVQ_TEMPLATE=1 and prints the template kernel's source up to its `_fused_decode`
call, and the lowering's picks. GPU only. usage: python bench/debug/template_code.py [preset]"""
import os
import sys

os.environ["KVQ_TEMPLATE"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

import torch  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402

from kvq_compile import kvq_backend, lowering  # noqa: E402
from models import compile_config, hf_model, prompts, small_windows  # noqa: E402

preset = sys.argv[1] if len(sys.argv) > 1 else "kvquant-3"
model = hf_model("llama", kv_heads=2, gqa=4, head_dim=128, layers=1, dtype=torch.bfloat16).cuda()
ids, mask = (t.cuda() for t in prompts(2, 9))
_, codes = run_and_get_code(lambda: model.generate(
    ids, attention_mask=mask, max_new_tokens=3, cache_implementation="static",
    compile_config=compile_config(kvq_backend(small_windows(preset)))))
found = 0
for code in codes:
    at = code.find("_fused_decode(")
    while at >= 0:
        found += 1
        start = code.rfind("def triton_", 0, at)
        print(f"--- kernel {found}: {code[start:code.find('(', start)]}")
        print(code[code.rfind("@triton", 0, start):at + 60])
        at = code.find("_fused_decode(", at + 1)
print("template kernels:", found, "picks:", [c for _, c in lowering.SELECTED])
