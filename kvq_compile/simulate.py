"""An independent simulation of what the store holds: from the full fp16 history, rebuild the quantized
view of every position directly with the reference math, without the store's ring buffer, flush logic
or packing. Tests use it to show that the store and the ops add no error beyond the quantization itself.
"""
from __future__ import annotations

import torch

from . import reference as ref
from .config import Axis, KVQConfig, Levels, QuantizerSpec, Symmetry
from .store import fill_boundary


def _eta(cfg: KVQConfig, q: QuantizerSpec) -> float:
    plain = q.symmetry is Symmetry.ASYMMETRIC and q.levels is Levels.UNIFORM
    return cfg.eta.get(q.bits, 0.0) if plain else 0.0


def quantized_view(history: torch.Tensor, q: QuantizerSpec, cfg: KVQConfig, length: int, first_chunk: int,
                   codes_from: torch.Tensor | None = None, levels: torch.Tensor | None = None,
                   is_key: bool = False) -> torch.Tensor:
    """float32 [B, H, length, D]: positions as attention reads them when `length` tokens are stored.

    history: [B, H, >=length, D] every token ever appended, in the cache dtype.
    first_chunk: size of the first append (static per-channel ranges and key norms come from it).
    codes_from: for XQuant sharing, the source layer's history: its codes, this layer's ranges.
    """
    x = history[:, :, :length]
    if codes_from is not None and q.axis is Axis.CHANNEL and q.group_size is None:
        raise NotImplementedError("simulating shared codes with static per-channel ranges")
    if not q.quantized:
        return x.float()
    dt = history.dtype
    S, G = cfg.sink, q.tokens_per_group
    levels = ref.levels_for(q) if levels is None else levels
    bnd = fill_boundary(length, S, cfg.recent, G)
    out = x.float().clone()
    if bnd <= S:
        return out
    body = history[:, :, S:first_chunk] if first_chunk > S else history[:, :, :first_chunk]
    norm = None
    if is_key and cfg.key_norm:
        norm = body.float().abs().amax(-2, keepdim=True).sqrt().clamp_min(ref.EPS)
    static = None
    if q.axis is Axis.CHANNEL and q.group_size is None:
        static = ref.static_channel_range(body.float() / norm if norm is not None else body, q, dt, _eta(cfg, q))

    def deq(block, src_block):
        blk = block.to(dt)
        blk = blk.float() / norm if norm is not None else blk
        qb = ref.quantize_block(blk, q, levels, dt, _eta(cfg, q), static)
        if src_block is not None:  # XQuant: the source layer's codes with this layer's ranges
            sb = src_block.to(dt)
            qb.codes = ref.quantize_block(sb, q, levels, dt, _eta(cfg, q), None).codes
        y = ref.dequantize_block(qb, q, levels)
        return y * norm if norm is not None else y

    step = G
    for s in range(S, bnd, step):
        src = None if codes_from is None else codes_from[:, :, s:s + step]
        out[:, :, s:s + step] = deq(history[:, :, s:s + step], src)
    return out
