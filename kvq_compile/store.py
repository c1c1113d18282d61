"""The packed KV store: its layout, allocation, and the reference append / read that the ops run on CPU.

One `LayerStore` per attention layer holds, for Keys and for Values ("k." / "v." prefixes):

    data     [B, H, T, D]  cache dtype   unquantized tensors only (bits == 16)
    codes    [B, H, T, W]  int32         packed codes, W = ceil(D / (32 // bits)); absent when the codes
                                         are shared from an earlier layer (XQuant)
    center   group shape   cache dtype   absent for symmetric groups (always 0)
    half     group shape   cache dtype   hybrid groups: its sign is the group's choice (negative = symmetric
                                         levels; the half-range is its magnitude, always > 0: `signed_half`)
    out_val  [B, H, T, k]  cache dtype   dense-and-sparse outliers, k per token
    out_idx  [B, H, T, k]  uint8/int16   their channels
    sink     [B, H, S, D]  cache dtype   the first `sink` tokens, exact
    ring     [B, H, Wr, D] cache dtype   the recent window's tokens (not yet read as quantized), at slot position % Wr
    levels   [2^bits]      float32       non-uniform levels (NormalFloat or a calibrated codebook)
    norm     [B, H, 1, D]  float32       InnerQ key normalization (Keys only)
group shape: TOKEN axis [B, H, T, D/g]; CHANNEL axis in groups of G tokens [B, H, ceil((T-S)/G), D];
CHANNEL static ranges [B, H, 1, D].

Token positions: with fill length L, sink S, recent R and token group G (1 unless CHANNEL-grouped),
    positions [0, S)  -> sink;  [S, Q(L)) -> quantized;  [Q(L), L) -> ring,
    Q(L) = S + floor(max(0, L - S - R) / G) * G
so a token is read as quantized once it has left the recent window and its group is complete; the ring never
holds more than R + G - 1 tokens, which is its size. A group's codes are written on the step that completes it
(`code_boundary`, EAGER_GROUPS: C(L) = S + floor(max(0, L - S) / G) * G, Q(L) without the recent window), not when
it leaves the window: read only from then on, they equal the late ones, and with a recent window (R >= 1) a decode
step's attention reads nothing that the same step's append writes (`attention_independent`).

Keys stored before RoPE share one model-level table `rope.cos` / `rope.sin` [B, T, D] (cache dtype).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from . import reference as ref
from .config import Axis, KVQConfig, LayerSpec, Levels, QuantizerSpec, Symmetry

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class Geometry:
    batch: int
    heads: int
    max_len: int
    head_dim: int
    dtype: str  # cache dtype name

    @property
    def rows(self) -> int:
        """Rows of the per-token buffers: the cache length rounded up to even, so that every head's rows start
        16-byte aligned in the 8-byte-a-token Value statistics that KIVI's TMA ring copies (HF's `generate` makes
        static caches of prompt + new tokens - 1: odd lengths took plain loads there until session 32). The padding
        row of an odd length holds nothing: only an append past the cache writes it, and a kernel that reads it
        (a TMA box crossing the region's end) masks it out."""
        return self.max_len + self.max_len % 2

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    for k, v in _DTYPES.items():
        if v == dtype:
            return k
    raise ValueError(f"unsupported cache dtype {dtype}; kvq supports float16, bfloat16 and float32 caches")


def fill_boundary(length: int, sink: int, recent: int, tokens_per_group: int) -> int:
    """Q(L): the first position that is not (yet) quantized."""
    return sink + max(0, length - sink - recent) // tokens_per_group * tokens_per_group


EAGER_GROUPS = True   # every group's codes are written on the step that completes it (`code_boundary`), not when
# it leaves the recent window R steps later: the codes need no later token, nothing reads them before the group leaves
# the window, and the decode step's attention then reads nothing its append writes (R >= 1: the group that leaves
# the window was coded at least one step earlier), so the two may run side by side (`attention_independent`).
# Single-token groups (per-token groups, static per-channel ranges) were coded this way from session 38 on
# (EAGER_TOKEN_GROUPS; H200: the Triton append's increment to an (append, attention) step 0.2-0.7 us smaller on the
# steps that complete no group, kivi-2 at (8, 8192) 2.5 against 2.8 us); groups of G > 1 tokens (KIVI's Keys,
# InnerQ's Values) from session 42 on. False: every group at the fill boundary Q (the rule before session 38).


def code_boundary(length: int, sink: int, recent: int, tokens_per_group: int) -> int:
    """C(L): the first position whose codes are not written yet with `length` tokens appended: the end of the last
    complete group (EAGER_GROUPS), else the fill boundary Q(L)."""
    return fill_boundary(length, sink, 0 if EAGER_GROUPS else recent, tokens_per_group)


def attention_independent(cfg: KVQConfig) -> bool:
    """Whether a decode step's attention reads nothing that the same step's append writes, so that the two may run
    in either order or side by side: with EAGER_GROUPS and a recent window. The attention at position p0 reads:
    - codes below Q(p0 + 1). The append codes only on a step that completes a group, [p0 + 1 - G, p0 + 1)
      (p0 + 1 - S a multiple of G), and there Q(p0 + 1) = max(S, p0 + 1 - ceil(R / G) G) <= p0 + 1 - G for R >= 1;
    - the ring's slots of [Q(p0 + 1), p0). The append writes slot p0 % (R + G - 1), position p0 - R - G + 1's,
      below Q(p0 + 1);
    - the sink below min(S, p0) (the append writes sink[p0]), rows below p0 of the RoPE table and of unquantized
      sides, and the appended token from the op's own inputs. The norm and static ranges are set by chunks only
      (p0 == 0, or a later chunk while Q(p0) = S: `append_side`), never by a decode step.
    Without a recent window a group of G > 1 tokens that p0 completes is read at once. (Layouts of single-token
    groups without one, int8 and kvquant's, read codes below p0 only and may be independent too; not claimed here:
    unchecked against every kernel.)"""
    return EAGER_GROUPS and cfg.recent >= 1


def ring_size(recent: int, tokens_per_group: int) -> int:
    return recent + tokens_per_group - 1


def side_shapes(q: QuantizerSpec, geo: Geometry, sink: int, recent: int, shared_codes: bool,
                is_key: bool, key_norm: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of one side's buffers. The single source of truth for allocation and bytes."""
    B, H, T, D = geo.batch, geo.heads, geo.rows, geo.head_dim
    dt = geo.torch_dtype
    if not q.quantized:
        return {"data": ((B, H, T, D), dt)}
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    if not shared_codes:
        out["codes"] = ((B, H, T, ref.packed_width(D, q.bits)), torch.int32)
    if q.axis is Axis.TOKEN:
        gshape = (B, H, T, D // (q.group_size or D))
    elif q.group_size is None:
        gshape = (B, H, 1, D)
    else:
        gshape = (B, H, -(-max(T - sink, 0) // q.group_size), D)
    if q.symmetry is not Symmetry.SYMMETRIC:
        out["center"] = (gshape, dt)
    out["half"] = (gshape, dt)
    k = ref.outliers_per_token(q, D)
    if k:
        out["out_val"] = ((B, H, T, k), dt)
        out["out_idx"] = ((B, H, T, k), torch.uint8 if D <= 256 else torch.int16)
    if sink:
        out["sink"] = ((B, H, sink, D), dt)
    wr = ring_size(recent, q.tokens_per_group)
    if wr:
        out["ring"] = ((B, H, wr, D), dt)
    if q.levels is Levels.NORMAL_FLOAT:
        out["levels"] = ((2 ** q.bits,), torch.float32)
    if is_key and key_norm:
        out["norm"] = ((B, H, 1, D), torch.float32)
    return out


def _nbytes(shapes) -> int:
    total = 0
    for shape, dt in shapes.values():
        n = 1
        for s in shape:
            n *= s
        total += n * torch.empty((), dtype=dt).element_size()
    return total


def rope_table_shapes(geo: Geometry) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {"rope.cos": ((geo.batch, geo.rows, geo.head_dim), geo.torch_dtype),
            "rope.sin": ((geo.batch, geo.rows, geo.head_dim), geo.torch_dtype)}


def model_store_bytes(cfg: KVQConfig, num_layers: int, batch: int, heads: int, max_len: int, head_dim: int,
                      dtype_bytes: int = 2) -> int:
    """Bytes `ModelStore` allocates for this config and geometry."""
    dtype = {2: "float16", 4: "float32"}[dtype_bytes]
    geo = Geometry(batch, heads, max_len, head_dim, dtype)
    specs = cfg.check_model(num_layers, head_dim, max_len)
    total = sum(_nbytes(LayerStore.layout(cfg, s, geo)) for s in specs)
    if cfg.keys_before_rope:
        total += _nbytes(rope_table_shapes(geo))
    return total


# ---------------------------------------------------------------------------------------------
# The per-layer store and the layout string the ops receive
# ---------------------------------------------------------------------------------------------
class LayerStore:
    """The buffers of one attention layer. `append_tensors` are the ones its append op mutates;
    `attend_tensors` add what attention reads from elsewhere (shared codes, the RoPE table)."""

    def __init__(self, cfg: KVQConfig, spec: LayerSpec, geo: Geometry, device, rope: dict | None,
                 source: "LayerStore | None" = None, layer_index: int = 0, num_layers: int = 1,
                 frontier: torch.Tensor | None = None):
        self.cfg, self.spec, self.geo = cfg, spec, geo
        self.layer_index, self.num_layers = layer_index, num_layers
        self.buffers: dict[str, torch.Tensor] = {}
        for name, (shape, dt) in self.layout(cfg, spec, geo).items():
            self.buffers[name] = torch.zeros(shape, dtype=dt, device=device)
        for side, q in (("k", spec.key), ("v", spec.value)):
            if f"{side}.levels" in self.buffers:
                table = cfg.codebooks.get(f"{layer_index}.{'key' if side == 'k' else 'value'}")
                self.buffers[f"{side}.levels"].copy_(ref.levels_for(q, table))
        self.rope = rope or {}
        # the store's frontier (`ModelStore.frontier`), in the first layer's append lists only: its append checks
        # and advances it once a step
        self.control = {"frontier": frontier} if frontier is not None else {}
        self.shared: dict[str, torch.Tensor] = {}
        if spec.share_key_codes_from is not None:
            self.shared["k.codes"] = source.buffers["k.codes"]
        if spec.share_value_codes_from is not None:
            self.shared["v.codes"] = source.buffers["v.codes"]

    @staticmethod
    def layout(cfg: KVQConfig, spec: LayerSpec, geo: Geometry) -> dict:
        out = {}
        for side, q, shared in (("k", spec.key, spec.share_key_codes_from is not None),
                                ("v", spec.value, spec.share_value_codes_from is not None)):
            for name, v in side_shapes(q, geo, cfg.sink, cfg.recent, shared, side == "k", cfg.key_norm).items():
                out[f"{side}.{name}"] = v
        return out

    def append_tensors(self) -> tuple[list[str], list[torch.Tensor]]:
        d = {**self.buffers, **self.rope, **self.control}
        return list(d), list(d.values())

    def attend_tensors(self, control: bool = False) -> tuple[list[str], list[torch.Tensor]]:
        """control: with the frontier, for kvq::append_attend (the append's check); kvq::attend reads none."""
        d = {**self.buffers, **self.shared, **self.rope, **(self.control if control else {})}
        return list(d), list(d.values())

    def descriptor(self, names: list[str]) -> str:
        """The op's `layout` string: everything the kernel needs to interpret the tensor list."""
        return json.dumps({"cfg": self.cfg.to_dict(), "layer": self.layer_index, "geo": self.geo.__dict__,
                           "num_layers": self.num_layers, "names": names}, sort_keys=True)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())


class ModelStore:
    """All layers' stores of one cache, plus the shared RoPE table for keys stored before RoPE."""

    def __init__(self, cfg: KVQConfig, num_layers: int, geo: Geometry, device):
        self.cfg, self.geo = cfg, geo
        self.specs = cfg.check_model(num_layers, geo.head_dim, geo.max_len)
        # `backend._StepRunner`'s bookkeeping: the fp16 cache last absorbed (a weak reference) and its version, and
        # whether the last absorb changed caches (two in a row: one compiled function serving several caches)
        self.owner, self.owner_version, self.switched_last, self.warned_switching = None, None, False, False
        self.rope = {}
        if cfg.keys_before_rope:
            self.rope = {n: torch.zeros(s, dtype=dt, device=device) for n, (s, dt) in rope_table_shapes(geo).items()}
        # slot -> mask column of each row: its first (absorbed) prefix seated (`seating`), the identity after it,
        # and the sink slots of rows whose real tokens started in a later chunk traded with those tokens' slots
        # (`seat_fresh_rows`); every step's mask is read through it (`seated_mask`). Configs with a sink only; B x T
        # int64, not counted in `nbytes`
        self.seats = None
        if cfg.sink > 0:
            self.seats = torch.arange(geo.max_len, device=device).expand(geo.batch, -1).clone()
        # one past the last position written (int64 [1]) where a step back is refused (`check_rollback`); None
        # where the store takes positions in any order (`any_order`). Not counted in `nbytes`
        self.frontier = None
        if not any_order(cfg, self.specs):
            self.frontier = torch.zeros(1, dtype=torch.int64, device=device)
        self.layers: list[LayerStore] = []
        for i, spec in enumerate(self.specs):
            src_idx = spec.share_key_codes_from if spec.share_key_codes_from is not None else spec.share_value_codes_from
            src = self.layers[src_idx] if src_idx is not None else None
            self.layers.append(LayerStore(cfg, spec, geo, device, self.rope, src, i, num_layers,
                                          self.frontier if i == 0 else None))

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.layers) + sum(t.numel() * t.element_size() for t in self.rope.values())


# ---------------------------------------------------------------------------------------------
# Reference append and read (what the CPU ops run)
# ---------------------------------------------------------------------------------------------
def positions_span(positions: torch.Tensor) -> tuple[int, int]:
    """(p0, n) of contiguous append positions; raises on anything else."""
    n = positions.numel()
    p0 = int(positions.reshape(-1)[0])
    expect = torch.arange(p0, p0 + n, device=positions.device)
    if not torch.equal(positions.reshape(-1).to(expect.dtype), expect):
        raise RuntimeError("kvq: cache positions must be contiguous and increasing; got "
                           f"{positions.reshape(-1).tolist()[:8]}")
    return p0, n


def any_order(cfg: KVQConfig, specs: list[LayerSpec]) -> bool:
    """Whether the store takes positions in any order (a step back to an earlier position, as speculative decoding's
    rollback or HF's assisted generation make, then equals a fresh run of the final tokens): every quantized token
    is coded from itself alone (per-token groups) and kept nowhere else (unquantized sides, the sink: exact copies).
    Not where a layer keeps a recent window (its ring no longer holds the tokens that later ones overwrote) or
    statistics from its first chunks (static per-channel ranges, InnerQ's Key norm: a step back into those chunks
    leaves them as the rejected tokens made them)."""
    return not any(q.quantized and (q.axis is Axis.CHANNEL or ring_size(cfg.recent, q.tokens_per_group)
                                    or (q is s.key and cfg.key_norm))
                   for s in specs for q in (s.key, s.value))


ROLLBACK_HELP = ("this store cannot take back tokens (a recent window, or statistics from the first chunks): "
                 "speculative decoding's or HF's assisted generation's rejected draft tokens, regenerating from the "
                 "middle. Start the sequence again at position 0, or use a store that takes positions in any order "
                 "(`store.any_order`: int8, fp16)")


def check_rollback(bufs: dict, p0: int, n: int) -> None:
    """Host check of an append of positions [p0, p0 + n) against the store's frontier F (`ModelStore.frontier`,
    in the first layer's append buffers only): positions go on from F or further (a gap leaves slots that no mask
    may attend), or start a new sequence at 0; 0 < p0 < F is refused before anything is written. Then F = p0 + n.
    Compiled CUDA decode steps check on the device (`quantize_append.step_guard`)."""
    f = bufs.get("frontier")
    if f is None:
        return
    last = int(f)
    if 0 < p0 < last:
        raise ValueError(f"kvq: cannot append at position {p0}: positions up to {last - 1} are written, and "
                         + ROLLBACK_HELP)
    f.fill_(p0 + n)


def _side(bufs: dict, side: str) -> dict:
    pre = side + "."
    return {k[len(pre):]: v for k, v in bufs.items() if k.startswith(pre)}




def _levels(b: dict, q: QuantizerSpec) -> torch.Tensor:
    return b["levels"] if "levels" in b else ref.levels_for(q, device=b["half"].device)


def _static_range(b: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(center, half) of a side's static per-channel ranges (center 0 when symmetric: not stored)."""
    return (b["center"] if "center" in b else torch.zeros_like(b["half"]), b["half"])


def _set_rows(buf: torch.Tensor, value: torch.Tensor, rows: torch.Tensor | None) -> None:
    """buf <- value (every row), or only where rows [B] (bool) is True."""
    if rows is None:
        buf.copy_(value)
    else:
        buf.copy_(torch.where(rows.view(-1, *([1] * (buf.dim() - 1))), value.to(buf.dtype).expand_as(buf), buf))


def statistics_start(first: int, n: int, masked: bool) -> int:
    """Where a first chunk of n tokens, its first `first` in the sink, starts the tokens its statistics take: past
    the sink when others lie there, at least one with a mask (`statistics_tokens` then gives a row with fewer than 2
    all its real tokens), at least 2 without (one token's range is a point); else at 0, the whole chunk."""
    return first if n - first >= (1 if masked else 2) else 0


def statistics_tokens(real: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, n] bool, alone [B] bool): the tokens of a chunk whose statistics a row takes (`append_side`),
    from its real tokens `real` [B, n] (slot order) and the chunk's first `first` tokens that sit in the sink: its
    real tokens past those; a row with fewer than 2 there (`alone`: one token's range is a point), all its real
    tokens, the sink's too (its pads hold copies of one of them, `neutralized`); a row with no real token, every
    token past the sink (as without a mask: a row of pads takes nothing from its neighbours)."""
    past = torch.arange(real.shape[-1], device=real.device) >= first
    body = real & past
    has_body = body.sum(-1, keepdim=True) >= 2
    alone = real.any(-1) & ~has_body[..., 0]
    return torch.where(has_body, body, torch.where(real.any(-1, keepdim=True), real, past)), alone


def _exact_prefix(b: dict, p0: int, S: int, wr: int) -> torch.Tensor:
    """Positions [0, p0) of a side whose tokens all still sit in its sink and ring, exact (cache dtype)."""
    parts = [b["sink"][:, :, :min(S, p0)]] if S else []
    if p0 > S:
        parts.append(b["ring"][:, :, torch.arange(S, p0, device=b["ring"].device) % wr])
    return torch.cat(parts, dim=2)


def _filled(whole: torch.Tensor, a: torch.Tensor, p0: int, fill) -> tuple[torch.Tensor, torch.Tensor]:
    """(whole [B, H, p0 + n, D], a [B, p0 + n]) of a widening re-append (`append_side`) with `sink_fill`'s copies
    made in it: each filled sink slot holds its chunk token and is attended, the token's own slot is a pad."""
    dst, src, ok = fill
    whole = whole.expand(dst.shape[0], *whole.shape[1:]).clone()
    _fill_rows(whole, whole[:, :, p0:].clone(), dst, src, ok)
    return whole, filled_mask(a, p0, fill)


def filled_mask(a: torch.Tensor, p0: int, fill) -> torch.Tensor:
    """[B, T] the slots a [B or 1, T] (T >= p0 + n) attend once `sink_fill`'s copies are made: each filled sink slot
    attended, each moved token's own slot (>= sink) a pad."""
    dst, src, ok = fill
    a = a.expand(dst.shape[0], a.shape[-1]).clone()
    a.scatter_(1, dst, a.gather(1, dst) | ok)
    return moved_out(a, p0 + src, ok)


def moved_out(keep: torch.Tensor, own: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """keep [B, m] bool with its columns own [B, k] cleared where ok [B, k] (columns outside [0, m) ignored): the
    slots that `sink_fill`'s moved tokens leave, pads from then on."""
    m = keep.shape[-1]
    idx = torch.where(ok & (own >= 0) & (own < m), own, m)   # (m: a spare column)
    return torch.cat([keep, keep[:, :1]], 1).scatter_(1, idx, False)[:, :m]


def append_side(b: dict, q: QuantizerSpec, cfg: KVQConfig, geo: Geometry, x: torch.Tensor, p0: int,
                is_key: bool, slots: torch.Tensor | None = None, fill=None) -> None:
    """Write chunk x [B, H, n, D] at positions [p0, p0 + n) into one side's buffers (in place).

    The statistics a side keeps from its first chunk (InnerQ's Key norm, static per-channel ranges) come from the
    chunk at p0 = 0. A later chunk (n > 1: a chunked prefill's, or a next turn's) widens them while every earlier
    token is still exact in the sink and the ring (Q(p0) = S: none has left the recent window, so no code has been
    read yet): the side is appended again from position 0 with the exact prefix and the chunk, both in the cache
    dtype, as if the prefill so far had come in one piece (its codes rewritten; with an input dtype wider than the
    cache's, the statistics then come from values rounded to the cache dtype, where one piece takes them from the
    input). After that they stay, except for rows whose earlier tokens past the sink were all pads, which take them
    from this chunk (a chunked prefill whose first chunks held fewer real tokens than the sink for a row: seated
    into its sink, `seating`, or moved there, `sink_fill`). The statistics leave the sink's tokens out where the
    chunk has at least 2 real tokens past it; a row with fewer takes them over all its real tokens, the sink's too
    (a left-padded row of at most `sink` + 1 real tokens; its pads hold copies of one of them, `neutralized`, over
    which a range would be a point). Not handled: a row whose first real chunk holds a single real token gets a point
    range, as a one-token first chunk does; a one-token chunk (a decode step, a last prefill chunk of one token:
    the decode append) changes nothing.
    slots [B or 1, >= p0 + n] bool (`attended_slots`): the slots, in slot order (`seated_mask`), that the chunk's
    last query attends; the others are pads, `neutralized` in the prefix appended again (also in the sink and ring:
    a slot that an earlier query of the chunk attends but the last does not, as under a sliding window, would be
    read as a copy; no caller passes such masks: KVQCache and the pass refuse sliding windows) and in each block of
    groups coded (the ring's tokens of earlier chunks with this chunk's: a pad copies a real token of its block, as
    one piece's copies one next to it, where the chunk's own neutralization may have copied one of another group),
    and left out of the static ranges taken from the chunk (their percentiles: `reference.static_channel_range`'s
    valid). A seated first chunk's slots are in its seated order, as its tokens are here. None, or shorter than
    p0 + n: no pads.
    fill: `sink_fill`'s copies of the chunk's tokens into the sink's pad slots, which `append` makes after this:
    their own slots here hold pads (`neutralized`; masked from then on), and a widening re-append counts them in
    the sink, as one piece seated holds them; a chunk that does not widen still takes its statistics with them (a
    fresh row's, taken from that chunk alone: without them, as one piece, its ranges were narrower and SmolLM2
    kvquant-4 worse, bench/RESULTS.md session 52)."""
    n = x.shape[2]
    if not q.quantized:
        b["data"][:, :, p0:p0 + n] = x.to(b["data"].dtype)
        return
    S, R, G = cfg.sink, cfg.recent, q.tokens_per_group
    wr = ring_size(R, G)
    dt = geo.torch_dtype
    static = q.axis is Axis.CHANNEL and q.group_size is None
    firsts = static or "norm" in b   # statistics kept from the first chunk
    a = slots if slots is not None and slots.shape[-1] >= p0 + n else None
    if p0 > 0 and n > 1 and firsts and fill_boundary(p0, S, R, G) == S:
        whole = torch.cat([_exact_prefix(b, p0, S, wr), x.to(dt)], dim=2)
        if a is not None:
            a = a[..., :p0 + n]
            if fill is not None:   # the sink's pad slots take the chunk's tokens past it (`append`): as one seated
                whole, a = _filled(whole, a, p0, fill)   # piece, those count in the sink, their own slots as pads
            whole = neutralized(a, whole)[0]
        append_side(b, q, cfg, geo, whole, 0, is_key, a)
        return
    fresh = None
    if p0 > S and n > 1 and a is not None and firsts:   # (rows whose real tokens so far all sit in the sink)
        fresh = fresh_rows(a[..., S:], p0 - S, n, geo.batch)
    first = statistics_start(max(S - p0, 0), n, a is not None)
    alone = None   # rows with fewer than 2 real tokens past the chunk's sink part: statistics over all of them
    if first and a is not None and firsts:
        stat_tokens, alone = statistics_tokens(a[..., p0:p0 + n].expand(geo.batch, n), first)
        alone = alone if bool(alone.any()) else None
    body = x[:, :, first:]
    rows = None if p0 == 0 else fresh
    if (p0 == 0 or fresh is not None) and "norm" in b:
        norm = ref.key_norm(body)
        if alone is not None:
            norm = torch.where(alone[:, None, None, None], ref.key_norm(x), norm)
        _set_rows(b["norm"], norm, rows)
    if (p0 == 0 or fresh is not None) and static:
        # over the real tokens: a pad holds a copy of one (`neutralized`), which would weigh in a percentile
        valid = None if a is None else a[..., p0 + first:p0 + n][:, None, :, None]
        if alone is not None:   # the whole chunk, its sink part counted for those rows alone
            body = x
            valid = stat_tokens[:, None, :, None]
        scaled = body.float() / b["norm"] if "norm" in b else body
        c, h = ref.static_channel_range(scaled, q, dt, cfg.eta_for(q), valid)
        if "center" in b:
            _set_rows(b["center"], c, rows)
        _set_rows(b["half"], h, rows)
    if fill is not None and a is not None:   # the tokens `append` copies into the sink: pads in their own slots
        x = neutralized(moved_out(a[..., p0:p0 + n].expand(geo.batch, n), fill[1], fill[2]), x)[0]
    q_old, q_new = code_boundary(p0, S, R, G), code_boundary(p0 + n, S, R, G)
    if q_new > q_old:
        parts = []
        if q_old < p0:  # tokens waiting in the ring
            slots = torch.arange(q_old, min(p0, q_new), device=x.device) % wr
            parts.append(b["ring"][:, :, slots])
        if q_new > p0:  # tokens of this chunk that are quantized straight away
            parts.append(x[:, :, max(q_old, p0) - p0:q_new - p0].to(dt))
        block = torch.cat(parts, dim=2)
        if a is not None:   # its pads (the ring's from earlier chunks too, and the tokens `append` moves into the
            keep = a[..., q_old:q_new].expand(geo.batch, q_new - q_old)   # sink) as copies of its own real tokens
            if fill is not None:
                keep = moved_out(keep, p0 + fill[1] - q_old, fill[2])
            block = neutralized(keep, block)[0]
        if "norm" in b:
            block = block.float() / b["norm"]
        qb = ref.quantize_block(block, q, _levels(b, q), dt, cfg.eta_for(q), _static_range(b) if static else None)
        if "codes" in b:  # absent when this layer dequantizes an earlier layer's codes (XQuant)
            b["codes"][:, :, q_old:q_new] = ref.pack_bits(qb.codes, q.bits)
        if not static:
            if q.axis is Axis.TOKEN:
                g0, g1 = q_old, q_new
            else:
                g0, g1 = (q_old - S) // G, (q_new - S) // G
            if "center" in b:
                b["center"][:, :, g0:g1] = qb.center
            b["half"][:, :, g0:g1] = signed_half(qb)
        if "out_val" in b:
            b["out_val"][:, :, q_old:q_new] = qb.outlier_values.to(dt)
            b["out_idx"][:, :, q_old:q_new] = qb.outlier_index
    if p0 < S:
        e = min(S, p0 + n)
        b["sink"][:, :, p0:e] = x[:, :, : e - p0].to(dt)
    lo = max(fill_boundary(p0 + n, S, R, G), p0)   # the chunk's tokens in the recent window
    if lo < p0 + n:
        slots = torch.arange(lo, p0 + n, device=x.device) % wr
        b["ring"][:, :, slots] = x[:, :, lo - p0:].to(dt)


def signed_half(qb: ref.QuantizedBlock) -> torch.Tensor:
    """The stored `half` of a block: the half-range, negated where a hybrid group chose symmetric levels (the
    half-range is never 0, `ref.EPS`, so the sign is free; no separate mask buffer to store or load)."""
    return qb.half if qb.mask is None else torch.where(qb.mask, -qb.half, qb.half)


def split_half(half: torch.Tensor, q: QuantizerSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(half-range, hybrid mask or None) of a stored `half` (`signed_half`)."""
    if q.symmetry is not Symmetry.HYBRID:
        return half, None
    return half.abs(), half < 0


def read_side(b: dict, q: QuantizerSpec, cfg: KVQConfig, head_dim: int, length: int, upto: int) -> torch.Tensor:
    """Positions [0, upto) of one side as float32 [B, H, upto, D], the store holding `length` tokens."""
    if not q.quantized:
        return b["data"][:, :, :upto].float()
    S, R, G = cfg.sink, cfg.recent, q.tokens_per_group
    bnd = fill_boundary(length, S, R, G)
    half = b["half"]
    parts = [torch.zeros(*half.shape[:2], 0, head_dim, device=half.device)]
    if S:
        parts.append(b["sink"][:, :, :min(S, upto)].float())
    qe = min(bnd, upto)
    if qe > S:
        codes = ref.unpack_bits(b["codes"][:, :, S:qe], q.bits, head_dim)
        if q.axis is Axis.TOKEN:
            sl = slice(S, qe)
        elif q.group_size is None:
            sl = slice(0, 1)
        else:
            sl = slice(0, -(-(qe - S) // G))
        half, mask = split_half(b["half"][:, :, sl], q)
        center = b["center"][:, :, sl] if "center" in b else torch.zeros_like(half)
        qb = ref.QuantizedBlock(codes, center, half, mask,
                                b["out_val"][:, :, S:qe] if "out_val" in b else None,
                                b["out_idx"][:, :, S:qe] if "out_idx" in b else None)
        if q.axis is Axis.CHANNEL and q.group_size is not None:
            x = _dequant_channel_groups(qb, q, _levels(b, q), qe - S)
        else:
            x = ref.dequantize_block(qb, q, _levels(b, q))
        if "norm" in b:
            x = x * b["norm"]
        parts.append(x)
    if upto > bnd:
        slots = torch.arange(bnd, upto, device=b["ring"].device) % ring_size(R, G)
        parts.append(b["ring"][:, :, slots].float())
    return torch.cat(parts, dim=2)


def _dequant_channel_groups(qb, q, levels, t):
    """Dequantize CHANNEL-grouped codes of t tokens (t need not be a multiple of G: the last group is cut)."""
    G = q.group_size
    pad = -t % G
    codes = torch.nn.functional.pad(qb.codes, (0, 0, 0, pad))
    vals = None if qb.outlier_values is None else torch.nn.functional.pad(qb.outlier_values, (0, 0, 0, pad))
    idx = None if qb.outlier_index is None else torch.nn.functional.pad(qb.outlier_index, (0, 0, 0, pad))
    full = ref.QuantizedBlock(codes, qb.center, qb.half, qb.mask, vals, idx)
    return ref.dequantize_block(full, q, levels)[:, :, :t]


def append(bufs: dict, cfg: KVQConfig, spec: LayerSpec, geo: Geometry, key: torch.Tensor, value: torch.Tensor,
           p0: int, cos=None, sin=None, slots: torch.Tensor | None = None) -> None:
    """Reference quantize-on-append for one layer. Keys arrive already un-rotated when stored before RoPE.
    slots: `append_side`'s (the chunk's attended slots, `kvq::append_chunk`'s `attended`)."""
    n = key.shape[2]
    if cos is not None and "rope.cos" in bufs:
        cos, sin = (c[:, 0] if c.dim() == 4 else c for c in (cos, sin))  # [B|1, 1, n, D] -> [B|1, n, D]
        bufs["rope.cos"][:, p0:p0 + n] = cos.to(bufs["rope.cos"].dtype).expand(geo.batch, n, geo.head_dim)
        bufs["rope.sin"][:, p0:p0 + n] = sin.to(bufs["rope.sin"].dtype).expand(geo.batch, n, geo.head_dim)
    fill = sink_fill(slots, p0, n, cfg.sink, geo.batch)
    append_side(_side(bufs, "k"), spec.key, cfg, geo, key, p0, True, slots, fill)
    append_side(_side(bufs, "v"), spec.value, cfg, geo, value, p0, False, slots, fill)
    if fill is not None:   # pad slots of the sink take the chunk's first real tokens past it (`seat_fresh_rows`)
        for name, x in (("k", key), ("v", value)):
            b = _side(bufs, name)
            _fill_rows(b["sink"] if "sink" in b else b["data"], x, *fill)
        if cos is not None and "rope.cos" in bufs:
            for name, c in (("rope.cos", cos), ("rope.sin", sin)):
                _fill_rows(bufs[name][:, None], c.expand(geo.batch, -1, -1)[:, None], *fill)
    if slots is not None and slots.shape[-1] >= p0 + n and n > 1:
        keep = slots[..., :p0 + n].expand(geo.batch, p0 + n)
        keep = keep if fill is None else filled_mask(keep, p0, fill)
        for name, q in (("k", spec.key), ("v", spec.value)):
            neutralize_open_group(_side(bufs, name), q, cfg, keep)


def neutralize_open_group(b: dict, q: QuantizerSpec, cfg: KVQConfig, keep: torch.Tensor) -> None:
    """After a chunk (of a prefill of length L = keep's): the pads among the ring's tokens of the group of G > 1
    tokens still open, [C(L), L), which a decode step codes with the tokens that complete it (`code_boundary`),
    as copies of real tokens, as one piece's (`neutralized` over the slots keep [B, L], `filled_mask`): the nearest
    real one after it among them, else the last real one in the sink (left padding seats the pads before a row's
    real tokens past the sink: a pad with no real token after it has none past the sink before it either). A
    chunk's own neutralization copied tokens of its own chunk (the next real one may come in a later chunk) or,
    where the chunk held none, left them as they were (the tokens `sink_fill` moved). Not one piece's where a chunk
    that started inside the sink put the row's sink tokens out of order (the last in slot order is then not the
    row's last)."""
    if not q.quantized or q.tokens_per_group < 2 or "ring" not in b:
        return
    L, S = keep.shape[-1], cfg.sink
    c = code_boundary(L, S, cfg.recent, q.tokens_per_group)
    if c >= L:
        return
    at = torch.arange(c, L, device=keep.device) % b["ring"].shape[2]
    ring = b["ring"][:, :, at]
    if S:
        ring = neutralized(torch.cat([keep[:, :S], keep[:, c:]], 1), torch.cat([b["sink"], ring], 2))[0][:, :, S:]
    else:
        ring = neutralized(keep[:, c:], ring)[0]
    b["ring"][:, :, at] = ring


def fresh_rows(slots: torch.Tensor, p0: int, n: int, batch: int) -> torch.Tensor | None:
    """[batch] bool: the rows that `slots` ([B or 1, >= p0 + n] bool, slot order) shows attending nothing before p0
    and something in the chunk [p0, p0 + n) (their first chunks held only left padding); None where no row does
    (read on the host: a chunk reads p0 there anyway)."""
    fresh = slots[..., p0:p0 + n].any(-1) & ~slots[..., :p0].any(-1)
    return fresh.expand(batch) if bool(fresh.any()) else None


def sink_fill(slots: torch.Tensor | None, p0: int, n: int, sink: int, batch: int):
    """A later chunk's rows whose sink holds pads, which take its first real tokens past the sink there: (dst [B, m]
    sink slots, src [B, m] chunk indices, ok [B, m]; m = min(sink, n - j)): the k-th sink slot that `slots`
    ([B or 1, >= p0 + n] bool, `attended_slots` in slot order) shows unattended takes the chunk's k-th attended token
    among those past the sink (chunk index >= j = max(sink - p0, 0)), for k below both counts (ok). A sink holds pads
    where a row's first chunks held fewer than `sink` real tokens (left padding up to or past a chunk boundary:
    `seating` put that chunk's real tokens first). A chunk at p0 < sink writes its first j tokens into the sink in
    place (its own pads there count as unattended sink slots) and fills only where it reaches past the sink
    (p0 + n > sink); with the later chunks' fills a row's sink then holds its first `sink` real tokens, as one piece
    seats them. None where no row takes any; chunks of n >= 2 tokens only (a decode step's append is
    `append_decode`'s). Reads on the host whether any row takes one (a chunk reads p0 there anyway)."""
    j = max(sink - p0, 0)
    if slots is None or sink == 0 or p0 == 0 or n < 2 or j >= n or slots.shape[-1] < p0 + n:
        return None
    s = slots.expand(batch, slots.shape[-1])
    empty, a = ~s[:, :sink], s[:, p0 + j:p0 + n]
    if not bool((empty.any(-1) & a.any(-1)).any()):
        return None
    m = min(sink, n - j)
    # the unattended sink slots first, the attended chunk tokens first, each in order (stable sorts)
    dst = torch.sort((~empty).to(torch.uint8), dim=-1, stable=True).indices[:, :m]
    src = torch.sort((~a).to(torch.uint8), dim=-1, stable=True).indices[:, :m] + j
    k = torch.arange(m, device=s.device)
    ok = (k < empty.sum(-1, keepdim=True)) & (k < a.sum(-1, keepdim=True))
    return dst, src, ok


def _fill_rows(buf: torch.Tensor, x: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, ok: torch.Tensor) -> None:
    """buf[b, :, dst[b, j]] = x[b, :, src[b, j]] where ok[b, j] (buf, x [B, H, *, D]; `sink_fill`)."""
    B, m = src.shape
    x = x.expand(B, *x.shape[1:])
    rows = lambda i, t: i[:, None, :, None].expand(B, t.shape[1], m, t.shape[3])  # noqa: E731
    picked = x.gather(2, rows(src, x)).to(buf.dtype)
    buf.scatter_(2, rows(dst, buf), torch.where(ok[:, None, :, None], picked, buf.gather(2, rows(dst, buf))))


def read(bufs: dict, cfg: KVQConfig, spec: LayerSpec, head_dim: int, length: int, upto: int):
    """(K, V) float32 [B, H, upto, D] as attention sees them; Keys stored before RoPE are rotated back."""
    k = read_side(_side(bufs, "k"), spec.key, cfg, head_dim, length, upto)
    v = read_side(_side(bufs, "v"), spec.value, cfg, head_dim, length, upto)
    if cfg.keys_before_rope and upto:
        k = ref.rope_rotate(k, bufs["rope.cos"][:, :upto].float(), bufs["rope.sin"][:, :upto].float())
    return k, v


# ---------------------------------------------------------------------------------------------
# Sync-free append of one token (decode), for CUDA graphs
# ---------------------------------------------------------------------------------------------
def _device_fill_boundary(length: torch.Tensor, sink: int, recent: int, tpg: int) -> torch.Tensor:
    return sink + torch.clamp(length - sink - recent, min=0) // tpg * tpg


def _device_code_boundary(length: torch.Tensor, sink: int, recent: int, tpg: int) -> torch.Tensor:
    return _device_fill_boundary(length, sink, 0 if EAGER_GROUPS else recent, tpg)


def _write_rows(buf: torch.Tensor, dim: int, index: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> None:
    """buf[index along dim] = rows where `keep` is False, unchanged where True (index clamped in range)."""
    index = index.clamp(0, buf.shape[dim] - 1)
    old = buf.index_select(dim, index)
    buf.index_copy_(dim, index, torch.where(keep, old, rows.to(buf.dtype)))


def append_side_decode(b: dict, q: QuantizerSpec, cfg: KVQConfig, geo: Geometry, x: torch.Tensor,
                       p0: torch.Tensor, is_key: bool) -> None:
    """`append_side` for one token at device position p0 (a 0-d tensor): the same writes, without reading
    p0 on the host. Every branch of `append_side` becomes a masked write of fixed shape; the token group
    that may complete is always quantized (with `reference.quantize_block`) and written only if it did."""
    if not q.quantized:
        b["data"].index_copy_(2, p0.reshape(1), x.to(b["data"].dtype))
        return
    S, R, G = cfg.sink, cfg.recent, q.tokens_per_group
    wr = ring_size(R, G)
    dt = geo.torch_dtype
    dev = x.device
    first = (p0 == 0).view(1, 1, 1, 1)  # a one-token first chunk sets what `append_side` sets at p0 == 0
    if "norm" in b:
        b["norm"].copy_(torch.where(first, ref.key_norm(x), b["norm"]))
    static = q.axis is Axis.CHANNEL and q.group_size is None
    if static:
        scaled = x.float() / b["norm"] if "norm" in b else x
        c, h = ref.static_channel_range(scaled, q, dt, cfg.eta_for(q))
        if "center" in b:
            b["center"].copy_(torch.where(first, c, b["center"]))
        b["half"].copy_(torch.where(first, h, b["half"]))
    q_old = _device_code_boundary(p0, S, R, G)
    q_new = _device_code_boundary(p0 + 1, S, R, G)
    no_flush = (q_new <= q_old)
    pos = q_old + torch.arange(G, device=dev)  # the group that completes when q_new > q_old
    block = x.expand(-1, -1, G, -1)
    if wr:
        ring_part = b["ring"].index_select(2, pos % wr)
        block = torch.where((pos == p0).view(1, 1, G, 1), block, ring_part)
    block = block.to(dt)
    if "norm" in b:
        block = block.float() / b["norm"]
    qb = ref.quantize_block(block, q, _levels(b, q), dt, cfg.eta_for(q), _static_range(b) if static else None)
    keep = no_flush.view(1, 1, 1, 1)
    if "codes" in b:
        _write_rows(b["codes"], 2, pos, ref.pack_bits(qb.codes, q.bits), keep)
    if not static:
        gidx = pos if q.axis is Axis.TOKEN else ((q_old - S) // G).reshape(1)
        if "center" in b:
            _write_rows(b["center"], 2, gidx, qb.center, keep)
        _write_rows(b["half"], 2, gidx, signed_half(qb), keep)
    if "out_val" in b:
        _write_rows(b["out_val"], 2, pos, qb.outlier_values, keep)
        _write_rows(b["out_idx"], 2, pos, qb.outlier_index, keep)
    if S:
        _write_rows(b["sink"], 2, p0.reshape(1), x, (p0 >= S).view(1, 1, 1, 1))
    if wr:  # after the group was read out of the ring: the new token may reuse its slot
        _write_rows(b["ring"], 2, (p0 % wr).reshape(1), x,
                    (_device_fill_boundary(p0 + 1, S, R, G) > p0).view(1, 1, 1, 1))


def append_decode(bufs: dict, cfg: KVQConfig, spec: LayerSpec, geo: Geometry, key: torch.Tensor,
                  value: torch.Tensor, positions: torch.Tensor, cos=None, sin=None) -> None:
    """`append` of one token per sequence at positions[0], with no host synchronization."""
    p0 = positions.reshape(-1)[0]
    if cos is not None and "rope.cos" in bufs:
        cos, sin = (c[:, 0] if c.dim() == 4 else c for c in (cos, sin))
        for name, c in (("rope.cos", cos), ("rope.sin", sin)):
            bufs[name].index_copy_(1, p0.reshape(1), c.to(bufs[name].dtype).expand(geo.batch, 1, geo.head_dim))
    append_side_decode(_side(bufs, "k"), spec.key, cfg, geo, key, p0, True)
    append_side_decode(_side(bufs, "v"), spec.value, cfg, geo, value, p0, False)


def attended(attention_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """[B or 1, n] bool: which tokens of a chunk at `positions` its last query attends to (a padded row's real
    tokens; that query is a real token), from a bool (True = attend) or additive [B, 1 or Hq, q, T] mask; None for
    any other shape. Positions past the mask read its last column (the append refuses them with its own error)."""
    if attention_mask.dim() != 4:
        return None
    row = attention_mask[:, 0, -1]
    last = row.index_select(-1, positions.clamp(max=row.shape[-1] - 1))
    return last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min


def attended_slots(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[B or 1, T] bool: the slots that a chunk's last query attends (a padded row's real tokens before it and in the
    chunk; that query is a real token), from a bool (True = attend) or additive [B, 1 or Hq, q, T] mask in slot
    order (`seated_mask`); None for any other mask. A chunk's append (`append_side`) reads from it which of its
    prefix's slots are pads and which rows saw no real token before it, without reading anything on the host
    (compiled chunks)."""
    if attention_mask is None or attention_mask.dim() != 4:
        return None
    row = attention_mask[:, 0, -1]
    return row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min


def neutralize_pads(attention_mask: torch.Tensor, positions: torch.Tensor, *sides: torch.Tensor):
    """`neutralized` sides of a chunk at `positions`, its masked tokens read from `attended` (left padding); any
    other mask shape: sides unchanged."""
    keep = attended(attention_mask, positions)
    return list(sides) if keep is None else neutralized(keep, *sides)


def neutralized(keep: torch.Tensor, *sides: torch.Tensor):
    """sides [B, H, n, D] with each token not kept (`keep` [B or 1, n] bool: a pad) replaced by the nearest kept
    token after it in its row (before it where none follows; a row with none is left as it is). Attention never
    reads a pad, but quantization statistics would: a pad widens the groups over tokens it shares, InnerQ's Key
    normalization and KVQuant's static channel ranges (taken over the prefill). The nearest real token after a
    block of left padding is the row's first (or, seated, the first after its sink: `seating`). The copies leave
    minima, maxima and maxima of magnitude (InnerQ's Key norm) as the real tokens have them; a percentile (KVQuant's
    outlier ranges) would move towards the copied token (P copies among n + P tokens), so the append takes it over
    the real tokens alone (`append_side`'s slots, `reference.static_channel_range`'s valid). `keep` comes from the
    chunk's last query (`attended`): a token that an earlier query attends but the last does not (a sliding
    window) is replaced too; later queries do not attend it either."""
    n = keep.shape[-1]
    at = torch.arange(n, device=keep.device).expand_as(keep)
    nxt = torch.where(keep, at, n).flip(-1).cummin(-1).values.flip(-1)
    prev = torch.where(keep, at, -1).cummax(-1).values
    src = torch.where(nxt < n, nxt, prev)
    src = torch.where(src < 0, at, src)                     # a row with no kept token
    out = []
    for x in sides:
        idx = src.expand(x.shape[0], n)[:, None, :, None].expand(-1, x.shape[1], n, x.shape[3])
        out.append(x.gather(2, idx))
    return out


def seating(keep: torch.Tensor, sink: int) -> torch.Tensor:
    """[B, n] int64 slot -> token of a first chunk (`keep` [B, n] bool: its attended tokens) reordered per row as
    its first `sink` real tokens, then its pads, then its other real tokens, each in its order. A left-padded row's
    sink then holds its first real tokens, and its pads sit in the quantized region (masked, `neutralized`) rather
    than in the recent window. KVQCache's eager first chunk and the backend's absorbed prefill; later masks are
    read through `seated_mask`."""
    real = keep.long()
    rank = real.cumsum(-1) - 1                       # a real token's rank among its row's real tokens
    prank = (1 - real).cumsum(-1) - 1                # a pad's among the pads
    pads = (1 - real).sum(-1, keepdim=True)
    head = real.sum(-1, keepdim=True).clamp(max=sink)
    slot = torch.where(keep, rank + (rank >= sink) * pads, head + prank)
    return slot.argsort(-1)


def seat(x: torch.Tensor, seats: torch.Tensor, dim: int) -> torch.Tensor:
    """x [B, ..., n, ...] (token axis `dim`, batch 1 broadcast) with token seats[b, s] of row b at slot s."""
    B, n = seats.shape
    x = x.expand(B, *x.shape[1:])
    shape = [1] * x.dim()
    shape[0], shape[dim] = B, n
    return x.gather(dim, seats.view(shape).expand(*x.shape[:dim], n, *x.shape[dim + 1:]))


def seat_first_chunk(seats: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor,
                     sink: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A compiled chunk's seating (`kvq::seat_chunk`; an eager first chunk of KVQCache is seated by
    `hf.KVQLayer.seat_rows`, the backend's absorbed prefill by `_StepRunner.absorb`). Returns (chunk [B, n]: slot ->
    token within the chunk, read [B, T]: the seats this step's mask is read through, `seated_mask`). A first chunk
    (positions from 0) is seated (`seating`) and `seats` [B, T] becomes its order, then the identity: later steps
    read their masks through it, and what a previous sequence left there is gone; the chunk's own mask is read
    unseated (its attention takes the chunk's K/V as they come), its append's slots seated by `chunk` (`seated_mask`:
    the append stores the chunk seated). A later chunk: the identity within it, and the prefix's columns through
    `seats`, except that rows whose sink holds pads take its first real tokens past the sink there
    (`seat_fresh_rows`: their seats change, this chunk's mask is read through them as they were before). Reads its
    start position on the host (chunks do: `ops.chunk_ops`). No mask (a maskless chunk: no pads): a first chunk
    makes `seats` the identity, a later one changes nothing."""
    B, T = seats.shape
    n = positions.shape[0]
    identity = torch.arange(T, device=seats.device).expand(B, T)
    p0 = int(positions[0])
    if attention_mask is None:
        if p0 == 0:
            seats.copy_(identity)
        return identity[:, :n].clone(), seats.clone()
    if p0 != 0:
        return identity[:, :n].clone(), seat_fresh_rows(seats, attention_mask, p0, n, sink)
    keep = attended(attention_mask, positions)
    chunk = identity[:, :n].clone() if keep is None else seating(keep.expand(B, n), sink)
    seats.copy_(torch.cat([chunk, identity[:, n:]], -1))
    return chunk, identity.clone()


def seat_fresh_rows(seats: torch.Tensor, attention_mask: torch.Tensor, p0: int, n: int, sink: int) -> torch.Tensor:
    """A later chunk (at p0 > 0, n tokens) of rows whose sink holds pads (their first chunks held fewer than `sink`
    real tokens: left padding up to or past a chunk boundary). Such a row's unattended sink slots take its first
    real tokens of the chunk past the sink (`sink_fill`; a chunk at p0 < sink writes the sink slots it reaches in
    place, its pads there among the unattended): the append copies them there (`append`), and here each such slot
    and the token's own slot trade mask columns in `seats` (in place), so later steps read the sink slot as that
    token and its own slot as the sink slot's pad column (masked). Returns the seats this chunk's own mask is read
    through: the seats as they were before the trade. Every layer's call gives the same (KVQCache calls it per
    layer): the slots are decided from the mask and the seats with this chunk's trades undone (a slot before the
    chunk already seated at a column >= p0 counts as unattended, the chunk's slots read their own columns), and a
    row already traded is left as it is (its first sink slot seated at a token past the sink and the chunk's
    start: before the trade a slot before the chunk reads a column < p0, one of the chunk's its own, < sink)."""
    B, T = seats.shape
    if attention_mask.dim() != 4 or attention_mask.shape[-1] != T or p0 == 0 or p0 + n <= sink:
        return seats.clone()   # (a first chunk, or one that ends inside the sink: nothing to fill)
    raw = attended_slots(attention_mask).expand(B, T)
    att = raw.gather(1, seats) & (seats < p0)
    att[:, p0:p0 + n] = raw[:, p0:p0 + n]
    fill = sink_fill(att, p0, n, sink, B)
    if fill is None:
        return seats.clone()
    dst, src, ok = fill
    own = p0 + src
    at_dst, at_own = seats.gather(1, dst), seats.gather(1, own)
    traded = seats.clone()
    traded.scatter_(1, dst, torch.where(ok, at_own, at_dst))
    traded.scatter_(1, own, torch.where(ok, at_dst, at_own))
    rows = ok[:, :1]
    done = rows & (at_dst[:, :1] >= max(p0, sink))   # traded by an earlier layer's call: undone, the seats before
    read = torch.where(done, traded, seats)
    seats.copy_(torch.where(rows & ~done, traded, seats))
    return read


def seated_chunk(keep: torch.Tensor | None, chunk: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor,
                 cos: torch.Tensor | None, sin: torch.Tensor | None, neutralize: bool = True):
    """(key, value, cos, sin) of a chunk as the append stores it: in `chunk`'s order ([B, n] slot -> token:
    `seating`, `seat_first_chunk`; None: as it comes; token axis -2: K/V [B, H, n, D], the RoPE rows [n, D],
    [B|1, n, D] or [B|1, 1, n, D]) with its pads `neutralized` where `neutralize` (a layer that quantizes
    something) and `keep` ([B or 1, n] bool in token order, `attended`) is given. KVQCache's first chunks (eager
    and compiled), the rewrite's chunk graphs and the backend's absorbed prefill."""
    def put(x):   # (a [n, D] RoPE table as [1, n, D])
        if x is None or chunk is None:
            return x
        return seat(x if x.dim() > 2 else x[None], chunk, max(x.dim(), 3) - 2)

    key, value, cos, sin = put(key), put(value), put(cos), put(sin)
    if neutralize and keep is not None:
        if chunk is not None:
            keep = keep.expand(chunk.shape[0], -1).gather(-1, chunk)
        key, value = neutralized(keep, key, value)
    return key, value, cos, sin


def seated_mask(mask: torch.Tensor | None, seats: torch.Tensor | None) -> torch.Tensor | None:
    """mask [B or 1, 1 or Hq, q, T] with its first n columns in `seats`' ([B, n]) order: slot s reads column
    seats[b, s] (`ModelStore.seats`); None or another shape: unchanged."""
    if seats is None or mask is None or mask.dim() != 4:
        return mask
    B, n = seats.shape
    m = mask.expand(B, *mask.shape[1:])
    head = m[..., :n].gather(-1, seats[:, None, None, :].expand(B, m.shape[1], m.shape[2], n))
    return head if n == m.shape[-1] else torch.cat([head, m[..., n:]], -1)
