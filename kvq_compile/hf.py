"""`KVQCache`: a HuggingFace `Cache` that holds only the packed kvq store, never an fp16 copy.

    cache = KVQCache(model, "kivi-2", batch_size=1, max_cache_len=4096)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=256)                      # eager
    out = model.generate(ids, past_key_values=cache, compile_config=CompileConfig(fullgraph=True))  # compiled

Which path saves what:
- `kvq_backend` with `cache_implementation="static"` keeps the user's model and cache untouched: HF allocates
  its fp16 static cache and runs the prefill eagerly into it; the first compiled step absorbs that prefix into
  the store and re-points the fp16 tensors at a zero-stride storage. The peak therefore includes the fp16
  cache once, during prefill; the steady state holds only the store.
- `KVQCache` never allocates fp16 K/V: prefill and every decode step append to the store through
  `kvq::append` and attend through `kvq::attend` (chunks through their cudagraph-unsafe twins, `ops.chunk_ops`;
  the same ops the backend's rewrite emits), so the whole
  `generate` peaks at the store's size plus one chunk's activations. It binds itself to the model's attention
  modules and switches the model to the "kvq" attention implementation (registered with transformers'
  AttentionInterface); a module not served by a KVQCache in the current forward falls back to SDPA.

`cache.update` only assigns positions; the attention function appends the chunk and attends, because it is
also where the position ids (needed to un-rotate keys stored before RoPE) are known. A decode step whose attention
reads nothing its append writes (`store.attention_independent`, Keys stored after RoPE) calls the pair as one
`kvq::append_attend`, as `kvq_backend` emits it: on CUDA its kernel launches the append beside the attention
(`append_beside`, below).
"""
from __future__ import annotations

import weakref

import torch

from . import ops
from . import reference as ref
from . import store as st
from .config import KVQConfig

ATTN_NAME = "kvq"

try:  # transformers is a declared dependency, but keep `import kvq_compile` working without it
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError:  # pragma: no cover
    Cache, CacheLayerMixin = object, object


class _Slot:
    """What an attention module knows of the KVQCache layer bound to it (`_bind`), held strongly by the module: a
    weak reference to the layer (a module does not keep a dropped cache alive) and `pending`, the positions of the
    chunk that the layer's `update` announced to the attention function of the same forward (None: attend through
    SDPA). `kvq_attention` takes `pending` off the slot first and follows the weak reference only when it was set
    (the layer is then the one this forward updated, alive; a dead one falls back to SDPA). Read through the weak
    reference (before session 55), a forward compiled for another cache guarded on the dropped layer's `pending`;
    a layer freed by the cyclic collector while that graph compiled failed the guard's creation (once in a CPU
    test run)."""

    def __init__(self):
        self.layer: weakref.ref | None = None
        self.pending: torch.Tensor | None = None
        self.config = None   # the module's config: its attention implementation must stay "kvq" (`KVQLayer.update`)

    def __deepcopy__(self, memo):   # a copied model's modules share the slot, as they shared the weak reference
        return self

    def __copy__(self):
        return self


class KVQLayer(CacheLayerMixin):
    """One attention layer's view of the store. `slot.pending` carries the positions of the chunk that `update`
    announced to the attention function of the same forward (`_Slot`: its attention module's, once bound; a plain
    attribute of the slot, not a property of the layer: torch 2.11's Dynamo did not carry a property's store to
    the slot, and compiled KVQCache forwards attended through SDPA, session 55)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, layer: st.LayerStore, max_cache_len: int, device, rotary=None, append_beside: bool = False,
                 seats: torch.Tensor | None = None):
        super().__init__()
        self.store, self.max_cache_len, self.rotary = layer, max_cache_len, rotary
        self.bound = True   # False once a later KVQCache took the model's attention modules (`_bind`)
        # decode steps as one kvq::append_attend: only where the attention reads nothing the append writes and the
        # Keys are stored after RoPE (the op appends the rotated key; `ops._append_attend_layout`)
        self.append_beside = append_beside and rotary is None and st.attention_independent(layer.cfg)
        self.cumulative_length = torch.zeros((), dtype=torch.int64, device=device)
        self.slot = _Slot()   # its attention module's, once bound (`_bind`)
        # the store's [B, T] slot -> mask column buffer (`ModelStore.seats`, shared by the layers, one address: CUDA
        # graphs keep it), read by later masks once an eager first chunk with masked tokens seated its rows
        # (`seat_rows`) or a later chunk filled a row's sink where it held pads (`store.seat_fresh_rows`)
        self.seat_buffer = seats
        self.seats: torch.Tensor | None = None
        self.append_names, self.append_tensors = layer.append_tensors()
        self.attend_names, self.attend_tensors = layer.attend_tensors()
        self.fused_names, self.fused_tensors = layer.attend_tensors(control=True)   # kvq::append_attend's
        self.append_layout = layer.descriptor(self.append_names)
        self.attend_layout = layer.descriptor(self.attend_names)
        self.fused_layout = layer.descriptor(self.fused_names)
        self.batch_size, self.num_heads = layer.geo.batch, layer.geo.heads
        self.dtype, self.device = layer.geo.torch_dtype, device
        self.is_initialized = True
        if not torch.compiler.is_compiling():
            for t in (*self.fused_tensors, self.cumulative_length):
                torch._dynamo.mark_static_address(t)

    def lazy_initialization(self, key_states, value_states) -> None:  # allocated up front
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        if not self.bound:
            raise ValueError("this KVQCache no longer serves the model: a later KVQCache(model, ...) took its "
                             "attention modules; build this cache again, or generate with the later one")
        impl = getattr(self.slot.config, "_attn_implementation", ATTN_NAME)
        if impl != ATTN_NAME:   # its attention would get this chunk alone from update, not the cache's tokens
            raise ValueError(f"the model's attention implementation is now {impl!r}, not KVQCache's {ATTN_NAME!r} "
                             "(set_attn_implementation after the cache was built?): build the KVQCache again")
        geo = self.store.geo
        if tuple(key_states.shape[:2]) != (self.batch_size, self.num_heads) or key_states.shape[-1] != geo.head_dim:
            raise ValueError(f"KVQCache was sized for batch {self.batch_size}, {self.num_heads} KV heads, head_dim "
                             f"{geo.head_dim}; got key states of shape {tuple(key_states.shape)} (num_beams "
                             "and num_return_sequences multiply generate's batch; beam search is not supported)")
        if self.store.layer_index == 0 and not torch.compiler.is_compiling():
            # eager (prefill, chunks, uncompiled steps): checked on the host before anything is written (compiled
            # chunks by their append too, `ops._append_impl`)
            filled = int(self.cumulative_length)
            if filled + n > self.max_cache_len:
                raise ValueError(f"KVQCache holds {self.max_cache_len} positions: {filled} are filled, cannot "
                                 f"append {n} more; size max_cache_len for the prompt plus max_new_tokens")
        elif self.store.layer_index == 0 and n == 1 and key_states.is_cuda:
            # compiled CUDA decode steps: a host read would break the graph (and CUDA graphs), so the check is an
            # assertion on the device (Inductor's tl.device_assert, kept by CUDA graphs; active while Inductor
            # compiles Triton with debug asserts, its default assert_indirect_indexing, not on ROCm); a failed one
            # ends the process's CUDA context, as an out-of-range index does in torch. Compiled chunks, and decode
            # tokens on the CPU, are refused by their append (`ops._refuse_overflow`)
            torch._assert_async(self.cumulative_length + n <= self.max_cache_len,
                                f"KVQCache holds {self.max_cache_len} positions: cannot append {n} more; size "
                                "max_cache_len for the prompt plus max_new_tokens")
        self.slot.pending = torch.arange(n, device=key_states.device) + self.cumulative_length
        self.cumulative_length.add_(n)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self):
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        for name, t in zip(self.append_names, self.append_tensors):
            if not name.endswith("levels"):  # codebooks are configuration, not state
                t.zero_()
        self.cumulative_length.zero_()
        self.slot.pending = None
        self.seats = None
        if self.seat_buffer is not None:   # the identity again: a compiled later chunk reads masks through it
            self.seat_buffer.copy_(torch.arange(self.seat_buffer.shape[1], device=self.seat_buffer.device))

    def seat_rows(self, attention_mask, positions, key, value, cos, sin, neutralize: bool = True):
        """The first chunk's tokens seated per row (`store.seating`: its first `sink` real tokens, its pads, its
        other real tokens), pads `neutralized` (where `neutralize`: a layer that quantizes something), so that a
        left-padded row's sink holds its first real tokens and its recent window no pads; `self.seats` records the
        order for later steps' masks (`append_and_attend`). Only where the chunk has masked tokens (else `seats`
        stays None)."""
        keep = st.attended(attention_mask, positions)
        if keep is None or bool(keep.all()) or self.seat_buffer is None:
            return key, value, cos, sin
        keep = keep.expand(key.shape[0], -1)
        seats = st.seating(keep, self.store.cfg.sink)
        n = seats.shape[1]
        self.seat_buffer[:, :n] = seats
        self.seat_buffer[:, n:] = torch.arange(n, self.seat_buffer.shape[1], device=seats.device)
        self.seats = self.seat_buffer
        # keys stored before RoPE: each slot's table row goes with its token
        return st.seated_chunk(keep, seats, key, value, cos, sin, neutralize)

    def append_and_attend(self, query, key, value, positions, attention_mask, scale, is_causal, position_ids):
        """positions: what `update` announced (`kvq_attention` took them off the slot); attention_mask: as the model
        made it (slot order); read through `seats` here."""
        cos = sin = None
        stored_key = key
        if self.rotary is not None:
            if position_ids is None:
                raise ValueError("KVQCache with keys_before_rope needs the model to pass position_ids to attention")
            cos, sin = self.rotary(value, position_ids)
            stored_key = ref.rope_unrotate(key.float(), cos.float(), sin.float()).to(key.dtype)
        mask = st.seated_mask(attention_mask, self.seats)   # (an eager first chunk: no seats yet)
        if self.append_beside and query.shape[2] == 1:
            return torch.ops.kvq.append_attend(query, self.fused_tensors, key, value, positions, mask,
                                               scale, is_causal, self.fused_layout)
        append, attend = ops.chunk_ops(query.shape[2])
        stored_value = value
        quantized = self.store.spec.key.quantized or self.store.spec.value.quantized
        slot_mask = mask   # the mask in the order the append stores the chunk (a seated first chunk: seated)
        if query.shape[2] > 1 and attention_mask is not None:
            # every layer is seated (their masks are read through the seats, and the RoPE table is shared); only
            # those that quantize something neutralize their pads
            sink = self.store.cfg.sink > 0 and self.seat_buffer is not None
            if sink and torch.compiler.is_compiling() and attention_mask.dim() == 4:
                # a compiled chunk, as kvq_backend's (`kvq::seat_chunk`: seats a first chunk, reads its start
                # position on the host as chunks do); later steps read their masks through the buffer
                chunk, read = torch.ops.kvq.seat_chunk(self.seat_buffer, attention_mask, positions,
                                                       self.store.cfg.sink)
                stored_key, stored_value, cos, sin = st.seated_chunk(st.attended(attention_mask, positions), chunk,
                                                                     stored_key, stored_value, cos, sin, quantized)
                mask = st.seated_mask(attention_mask, read)
                slot_mask = st.seated_mask(mask, chunk)   # a first chunk's own columns seated (read: identity)
                self.seats = self.seat_buffer
            elif sink and not torch.compiler.is_compiling() and int(positions[0]) == 0:
                stored_key, stored_value, cos, sin = self.seat_rows(attention_mask, positions, stored_key,
                                                                    stored_value, cos, sin, quantized)
                slot_mask = st.seated_mask(attention_mask, self.seats)   # (seated where seat_rows set the seats)
            else:
                if sink and attention_mask.dim() == 4 and attention_mask.shape[-1] == self.seat_buffer.shape[1]:
                    # an eager later chunk: rows whose sink holds pads take its first real tokens past the sink there
                    # (`store.seat_fresh_rows`); this chunk's mask is read as before
                    read = st.seat_fresh_rows(self.seat_buffer, attention_mask, int(positions[0]),
                                              positions.shape[0], self.store.cfg.sink)
                    if self.seats is not None or not torch.equal(read, self.seat_buffer):
                        mask = slot_mask = st.seated_mask(attention_mask, read)
                        self.seats = self.seat_buffer
                if quantized:
                    stored_key, stored_value = st.neutralize_pads(attention_mask, positions, stored_key, value)
            # a chunk: which slots its last query attends (slot order), for the first-chunk statistics and the
            # sink slots of rows that held pads there (`append_side`, `store.sink_fill`)
        attended = (st.attended_slots(slot_mask) if quantized or self.store.cfg.sink else None,) \
            if query.shape[2] > 1 else ()
        append(self.append_tensors, stored_key, stored_value, positions, cos, sin, self.append_layout, *attended)
        return attend(query, self.attend_tensors, key, value, positions, mask, scale, is_causal,
                      self.attend_layout)


class KVQCache(Cache):
    """A compileable HF cache backed by a packed `store.ModelStore` (see the module docstring).

    model:         a transformers decoder whose attention modules carry `layer_idx` (Llama, Mistral, Qwen...)
    cfg:           a KVQConfig or a preset name
    batch_size:    rows of the batch it will serve (one sequence a row: no beam search); max_cache_len: prompt + new
                   tokens, at most (steps that would append past it raise; compiled CUDA decode steps fail a
                   device assertion)
    append_beside: decode steps call one kvq::append_attend where the layer's attention reads nothing its append
                   writes (the pair otherwise). None (default): on CUDA, unless KVQ_APPEND_BESIDE=0 or Inductor's
                   global config asks for max_autotune (`lowering.beside_by_default`); a
                   `CompileConfig(mode="max-autotune")` is not visible from here: pass False to keep kvq::attend
                   and its lowering's autotuned choices. Results are the same either way (tests/test_hf_cache.py).
    """

    def __init__(self, model, cfg: KVQConfig | str, batch_size: int, max_cache_len: int, device=None, dtype=None,
                 append_beside: bool | None = None):
        cfg = KVQConfig.preset(cfg) if isinstance(cfg, str) else cfg
        conf = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        window = getattr(conf, "sliding_window", None)
        if window is not None and getattr(conf, "use_sliding_window", True) and window < max_cache_len:
            raise ValueError(f"KVQCache does not support sliding-window attention (window {window} < max_cache_len "
                             f"{max_cache_len}); use the model's own cache, or max_cache_len <= {window}")
        if getattr(conf, "attn_logit_softcapping", None) is not None:
            raise ValueError(f"KVQCache does not implement attention logit softcapping (attn_logit_softcapping="
                             f"{conf.attn_logit_softcapping}); use the model's own cache")
        if getattr(conf, "is_encoder_decoder", False):
            raise ValueError("KVQCache serves decoder-only models; encoder-decoder caches are not supported")
        if batch_size < 1 or max_cache_len < 1:
            raise ValueError(f"KVQCache needs batch_size >= 1 and max_cache_len >= 1, got {batch_size} and "
                             f"{max_cache_len}")
        num_layers = conf.num_hidden_layers
        heads = getattr(conf, "num_key_value_heads", None) or conf.num_attention_heads
        head_dim = getattr(conf, "head_dim", None) or conf.hidden_size // conf.num_attention_heads
        device = _store_device(model, device)
        dtype = dtype or model.dtype
        geo = st.Geometry(batch_size, heads, max_cache_len, head_dim, st.dtype_name(dtype))
        self.cfg, self.model_store = cfg, st.ModelStore(cfg, num_layers, geo, device)
        rotary = None
        if cfg.keys_before_rope:
            rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
            if rotary is None:
                raise ValueError(f"config {cfg.name!r} stores keys before RoPE, but the model has no "
                                 "`model.rotary_emb` to recompute cos/sin; pick a post-RoPE config")
        if append_beside is None:   # kvq_backend's rule, without a compile's options
            from . import lowering

            append_beside = device.type == "cuda" and lowering.beside_by_default({})
        seats = self.model_store.seats
        if seats is not None:
            torch._dynamo.mark_static_address(seats)
        layers = [KVQLayer(layer, max_cache_len, device, rotary, append_beside, seats)
                  for layer in self.model_store.layers]
        super().__init__(layers=layers)
        _bind(model, self)
        if device.type == "cuda":  # compiled steps (CompileConfig) lower kvq::attend through Inductor
            from . import lowering

            lowering.register()
            lowering.install_cache_key_pass()


def _unsupported(what: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"KVQCache does not support {what}: its quantized groups cannot be reordered, "
                                  "repeated or cut back; use greedy or sampling decoding with one sequence per row")
    return method


for _name, _what in (("reorder_cache", "beam search (reorder_cache)"), ("crop", "crop"),
                     ("batch_repeat_interleave", "batch_repeat_interleave"),
                     ("batch_select_indices", "batch_select_indices")):
    setattr(KVQCache, _name, _unsupported(_what))


# Keyword arguments of HF attention functions that change the attention's math, which kvq_attention does not
# implement: Gemma-2's logit softcapping, gpt-oss's attention sinks. Given (not None), they raise.
UNSERVED_ATTENTION_ARGS = ("softcap", "s_aux")


def kvq_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The "kvq" attention implementation: append + attend through the store when a KVQCache announced
    this chunk, plain SDPA otherwise (another cache, or no cache)."""
    slot = module.__dict__.get("_kvq_slot")   # (`_Slot`: the weak reference followed only with a chunk pending)
    positions = None if slot is None else slot.pending
    if positions is not None:   # taken off first: a check below that raises leaves no stale announcement behind
        slot.pending = None
    layer = None if positions is None else slot.layer()
    if layer is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout and module.training:
        raise ValueError("KVQCache serves inference; attention dropout must be 0")
    unserved = {k: kwargs[k] for k in UNSERVED_ATTENTION_ARGS if kwargs.get(k) is not None}
    if unserved:
        raise ValueError(f"KVQCache's attention does not implement {', '.join(sorted(unserved))} (attention logit "
                         "softcapping, attention sinks): this model's attention cannot run over the quantized "
                         "store; use the model's own cache")
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[-1] != layer.max_cache_len:
        raise ValueError(f"attention mask covers {attention_mask.shape[-1]} positions, the KVQCache "
                         f"{layer.max_cache_len}; the model did not size its mask from the cache")
    n = query.shape[2]
    is_causal = attention_mask is None and n > 1 and getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = layer.append_and_attend(query, key, value, positions, attention_mask, float(scale), bool(is_causal),
                                  kwargs.get("position_ids"))
    return out.transpose(1, 2).contiguous(), None


def _attention_modules(model) -> list:
    """The model's attention modules (a layer index, a config and q / qkv projections), as `_bind` serves them."""
    return [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "config")
            and any(hasattr(m, p) for p in ("q_proj", "qkv_proj", "c_attn"))]


def _store_device(model, device) -> torch.device:
    """The one device of the model's attention modules' parameters (`device`, if given, must name it): the store,
    its RoPE table and its seats are single-device, so a model split across devices (`device_map`) is refused here
    rather than have a kernel read another device's store."""
    found = {p.device for m in _attention_modules(model) for p in m.parameters()}
    if len(found) > 1:
        raise ValueError(f"KVQCache: the model's attention layers lie on several devices ({sorted(map(str, found))}); "
                         "its store serves one device: load the model on one device")
    if device is None:
        return next(iter(found)) if found else model.device
    device = torch.device(device)
    if found:
        have = next(iter(found))
        if have.type != device.type or (None not in (have.index, device.index) and have.index != device.index):
            raise ValueError(f"KVQCache: device {device} given, but the model's attention layers are on {have}")
    return device


def _bind(model, cache: KVQCache) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_NAME, kvq_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
    modules = _attention_modules(model)
    for module in modules:   # every check before any module changes hands
        if module.layer_idx >= len(cache.layers):
            raise ValueError(f"attention module with layer_idx {module.layer_idx}, but the cache has "
                             f"{len(cache.layers)} layers")
    if len(modules) != len(cache.layers):
        raise ValueError(f"KVQCache found {len(modules)} attention modules with a layer_idx, expected "
                         f"{len(cache.layers)}")
    for module in modules:
        layer = cache.layers[module.layer_idx]
        slot = module.__dict__.setdefault("_kvq_slot", _Slot())
        previous = None if slot.layer is None else slot.layer()
        if previous is not None and previous is not layer:
            previous.bound = False   # an older cache of this model: its update now raises, not falls back
            previous.slot = _Slot()  # (and its reset leaves this module's slot alone)
        slot.layer, slot.pending, slot.config = weakref.ref(layer), None, module.config
        layer.slot = slot
    for conf in {id(c): c for c in (model.config, getattr(model.config, "get_text_config", lambda: None)())
                 if c is not None}.values():
        conf._attn_implementation = ATTN_NAME
