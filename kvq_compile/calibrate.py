"""Offline calibration: fill a `KVQConfig`'s data-dependent tables from a model and calibration text.

    cfg = kvq_compile.calibrate(model, texts, KVQConfig.preset("kvquant-3-1%"), tokenizer=tok)
    kvq_compile.save_calibration(cfg, "calib/")          # kvq_config.json + kvq_tables.safetensors
    cfg = kvq_compile.load_calibration("calib/")
    # or: python -m kvq_compile calibrate --model PATH --preset kvquant-3-1% --text a.txt --out calib/

What `calibrate` computes depends on the config; each part runs only when the config uses it:

| the config uses                     | filled in           | how                                                  |
|-------------------------------------|---------------------|------------------------------------------------------|
| NORMAL_FLOAT levels (KVQuant)       | `codebooks`         | Fisher-weighted 1-D k-means (`calibrate_codebooks`)  |
| `softmax_tau` (CalibQuant)          | `softmax_tau`       | grid search on attention KL (`search_softmax_tau`)   |
| `eta` or `xquant_pattern` (XQuant)  | `eta` per bit width | data-free MSE on N(0, 1) groups (`xquant_eta`)       |
| `key_norm` (InnerQ)                 | nothing             | its normalization is computed from the prefill       |

Codebooks are computed first, so a config with both non-uniform levels and a softmax calibration searches tau
with its calibrated levels. The model runs in float32, one calibration sequence per forward (and backward).
Note: `kvq_compile.calibrate` is the function (re-exported by the package); import helpers from this module
with `from kvq_compile.calibrate import ...`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import time
from typing import Callable

import torch

from . import reference as ref
from .config import Axis, KVQConfig, Levels, QuantizerSpec, Symmetry
from .store import fill_boundary, statistics_start

log = logging.getLogger("kvq_compile")

Progress = Callable[[str, int, int], None]  # (stage, done, total)

TAU_GRID = tuple((t1, t2) for t1 in range(4) for t2 in range(4))  # CalibQuant's search space {0,1,2,3}^2
TAU_QUERY_ROWS = 256  # query rows per sequence (the last ones, each over its full causal prefix)
KMEANS_ITERS = 100
KMEANS_TOL = 1e-7
HIST_BINS = 2 ** 16  # bins of the normalized range [-1, 1]; two more bins hold the values beyond it
CONFIG_FILE = "kvq_config.json"
TABLES_FILE = "kvq_tables.safetensors"
_FORMAT = "kvq-calibration"
_ATTN_NAME = "kvq_calibrate"


# =============================================================================================
# Calibration data
# =============================================================================================
def calibration_batch(data, tokenizer=None, seq_len: int = 2048, num_sequences: int = 16,
                      seed: int = 0) -> torch.Tensor:
    """The token batch [N, L] that calibration runs on.

    data: a list of strings, or a LongTensor [N, L] of token ids.
      strings: joined with blank lines, tokenized once, and cut into `num_sequences` windows of `seq_len`
        tokens whose starts are drawn uniformly with `seed` (sorted); windows may overlap on short text.
      tensor: used as given, cut to its first `num_sequences` rows and first `seq_len` tokens.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len}: calibration needs at least 2 tokens per sequence (one prediction)")
    if num_sequences < 1:
        raise ValueError(f"num_sequences={num_sequences} must be >= 1")
    if isinstance(data, torch.Tensor):
        if data.dim() != 2 or data.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"token batches must be an integer tensor [N, L]; got {data.dtype} {tuple(data.shape)}")
        ids = data[:num_sequences, :seq_len].long()
        if ids.shape[0] == 0 or ids.shape[1] < 2:
            raise ValueError(f"the token batch {tuple(data.shape)} is empty or shorter than 2 tokens; pass [N, L>=2]")
        return ids
    if isinstance(data, str):
        raise ValueError("pass a list of strings (e.g. [text]), not a bare string")
    texts = list(data)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("calibration data must be a non-empty list of strings or a LongTensor [N, L] of token ids")
    if not any(t.strip() for t in texts):
        raise ValueError("all calibration texts are empty; pass real text")
    if tokenizer is None:
        raise ValueError("calibration texts need a tokenizer: pass tokenizer=AutoTokenizer.from_pretrained(...) "
                         "or a LongTensor [N, L] of token ids")
    stream = tokenizer("\n\n".join(texts), return_tensors="pt", verbose=False).input_ids[0]
    if len(stream) < seq_len:
        raise ValueError(f"the calibration text has {len(stream)} tokens, fewer than seq_len={seq_len}; "
                         f"pass more text or a smaller seq_len")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - seq_len + 1, (num_sequences,), generator=g).sort().values
    return torch.stack([stream[s:s + seq_len] for s in starts.tolist()])


# =============================================================================================
# Capturing what attention receives
# =============================================================================================
class _Capture:
    """Runs a HuggingFace model with an attention function that records each layer's (query, key, value)
    as attention receives them (keys after RoPE, [B, H, L, D]) and then calls SDPA. `keep_query` keeps only
    the last rows of the query. Restores the model's attention implementation on exit."""

    def __init__(self, model, keep_query: int = 0):
        self.model, self.keep_query = model, keep_query
        self.layers: dict[int, dict] = {}

    def _attend(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        rec = {"key": key, "value": value,
               "scaling": float(scaling if scaling is not None else query.shape[-1] ** -0.5)}
        if self.keep_query:
            rec["query"] = query[:, :, -self.keep_query:].detach()
        self.layers[module.layer_idx] = rec
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)

    def __enter__(self):
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        AttentionInterface.register(_ATTN_NAME, self._attend)
        ALL_MASK_ATTENTION_FUNCTIONS.register(_ATTN_NAME, sdpa_mask)
        self.configs = _configs(self.model)
        self.saved = [c._attn_implementation for c in self.configs]
        for c in self.configs:
            c._attn_implementation = _ATTN_NAME
        return self

    def __exit__(self, *exc):
        for c, impl in zip(self.configs, self.saved):
            c._attn_implementation = impl
        return False


def _configs(model):
    confs = [model.config, getattr(model.config, "get_text_config", lambda: None)()]
    return list({id(c): c for c in confs if c is not None}.values())


def _geometry(model) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a HuggingFace decoder."""
    conf = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(conf, "num_key_value_heads", None) or conf.num_attention_heads
    head_dim = getattr(conf, "head_dim", None) or conf.hidden_size // conf.num_attention_heads
    return conf.num_hidden_layers, heads, head_dim


def _check_model(model) -> None:
    conf = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(conf, "attn_logit_softcapping", None) is not None:   # (the capture's SDPA would drop it)
        raise ValueError("calibration runs the model's attention through SDPA, which has no logit softcapping "
                         f"(attn_logit_softcapping={conf.attn_logit_softcapping}); such a model cannot be served "
                         "by kvq either")
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes != {torch.float32}:
        raise ValueError(f"calibration runs the model in float32, but its parameters are {sorted(map(str, dtypes))}: "
                         "pass model.float() (or load it with dtype=torch.float32) and cast it back afterwards")


@contextlib.contextmanager
def _frozen(model):
    """Parameters stop requiring grad for the duration (restored after): gradients are taken with respect to
    activations only, so autograd keeps no inputs for weight gradients."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def _rope(model, x: torch.Tensor):
    """cos, sin [1, L, D] of positions 0..L-1, from the model's own rotary embedding (as `KVQCache` uses it)."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rotary is None:
        raise ValueError("this config stores keys before RoPE, but the model has no `model.rotary_emb`; "
                         "calibrate a post-RoPE config (keys_before_rope=False) instead")
    pos = torch.arange(x.shape[2], device=x.device)[None]
    cos, sin = rotary(x, pos)
    return cos.float(), sin.float()


def _rope_transpose(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """R^T g for the RoPE rotation R of `reference.rope_rotate`: the gradient w.r.t. the pre-RoPE key when g is
    the gradient w.r.t. the rotated key. Per channel pair (i, i + D/2): R = [[c, -s], [s, c]], so
    R^T g = g * cos - rotate_half(g) * sin."""
    half = g.shape[-1] // 2
    rot = torch.cat((-g[..., half:], g[..., :half]), dim=-1)
    return g * cos.unsqueeze(1) - rot * sin.unsqueeze(1)


# =============================================================================================
# KVQuant: Fisher-weighted non-uniform levels
# =============================================================================================
def normalized_activations(x: torch.Tensor, spec: QuantizerSpec, storage_dtype: torch.dtype = torch.float32):
    """The values `reference.quantize_block` picks levels for, and which of them it quantizes.

    x: [..., T, D] a whole sequence's body (sink tokens removed, T a multiple of the token group).
    Returns (xn, valid), both [..., T, D]: xn = (x - c) / h with the quantizer's group statistics (c, h) and
    valid = False for the dense-and-sparse outliers that are kept exact. Exactly as the store does it:
      static per-channel ranges (CHANNEL axis, group_size None): (c, h) = `reference.static_channel_range` of the
        chunk (per channel over its tokens; with outliers the f/2 and 1 - f/2 quantiles instead of min / max;
        half-width times range_scale), outliers = the top-k of |x - c| / h per token vector;
      per-group ranges (e.g. per-token Values): outliers = the top-k of |x - c0| / h0 per token vector with the
        full group range (c0, h0), then (c, h) = min / max range (or absmax) of the remaining members.
    (c, h) are rounded to `storage_dtype` as the store rounds them to the cache dtype.
    """
    shape = x.shape
    xf = x.float()
    static = spec.axis is Axis.CHANNEL and spec.group_size is None
    static_range = ref.static_channel_range(xf, spec, storage_dtype) if static else None
    _, valid = ref.select_outliers(xf, spec, static_range)
    if static:
        c, h = (t.float() for t in static_range)
        return (xf - c) / h, torch.ones_like(xf, dtype=torch.bool) if valid is None else valid
    xg = ref.to_groups(xf, spec)
    c, h = ref.group_range(xg, spec, None if valid is None else ref.to_groups(valid, spec), storage_dtype)
    xn = ref.from_groups((xg - c.float()) / h.float(), spec, shape)
    return xn, torch.ones_like(xf, dtype=torch.bool) if valid is None else valid


class WeightedHistogram:
    """Weighted 1-D data summarized exactly enough for Lloyd's algorithm on [-1, 1] levels.

    `bins` equal bins cover [-1, 1]; two more hold everything below -1 and above 1 (always assigned to the
    outer levels, which lie in [-1, 1]). Each bin keeps sum(w) and sum(w x), so a bin's weighted mean stands
    for its members: k-means on the bins equals k-means on the points up to bins cut by a cell boundary
    (width 2 / bins). No subsampling is needed however many points are added."""

    def __init__(self, bins: int = HIST_BINS):
        self.bins = bins
        self.w = torch.zeros(bins + 2, dtype=torch.float64)
        self.wx = torch.zeros(bins + 2, dtype=torch.float64)

    def add(self, x: torch.Tensor, w: torch.Tensor) -> None:
        x, w = x.reshape(-1).double().cpu(), w.reshape(-1).double().cpu()
        idx = ((x + 1) * (self.bins / 2)).floor().clamp(0, self.bins - 1).long()
        idx = torch.where(x < -1, self.bins, torch.where(x > 1, self.bins + 1, idx))
        self.w.index_add_(0, idx, w)
        self.wx.index_add_(0, idx, w * x)

    def points(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weighted mean, total weight) of every non-empty bin."""
        keep = self.w > 0
        return self.wx[keep] / self.w[keep], self.w[keep]


def weighted_kmeans_1d(x: torch.Tensor, w: torch.Tensor, init: torch.Tensor, iters: int = KMEANS_ITERS,
                       tol: float = KMEANS_TOL) -> torch.Tensor:
    """Lloyd's algorithm for sorted levels l minimizing sum_i w_i min_k (x_i - l_k)^2 with every l_k in [-1, 1].

    Deterministic: starts from `init` (sorted), assigns each point to its nearest level (ties to the lower one,
    as `reference.nearest_level` does), moves each level to the weighted mean of its points clamped to [-1, 1]
    (the exact minimizer of its cell's cost under the box constraint), keeps a level whose cell is empty, and
    stops after `iters` rounds or when no level moves more than `tol`. Returns float64 sorted levels."""
    x, w = x.reshape(-1).double(), w.reshape(-1).double()
    if x.numel() == 0 or float(w.sum()) <= 0:
        raise ValueError("weighted k-means got no points with positive weight; calibrate on more (or longer) "
                         "sequences")
    order = x.argsort()
    x, w = x[order], w[order]
    zero = torch.zeros(1, dtype=torch.float64)
    cw, cwx = torch.cat((zero, w.cumsum(0))), torch.cat((zero, (w * x).cumsum(0)))  # prefix sums
    lv = init.double().sort().values.clamp(-1, 1)
    for _ in range(iters):
        # sorted points: level k's cell is the run with mid[k-1] < x <= mid[k] (bucketize's rule)
        ends = torch.searchsorted(x, (lv[1:] + lv[:-1]) / 2, right=True)
        b = torch.cat((ends.new_zeros(1), ends, ends.new_full((1,), x.numel())))
        sw, swx = cw[b[1:]] - cw[b[:-1]], cwx[b[1:]] - cwx[b[:-1]]
        new = torch.where(sw > 0, swx / sw.clamp_min(1e-300), lv).clamp(-1, 1).sort().values
        moved = float((new - lv).abs().max())
        lv = new
        if moved <= tol:
            break
    return lv


def weighted_quantization_error(x: torch.Tensor, w: torch.Tensor, levels: torch.Tensor) -> float:
    """sum w (x - l[nearest(x)])^2 / sum w: the Fisher-weighted MSE of normalized values on these levels."""
    lv = levels.double()
    x, w = x.reshape(-1).double(), w.reshape(-1).double()
    q = lv[ref.nearest_level(x, lv, uniform=False).long()]
    return float((w * (x - q) ** 2).sum() / w.sum())


def _codebook_sides(cfg: KVQConfig, specs) -> list[tuple[int, str, QuantizerSpec]]:
    out = []
    for i, s in enumerate(specs):
        for tensor, q, shared in (("key", s.key, s.share_key_codes_from), ("value", s.value, s.share_value_codes_from)):
            if q.quantized and q.levels is Levels.NORMAL_FLOAT:
                if shared is not None:
                    raise ValueError(f"layer {i} shares its {tensor} codes (XQuant) and uses non-uniform levels; "
                                     "codebook calibration needs per-layer codes: drop the sharing or use "
                                     "uniform levels")
                out.append((i, tensor, q))
    return out


def fisher_activations(model, ids: torch.Tensor, cfg: KVQConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """For one token sequence ids [1, L]: {"<layer>.key" | "<layer>.value": (xn, fisher)} over the quantized
    entries of every side with non-uniform levels.

    fisher = (dLoss/da)^2, the diagonal Fisher information of the cached activation a, with Loss the mean
    next-token cross-entropy of the sequence; a = the Key as the store receives it (before RoPE when
    cfg.keys_before_rope: g_pre = R^T g_post) and the Value (the v_proj output). xn = `normalized_activations`
    of the sequence body (positions >= cfg.sink; the sink stays exact); outliers are left out."""
    num_layers, _, _ = _geometry(model)
    specs = cfg.resolve(num_layers)
    sides = _codebook_sides(cfg, specs)
    ids = ids.to(model.device)
    with _frozen(model), _Capture(model) as cap:
        emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)  # the graph starts here
        logits = model(inputs_embeds=emb, position_ids=torch.arange(ids.shape[1], device=ids.device)[None],
                       use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    if set(cap.layers) != set(range(num_layers)):
        raise ValueError(f"captured attention for layers {sorted(cap.layers)}, expected 0..{num_layers - 1}: "
                         "the model's attention modules must carry layer_idx and use the attention interface")
    wanted = [(i, t) for i, t, _ in sides]
    tensors = [cap.layers[i][t] for i, t in wanted]
    grads = torch.autograd.grad(loss, tensors)
    del logits, loss
    cos = sin = None
    if cfg.keys_before_rope and any(t == "key" for _, t in wanted):
        cos, sin = _rope(model, cap.layers[0]["value"])
    out = {}
    S = cfg.sink
    for (i, tensor, q), a, g in zip(sides, tensors, grads):
        a, g = a.detach().float(), g.float()
        if tensor == "key" and cfg.keys_before_rope:
            a, g = ref.rope_unrotate(a, cos, sin), _rope_transpose(g, cos, sin)
        body, gb = a[:, :, S:], g[:, :, S:]
        t = body.shape[2] // q.tokens_per_group * q.tokens_per_group
        if t == 0:
            raise ValueError(f"sequences of {ids.shape[1]} tokens leave no quantized token after the sink "
                             f"(sink={S}, token group {q.tokens_per_group}); use a longer seq_len")
        body, gb = body[:, :, :t], gb[:, :, :t]
        if tensor == "key" and cfg.key_norm:
            norm = ref.key_norm(body)
            body, gb = body / norm, gb * norm  # d/d(a / n) = n * d/da
        xn, valid = normalized_activations(body, q, torch.float32)
        out[f"{i}.{tensor}"] = (xn[valid], (gb * gb)[valid])
    return out


def calibrate_codebooks(model, ids: torch.Tensor, cfg: KVQConfig, progress: Progress | None = None,
                        report: dict | None = None) -> dict[str, list[float]]:
    """KVQuant's sensitivity-weighted non-uniform levels (Hooper et al. 2024, §3.3), per layer and tensor.

    For every side with NORMAL_FLOAT levels, the normalized activations xn and their Fisher weights F of all
    calibration sequences (`fisher_activations`) are summarized in a `WeightedHistogram`, and the 2^bits
    levels minimize the Fisher-weighted error  sum F (xn - l[nearest(xn)])^2  by `weighted_kmeans_1d`
    started from the NormalFloat levels. As in KVQuant's reference code the weights are the Fisher entries
    alone (the group's range is not folded in); unlike it, the range statistics are the store's own (per
    sequence, like a prefill) and non-outlier values beyond [-1, 1] are kept (the store clamps them to the
    outer levels). Returns {"<layer>.key" | "<layer>.value": sorted float32-representable levels}."""
    num_layers, _, _ = _geometry(model)
    sides = _codebook_sides(cfg, cfg.resolve(num_layers))
    hists = {f"{i}.{t}": WeightedHistogram() for i, t, _ in sides}
    if progress:
        progress("fisher k-means", 0, ids.shape[0])
    for n in range(ids.shape[0]):
        for name, (xn, f) in fisher_activations(model, ids[n:n + 1], cfg).items():
            hists[name].add(xn, f)
        if progress:
            progress("fisher k-means", n + 1, ids.shape[0])
    books = {}
    for i, tensor, q in sides:
        name = f"{i}.{tensor}"
        x, w = hists[name].points()
        lv = weighted_kmeans_1d(x, w, ref.normal_float_levels(q.bits))
        books[name] = [float(v) for v in lv.float()]
        if report is not None:
            report.setdefault("codebook_error", {})[name] = {
                "normal_float": weighted_quantization_error(x, w, ref.normal_float_levels(q.bits)),
                "calibrated": weighted_quantization_error(x, w, torch.tensor(books[name]))}
    return books


# =============================================================================================
# CalibQuant: the softmax calibration (tau1, tau2)
# =============================================================================================
def quantized_keys(history: torch.Tensor, q: QuantizerSpec, cfg: KVQConfig, levels: torch.Tensor,
                   codes_from: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [B, H, L, D]: every body token of a whole sequence's keys as the store holds it once quantized
    (positions < sink and the incomplete last token group stay exact), the sequence being one prefill.

    The same math as `simulate.quantized_view` with recent = 0 (tested equal), in one `quantize_block` call
    instead of one per token group: each token group's codes depend only on its own tokens and on the static
    ranges / key norm of the prefill."""
    L, S, G = history.shape[2], cfg.sink, q.tokens_per_group
    dt = history.dtype
    end = S + (L - S) // G * G if L > S else L
    out = history.float().clone()
    if end <= S:
        return out
    body = history[:, :, S:]
    stats = history[:, :, statistics_start(S, L, False):]
    norm = ref.key_norm(stats) if cfg.key_norm else None
    blk = body[:, :, :end - S]
    blk = blk.float() / norm if norm is not None else blk
    static = None
    if q.axis is Axis.CHANNEL and q.group_size is None:
        static = ref.static_channel_range(stats.float() / norm if norm is not None else stats, q, dt, cfg.eta_for(q))
    qb = ref.quantize_block(blk, q, levels, dt, cfg.eta_for(q), static)
    if codes_from is not None:  # XQuant: the source layer's codes with this layer's ranges
        qb.codes = ref.quantize_block(codes_from[:, :, S:end], q, levels, dt, cfg.eta_for(q), None).codes
    y = ref.dequantize_block(qb, q, levels)
    out[:, :, S:end] = y * norm if norm is not None else y
    return out


def _kl_rows(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row (entries where p = 0 contribute 0)."""
    terms = torch.where(p > 0, p * (p.clamp_min(1e-38).log() - q.clamp_min(1e-38).log()), 0.0)
    return terms.sum(-1)


def attention_distortion(model, ids: torch.Tensor, cfg: KVQConfig, grid=TAU_GRID, query_rows: int = TAU_QUERY_ROWS,
                         progress: Progress | None = None) -> dict[tuple[float, float], float]:
    """Mean KL(p_fp || p_quant) of attention rows on calibration data, for every (tau1, tau2) of `grid`.

    Per sequence and layer, the last `query_rows` query rows t attend over their full causal prefix as a
    decode step at position t would through the store: keys at positions [sink, Q(t + 1)) quantized (the
    config's key quantizer for that layer, with its codebook, eta, key norm and static ranges taken over the
    whole sequence as one prefill; `quantized_keys`), the others exact. p_fp = softmax of the exact
    logits, p_quant = `reference.calibrated_softmax` of the mixed logits with tau. The mean runs over
    sequences, layers, query heads and rows. Values are not involved (they do not change the probabilities).
    Since g is a per-row temperature t = 1 - (tau1 + tau2) / (delta - gamma), pairs with the same sum score alike.
    """
    num_layers, _, _ = _geometry(model)
    specs = cfg.resolve(num_layers)
    sums = sorted({t1 + t2 for t1, t2 in grid})
    total = {s: 0.0 for s in sums}
    count = 0
    if progress:
        progress("tau search", 0, ids.shape[0])
    for n in range(ids.shape[0]):
        seq = ids[n:n + 1].to(model.device)
        L = seq.shape[1]
        rows = min(query_rows, L - 1)
        with torch.no_grad(), _Capture(model, keep_query=rows) as cap:
            model(seq, position_ids=torch.arange(L, device=seq.device)[None], use_cache=False)
        cos = sin = None
        if cfg.keys_before_rope:
            cos, sin = _rope(model, cap.layers[0]["value"])
        t_pos = torch.arange(L - rows, L, device=seq.device)
        s_pos = torch.arange(L, device=seq.device)
        allowed = s_pos[None] <= t_pos[:, None]  # [rows, L]
        for i, spec in enumerate(specs):
            q = spec.key
            if not q.quantized:
                continue
            rec = cap.layers[i]
            k = rec["key"].float()
            hist = ref.rope_unrotate(k, cos, sin) if cfg.keys_before_rope else k
            src = None
            if spec.share_key_codes_from is not None:
                sk = cap.layers[spec.share_key_codes_from]["key"].float()
                src = ref.rope_unrotate(sk, cos, sin) if cfg.keys_before_rope else sk
            levels = ref.levels_for(q, cfg.codebooks.get(f"{i}.key"), device=k.device)
            k_hat = quantized_keys(hist, q, cfg, levels, src)
            if cfg.keys_before_rope:
                k_hat = ref.rope_rotate(k_hat, cos, sin)
            bound = torch.tensor([fill_boundary(int(t) + 1, cfg.sink, cfg.recent, q.tokens_per_group)
                                  for t in t_pos], device=k.device)
            quant = (s_pos[None] >= cfg.sink) & (s_pos[None] < bound[:, None])  # [rows, L]
            query = rec["query"].float()
            rep = query.shape[1] // k.shape[1]
            exact = (query @ k.repeat_interleave(rep, 1).transpose(-1, -2)) * rec["scaling"]
            approx = (query @ k_hat.repeat_interleave(rep, 1).transpose(-1, -2)) * rec["scaling"]
            mixed = torch.where(quant, approx, exact)
            allow = allowed.expand_as(exact)
            p_fp = ref.calibrated_softmax(exact, allow, None)
            for s in sums:
                p_q = ref.calibrated_softmax(mixed, allow, (0.0, float(s)))
                total[s] += float(_kl_rows(p_fp, p_q).sum())
            count += exact.numel() // exact.shape[-1]
        if progress:
            progress("tau search", n + 1, ids.shape[0])
    if count == 0:
        raise ValueError("no layer quantizes its keys: the softmax calibration has nothing to calibrate")
    return {(float(t1), float(t2)): total[t1 + t2] / count for t1, t2 in grid}


def search_softmax_tau(model, ids: torch.Tensor, cfg: KVQConfig, grid=TAU_GRID, query_rows: int = TAU_QUERY_ROWS,
                       progress: Progress | None = None):
    """CalibQuant's (tau1, tau2) by grid search: the pair of `grid` with the lowest `attention_distortion`
    (mean KL(p_fp || p_quant)), fixed across layers and heads. Ties (equal tau1 + tau2 score alike) go to the
    first pair in grid order, i.e. the smallest tau1. Returns (pair, {pair: distortion}).

    CalibQuant (arXiv 2502.14882) picks (tau1, tau2) per model from a small grid; its reference code ships
    (0, 3) for 1-bit without a search script, so the criterion here is our choice: the KL divergence of the
    quantized attention rows from the exact ones, i.e. the distortion the calibration is meant to undo."""
    scores = attention_distortion(model, ids, cfg, grid, query_rows, progress)
    best = min(scores, key=lambda p: (scores[p], list(scores).index(p)))
    return best, scores


# =============================================================================================
# XQuant: data-free eta, bit maps
# =============================================================================================
@functools.lru_cache(maxsize=None)
def xquant_eta(bits: int, group_size: int = 32, groups: int = 2 ** 14, seed: int = 0) -> float:
    """XQuant's data-free calibration eta for B-bit asymmetric uniform groups of G members.

    With z' = z + eta s (2^B - 1), s' = (1 - 2 eta) s the group range [min, max] shrinks by eta of its width on
    both sides; we pick the eta minimizing the expected reconstruction MSE of a group of G i.i.d. N(0, 1)
    values, E || x - deq(quant(x; eta)) ||^2, by Monte Carlo (`groups` groups drawn with a fixed seed, the
    same draws for every eta) on a 0.01 grid over [0, 0.5) refined to 0.001 around the best point.
    For G = 32 this gives about 0.30 (1 bit), 0.14 (2 bits), 0.045 (3 bits), 0.012 (4 bits); the xquant-1.38
    preset uses the middle of the XQuant reference code's grids, 1/6 (1 bit) and 0.045 (2 bits): smaller, as
    real K/V groups have heavier tails than a normal sample (a larger eta clamps more of them)."""
    if bits not in (1, 2, 3, 4, 8):
        raise ValueError(f"bits={bits}: XQuant's eta applies to quantized groups of 1, 2, 3, 4 or 8 bits")
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: a group needs at least 2 members for a range")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(groups, group_size, generator=g)
    mx, mn = x.amax(-1, keepdim=True), x.amin(-1, keepdim=True)
    c, h0 = (mx + mn) / 2, (mx - mn) / 2
    levels = ref.uniform_levels(2 ** bits)

    def mse(eta: float) -> float:
        h = h0 * (1 - 2 * eta)
        k = ref.nearest_level((x - c) / h, levels, uniform=True).long()
        return float(((levels[k] * h + c - x) ** 2).double().mean())

    best = min((i / 100 for i in range(50)), key=mse)
    fine = [round(best + j / 1000, 3) for j in range(-10, 11) if 0 <= best + j / 1000 < 0.5]
    return min(fine, key=mse)


def _xquant_group_size(cfg: KVQConfig, specs) -> int:
    sizes = {q.group_size for s in specs for q in (s.key, s.value)
             if q.quantized and q.symmetry is Symmetry.ASYMMETRIC and q.levels is Levels.UNIFORM}
    if not sizes:
        raise ValueError("the config sets eta, but no layer has asymmetric uniform groups for it to act on")
    if None in sizes or len(sizes) != 1:
        raise ValueError(f"XQuant's data-free eta needs one group size for all asymmetric uniform groups; got "
                         f"{sorted(sizes, key=str)}: set the same group_size on key and value (e.g. 32)")
    return sizes.pop()


def xquant_etas(cfg: KVQConfig, num_layers: int) -> dict[int, float]:
    """{bits: eta} for every bit width of the config's asymmetric uniform groups (`xquant_eta`)."""
    specs = cfg.resolve(num_layers)
    G = _xquant_group_size(cfg, specs)
    bits = sorted({q.bits for s in specs for q in (s.key, s.value)
                   if q.quantized and q.symmetry is Symmetry.ASYMMETRIC and q.levels is Levels.UNIFORM})
    return {b: xquant_eta(b, G) for b in bits}


def _side_code_bits(num_layers: int, q2: int, share: int) -> int:
    """Code bits per token-channel of one tensor over all layers: layers < q2 at 2 bits, the rest at 1 bit;
    every odd layer >= max(share, 1) whose bits equal its even predecessor's stores no codes (`KVQConfig.resolve`)."""
    bits = [2 if i < q2 else 1 for i in range(num_layers)]
    return sum(b for i, b in enumerate(bits)
               if not (i >= max(share, 1) and i % 2 == 1 and bits[i - 1] == b))


def code_bits(cfg: KVQConfig, num_layers: int) -> float:
    """Code bits per cached element (scales, zero-points and fp16 windows not counted): the mean over layers and
    K/V of each resolved quantizer's bits, 0 for a layer that reuses another layer's codes."""
    total = 0
    for s in cfg.resolve(num_layers):
        for q, shared in ((s.key, s.share_key_codes_from), (s.value, s.share_value_codes_from)):
            total += 0 if shared is not None else q.bits
    return total / (2 * num_layers)


def _xquant_path(num_layers: int):
    """The configurations (kq, vq, km, vm) `xquant_bit_map` chooses from, from 2.0 code bits down to 0.5.

    Anchored on XQuant's 1.38-bit setting for 32 layers (kq=30, vq=2, km=32, vm=16: Keys at 2 bits but in the
    last 1/16 of the layers, Values at 1 bit but in the first 1/16, Value codes shared from the middle) and
    scaled to the layer count (e = round(L / 16)), the steps lower the code bits in this order:
      1. Values to 1 bit from the top down to layer e;       2. Keys to 1 bit from the top down to layer L - e;
      3. Value sharing, its (even) start from the top down to 0;  4. the same for Key sharing;
      5. the remaining 2-bit Values, then Keys, to 1 bit."""
    L = num_layers
    e = max(1, round(L / 16)) if L > 2 else 0
    path = []
    kq, vq, km, vm = L, L, L, L
    path.append((kq, vq, km, vm))
    for vq in range(L - 1, e - 1, -1):
        path.append((kq, vq, km, vm))
    for kq in range(L - 1, L - e - 1, -1):
        path.append((kq, vq, km, vm))
    starts = range(2 * ((L - 1) // 2), -1, -2)  # even starts: start s shares the odd layers s + 1, s + 3, ...
    for vm in starts:
        path.append((kq, vq, km, vm))
    for km in starts:
        path.append((kq, vq, km, vm))
    for vq in range(vq - 1, -1, -1):
        path.append((kq, vq, km, vm))
    for kq in range(kq - 1, -1, -1):
        path.append((kq, vq, km, vm))
    return path


def xquant_bit_map(num_layers: int, target_bits: float) -> dict:
    """Per-layer K/V bit widths (2 or 1) and XQuant code-sharing start layers for a target number of CODE bits
    per cached element (scales and windows not counted; sharing an odd layer's codes with the even layer
    below stores none for it). Walks `_xquant_path` and returns the first configuration whose code bits are
    closest to the target; consecutive steps differ by at most 1 / num_layers bits, so the result is within
    1 / (2 num_layers) of any target in [0.5, 2]. For 32 layers, 1.38 gives XQuant's kq=30, vq=2, km=32,
    vm=16 (1.375 bits) and 1.16 gives kq=30, vq=2, km=26, vm=0 (1.156 bits).

    Returns dict(layer_bits={layer: (k_bits, v_bits)}, share_key_codes_from_layer=..., share_value_codes_from_layer=...)
    (None = no sharing), the `KVQConfig` fields to set with xquant_pattern=None (see `xquant_config`)."""
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers} must be positive")
    if not 0.5 <= target_bits <= 2.0:
        raise ValueError(f"target_bits={target_bits}: 1/2-bit layers with sharing reach code bits in [0.5, 2]")
    L = num_layers
    best, best_err = None, math.inf
    for kq, vq, km, vm in _xquant_path(L):
        bits = (_side_code_bits(L, kq, km) + _side_code_bits(L, vq, vm)) / (2 * L)
        if abs(bits - target_bits) < best_err - 1e-12:
            best, best_err = (kq, vq, km, vm), abs(bits - target_bits)
    kq, vq, km, vm = best
    return dict(layer_bits={i: (2 if i < kq else 1, 2 if i < vq else 1) for i in range(L)},
                share_key_codes_from_layer=km if km < L else None,
                share_value_codes_from_layer=vm if vm < L else None)


def xquant_config(num_layers: int, target_bits: float) -> KVQConfig:
    """The xquant-1.38 preset (KIVI layout, eta 1/6 and 0.045) with `xquant_bit_map`'s bits and sharing for this
    layer count and target code bits."""
    cfg = KVQConfig.preset("xquant-1.38")
    return dataclasses.replace(cfg, name=f"xquant-{target_bits:g}", xquant_pattern=None,
                               **xquant_bit_map(num_layers, target_bits))


def asymkv_config(num_layers: int, target_bits: float) -> KVQConfig:
    """An AsymKV-style mix (Tao et al. 2024: layer-wise asymmetric K/V bit widths) at the same code bits as
    `xquant_config`, without cross-layer sharing, for the XQuant paper's comparison: 2-bit Keys in the first
    l_k layers and 2-bit Values in the first l_v layers, 1 bit elsewhere, with l_k + l_v = round(2 L (b - 1))
    and Keys served first (AsymKV: Keys need the bits more). Everything else (layout, windows, eta) is the
    xquant-1.38 preset's, so only the sharing differs; set cfg.eta = {} for AsymKV's plain min-max ranges."""
    if not 1.0 <= target_bits <= 2.0:
        raise ValueError(f"target_bits={target_bits}: without sharing, 1/2-bit layers reach code bits in [1, 2]")
    L = num_layers
    n = round(2 * L * (target_bits - 1))
    lk, lv = min(n, L), max(0, n - L)
    cfg = KVQConfig.preset("xquant-1.38")
    return dataclasses.replace(cfg, name=f"asymkv-{target_bits:g}", xquant_pattern=None,
                               layer_bits={i: (2 if i < lk else 1, 2 if i < lv else 1) for i in range(L)},
                               share_key_codes_from_layer=None, share_value_codes_from_layer=None)


# =============================================================================================
# The entry point
# =============================================================================================
def calibrate(model, texts_or_token_batches, cfg: KVQConfig, *, tokenizer=None, seq_len: int = 2048,
              num_sequences: int = 16, seed: int = 0, progress: Progress | None = None,
              report: dict | None = None) -> KVQConfig:
    """A copy of `cfg` with its calibrated tables filled in (see the module docstring for what each config
    gets). `cfg` itself is not modified.

    model: a HuggingFace decoder in float32 (Llama, Mistral, Qwen2, ...), its attention modules carrying layer_idx.
    texts_or_token_batches, tokenizer, seq_len, num_sequences, seed: see `calibration_batch` (seed picks the
        text windows; every computation is deterministic for it).
    progress: called as progress(stage, done, total) after each sequence of a stage.
    report: if given, filled with what was computed: seconds per stage, the Fisher-weighted errors of the
        NormalFloat and calibrated levels, the tau distortions, the etas.
    InnerQ (`key_norm`): nothing is calibrated offline; its normalization comes from the prefill at run time.
    """
    if not isinstance(cfg, KVQConfig):
        raise ValueError(f"cfg must be a KVQConfig (e.g. KVQConfig.preset('kvquant-3-1%')), got {type(cfg).__name__}")
    out = KVQConfig.from_dict(json.loads(cfg.to_json()))  # a deep copy through the validated round trip
    out.codebooks = {}   # every non-uniform side is calibrated again (a config calibrated for another model too)
    ids = calibration_batch(texts_or_token_batches, tokenizer, seq_len, num_sequences, seed)
    num_layers, _, head_dim = _geometry(model)
    out.check_model(num_layers, head_dim, max(ids.shape[1], out.sink + out.recent))
    specs = out.resolve(num_layers)
    report = {} if report is None else report
    report.update(sequences=int(ids.shape[0]), seq_len=int(ids.shape[1]), seed=seed, seconds={})
    needs_books = bool(_codebook_sides(out, specs))
    if needs_books or out.softmax_tau is not None:
        _check_model(model)
    was_training = model.training
    model.eval()
    try:
        if needs_books:
            t = time.time()
            out.codebooks = calibrate_codebooks(model, ids, out, progress, report)
            report["seconds"]["codebooks"] = time.time() - t
        if out.softmax_tau is not None:
            t = time.time()
            out.softmax_tau, scores = search_softmax_tau(model, ids, out, progress=progress)
            report["tau_distortion"] = {f"{a:g},{b:g}": v for (a, b), v in scores.items()}
            report["seconds"]["softmax_tau"] = time.time() - t
    finally:
        model.train(was_training)
    if out.eta or out.xquant_pattern is not None:
        out.eta = xquant_etas(out, num_layers)
        report["eta"] = {str(b): e for b, e in out.eta.items()}
    report["calibrated"] = [k for k, on in (("codebooks", needs_books), ("softmax_tau", out.softmax_tau is not None),
                                            ("eta", "eta" in report)) if on]
    if not report["calibrated"]:   # (InnerQ, KIVI, int8: their statistics all come from the prefill at run time)
        log.warning("calibrate: %s has nothing to calibrate offline (no NormalFloat codebooks, softmax_tau or XQuant "
                    "eta); it is returned unchanged", cfg.name)
    elif not out.name.endswith("+calibrated"):
        out.name = f"{out.name}+calibrated"
    out.check_model(num_layers, head_dim, max(ids.shape[1], out.sink + out.recent))
    return out


# =============================================================================================
# Saving and loading
# =============================================================================================
def save_calibration(cfg: KVQConfig, directory: str, metadata: dict | None = None) -> None:
    """Write `cfg` to `directory`: kvq_config.json (every scalar field through `KVQConfig.to_dict`, codebooks
    left out, plus optional JSON `metadata`) and kvq_tables.safetensors (each codebook as a float64 tensor
    "codebooks/<layer>.<key|value>", so that `load_calibration` gives back exactly the same config)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    d = cfg.to_dict()
    books = d.pop("codebooks")
    d["codebooks"] = {}
    doc = {"format": _FORMAT, "version": 1, "config": d, "tables": TABLES_FILE, "metadata": metadata or {}}
    save_file({f"codebooks/{k}": torch.tensor(v, dtype=torch.float64) for k, v in books.items()},
              os.path.join(directory, TABLES_FILE))
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")


def load_calibration(directory: str) -> KVQConfig:
    """The config `save_calibration` wrote to `directory`."""
    from safetensors.torch import load_file

    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.exists(path):
        raise ValueError(f"{path} does not exist; pass the directory that save_calibration (or "
                         f"`python -m kvq_compile calibrate --out`) wrote")
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if doc.get("format") != _FORMAT or doc.get("version") != 1:
        raise ValueError(f"{path} is not a kvq calibration (format {doc.get('format')!r}, version "
                         f"{doc.get('version')!r}); expected {_FORMAT!r} version 1")
    d = dict(doc["config"])
    tables = load_file(os.path.join(directory, doc["tables"]))
    d["codebooks"] = {k[len("codebooks/"):]: v.tolist() for k, v in sorted(tables.items())
                      if k.startswith("codebooks/")}
    return KVQConfig.from_dict(d)


def read_metadata(directory: str) -> dict:
    """The metadata dict stored by `save_calibration`."""
    with open(os.path.join(directory, CONFIG_FILE), encoding="utf-8") as f:
        return json.load(f).get("metadata", {})
