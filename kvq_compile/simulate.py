"""An independent simulation of what the store holds: from the full fp16 history, rebuild the quantized
view of every position directly with the reference math, without the store's ring buffer, flush logic
or packing. Tests use it to show that the store and the ops add no error beyond the quantization itself.
"""
from __future__ import annotations

import torch

from . import reference as ref
from .config import Axis, KVQConfig, QuantizerSpec
from .store import (attended, fill_boundary, neutralized, seat, seated_mask, seating, statistics_start,
                    statistics_tokens)




def quantized_view(history: torch.Tensor, q: QuantizerSpec, cfg: KVQConfig, length: int, first_chunk: int,
                   codes_from: torch.Tensor | None = None, levels: torch.Tensor | None = None,
                   is_key: bool = False, valid: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [B, H, length, D]: positions as attention reads them when `length` tokens are stored.

    history: [B, H, >=length, D] every token ever appended, in the cache dtype.
    first_chunk: size of the first append (static per-channel ranges and key norms come from it; the simulation
        takes a prefill in one piece, which a chunked prefill within the recent window matches: `store.append_side`).
    codes_from: for XQuant sharing, the source layer's history: its codes, this layer's ranges.
    valid: [B or 1, first_chunk] bool, the first chunk's real tokens in slot order (pads neutralized in `history`):
        the static ranges' percentiles leave the others out, as the append does (`store.append_side`).
    """
    x = history[:, :, :length]
    if codes_from is not None and q.axis is Axis.CHANNEL and q.group_size is None:
        raise NotImplementedError("simulating shared codes with static per-channel ranges")
    if not q.quantized:
        return x.float()
    dt = history.dtype
    S, G = cfg.sink, q.tokens_per_group
    levels = ref.levels_for(q, device=x.device) if levels is None else levels.to(x.device)
    bnd = fill_boundary(length, S, cfg.recent, G)
    out = x.float().clone()
    if bnd <= S:
        return out
    first = statistics_start(S, first_chunk, valid is not None)
    body = history[:, :, first:first_chunk]
    stat_valid = None if valid is None else valid[..., first:first_chunk]
    alone = None   # rows with fewer than 2 real tokens past the sink: statistics over all (`store.statistics_tokens`)
    if valid is not None and first:
        stat_tokens, alone = statistics_tokens(valid[..., :first_chunk].expand(x.shape[0], first_chunk), first)
        if bool(alone.any()):
            body, stat_valid = history[:, :, :first_chunk], stat_tokens
        else:
            alone = None
    norm = None
    if is_key and cfg.key_norm:
        norm = ref.key_norm(body if alone is None else history[:, :, first:first_chunk])
        if alone is not None:
            norm = torch.where(alone[:, None, None, None], ref.key_norm(body), norm)
    static = None
    if q.axis is Axis.CHANNEL and q.group_size is None:
        static = ref.static_channel_range(body.float() / norm if norm is not None else body, q, dt, cfg.eta_for(q),
                                          None if stat_valid is None else stat_valid[:, None, :, None])

    def deq(block, src_block):
        blk = block.to(dt)
        blk = blk.float() / norm if norm is not None else blk
        qb = ref.quantize_block(blk, q, levels, dt, cfg.eta_for(q), static)
        if src_block is not None:  # XQuant: the source layer's codes with this layer's ranges
            sb = src_block.to(dt)
            qb.codes = ref.quantize_block(sb, q, levels, dt, cfg.eta_for(q), None).codes
        y = ref.dequantize_block(qb, q, levels)
        return y * norm if norm is not None else y

    step = G
    for s in range(S, bnd, step):
        src = None if codes_from is None else codes_from[:, :, s:s + step]
        out[:, :, s:s + step] = deq(history[:, :, s:s + step], src)
    return out


class HFSimulation:
    """Runs a HuggingFace model eagerly, with each decode step attending over the simulated quantized view
    of the static cache (`quantized_view`) instead of the kvq store: the pure-torch "dequantize, then
    attend" that a compiled kvq_backend run must reproduce. The prefill is plain SDPA, as in `generate`.

    Keys stored before RoPE are un-rotated with the positions the backend infers for the prefix
    (each slot's position = the current position minus its distance), so padding slots match too.
    """

    NAME = "kvq_simulation"

    def __init__(self, model, cfg: KVQConfig):
        self.model, self.cfg = model, cfg
        self.specs = cfg.resolve(model.config.num_hidden_layers)
        self.cache = None
        self.first_chunk = 0

    def generate(self, input_ids, attention_mask=None, max_new_tokens=8, **kwargs):
        from transformers import AttentionInterface, StaticCache
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        AttentionInterface.register(self.NAME, self._attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(self.NAME, sdpa_mask)
        self.cache = StaticCache(config=self.model.config, max_cache_len=input_ids.shape[1] + max_new_tokens)
        self.first_chunk = input_ids.shape[1]
        previous = self.model.config._attn_implementation
        self.model.config._attn_implementation = self.NAME
        try:
            # eager: on accelerators generate() compiles static-cache decoding by default, and the simulation
            # (host-side lengths, torch.quantile) is a reference, not a compile target
            kwargs.setdefault("disable_compile", True)
            return self.model.generate(input_ids, attention_mask=attention_mask, past_key_values=self.cache,
                                       max_new_tokens=max_new_tokens, **kwargs)
        finally:
            self.model.config._attn_implementation = previous

    def _history(self, i, length, position_ids, keep=None, seats=None):
        """(keys, values, RoPE's (cos, sin) or None) of layer i's first `length` positions as the store holds
        them: keys un-rotated where stored before RoPE; the prompt seated (`store.seating`, `seats` [B, n]) and its
        pads `neutralized` where the layer quantizes (`keep` [B, n], in the seats' order), as the backend absorbs
        an eager prefill."""
        layer = self.cache.layers[i]
        k, v, rope = layer.keys[:, :, :length], layer.values[:, :, :length], None
        if self.cfg.keys_before_rope:
            pos = position_ids[:, -1:] - (length - 1) + torch.arange(length, device=k.device)
            rope = self.model.model.rotary_emb(k, pos)
            k = ref.rope_unrotate(k.float(), rope[0].float(), rope[1].float()).to(k.dtype)
        n = self.first_chunk

        def prompt(x, f, dim):   # f applied to the prompt's tokens along `dim`
            head = f(x.narrow(dim, 0, n))
            return torch.cat([head, x.narrow(dim, n, x.shape[dim] - n)], dim)

        if seats is not None:
            k, v = prompt(k, lambda x: seat(x, seats, 2), 2), prompt(v, lambda x: seat(x, seats, 2), 2)
            if rope is not None:
                rope = tuple(prompt(c, lambda x: seat(x, seats, 1), 1) for c in rope)
        spec = self.specs[i]
        if keep is not None and (spec.key.quantized or spec.value.quantized):
            k = prompt(k, lambda x: neutralized(keep, x)[0], 2)
            v = prompt(v, lambda x: neutralized(keep, x)[0], 2)
        return k, v, rope

    def _attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        from .ops import attend_reference

        i = module.layer_idx
        length = int(self.cache.layers[i].cumulative_length)
        n = query.shape[2]
        p0 = length - n
        if p0 == 0:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        spec, cfg = self.specs[i], self.cfg
        pid = kwargs["position_ids"]
        keep = seats = None
        if attention_mask is not None:   # the step's query attends every real token of the prompt
            keep = attended(attention_mask, torch.arange(self.first_chunk, device=query.device))
        if keep is not None:
            keep = keep.expand(query.shape[0], -1)
            if cfg.sink > 0 and not bool(keep.all()):
                seats = seating(keep, cfg.sink)
                keep = keep.gather(-1, seats)
                attention_mask = seated_mask(attention_mask, seats)
        kh, vh, rope = self._history(i, length, pid, keep, seats)
        src_k = src_v = None
        if spec.share_key_codes_from is not None:
            src_k = self._history(spec.share_key_codes_from, length, pid, keep, seats)[0]
        if spec.share_value_codes_from is not None:
            src_v = self._history(spec.share_value_codes_from, length, pid, keep, seats)[1]
        dev = kh.device
        lk = ref.levels_for(spec.key, cfg.codebooks.get(f"{i}.key"), dev) if spec.key.quantized else None
        lv = ref.levels_for(spec.value, cfg.codebooks.get(f"{i}.value"), dev) if spec.value.quantized else None
        kq = quantized_view(kh, spec.key, cfg, length, self.first_chunk, src_k, lk, is_key=True, valid=keep)[:, :, :p0]
        vq = quantized_view(vh, spec.value, cfg, length, self.first_chunk, src_v, lv, valid=keep)[:, :, :p0]
        if rope is not None:
            kq = ref.rope_rotate(kq, rope[0][:, :p0].float(), rope[1][:, :p0].float())
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = attend_reference(query, kq, vq, key[:, :, p0:length], value[:, :, p0:length], attention_mask,
                               scale, False, cfg.softmax_tau)
        return out.transpose(1, 2).contiguous(), None
