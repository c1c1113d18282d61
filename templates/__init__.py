"""Triton templates for the kvq ops (installed as `kvq_compile.templates`).

    decode_attention.py   attention of one query token per sequence over the packed store: unpacking fused
                          into the tile loads, post-scaling, RoPE after dequantization, LUT levels, outliers,
                          fp16 sink/ring windows, calibrated softmax, split-K with a combine kernel.
    prefill_attention.py  attention of a chunk of query tokens over the stored prefix plus the chunk (a later
                          prefill chunk, the next turn): the same fused tile loads, causal / mask rows, CalibQuant.
    quantize_append.py    quantize-on-append of one token per sequence, K and V of a layer in one launch.

On CUDA, `kvq_compile.lowering` lowers `kvq::attend` of decode steps to a call of this template (its default
launch, or under max_autotune the fastest of several launch configurations, as `ExternKernelChoice`s); `kvq_compile.ops` also registers it as the op's CUDA kernel
(what runs when the op stays opaque). The decode append runs `quantize_append.py` (`KVQ_APPEND=inductor`: the
sync-free `store.append_decode` compiled by Inductor). A first chunk runs torch's SDPA; a chunk over a stored
prefix runs `prefill_attention.py` or SDPA over the dequantized prefix, as `kvq_compile.ops._prefill_choice`
decides (KVQ_PREFILL).
The CPU test suite runs the template under TRITON_INTERPRET=1.
"""
