"""The decode-attention template against the reference on real attention inputs of SmolLM2-135M-Instruct
(tests/data/smollm2_kv.safetensors, written by bench/capture_kv.py): queries, keys (before and after RoPE) and
values of layers 0, 14 and 29 over 192 tokens of held-out Austen text, with the model's outlier channels.

A two-layer store holds two real layers (so XQuant's second layer dequantizes the first one's codes with its
own statistics); the first 176 tokens go in as a prefill chunk, then real tokens are decoded one at a time and
the template's output is compared with the reference op on each step. Every preset and layer pair runs under
TRITON_INTERPRET=1 in the CPU suite, compiled on a GPU. A last check bounds what quantization
itself costs on this data: the reference output against exact fp16 attention."""
import os

import pytest
import torch

from kvq_compile import store as st
from kvq_compile.ops import attend_cpu_reference, attend_reference
from models import LAYOUT_PRESETS, small_windows, snr_db

triton = pytest.importorskip("triton")
from kvq_compile.templates.decode_attention import decode_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DATA = os.path.join(os.path.dirname(__file__), "data", "smollm2_kv.safetensors")
PREFILL, STEPS = 176, 2


@pytest.fixture(scope="module")
def real():
    from safetensors.torch import load_file

    return {k: v.to(DEVICE) for k, v in load_file(DATA).items()}


def run(real, cfg, layers=(0, 29), steps=STEPS, compare=True):
    """Max |template - reference| on the last layer of a store filled with the real layers `layers` (0 without
    `compare`), the reference outputs and the exact attention of the decoded steps."""
    T, D = real["cos"].shape
    H, Hq = real["0.k"].shape[0], real["0.q"].shape[0]
    geo = st.Geometry(1, H, T, D, "float16")
    ms = st.ModelStore(cfg, len(layers), geo, DEVICE)
    src = {i: real[f"{layer}.k_pre" if cfg.keys_before_rope else f"{layer}.k"] for i, layer in enumerate(layers)}

    def append(lo, hi):
        cos = real["cos"][None, lo:hi] if cfg.keys_before_rope else None
        sin = real["sin"][None, lo:hi] if cfg.keys_before_rope else None
        for i, layer in enumerate(layers):
            names, tensors = ms.layers[i].append_tensors()
            torch.ops.kvq.append(tensors, src[i][None, :, lo:hi], real[f"{layer}.v"][None, :, lo:hi],
                                 torch.arange(lo, hi, device=DEVICE), cos, sin, ms.layers[i].descriptor(names))

    append(0, PREFILL)
    last = len(layers) - 1
    lay, name = ms.layers[last], layers[last]
    names, tensors = lay.attend_tensors()
    worst, refs, exact = 0.0, [], []
    for p in range(PREFILL, PREFILL + steps):
        append(p, p + 1)
        q = real[f"{name}.q"][None, :, p - (T - 16):p - (T - 16) + 1]
        k = real[f"{name}.k"][None, :, p:p + 1]  # the chunk attends to itself exactly, after RoPE
        v = real[f"{name}.v"][None, :, p:p + 1]
        pos = torch.tensor([p], device=DEVICE)
        ref = attend_cpu_reference(q, tensors, k, v, pos, None, D ** -0.5, False, lay.descriptor(names))
        if compare:
            out = decode_attention(q, dict(zip(names, tensors)), k, v, pos, None, D ** -0.5, False, cfg, lay.spec,
                                   geo, block_t=32)
            torch.testing.assert_close(out.float(), ref.float(), atol=4e-3, rtol=4e-3,
                                       msg=lambda m: f"{cfg.name} layers {layers} step {p}: {m}")
            worst = max(worst, (out.float() - ref.float()).abs().max().item())
        kf, vf = real[f"{name}.k"][None, :, :p].float(), real[f"{name}.v"][None, :, :p].float()
        refs.append(ref.float())
        exact.append(attend_reference(q, kf, vf, k, v, None, D ** -0.5, False, None).float())
    return worst, torch.cat(refs), torch.cat(exact)


@pytest.mark.interpreter
@pytest.mark.parametrize("name", LAYOUT_PRESETS)
def test_template_matches_reference_on_real_kv(real, name):
    for layers in ((0, 29), (14, 0), (29, 14)):
        run(real, small_windows(name), layers)


@pytest.mark.parametrize("name,min_snr", [("fp16", 60), ("int8", 33), ("kivi-4", 22), ("kivi-2", 10),
                                           ("kvquant-4-1%", 18)])
def test_quantization_error_on_real_kv(real, name, min_snr):
    """Reference op (windows shrunk so most tokens are quantized) against exact attention: signal-to-noise
    floors that hold with margin on this data; they fail if a quantizer breaks on real value ranges."""
    _, refs, exact = run(real, small_windows(name), (14, 29), steps=4, compare=False)
    assert snr_db(exact, refs) > min_snr, f"{name}: {snr_db(exact, refs):.1f} dB"
