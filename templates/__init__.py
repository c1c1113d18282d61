"""Triton templates for the kvq ops (installed as `kvq_compile.templates`).

    decode_attention.py   attention of one query token per sequence over the packed store: unpacking fused
                          into the tile loads, post-scaling, RoPE after dequantization, LUT levels, outliers,
                          fp16 sink/ring windows, calibrated softmax, split-K with a combine kernel.

On CUDA, `kvq_compile.ops` registers the template as the CUDA kernel of `kvq::attend` for decode steps
(an opaque kernel inside the compiled graph; no Inductor lowering yet), and the decode append runs the
sync-free `store.append_decode` compiled by Inductor. Chunks (prefill) use the reference kernels.
The CPU test suite runs the template under TRITON_INTERPRET=1.
"""
