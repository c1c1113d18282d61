"""The `kvq` custom ops: quantize-on-append and attention over the packed store.

Both take a layer's store as a tensor list plus a `layout` string (see `store.LayerStore.descriptor`)
that names each tensor. Shapes are static (sized from the cache's max length) and the store tensors
keep fixed addresses, so compiled steps can be captured in CUDA graphs. The CPU implementations below
are the reference (pure torch, `kvq_compile.reference`); GPU templates register as Inductor lowerings
of these same ops.

    kvq::append(store!, key [B,H,n,D], value [B,H,n,D], positions [n], cos?, sin?, layout)
        writes the chunk at positions (contiguous), quantizing what leaves the recent window.
        For keys stored before RoPE, `key` is pre-RoPE and cos/sin [B|1, n, D] fill the RoPE table.
    kvq::attend(query [B,Hq,n,D], store, key [B,H,n,D], value [B,H,n,D], positions [n], attn_mask?,
                scale, is_causal, layout) -> [B,Hq,n,D]
        the chunk attends to the stored prefix [0, p0) and exactly (in the cache dtype) to itself;
        the mask and is_causal mean what they mean to scaled_dot_product_attention over the static
        buffer, restricted to the written length p0 + n. GQA maps query head h to KV head h // (Hq // H).
    kvq::append_chunk, kvq::attend_chunk: the same for chunks of n > 1 tokens, tagged cudagraph_unsafe
        (`chunk_ops`): a chunk reads its start position on the host. kvq::append_chunk takes `attended` [B|1, >=
        p0 + n] too (`store.attended_slots`): which slots its last query attends, in the order the store holds them
        (a seated first chunk's seated), for its first-chunk statistics (`store.append_side`: static ranges over the
        real tokens alone, widened while the prefix is exact, taken again by rows that saw only pads).
    kvq::seat_chunk(seats!, attn_mask, positions, sink) -> (chunk [B, n], read [B, T]): a left-padded first
        chunk's seating for configs with a sink, and a later chunk's for rows whose sink holds pads (their
        sink, `store.seat_first_chunk`, `store.seat_fresh_rows`): once per chunk graph of the rewrite, once per
        layer in KVQCache's compiled chunks.
    kvq::grouped_linear(x [..., K], weights [W_g [N_g, K]]) -> [y_g [..., N_g]]: same-input projections without
        bias (torch's linear of each weight), on CUDA in one launch for decode steps (`templates/grouped_linear.py`;
        the backend's `passes/grouped_linear.py` groups them).
    kvq::append_attend(query [B,Hq,1,D], store!, key, value, positions [1], attn_mask?, scale, is_causal, layout)
        -> [B,Hq,1,D]: one decode step of a layer, kvq::append then kvq::attend, as one op so that its CUDA kernel
        may launch the append beside the attention (`decode_attention`'s append) where the attention reads
        nothing the append writes (`store.attention_independent`; Keys stored after RoPE). `store` is the
        attention's list (`LayerStore.attend_tensors`); the append writes none of the codes shared from an
        earlier layer (XQuant), which the list holds too.
"""
from __future__ import annotations

import functools
import math

import torch

from . import compat
from . import reference as ref
from . import store as st
from .config import KVQConfig


@functools.lru_cache(maxsize=512)
def _decode_layout(layout: str):
    import json

    d = json.loads(layout)
    cfg = KVQConfig.from_dict(d["cfg"])
    geo = st.Geometry(**d["geo"])
    spec = cfg.resolve(d["num_layers"])[d["layer"]]
    return cfg, geo, spec, tuple(d["names"])


def _bufs(store, names):
    return dict(zip(names, store))


@torch.library.custom_op("kvq::append", mutates_args=("store",))
def append(store: list[torch.Tensor], key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
           cos: torch.Tensor | None, sin: torch.Tensor | None, layout: str) -> None:
    _append_impl(store, key, value, positions, cos, sin, layout, compiled=False)


# A chunk of several tokens reads its start position on the host (the store's windows and groups move by it), which
# CUDA graphs cannot capture. The rewrite and KVQCache therefore emit these twins of the ops for chunks: the same
# kernels, tagged cudagraph_unsafe, so that Inductor keeps them out of CUDA graphs (it skips or partitions a chunk's
# graph: chunked prefill, a next turn) instead of failing the capture. Decode steps keep kvq::append / kvq::attend
# (device-side positions).
_CHUNK_TAGS = (torch.Tag.cudagraph_unsafe,)  # torch >= 2.11 (pyproject) has it


@torch.library.custom_op("kvq::append_chunk", mutates_args=("store",), tags=_CHUNK_TAGS)
def append_chunk(store: list[torch.Tensor], key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                 cos: torch.Tensor | None, sin: torch.Tensor | None, layout: str,
                 attended: torch.Tensor | None = None) -> None:
    """attended [B or 1, >= p0 + n] bool (`store.attended_slots`): the slots the chunk's last query attends, in slot
    order (a seated first chunk's seated); the others are pads (`store.append_side`)."""
    _append_impl(store, key, value, positions, cos, sin, layout, compiled=False, attended=attended)


@append_chunk.register_fake
def _append_chunk_fake(store, key, value, positions, cos, sin, layout, attended=None):
    return None


@torch.library.custom_op("kvq::seat_chunk", mutates_args=("seats",), tags=_CHUNK_TAGS)
def seat_chunk(seats: torch.Tensor, attn_mask: torch.Tensor | None, positions: torch.Tensor,
               sink: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A compiled chunk's seating (`store.seat_first_chunk`): (the chunk's slot -> token [B, n], the seats its mask
    is read through [B, T]); a first chunk writes the store's seats, a later chunk those of rows whose real tokens
    start in it. The rewrite emits it once per chunk graph of a config with a sink (without a mask where the graph
    is not seated by its mask: a first chunk then resets the seats an earlier sequence left), KVQCache's compiled
    chunks once per layer."""
    return st.seat_first_chunk(seats, attn_mask, positions, sink)


@seat_chunk.register_fake
def _seat_chunk_fake(seats, attn_mask, positions, sink):
    B, T = seats.shape
    return seats.new_empty(B, positions.shape[0]), seats.new_empty(B, T)


def chunk_ops(n) -> tuple:
    """(append, attend) OpOverloads for n query tokens per sequence: the decode ops for a static n == 1, their
    cudagraph-unsafe twins for chunks (and for a symbolic n)."""
    if isinstance(n, int) and n == 1:
        return torch.ops.kvq.append.default, torch.ops.kvq.attend.default
    return torch.ops.kvq.append_chunk.default, torch.ops.kvq.attend_chunk.default


def _append_impl(store, key, value, positions, cos, sin, layout: str, compiled: bool, attended=None) -> None:
    """A chunk goes through the reference append (reads its start position on the host); one token per
    sequence through the sync-free decode append (positions stay on the device: CUDA-graph safe). On CUDA
    (`compiled`) that is the Triton template `quantize_append` (one launch for K and V), or with
    KVQ_APPEND=inductor (or a layout the template does not take) the reference decode append compiled by
    Inductor."""
    cfg, geo, spec, names = _decode_layout(layout)
    bufs = _bufs(store, names)
    if key.shape[2] != 1:
        p0, n = st.positions_span(positions)
        _refuse_overflow(geo, p0, n)
        st.check_rollback(bufs, p0, n)
        st.append(bufs, cfg, spec, geo, key, value, p0, cos, sin, attended)
    elif compiled and _triton_append(layout):
        from .templates.quantize_append import append_decode

        _assert_in_store(geo, positions, layout, bufs)
        append_decode(bufs, cfg, spec, geo, key, value, positions, cos, sin)
    elif compiled:
        _assert_in_store(geo, positions, layout, bufs)
        compiled_decode_append(layout)(bufs, key, value, positions, cos, sin)
    else:   # the reference path (CPU): reading the position costs no synchronization there
        _refuse_decode(geo, positions, bufs)
        st.append_decode(bufs, cfg, spec, geo, key, value, positions, cos, sin)


@functools.lru_cache(maxsize=None)
def _layer_of(layout: str) -> int:
    import json

    return json.loads(layout)["layer"]


def _assert_in_store(geo, positions: torch.Tensor, layout: str, bufs: dict) -> None:
    """Compiled decode steps (CUDA) cannot read their position on the host: the first layer's append asserts it on
    the device (`quantize_append.step_guard`, one small kernel, and the assert: two a step, kept by CUDA graphs;
    KVQCache's steps also assert in `hf.KVQLayer.update`): inside the store, and where the store cannot take tokens
    back (`store.any_order`) not behind its frontier unless at 0 (`store.check_rollback`; advanced here). Past the
    store the append would write nothing and the attention read past its rows; the model's own fp16 append would
    have failed the same way (an index out of range)."""
    if _layer_of(layout) == 0:
        from .templates.quantize_append import step_guard

        torch._assert_async(step_guard(positions, geo.max_len, bufs.get("frontier")), _guard_message(geo))


def _guard_message(geo) -> str:
    """`_assert_in_store`'s message (CUDA's `_assert_async` takes fewer than 255 characters)."""
    return (f"kvq store holds {geo.max_len} positions: a decode step past them (size the cache for the prompt "
            "plus the new tokens) or behind its last written position (a rollback: store.check_rollback)")


def _refuse_decode(geo, positions: torch.Tensor, bufs: dict) -> None:
    """The reference decode append's host checks (CPU: reading the position costs no synchronization there)."""
    _refuse_overflow(geo, int(positions.max()), 1)
    st.check_rollback(bufs, int(positions.reshape(-1)[0]), 1)


def _refuse_overflow(geo, p0: int, n: int) -> None:
    """Chunks on any device, decode tokens on the reference path. Compiled CUDA decode steps cannot read their
    position on the host: KVQCache asserts it on the device (`hf.KVQLayer.update`)."""
    if p0 + n > geo.max_len:
        raise ValueError(f"kvq store holds {geo.max_len} positions: cannot append {n} more at position {p0}; "
                         "size the cache (max_cache_len) for the prompt plus the new tokens")


PREFILL_TEMPLATE_MAX_CHUNK = 128  # query tokens per sequence up to which `auto` picks the prefill template


def _prefill_choice(n: int, layout: str) -> str:
    """How a CUDA chunk of n query tokens over a stored prefix attends. KVQ_PREFILL:
    'auto' (default): the fused prefill template for CalibQuant (its SDPA path is the float32 reference) and for
    chunks of at most PREFILL_TEMPLATE_MAX_CHUNK tokens whose codes need no per-element dequantization
    (no codebook, hybrid groups, outliers, RoPE after dequantization); SDPA over the dequantized prefix
    otherwise. On an H100 (bench/RESULTS.md, session 7) the template was 1.5-2.0x faster than the SDPA path at
    128-token chunks, 0.4-0.6x at 512 (every program re-reads and unpacks the whole prefix for its 64 query
    rows), and 0.7x for kvquant-4 at 128; it never holds a dequantized prefix (4-32 MiB extra vs 0.6-1.2 GiB).
    'sdpa' or 'triton' force one path."""
    import os

    choice = os.environ.get("KVQ_PREFILL", "auto")
    if choice not in ("auto", "sdpa", "triton"):
        raise ValueError(f"KVQ_PREFILL={choice!r}: use 'auto' (default), 'sdpa' (SDPA over the dequantized prefix) "
                         "or 'triton' (the fused prefill template)")
    if choice != "auto":
        return choice
    from .templates.decode_attention import layout_per_element

    cfg, _, spec, names = _decode_layout(layout)
    if cfg.softmax_tau is not None:
        return "triton"
    return "triton" if n <= PREFILL_TEMPLATE_MAX_CHUNK and not layout_per_element(cfg, spec, names) else "sdpa"


@functools.lru_cache(maxsize=512)
def _triton_append(layout: str) -> bool:
    """Whether decode appends of this layout run the Triton template (logged once per layout when not)."""
    import logging
    import os

    choice = os.environ.get("KVQ_APPEND", "triton")
    if choice not in ("triton", "inductor"):
        raise ValueError(f"KVQ_APPEND={choice!r}: use 'triton' (the template) or 'inductor' (compiled torch)")
    if choice == "inductor":
        return False
    from .templates.quantize_append import supported

    cfg, geo, spec, _ = _decode_layout(layout)
    why = supported(cfg, spec, geo)
    if why:
        logging.getLogger("kvq_compile").info("kvq append: Inductor-compiled torch instead of the template (%s)", why)
    return why is None


@append.register_fake
def _append_fake(store, key, value, positions, cos, sin, layout):
    return None


def attention_allowed(attn_mask, is_causal: bool, n: int, length: int, device):
    """(allowed bool [.., n, length], additive bias or None) as SDPA reads mask / is_causal, cut to length."""
    allowed = torch.ones(n, length, dtype=torch.bool, device=device)
    bias = None
    if attn_mask is not None:
        m = attn_mask[..., :length]
        if m.dtype == torch.bool:
            allowed = allowed & m
        else:
            bias = m.float()
            allowed = allowed & (bias > -math.inf)
    if is_causal:  # SDPA's is_causal aligns to the top-left corner of the (n x max_len) score matrix
        allowed = allowed & torch.ones(n, length, dtype=torch.bool, device=device).tril()
    return allowed, bias


def attend_reference(query, k_prefix, v_prefix, key, value, attn_mask, scale, is_causal, tau):
    """Attention of query over cat(prefix, chunk) (float32 math), GQA by head grouping."""
    k = torch.cat((k_prefix, key.float()), dim=2)
    v = torch.cat((v_prefix, value.float()), dim=2)
    rep = query.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    n, length = query.shape[2], k.shape[2]
    logits = (query.float() @ k.transpose(-1, -2)) * scale
    allowed, bias = attention_allowed(attn_mask, is_causal, n, length, query.device)
    if bias is not None:
        logits = logits + bias
    probs = ref.calibrated_softmax(logits, allowed.expand_as(logits), tau)
    return (probs @ v).to(query.dtype)


def attend_cpu_reference(query, store, key, value, positions, attn_mask, scale, is_causal, layout):
    cfg, geo, spec, names = _decode_layout(layout)
    p0, n = st.positions_span(positions)
    kp, vp = st.read(_bufs(store, names), cfg, spec, geo.head_dim, p0 + n, p0)
    tau = cfg.softmax_tau if p0 > 0 else None  # an empty prefix is exact attention on the chunk
    return attend_reference(query, kp, vp, key, value, attn_mask, scale, is_causal, tau)


def attend_chunk(query, store, key, value, positions, attn_mask, scale, is_causal, layout):
    """A chunk of several query tokens (prefill, or a later chunk of a chunked prefill / next turn) through
    torch's SDPA (GQA without repeat_kv; the reference's [n, L] float32 score matrix of a 32 x 4096 prefill would
    need 68 GB; which SDPA kernel runs, and whether it forms scores, is torch's choice for the mask and GQA).
    An empty store: exact attention over the chunk itself. Otherwise the stored prefix [0, p0)
    is dequantized (`store.read`) into the query dtype and concatenated with the exact chunk, under the mask
    `attention_allowed` builds (the reference's semantics). A fully masked row gives 0, as in the reference.
    CalibQuant's calibrated softmax needs each row's score range, so those configs take the reference path."""
    p0, n = st.positions_span(positions)
    if p0 == 0:
        mask = None if attn_mask is None else attn_mask[..., :n]
        out = torch.nn.functional.scaled_dot_product_attention(query, key.to(query.dtype), value.to(query.dtype),
                                                               attn_mask=mask, is_causal=is_causal, scale=scale,
                                                               enable_gqa=True)
        if mask is not None:
            allowed, _ = attention_allowed(mask, is_causal, query.shape[2], n, query.device)
            out = torch.where(allowed.any(-1, keepdim=True), out, 0.0)
        return out.contiguous()  # the op's fake returns a contiguous tensor; SDPA may not
    cfg, geo, spec, names = _decode_layout(layout)
    if cfg.softmax_tau is not None:
        return attend_cpu_reference(query, store, key, value, positions, attn_mask, scale, is_causal, layout)
    dt = query.dtype
    kp, vp = st.read(_bufs(store, names), cfg, spec, geo.head_dim, p0 + n, p0)
    k = torch.cat((kp.to(dt), key.to(dt)), dim=2)
    v = torch.cat((vp.to(dt), value.to(dt)), dim=2)
    if attn_mask is None and not is_causal:  # every stored position and the whole chunk: no mask at all
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, scale=scale, enable_gqa=True)
        return out.contiguous()
    allowed, bias = attention_allowed(attn_mask, is_causal, n, p0 + n, query.device)
    if bias is not None:  # finite float32 biases stay finite in the query dtype (float32's min is -inf in bf16)
        bias = bias.clamp_min(torch.finfo(dt).min).masked_fill(~allowed, -math.inf).to(dt)
    out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=allowed if bias is None else bias,
                                                           scale=scale, enable_gqa=True)
    return torch.where(allowed.any(-1, keepdim=True), out, 0.0).contiguous()


@torch.library.custom_op("kvq::attend", mutates_args=())
def attend(query: torch.Tensor, store: list[torch.Tensor], key: torch.Tensor, value: torch.Tensor,
           positions: torch.Tensor, attn_mask: torch.Tensor | None, scale: float, is_causal: bool,
           layout: str) -> torch.Tensor:
    if query.shape[2] > 1:
        return attend_chunk(query, store, key, value, positions, attn_mask, scale, is_causal, layout)
    return attend_cpu_reference(query, store, key, value, positions, attn_mask, scale, is_causal, layout)


@torch.library.custom_op("kvq::attend_chunk", mutates_args=(), tags=_CHUNK_TAGS)
def attend_chunk_op(query: torch.Tensor, store: list[torch.Tensor], key: torch.Tensor, value: torch.Tensor,
                    positions: torch.Tensor, attn_mask: torch.Tensor | None, scale: float, is_causal: bool,
                    layout: str) -> torch.Tensor:
    return attend(query, store, key, value, positions, attn_mask, scale, is_causal, layout)


@attend.register_fake
def _attend_fake(query, store, key, value, positions, attn_mask, scale, is_causal, layout):
    return query.new_empty(*query.shape[:-1], value.shape[-1])


attend_chunk_op.register_fake(_attend_fake)


@functools.lru_cache(maxsize=512)
def _append_attend_layout(layout: str):
    """(cfg, geo, spec, names, append names) of a kvq::append_attend layout: the append's names are the attention's
    less the codes shared from an earlier layer (XQuant), which the append of this layer must not write."""
    cfg, geo, spec, names = _decode_layout(layout)
    if cfg.keys_before_rope:
        raise ValueError("kvq::append_attend: Keys stored before RoPE append the unrotated key (kvq::append, "
                         "kvq::attend)")
    shared = {f"{side}.codes" for side, src in (("k", spec.share_key_codes_from), ("v", spec.share_value_codes_from))
              if src is not None}
    return cfg, geo, spec, names, tuple(n for n in names if n not in shared)


def _append_attend_bufs(query, store, key, layout):
    """(cfg, geo, spec, the attention's buffers by name, the append's) of one kvq::append_attend call."""
    if query.shape[2] != 1 or key.shape[2] != 1:
        raise ValueError(f"kvq::append_attend takes one decode token per sequence, got query "
                         f"{tuple(query.shape)} and key {tuple(key.shape)}")
    cfg, geo, spec, names, append_names = _append_attend_layout(layout)
    bufs = _bufs(store, names)
    return cfg, geo, spec, bufs, {n: bufs[n] for n in append_names}


@torch.library.custom_op("kvq::append_attend", mutates_args=("store",))
def append_attend(query: torch.Tensor, store: list[torch.Tensor], key: torch.Tensor, value: torch.Tensor,
                  positions: torch.Tensor, attn_mask: torch.Tensor | None, scale: float, is_causal: bool,
                  layout: str) -> torch.Tensor:
    cfg, geo, spec, _, abufs = _append_attend_bufs(query, store, key, layout)
    _refuse_decode(geo, positions, abufs)
    st.append_decode(abufs, cfg, spec, geo, key, value, positions)
    return attend_cpu_reference(query, store, key, value, positions, attn_mask, scale, is_causal, layout)


@append_attend.register_fake
def _append_attend_fake(query, store, key, value, positions, attn_mask, scale, is_causal, layout):
    return query.new_empty(*query.shape[:-1], value.shape[-1])


_COMPILED_APPENDS: dict = {}  # (quantizers, geometry, buffer names) -> function; lru_cache maps layouts to it


@functools.lru_cache(maxsize=None)
def compiled_decode_append(layout: str, compile: bool | None = None):
    """`store.append_decode` for one layer layout, compiled by Inductor (one decode append is ~100 small torch
    ops; compiled, a few fused kernels) with eager float32 rounding (`compat.eager_numerics_options`: codes are
    a rounding of float32 math, and a fused multiply-add or an approximate division moves values that sit
    near a tie between two levels to the other level). Layers with equal quantizers share one function. Each
    function gets its own code object, so Dynamo's recompile limit applies per layout, not to all of them
    together. KVQ_COMPILE_APPEND=0 (or compile=False) returns the plain function."""
    import os

    cfg, geo, spec, names = _decode_layout(layout)
    if compile is None:
        compile = os.environ.get("KVQ_COMPILE_APPEND", "1") == "1"
    key = (cfg.to_json(), repr(spec.key), repr(spec.value), geo, names, compile)
    fn = _COMPILED_APPENDS.get(key)
    if fn is None:
        fn = _COMPILED_APPENDS[key] = decode_append_function(
            cfg, spec, geo, f"kvq_decode_append_{len(_COMPILED_APPENDS)}",
            compat.eager_numerics_options() if compile else None)
    return fn


def decode_append_function(cfg, spec, geo, name: str, options: dict | None):
    """(bufs, key, value, positions, cos, sin) -> `store.append_decode` for one layer's quantizers, as a function
    with a code object of its own named `name` (Dynamo caches compiled code and counts recompiles per code
    object), compiled by Inductor (fullgraph, static shapes) with `options`, or plain where options is None."""
    import types

    def run(bufs, key, value, positions, cos, sin, cfg=cfg, spec=spec, geo=geo):
        st.append_decode(bufs, cfg, spec, geo, key, value, positions, cos, sin)

    code = run.__code__.replace(co_name=name)
    run = types.FunctionType(code, run.__globals__, code.co_name, run.__defaults__, run.__closure__)
    return run if options is None else torch.compile(run, fullgraph=True, dynamic=False, options=options)


@torch.library.custom_op("kvq::grouped_linear", mutates_args=())
def grouped_linear(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """[x @ W^T for W in weights] (torch's linear without bias): the reference, one linear per weight."""
    return [torch.nn.functional.linear(x, w) for w in weights]


@grouped_linear.register_fake
def _grouped_linear_fake(x, weights):
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]


def _grouped_linear_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], *inputs[1])


def _grouped_linear_backward(ctx, grads):
    """The linears' backward: dx = sum_g dy_g W_g, dW_g = dy_g^T x (over the leading dimensions)."""
    x, *weights = ctx.saved_tensors
    dx = None
    dws = []
    for w, dy in zip(weights, grads):
        if dy is None:
            dws.append(None)
            continue
        part = dy @ w
        dx = part if dx is None else dx + part
        dws.append(dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1]))
    return (torch.zeros_like(x) if dx is None else dx), dws


grouped_linear.register_autograd(_grouped_linear_backward, setup_context=_grouped_linear_setup)


def grouped_launch_fits(x: torch.Tensor, weights) -> bool:
    """Whether `templates/grouped_linear.py` takes these (else one linear per weight): a decode step's few rows,
    fp16 or bf16 throughout, the weights contiguous and x unit-stride along K, one device."""
    from .templates import grouped_linear as gt

    rows = x.numel() // max(x.shape[-1], 1)
    return (0 < rows <= gt.MAX_ROWS and 1 <= len(weights) <= gt.MAX_GROUP
            and all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in (x, *weights))
            and x.dtype in (torch.float16, torch.bfloat16) and x.stride(-1) == 1
            and all(w.dtype == x.dtype and w.dim() == 2 and w.is_contiguous() and w.shape[1] == x.shape[-1]
                    and w.device == x.device for w in weights))


def _register_gpu_kernels() -> None:
    """On CUDA, decode steps (one query token) run the decode template, chunks over a stored prefix the fused
    prefill template or SDPA over the dequantized prefix (`_prefill_choice`), first chunks SDPA (the function
    `attend_chunk`, not the op kvq::attend_chunk).
    Without Triton the ops still run, on their reference kernels, with a warning."""
    import os
    import warnings

    if not torch.cuda.is_available() or os.environ.get("KVQ_REFERENCE_KERNELS") == "1":
        return
    try:
        from .templates.decode_attention import decode_attention
    except Exception as e:  # noqa: BLE001  (triton missing or broken)
        warnings.warn(f"kvq: Triton decode attention unavailable ({type(e).__name__}: {e}); "
                      "kvq ops run their reference kernels (slow, and not CUDA-graph safe)")
        return
    try:
        from .templates.prefill_attention import prefill_attention
    except Exception as e:  # noqa: BLE001  (only the opt-in prefill path is lost)
        warnings.warn(f"kvq: Triton prefill attention unavailable ({type(e).__name__}: {e}); chunks run SDPA")
        prefill_attention = None

    from .templates import grouped_linear as gt

    @grouped_linear.register_kernel("cuda")
    def _grouped_linear_cuda(x, weights):
        if not grouped_launch_fits(x, weights):
            return [torch.nn.functional.linear(x, w) for w in weights]
        x2 = x.reshape(-1, x.shape[-1])
        outs = [x.new_empty((x2.shape[0], w.shape[0])) for w in weights]
        gt.launch(x2, weights, outs)
        return [y.view(*x.shape[:-1], y.shape[1]) for y in outs]

    @append.register_kernel("cuda")
    def _append_cuda(store, key, value, positions, cos, sin, layout):
        _append_impl(store, key, value, positions, cos, sin, layout, compiled=True)

    @attend_chunk_op.register_kernel("cuda")
    @attend.register_kernel("cuda")
    def _attend_cuda(query, store, key, value, positions, attn_mask, scale, is_causal, layout):
        chunk = query.shape[2] != 1  # a chunk: SDPA (`attend_chunk`), or the fused template over a stored prefix
        if chunk and not (prefill_attention and st.positions_span(positions)[0]
                          and _prefill_choice(query.shape[2], layout) == "triton"):
            return attend_chunk(query, store, key, value, positions, attn_mask, scale, is_causal, layout)
        cfg, geo, spec, names = _decode_layout(layout)
        if chunk:
            return prefill_attention(query, _bufs(store, names), key, value, positions, attn_mask, scale, is_causal,
                                     cfg, spec, geo)
        return decode_attention(query, _bufs(store, names), key, value, positions, attn_mask, scale, is_causal,
                                cfg, spec, geo)

    @append_attend.register_kernel("cuda")
    def _append_attend_cuda(query, store, key, value, positions, attn_mask, scale, is_causal, layout):
        cfg, geo, spec, bufs, abufs = _append_attend_bufs(query, store, key, layout)
        _assert_in_store(geo, positions, layout, abufs)
        append = None
        if _triton_append(layout):   # handed to the attention: beside it where it reads nothing the append writes
            from .templates.quantize_append import append_decode

            def append(**launch):
                append_decode(abufs, cfg, spec, geo, key, value, positions, None, None, **launch)
        else:
            compiled_decode_append(layout)(abufs, key, value, positions, None, None)
        return decode_attention(query, bufs, key, value, positions, attn_mask, scale, is_causal, cfg, spec, geo,
                                append=append)


_register_gpu_kernels()
