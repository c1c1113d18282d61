"""`kvq::attend` on a chunk of several tokens runs torch's SDPA, over the chunk alone (empty store) or over the
dequantized prefix plus the chunk; it must equal the reference path (float32 scores, zeros for fully masked
rows) for every mask form, with and without a stored prefix."""
import zlib

import pytest
import torch

from kvq_compile import store as st
from kvq_compile.ops import attend_chunk, attend_cpu_reference, attend_reference
from models import small_windows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["none", "bool", "additive", "causal"])
@pytest.mark.parametrize("preset,rep", [("kivi-2", 3), ("calibquant-1", 1), ("kvquant-4-1%", 4), ("innerq-2", 2)])
@pytest.mark.parametrize("p0", [0, 17])
def test_chunk_matches_reference(preset, rep, mask, dtype, p0):
    torch.manual_seed(zlib.crc32(f"{preset} {mask} {p0}".encode()))  # str hash() changes per process
    B, H, D, T, n = 3, 2, 32, 40, 13
    cfg = small_windows(preset)  # a prefix of 17 tokens is then mostly quantized
    geo = st.Geometry(B, H, T, D, st.dtype_name(dtype))
    lay = st.ModelStore(cfg, 1, geo, "cpu").layers[0]
    names, tensors = lay.attend_tensors()
    q = torch.randn(B, H * rep, n, D).to(dtype)
    k, v = torch.randn(B, H, n, D).to(dtype), torch.randn(B, H, n, D).to(dtype)
    pos = torch.arange(p0, p0 + n)
    append_names, append_tensors = lay.append_tensors()
    if p0:
        prefix = torch.randn(2, B, H, p0, D).to(dtype) * 2
        torch.ops.kvq.append(append_tensors, prefix[0], prefix[1], torch.arange(p0), None, None,
                             lay.descriptor(append_names))
    torch.ops.kvq.append(append_tensors, k, v, pos, None, None, lay.descriptor(append_names))
    attn_mask, causal = None, mask == "causal"
    if mask in ("bool", "additive"):
        allowed = torch.ones(B, 1, n, T, dtype=torch.bool).tril(p0)
        allowed[1, ..., :4] = False  # left padding: with p0 = 0 the first query rows of batch 1 see nothing
        allowed[2, :, :2] = False  # rows 0 and 1 of batch 2 see nothing (prefix and chunk)
        attn_mask = allowed if mask == "bool" else torch.where(allowed, 0.0, float("-inf")).to(dtype)
        if mask == "additive":
            attn_mask = attn_mask + torch.where(allowed, torch.rand(B, 1, n, T).to(dtype), 0.0)
            if dtype == torch.float32:  # float32's most negative finite bias: a large penalty, not a mask
                attn_mask[0, :, :, 1] = torch.finfo(torch.float32).min
    args = (q, tensors, k, v, pos, attn_mask, D ** -0.5, causal, lay.descriptor(names))
    out, ref = attend_chunk(*args), attend_cpu_reference(*args)
    assert out.shape == ref.shape and out.is_contiguous()
    if mask in ("bool", "additive"):
        assert out[2, :, :2].abs().max() == 0  # fully masked rows
        if p0 == 0:
            assert out[1, :, :4].abs().max() == 0
    if dtype == torch.float32 or (p0 and cfg.softmax_tau is not None):  # (CalibQuant: the reference path)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:  # SDPA sees the dequantized prefix rounded to bf16: so must the reference (which is float32 inside)
        kp, vp = st.read(dict(zip(names, tensors)), cfg, lay.spec, D, p0 + n, p0)
        tau = cfg.softmax_tau if p0 else None
        ref = attend_reference(q, kp.to(dtype).float(), vp.to(dtype).float(), k, v, attn_mask, D ** -0.5, causal, tau)
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)  # output ulp 2^-8 relative
