"""The FX pass: find each layer's KV-cache append and the attention that reads the cache back, and
rewrite them into `kvq::append` / `kvq::attend` over a packed store (a decode step's pair into one
`kvq::append_attend` where `rewrite`'s append_beside asks for it).

It runs on the Dynamo graph (before AOTAutograd), walking it by hand: Inductor's pattern matcher drops
matches that cross the cache mutation. Per attention layer it proves, from node targets and fake shapes:

    keys_cache.index_copy_(2, pos, k)        | keys_cache[:, :, pos] = k  | keys_cache.index_put_((.., .., pos), k)
    values_cache.<same>(2, pos, v)           (same positions node)
    key = repeat_kv(keys_cache)              getitem[:, :, None] / expand / reshape, repeat_interleave(r, 1),
                                             or none with enable_gqa=True (or no GQA)
    out = scaled_dot_product_attention(q, key, value, attn_mask, dropout_p=0, is_causal, scale)

and, for configs that store Keys before RoPE, k = pre*cos + cat(-pre[..., h:], pre[..., :h])*sin.
Anything else is left unchanged with a recorded reason; nothing outside the match is touched.
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

log = logging.getLogger("kvq_compile")

_SDPA = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}
_NOOP_METHODS = {"contiguous"}


def _val(node):
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


@dataclass
class Rotary:
    pre_key: fx.Node
    cos: fx.Node
    sin: fx.Node


@dataclass
class AttentionMatch:
    """One attention layer the pass can rewrite."""

    k_cache: fx.Node
    v_cache: fx.Node
    k_append: fx.Node
    v_append: fx.Node
    positions: fx.Node
    k_new: fx.Node
    v_new: fx.Node
    sdpa: fx.Node
    query: fx.Node
    attn_mask: fx.Node | None
    is_causal: bool
    scale: float
    read_chain: list[fx.Node]
    rotary: Rotary | None = None


@dataclass
class RewriteReport:
    """What the pass did: rewritten layers and, for every candidate left alone, why."""

    rewritten: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def skip(self, node, reason: str):
        name = node.name if isinstance(node, fx.Node) else str(node)
        self.skipped.append((name, reason))
        log.info("kvq: left %s unchanged: %s", name, reason)

    def __str__(self):
        lines = [f"kvq rewrite: {len(self.rewritten)} attention layer(s) rewritten, {len(self.skipped)} left unchanged"]
        lines += [f"  rewritten: {r}" for r in self.rewritten]
        lines += [f"  unchanged: {n}: {why}" for n, why in self.skipped]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Matching
# ---------------------------------------------------------------------------------------------
def _is_full_slice(x):
    return isinstance(x, slice) and x == slice(None, None, None)


def _append_of(node: fx.Node):
    """(cache placeholder, positions, new values) if node appends along dim 2 of a 4-D cache, else None."""
    if node.op == "call_method" and node.target == "index_copy_" and len(node.args) == 4:
        cache, dim, pos, src = node.args
        if dim in (2, -2):
            return cache, pos, src
    if node.op == "call_method" and node.target == "index_put_" and len(node.args) >= 3:
        cache, idx, src = node.args[:3]
        if isinstance(idx, (tuple, list)) and len(idx) == 3 and idx[0] is None and idx[1] is None:
            return cache, idx[2], src
    if node.op == "call_function" and node.target is operator.setitem:
        cache, idx, src = node.args
        if (isinstance(idx, tuple) and len(idx) == 3 and _is_full_slice(idx[0]) and _is_full_slice(idx[1])
                and isinstance(idx[2], fx.Node)):
            return cache, idx[2], src
    return None


def _repeat_chain(node: fx.Node, query_heads: int):
    """Walk SDPA's key/value argument back to the cache it reads. Returns (cache, chain nodes, reason).
    Accepts exactly the repeat-KV forms that map query head h to cache head h // (query_heads // H)."""
    chain = []
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in _NOOP_METHODS:
        chain.append(node)
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return None, chain, "attention key/value is not a graph value"
    if node.op == "placeholder":
        return node, chain, None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name == "repeat_interleave":  # x.repeat_interleave(n_rep, dim=1)
        src = node.args[0]
        reps = _arg(node, 1, "repeats")
        dim = _arg(node, 2, "dim")
        if isinstance(src, fx.Node) and src.op == "placeholder" and dim == 1:
            if reps == query_heads // _val(src).shape[1]:
                return src, chain + [node], None
        return None, chain, f"repeat_interleave({reps}, dim={dim}) is not repeat-KV over heads"
    if name in ("reshape", "view"):  # x[:, :, None, :, :].expand(B, H, n_rep, T, D).reshape(B, H * n_rep, T, D)
        exp = node.args[0]
        if isinstance(exp, fx.Node) and exp.op == "call_method" and exp.target == "expand":
            gi = exp.args[0]
            idx = gi.args[1] if isinstance(gi, fx.Node) and gi.target is operator.getitem else None
            if (isinstance(idx, tuple) and len(idx) >= 3 and idx[2] is None
                    and all(_is_full_slice(s) for s in idx[:2] + idx[3:])
                    and isinstance(gi.args[0], fx.Node) and gi.args[0].op == "placeholder"):
                src, out = _val(gi.args[0]), _val(node)
                if src is not None and out is not None and src.dim() == 4 and tuple(out.shape) == (
                        src.shape[0], query_heads, *src.shape[2:]) and query_heads % src.shape[1] == 0:
                    return gi.args[0], chain + [node, exp, gi], None
    return None, chain, f"attention reads {node.format_node()[:80]!r}, not a cache placeholder through repeat-KV"


# the ops a write index may come through (back to the graph inputs): offsets, ranges, casts and views keep it the
# written length the store counts; anything else (a ring buffer's `pos % W` in any spelling, a clamp, a table lookup)
# may not. Positions computed outside the graph are trusted.
_POSITION_OPS = {"add", "iadd", "__add__", "__radd__", "arange", "view", "reshape", "to", "_to_copy", "type", "long",
             "int", "unsqueeze", "squeeze", "expand", "contiguous", "clone", "detach", "size", "sym_size", "getitem"}


def _non_monotone_producer(pos) -> str | None:
    """The name of the first op among the positions' producers (back to the graph inputs) that is not known to keep a
    write index monotone (`_POSITION_OPS`; a getitem only with a constant index), else None."""
    seen, todo = set(), [pos]
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if n.op in ("call_function", "call_method"):
            name = n.target if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))
            name = name.split(".")[0]   # aten overloads (sym_size.int)
            index = []
            if name == "getitem":   # a tensor index is a lookup (`table[pos]`), a constant one a slice or element
                fx.node.map_arg(n.args[1:], index.append)
            if name not in _POSITION_OPS or any(isinstance(_val(x), torch.Tensor) for x in index):
                return name
        todo.extend(n.all_input_nodes)
    return None


def _arg(node: fx.Node, pos: int, name: str, default=None):
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def _match_rotary(k: fx.Node) -> Rotary | None:
    """k = pre * cos + cat((-pre[..., h:], pre[..., :h]), -1) * sin (HuggingFace rotate_half)."""
    if not (isinstance(k, fx.Node) and k.op == "call_function" and k.target is operator.add):
        return None
    a, b = k.args
    for m1, m2 in ((a, b), (b, a)):
        if not all(isinstance(m, fx.Node) and m.target is operator.mul for m in (m1, m2)):
            continue
        pre, cos = m1.args
        cat, sin = m2.args
        if not (isinstance(cat, fx.Node) and cat.target is torch.cat):
            continue
        parts = cat.args[0]
        if len(parts) != 2:
            continue
        neg, x1 = parts
        if not (isinstance(neg, fx.Node) and neg.target is operator.neg):
            continue
        x2 = neg.args[0]
        if not all(isinstance(x, fx.Node) and x.target is operator.getitem and x.args[0] is pre for x in (x1, x2)):
            continue
        d = _val(pre).shape[-1]
        if x1.args[1] == (Ellipsis, slice(None, d // 2, None)) and x2.args[1] == (Ellipsis, slice(d // 2, None, None)):
            return Rotary(pre, cos, sin)
    return None


def find_attention(gm: fx.GraphModule, keys_before_rope: bool, report: RewriteReport) -> list[AttentionMatch]:
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    appends = {}
    for node in graph.nodes:
        a = _append_of(node)
        if a is not None:
            cache = a[0]
            if not (isinstance(cache, fx.Node) and cache.op == "placeholder"):
                report.skip(node, "append target is not a graph input (cache placeholder)")
                continue
            if cache in appends:
                report.skip(cache, "cache is appended to more than once in one step")
                appends[cache] = None
                continue
            appends[cache] = (node, *a[1:])
    matches, explained, matched = [], set(), set()
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        q = _arg(node, 0, "query")
        qv = _val(q)
        dropout = _arg(node, 4, "dropout_p", 0.0)
        if dropout != 0.0:
            report.skip(node, f"dropout_p={dropout}: attention with dropout is not a cache read")
            continue
        kv_nodes = [_arg(node, 1, "key"), _arg(node, 2, "value")]
        kvv = _val(kv_nodes[0])
        if qv is None or kvv is None or qv.dim() != 4:
            report.skip(node, "attention inputs have no 4-D fake value to check shapes")
            continue
        found, reason = [], None
        for kv in kv_nodes:
            cache, chain, why = _repeat_chain(kv, qv.shape[1])
            if cache is None:
                reason = why
                break
            found.append((cache, chain))
        if reason:
            report.skip(node, reason)
            continue
        (k_cache, k_chain), (v_cache, v_chain) = found
        explained.update((k_cache, v_cache))  # any skip below already names these caches' attention
        if k_cache is v_cache:
            report.skip(node, f"{k_cache.name} serves as both keys and values")
            continue
        # (a second reader of a cache fails the users checks below first; kept as a guard for forms that pass them)
        taken = next((c for c in (k_cache, v_cache) if c in matched), None)
        if taken is not None:
            report.skip(node, f"{taken.name} is read by an earlier attention too")
            continue
        inside = {node, *k_chain, *v_chain}
        shared = next(((n, u) for n in k_chain + v_chain for u in n.users
                       if u not in inside and not _metadata_only(u)), None)
        if shared is not None:
            report.skip(node, f"the repeated cache {shared[0].name} is also used by {shared[1].format_node()[:60]!r}")
            continue
        enable_gqa = node.kwargs.get("enable_gqa", False)
        if not k_chain and _val(k_cache).shape[1] != qv.shape[1] and not enable_gqa:
            report.skip(node, "query and cache head counts differ without repeat-KV or enable_gqa")
            continue
        problem = None
        for cache in (k_cache, v_cache):
            if appends.get(cache) is None:
                problem = f"{cache.name} is read by attention but not appended to in this graph (e.g. cross-attention)"
                break
            cv = _val(cache)
            if cv.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                problem = f"unsupported cache dtype {cv.dtype} for {cache.name}"
                break
            chain = k_chain if cache is k_cache else v_chain
            allowed = {appends[cache][0], *(chain[-1:] if chain else [node])}
            others = [u for u in cache.users if u not in allowed and not _metadata_only(u)]
            if others:
                problem = f"{cache.name} is also used by {others[0].format_node()[:60]!r}, not only append and attention"
                break
            if order[appends[cache][0]] > order[node]:
                problem = f"{cache.name} is appended after attention reads it"
                break
        if problem:
            report.skip(node, problem)
            continue
        k_app, k_pos, k_new = appends[k_cache]
        v_app, v_pos, v_new = appends[v_cache]
        if k_pos is not v_pos:
            report.skip(node, "keys and values are appended at different position tensors")
            continue
        wrap = _non_monotone_producer(k_pos)
        if wrap is not None:
            report.skip(node, f"append positions come through {wrap!r}, not only offsets, ranges and casts (e.g. a "
                              "ring buffer's wrap-around): the store needs the written length")
            continue
        if k_app.users or v_app.users:
            report.skip(node, "the append's result is used")
            continue
        mask = _arg(node, 3, "attn_mask")
        max_len = _val(k_cache).shape[2]
        if mask is None and not _arg(node, 5, "is_causal", False):
            report.skip(node, "attention without a mask or is_causal reads every cache slot, written or not")
            continue
        if mask is not None:
            mv = _val(mask)
            if mv is None or mv.shape[-1] != max_len:
                report.skip(node, f"attention mask's last dim is not the cache length {max_len}")
                continue
        scale = _arg(node, 6, "scale")
        if isinstance(scale, fx.Node):
            report.skip(node, "attention scale is a tensor")
            continue
        rotary = None
        if keys_before_rope:
            rotary = _match_rotary(k_new)
            if rotary is None:
                report.skip(node, "keys_before_rope: the appended key is not recognized as x*cos + rotate_half(x)*sin")
                continue
        matched.update((k_cache, v_cache))
        matches.append(AttentionMatch(
            k_cache, v_cache, k_app, v_app, k_pos, k_new, v_new, node, q, mask,
            bool(_arg(node, 5, "is_causal", False)),
            float(scale) if scale is not None else 1 / math.sqrt(qv.shape[-1]),
            k_chain + v_chain, rotary))
    used = {m.k_cache for m in matches} | {m.v_cache for m in matches}
    for cache, a in appends.items():
        if a is not None and cache not in used and cache not in explained:
            report.skip(a[0], f"append to {cache.name} feeds no recognized attention")
    return matches


# ---------------------------------------------------------------------------------------------
# Rewriting
# ---------------------------------------------------------------------------------------------
_METADATA_METHODS = {"size", "dim", "stride", "numel", "element_size", "get_device"}
_METADATA_ATTRS = {"shape", "dtype", "device", "ndim"}


def _metadata_only(node: fx.Node) -> bool:
    """A use that reads the cache tensor's metadata, never its values (HF's mask code calls keys.size() on
    some devices): it stays valid after the rewrite, which keeps the cache tensor's shape."""
    if node.op == "call_method" and node.target in _METADATA_METHODS:
        return True
    if node.op == "call_function" and node.target is getattr and len(node.args) > 1:
        return node.args[1] in _METADATA_ATTRS
    return node.op == "call_function" and node.target in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int)


def _pads_to_neutralize(graph: fx.Graph, m: AttentionMatch, append_op, layer) -> bool:
    """Whether a chunk's append takes its K/V through `store.neutralize_pads` (its left padding replaced by real
    tokens, so that pads stay out of the quantization statistics): a chunk (not a decode token), a mask computed
    before the append, and something quantized."""
    if append_op is not torch.ops.kvq.append_chunk.default or not isinstance(m.attn_mask, fx.Node):
        return False
    if not (layer.spec.key.quantized or layer.spec.value.quantized):
        return False
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order[m.attn_mask] < order[m.v_append] and getattr(_val(m.attn_mask), "dim", lambda: 0)() == 4


def _chunk_mask(graph: fx.Graph, matches: list[AttentionMatch], append_op) -> bool:
    """Whether a chunk graph's layers read one 4-D mask node computed (as the first layer's positions) before the
    first append: what `store.attended_slots` reads."""
    mask, positions = matches[0].attn_mask, matches[0].positions
    if append_op is not torch.ops.kvq.append_chunk.default or not isinstance(mask, fx.Node) \
            or getattr(_val(mask), "dim", lambda: 0)() != 4 or any(m.attn_mask is not mask for m in matches):
        return False
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(order[m.v_append] for m in matches)
    return order[mask] < first and order[positions] < first


def _chunk_seating(graph: fx.Graph, matches: list[AttentionMatch], model_store, append_op) -> str | None:
    """Why a chunk graph's first chunk cannot be seated in the graph (`kvq::seat_chunk`), or "" where it can: a
    config with a sink (the store has seats), one [B, 1|Hq, q, T] mask node for every layer, computed (as the
    first layer's positions) before the first append. None also for graphs that need no seating (decode steps, no
    sink). Every chunk graph of a sink config takes it, also later chunks and unpadded prompts (their
    permutation is the identity): one host read of the start position, as the chunk ops do, and per layer a
    gather of K, V (and the RoPE rows) over the chunk. "maskless": a chunk graph without a mask (is_causal). A
    chunk graph not seated by its mask (maskless, or any reason returned) takes the op without one (`rewrite`),
    which makes a first chunk's seats the identity, as the chunk is stored in token order (a new sequence after a
    left-padded one read its masks through that one's seats before), and gathers nothing."""
    if append_op is not torch.ops.kvq.append_chunk.default or model_store.seats is None:
        return None
    mask, positions = matches[0].attn_mask, matches[0].positions
    if not isinstance(mask, fx.Node):   # no mask (is_causal, or none at all): no pads to seat
        return "maskless"
    if getattr(_val(mask), "dim", lambda: 0)() != 4 \
            or _val(mask).shape[-1] != model_store.seats.shape[1]:
        return "its mask is not one [B, 1 or Hq, q, max_len] tensor"
    if any(m.attn_mask is not mask for m in matches):   # (positions: every layer's hold the same values, as
        return "its layers read different masks"           # the backend's `_StepRunner` assumes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(order[m.v_append] for m in matches)
    if order[mask] > first or order[positions] > first:
        return "its mask is computed after an append"
    return ""


def rewrite(gm: fx.GraphModule, matches: list[AttentionMatch], model_store, register_buffer,
            append_beside: bool = False, keep_fp16: bool = False) -> list[tuple]:
    """Replace each match's appends with kvq::append and its attention with kvq::attend (their `chunk_ops` twins for
    chunks of several tokens). Returns the ops of each match: (append, attend), or (append_attend,).
    append_beside: a decode step's pair becomes one kvq::append_attend in the attention's place, where its attention
    reads nothing its append writes (`store.attention_independent`) and the Keys are stored after RoPE: its CUDA
    kernel then launches the append beside the attention (`decode_attention`'s append).

    keep_fp16: leave the appends into the fp16 cache in place (`kvq_backend(release_fp16_cache=False)`: that cache
    then stays whole, so that eager code reading it later, e.g. a next turn's prefill, sees every token).

    register_buffer(gm, name, tensor) -> name: makes a store tensor a get_attr of gm (compat hook)."""
    from kvq_compile import store as st
    from kvq_compile.ops import chunk_ops

    graph = gm.graph
    attr_names: dict[int, str] = {}
    emitted = []

    def getattrs(names, tensors, before, layer):
        nodes = []
        for n, t in zip(names, tensors):
            if id(t) not in attr_names:
                attr = f"kvq_store_l{layer}_{n.replace('.', '_')}"
                attr_names[id(t)] = register_buffer(gm, attr, t)
            with graph.inserting_before(before):
                nodes.append(graph.get_attr(attr_names[id(t)]))
        return nodes

    def seats_attr() -> str:
        """The get_attr name of the store's seats, registered once."""
        if id(model_store.seats) not in attr_names:
            attr_names[id(model_store.seats)] = register_buffer(gm, "kvq_store_seats", model_store.seats)
        return attr_names[id(model_store.seats)]

    seated: dict[fx.Node, fx.Node] = {}
    reset: list[fx.Node] = []   # a chunk graph's kvq::seat_chunk without a mask, once: masks are read after it

    def seated_mask(mask, read=None):
        """The mask node read through the store's seats (`store.seating`), once per mask; configs with a sink.
        read: a [B, T] node to read it through instead (a seated chunk's, `kvq::seat_chunk`)."""
        if model_store.seats is None or not isinstance(mask, fx.Node) or getattr(_val(mask), "dim", lambda: 0)() != 4:
            return mask
        if mask not in seated:   # torch-level nodes (a plain Python target would keep AOTAutograd from caching)
            B, T = model_store.seats.shape
            if _val(mask).shape[-1] != T:   # (find_attention takes masks over the whole cache)
                return mask
            seats = read
            if seats is None:
                anchor = mask   # (after a first chunk's reset of the seats, where the graph has one)
                if reset:
                    nodes = list(graph.nodes)
                    if nodes.index(reset[0]) > nodes.index(mask):
                        anchor = reset[0]
                with graph.inserting_after(anchor):
                    seats = graph.get_attr(seats_attr())
            with graph.inserting_after(seats):
                idx = graph.call_method("view", (seats, B, 1, 1, T))
            with graph.inserting_after(idx):
                full = graph.call_method("expand", (mask, B, -1, -1, -1))
            with graph.inserting_after(full):
                idx = graph.call_method("expand_as", (idx, full))
            with graph.inserting_after(idx):
                seated[mask] = graph.call_function(torch.gather, (full, -1, idx))   # `store.seated_mask`
        return seated[mask]

    chunk = read = None   # a chunk graph's seating (configs with a sink): once, before its first append
    append_op, _ = chunk_ops(_val(matches[0].query).shape[2]) if matches else (None, None)
    why = _chunk_seating(graph, matches, model_store, append_op) if matches else None
    positions = matches[0].positions if matches else None
    if why and why != "maskless":
        log.info("kvq: a compiled first chunk is not seated (%s): its pads are neutralized, its sink may hold "
                 "them", why)
    if why and isinstance(positions, fx.Node):
        # not seated by its mask: a first chunk resets the seats (stored in token order), right after its positions,
        # before any mask is read through them; the chunk itself is not permuted
        after = positions
        if positions.op == "placeholder":
            after = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(after):
            seats = graph.get_attr(seats_attr())
        with graph.inserting_after(seats):
            reset.append(graph.call_function(torch.ops.kvq.seat_chunk.default,
                                             (seats, None, positions, model_store.cfg.sink)))
    elif why == "":
        m0 = matches[0]
        order = {n: i for i, n in enumerate(graph.nodes)}
        with graph.inserting_before(min((m.v_append for m in matches), key=order.__getitem__)):
            seats = graph.get_attr(seats_attr())
            pair = graph.call_function(torch.ops.kvq.seat_chunk.default,
                                       (seats, m0.attn_mask, m0.positions, model_store.cfg.sink))
            chunk = graph.call_function(operator.getitem, (pair, 0))
            read = graph.call_function(operator.getitem, (pair, 1))
            keep = graph.call_function(st.attended, (m0.attn_mask, m0.positions))
    attended = None   # a chunk graph's slots that its last query attends, in slot order (`store.attended_slots`), once
    if matches and _chunk_mask(graph, matches, chunk_ops(_val(matches[0].query).shape[2])[0]):
        mask = seated_mask(matches[0].attn_mask, read)   # (its nodes sit before the first append: `_chunk_mask`)
        order = {n: i for i, n in enumerate(graph.nodes)}
        with graph.inserting_before(min((m.v_append for m in matches), key=order.__getitem__)):
            if chunk is not None:   # the append stores a seated first chunk seated: its own columns in that order
                mask = graph.call_function(st.seated_mask, (mask, chunk))
            attended = graph.call_function(st.attended_slots, (mask,))

    for i, m in enumerate(matches):
        layer = model_store.layers[i]
        append_op, attend_op = chunk_ops(_val(m.query).shape[2])  # decode ops, or the chunk twins
        fused = (append_beside and append_op is torch.ops.kvq.append.default and m.rotary is None
                 and st.attention_independent(layer.cfg))
        if fused:   # the append moves to the attention's place: nothing between them reads the cache (find_attention)
            attend_op = torch.ops.kvq.append_attend.default
            emitted.append((attend_op,))
        else:
            names, tensors = layer.append_tensors()
            store_nodes = getattrs(names, tensors, m.v_append, i)
            key_in, cos, sin = (m.rotary.pre_key, m.rotary.cos, m.rotary.sin) if m.rotary else (m.k_new, None, None)
            value_in = m.v_new
            emitted.append((append_op, attend_op))
            with graph.inserting_before(m.v_append):
                if chunk is not None:   # seated (every layer: the mask is read through the seats), pads neutralized
                    quad = graph.call_function(st.seated_chunk, (keep, chunk, key_in, value_in, cos, sin,
                                                                 layer.spec.key.quantized
                                                                 or layer.spec.value.quantized))
                    key_in, value_in, cos, sin = (
                        None if x is None else graph.call_function(operator.getitem, (quad, j))
                        for j, x in enumerate((key_in, value_in, cos, sin)))
                elif _pads_to_neutralize(graph, m, append_op, layer):   # a chunk's pads out of its statistics
                    pair = graph.call_function(st.neutralize_pads, (m.attn_mask, m.positions, key_in, value_in))
                    key_in, value_in = (graph.call_function(operator.getitem, (pair, j)) for j in (0, 1))
                args = (store_nodes, key_in, value_in, m.positions, cos, sin, layer.descriptor(names))
                if append_op is torch.ops.kvq.append_chunk.default and attended is not None:
                    args += (attended,)
                graph.call_function(append_op, args)
        if not keep_fp16:
            graph.erase_node(m.v_append)
            graph.erase_node(m.k_append)
        names, tensors = layer.attend_tensors(control=attend_op is torch.ops.kvq.append_attend.default)
        store_nodes = getattrs(names, tensors, m.sdpa, i)
        with graph.inserting_before(m.sdpa):
            out = graph.call_function(attend_op,
                                      (m.query, store_nodes, m.k_new, m.v_new, m.positions,
                                       seated_mask(m.attn_mask, read), m.scale, m.is_causal, layer.descriptor(names)))
        out.meta.update(m.sdpa.meta)
        m.sdpa.replace_all_uses_with(out)
        graph.erase_node(m.sdpa)
        for n in m.read_chain:  # dead now; removed by hand (no blanket DCE: it drops cache_length.add_)
            if not n.users:
                graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return emitted
