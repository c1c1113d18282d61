"""`kvq_backend(cfg)`: a torch.compile backend that rewrites KV-cache attention into kvq ops, then Inductor (or, to
debug, aot_eager or eager: `COMPILERS`).

    model.forward = torch.compile(model.forward, backend=kvq_backend(cfg))
    model.generate(ids, cache_implementation="static",
                   compile_config=CompileConfig(backend=kvq_backend(cfg), fullgraph=True))

Memory ownership: the packed store (`store.ModelStore`) belongs to the fp16 cache it replaces and is found
again by that cache tensor when Dynamo recompiles. Before a compiled step runs, the wrapper absorbs what
eager code wrote into the fp16 cache since the store last saw it (HuggingFace runs the prefill eagerly);
after that step, the fp16 cache tensors are re-pointed at a one-element storage with zero strides, so they
hold no memory but keep their shape, dtype and `zero_()` (freeing their storage outright crashes later
reads). The stride change causes one recompilation. `release_fp16_cache=False` keeps them allocated and
written by the compiled steps too (the rewrite leaves their appends in place), so that eager code reading them
later (a next turn's prefill on the same cache) sees every token.
"""
from __future__ import annotations

import copy
import logging
import re
import weakref

import torch

from . import compat, lowering
from . import reference as ref
from . import store as st
from .config import KVQConfig
from .passes import grouped_linear
from .passes.graph_slice import slice_graph
from .passes.kv_cache_attention import RewriteReport, find_attention, rewrite

log = logging.getLogger("kvq_compile")

# What runs the rewritten graph (`kvq_backend`'s compiler): Inductor (the product: fused code, the kvq ops' lowerings,
# `mode` / `options` honored); "aot_eager": AOTAutograd's functionalized graph run op by op, no code generated (a
# debugging aid, and the CPU suite's way to check the pass and the store without Inductor's codegen and C++ builds);
# "eager": the rewritten graph as it is (`explain`). Under aot_eager a kvq op that mutates the store runs on copies of
# the buffers it writes (AOTAutograd's auto_functionalized), copied back after it: the same values, more traffic.
# torch.compile's `mode` and `options` are Inductor's: aot_eager and eager ignore them (logged once a backend).
COMPILERS = ("inductor", "aot_eager", "eager")

# id(fp16 cache tensor) -> (weak reference to it, its store). Tensors compare elementwise, so no WeakKeyDictionary.
_STORES: dict[int, tuple[weakref.ref, st.ModelStore]] = {}


def _store_for(cache: torch.Tensor, cfg: KVQConfig, num_layers: int, geo: st.Geometry) -> st.ModelStore:
    entry = _STORES.get(id(cache))
    store = entry[1] if entry is not None and entry[0]() is cache else None
    if store is None or store.cfg.to_json() != cfg.to_json() or store.geo != geo or len(store.layers) != num_layers:
        store = st.ModelStore(cfg, num_layers, geo, cache.device)
        _STORES[id(cache)] = (weakref.ref(cache), store)
        weakref.finalize(cache, _STORES.pop, id(cache), None)
    return store


def released(t: torch.Tensor) -> bool:
    return t.dim() > 0 and t.numel() > 1 and all(s == 0 for s in t.stride())


def release_storage(t: torch.Tensor) -> None:
    """Point t at a one-element storage with zero strides: no memory, same shape and dtype, reads give 0."""
    if not released(t):
        tiny = torch.zeros(1, dtype=t.dtype, device=t.device).untyped_storage()
        t.set_(tiny, 0, t.shape, (0,) * t.dim())


class KVQBackend:
    """The backend object. `reports` keeps one `RewriteReport` per compiled graph (see `explain`); `stores()` the
    packed stores its graphs write, in compile order."""

    def __init__(self, cfg: KVQConfig, release_fp16_cache: bool = True, compiler: str = "inductor",
                 append_beside: bool | None = None, group_linears: bool | None = None):
        if not isinstance(cfg, KVQConfig):
            raise TypeError(f"kvq_backend needs a KVQConfig, got {type(cfg).__name__}; "
                            "use KVQConfig.preset('kivi-2') or build one")
        if compiler not in COMPILERS:
            raise ValueError(f"kvq_backend: compiler must be one of {', '.join(map(repr, COMPILERS))}, "
                             f"got {compiler!r}")
        self.cfg = cfg
        self.release_fp16_cache = release_fp16_cache
        self.compiler = compiler
        self.append_beside = append_beside
        self.group_linears = grouped_linear.ENABLED if group_linears is None else group_linears
        self.reports: list[RewriteReport] = []
        self._ignored_logged = False   # mode / options under aot_eager or eager: said once
        self._unchanged_warned = False   # a graph whose candidates were all left unchanged: said once
        self._stores: list[weakref.ref] = []   # weak: a store lives as long as the graphs (and cache) that use it

    def beside(self, device: torch.device, patches: dict) -> bool:
        """Whether decode steps' (append, attention) pairs become one kvq::append_attend (`rewrite`'s append_beside,
        whose CUDA kernel launches the append beside the attention): `append_beside` where set, else on CUDA unless
        KVQ_APPEND_BESIDE=0 or the lowering of kvq::attend could choose anything but the opaque kernel's own launch
        (`lowering.picks_default_launch`: max_autotune, the Inductor template (KVQ_TEMPLATE=1 or auto), other
        launch configurations): those keep kvq::attend for its lowering's choices, with the append on its own
        ahead of it. `explain(fn, ...)` compiles without Inductor's options: on CUDA it reports the op where a
        max-autotune compile would keep the pair."""
        if self.append_beside is not None:
            return self.append_beside
        return device.type == "cuda" and lowering.beside_by_default(patches)

    def stores(self) -> list[st.ModelStore]:
        """The stores of the graphs compiled so far that are still alive, oldest first, each once (a recompile of
        the same cache finds its store again). Use this rather than the cache tensors: generate's StaticCache may
        be freed as soon as generate returns (torch 2.11) or only when gc runs (2.13)."""
        seen, out = set(), []
        for r in self._stores:
            s = r()
            if s is not None and id(s) not in seen:
                seen.add(id(s))
                out.append(s)
        return out

    def __deepcopy__(self, memo):  # generate() copies its CompileConfig; keep one backend and its reports
        return self

    def __copy__(self):
        return self

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, mode=None, options=None, **unused):
        report = RewriteReport()
        self.reports.append(report)
        try:
            return self._compile(gm, example_inputs, report, mode, options)
        except BaseException:   # e.g. Dynamo's RestartAnalysis: the graph is traced again, and reported then
            self.reports.remove(report)
            raise

    def _compile(self, gm, example_inputs, report, mode, options):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        index = {n: i for i, n in enumerate(placeholders)}
        matches = find_attention(gm, self.cfg.keys_before_rope, report)
        runner = None
        inductor = self.compiler == "inductor"
        patches = compat.inductor_config_patches(mode, options, lowering.cache_key_pass) if inductor else {}
        if not inductor and (mode or options) and not self._ignored_logged:
            self._ignored_logged = True
            log.info("kvq_backend(compiler=%r) ignores torch.compile's mode=%r and options=%r (Inductor's)",
                     self.compiler, mode, options)
        if matches:
            runner = self._prepare(gm, example_inputs, matches, index, report, patches)
        if runner is not None:
            compat.bump_counter("kvq", "attention_rewrite", len(matches))
        keep = None
        if runner is not None:   # the fp16 caches the rewrite left unread are no inputs of the compiled graph
            gm, keep = _without_inputs(gm, [n for m in matches for n in (m.k_cache, m.v_cache)])
            example_inputs = [example_inputs[i] for i in keep]
        if self.group_linears:   # a decode step's same-input projections in one launch, lone ones of <= 8 rows alone
            # (`passes/grouped_linear.py`)
            grouped = grouped_linear.group_linears(gm)
            if grouped:
                compat.bump_counter("kvq", "grouped_linear", grouped)
        if inductor:
            if runner is not None:
                lowering.register()
                # the rewrite's calls of `store` helpers, cacheable by AOTAutograd under the sources' hash
                compat.mark_cacheable_calls(gm, patches["post_grad_custom_post_pass"].uuid(), __package__)
            compiled = compat.compile_fx(gm, example_inputs, patches)
        elif self.compiler == "aot_eager":
            compiled = compat.aot_eager(gm, example_inputs)
        else:
            compiled = gm.forward
        if runner is None:
            if report.skipped and not self._unchanged_warned:   # (once a backend: every graph is in `explain`)
                self._unchanged_warned = True
                name, why = report.skipped[0]
                log.warning("kvq: a compiled graph's %d KV-cache candidate(s) were all left unchanged, so its caches "
                            "stay fp16 (e.g. %s: %s); kvq_compile.explain(backend) lists every reason",
                            len(report.skipped), name, why)
            return compiled
        return runner.wrap(compiled, keep)

    def _prepare(self, gm, example_inputs, matches, index, report, patches):
        caches = [example_inputs[index[n]] for m in matches for n in (m.k_cache, m.v_cache)]
        k0 = caches[0]
        B, H, T, D = k0.shape
        if any(tuple(c.shape) != (B, H, T, D) or c.dtype != k0.dtype for c in caches):
            for m in matches:
                report.skip(m.sdpa, "cache tensors of different layers differ in shape or dtype")
            return None
        if len({c.device for c in caches}) > 1:   # one store (and RoPE table, seats) serves one device
            for m in matches:
                report.skip(m.sdpa, "the cache tensors of the layers lie on several devices (a model split across "
                            f"devices: {sorted({str(c.device) for c in caches})}); one store serves one device")
            return None
        why = _unservable(caches, example_inputs) or _layer_order_unverified(self.cfg, matches, report)
        if why is not None:
            for m in matches:
                report.skip(m.sdpa, why)
            log.warning("kvq: %d attention layer(s) left unchanged: %s", len(matches), why)
            return None
        geo = st.Geometry(B, H, T, D, st.dtype_name(k0.dtype))
        beside = self.beside(k0.device, patches)   # (CUDA: raises on a bad KVQ_APPEND_BESIDE before a store is made)
        store = _store_for(k0, self.cfg, len(matches), geo)
        pos_slice, pos_args = slice_graph(gm, [matches[0].positions])
        if pos_slice is None:
            for m in matches:
                report.skip(m.sdpa, f"cannot evaluate the append positions ahead of the step: {pos_args}")
            return None
        rotary = []
        for m in matches:
            if m.rotary is None:
                rotary.append(None)
                continue
            gmod, args = slice_graph(gm, [m.rotary.cos, m.rotary.sin])
            ints = [i for i in args if example_inputs[i].dtype in (torch.int32, torch.int64)]
            if gmod is None or len(ints) != 1 or example_inputs[ints[0]].dim() != 2:
                report.skip(m.sdpa, "keys_before_rope: cannot recompute cos/sin for the eagerly written prefix "
                            "(expected one [batch, q_len] position-id input)")
                return None
            rotary.append((gmod, args, ints[0]))
        _specialize_cache_shapes(matches)   # (only a graph that is rewritten: its store has the caches' sizes)
        self._stores.append(weakref.ref(store))   # only a graph that is rewritten below writes its store
        mask = None   # the first step's mask: which of the eagerly written tokens are pads (`_StepRunner.absorb`)
        if isinstance(matches[0].attn_mask, torch.fx.Node):
            mask_slice, mask_args = slice_graph(gm, [matches[0].attn_mask])
            mask = (mask_slice, mask_args) if mask_slice is not None else None
            if mask is None:
                log.info("kvq: the mask cannot be evaluated ahead of the step (%s); an eagerly written prefix is "
                         "quantized with its pads", mask_args)
        runner = _StepRunner(store, [(index[m.k_cache], index[m.v_cache]) for m in matches],
                             (pos_slice, pos_args), rotary, self.release_fp16_cache, mask)
        emitted = rewrite(gm, matches, store, compat.register_store_buffer, beside,
                          keep_fp16=not self.release_fp16_cache)
        for i, (m, ops) in enumerate(zip(matches, emitted)):
            ops = " + ".join(op.name() for op in ops)
            report.rewritten.append(f"layer {i}: {m.k_cache.name}/{m.v_cache.name} -> {ops} "
                                    f"({store.specs[i].key.bits}-bit K, {store.specs[i].value.bits}-bit V)")
        return runner


class _StepRunner:
    """Runs before and after each compiled step: absorbs eager writes, then releases fp16 storage."""

    def __init__(self, store, cache_args, positions, rotary, release, mask=None):
        self.store, self.cache_args, self.positions, self.rotary, self.release, self.mask = (
            store, cache_args, positions, rotary, release, mask)

    def wrap(self, compiled, keep: list[int]):
        """compiled takes the inputs at `keep` of the step's (`_without_inputs`); the hooks see them all."""
        def run(*args):
            boxed = len(args) == 1 and isinstance(args[0], list)  # Dynamo's boxed calling convention
            flat = args[0] if boxed else args
            self.before(flat)
            kept = [flat[i] for i in keep]
            out = compiled(kept) if boxed else compiled(*kept)
            self.after(flat)
            return out

        return run

    def before(self, args):
        k0 = args[self.cache_args[0][0]]
        owner = self.store.owner() if self.store.owner is not None else None
        if owner is k0 and k0._version == self.store.owner_version:
            self.store.switched_last = False
            return
        switched = owner is not None and owner is not k0
        gmod, idx = self.positions
        p0 = int(gmod(*[args[i] for i in idx])[0].reshape(-1)[0])
        if released(k0) and p0 > 0:   # (at 0 a new sequence starts: nothing to absorb, e.g. after the user's zero_())
            raise RuntimeError(
                "kvq: this compiled step was called with an fp16 cache that a kvq step had already released into "
                "its store. Either one compiled function serves several caches in turn (a model compiled block by "
                "block, or two models through one compiled forward): kvq does not support that, compile the whole "
                "model, one compiled forward per model; or a used cache was passed again (a next turn on the same "
                "StaticCache): give each generate a new cache, use kvq_compile.hf.KVQCache (which continues a "
                "conversation), or pass release_fp16_cache=False to kvq_backend (the fp16 cache then stays "
                "allocated and written, and each new turn is absorbed anew)")
        if switched and self.store.switched_last and not self.store.warned_switching:
            self.store.warned_switching = True
            log.warning("kvq: the compiled step's cache changed on two calls in a row: one compiled function serves "
                        "several caches in turn (a model compiled block by block?), and each call absorbs its whole "
                        "prefix again; compile the whole model instead")
        if self.store.seats is not None:   # a new sequence: seated again by its absorb, if any
            self.store.seats.copy_(torch.arange(self.store.seats.shape[1], device=self.store.seats.device))
        if p0 > 0:
            self.absorb(args, p0)
        self.store.switched_last = switched
        self.store.owner = weakref.ref(k0)
        self.store.owner_version = k0._version

    @torch.no_grad()
    def absorb(self, args, p0):
        """Quantize positions [0, p0) that eager code wrote into the fp16 cache, as one chunk (kvq::append_chunk,
        with the slots of its real tokens in their stored order where the step's mask shows pads; one token:
        kvq::append)."""
        positions = torch.arange(p0, device=args[self.cache_args[0][0]].device)
        keep = seats = None
        if self.mask is not None:   # the step's query attends every real token before it: the others are pads
            gmod, idx = self.mask
            keep = st.attended(gmod(*[args[i] for i in idx])[0], positions)
        if keep is not None:
            keep = keep.expand(args[self.cache_args[0][0]].shape[0], -1)
            if self.store.seats is not None and not bool(keep.all()):   # (`store.seating`, as KVQCache's)
                seats = st.seating(keep, self.store.cfg.sink)
                self.store.seats[:, :p0] = seats
        # the real tokens' slots in the order they are stored: the static ranges' percentiles leave the pads out
        slots = None if keep is None else keep if seats is None else keep.gather(-1, seats)
        for layer, (ki, vi), rot in zip(self.store.layers, self.cache_args, self.rotary):
            k, v = args[ki][:, :, :p0], args[vi][:, :, :p0]
            cos = sin = None
            if rot is not None:
                gmod, idx, pos_i = rot
                call = [args[i] for i in idx]
                pid = args[pos_i]
                j = idx.index(pos_i)
                call[j] = pid[:, :1] - p0 + torch.arange(p0, device=pid.device)
                cos, sin = gmod(*call)
                c3, s3 = (c[:, 0] if c.dim() == 4 else c for c in (cos, sin))
                k = ref.rope_unrotate(k.float(), c3.float(), s3.float()).to(k.dtype)
                cos, sin = c3, s3
            quantizes = layer.spec.key.quantized or layer.spec.value.quantized
            k, v, cos, sin = st.seated_chunk(keep, seats, k, v, cos, sin, quantizes)
            names, tensors = layer.append_tensors()
            if p0 > 1:   # (the chunk op: takes the slots)
                torch.ops.kvq.append_chunk(tensors, k, v, positions, cos, sin, layer.descriptor(names),
                                           slots if quantizes else None)
            else:        # one token: the decode append, as before (no percentile over one token)
                torch.ops.kvq.append(tensors, k, v, positions, cos, sin, layer.descriptor(names))

    def after(self, args):
        k0 = args[self.cache_args[0][0]]
        if self.release:
            for ki, vi in self.cache_args:
                release_storage(args[ki])
                release_storage(args[vi])
        # the step's own writes (the release; without it the fp16 appends the rewrite keeps) are no eager writes
        self.store.owner_version = k0._version


def _specialize_cache_shapes(matches) -> None:
    """The store is sized for the cache this graph is compiled with (its batch, heads, length and head_dim in the
    kvq ops' layouts). Dynamo's automatic dynamic shapes (HF's CompileConfig default, dynamic=None) make a graph
    compiled after a shape change symbolic in those sizes, so later caches of other sizes ran it over a store of the
    wrong size (a misleading overflow error, another error on a batch size; a device assertion on CUDA). Each
    symbolic size of the caches is specialized here (`guard_int`: a guard on its value, which Dynamo installs with
    the graph's), so a cache of another size compiles anew and gets its own store, as with dynamic=False."""
    from torch.fx.experimental.symbolic_shapes import guard_int

    for m in matches:
        for node in (m.k_cache, m.v_cache):
            value = node.meta.get("example_value")
            for size in getattr(value, "shape", ()):
                if isinstance(size, torch.SymInt):
                    guard_int(size)


def _unservable(caches, example_inputs) -> str | None:
    """Why the step's caches cannot be served (or None): a store is sized for one cache size, which kvq specializes
    (`_specialize_cache_shapes`) and mark_dynamic forbids; `_StepRunner` sees eager writes to a cache through its
    version counter, which inference tensors lack; and the kvq ops have no backward."""
    if any(getattr(c, "_dynamo_dynamic_indices", None) for c in caches):
        return ("the cache tensors' sizes are marked dynamic (torch._dynamo.mark_dynamic), and a kvq store is sized "
                "for one cache size: use torch._dynamo.maybe_mark_dynamic (kvq then specializes them), or no mark")
    if any(c.is_inference() for c in caches):
        return ("the cache tensors are inference tensors (made under torch.inference_mode()), which carry no "
                "version counter for kvq to see eager writes by: run generate under torch.no_grad() instead")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs):
        return ("gradients are enabled and the step's inputs require grad: the kvq ops serve inference only (no "
                "backward); run it under torch.no_grad()")
    return None


def _per_layer(cfg: KVQConfig) -> bool:
    """Whether `cfg` treats layers differently by their index (bits, XQuant's pattern and code sharing, calibrated
    per-layer codebooks): the store numbers a graph's rewritten layers 0, 1, ... in graph order."""
    return bool(cfg.layer_bits or cfg.codebooks or cfg.xquant_pattern is not None
                or cfg.share_key_codes_from_layer is not None or cfg.share_value_codes_from_layer is not None)


def _layer_indices(matches) -> list[int] | None:
    """The model's layer index of each match, read from its key cache's Dynamo source (the one integer subscript
    that differs between the matches, e.g. `cache.layers[3].keys`, `_modules['layers']._modules['3']`; a lone
    match's only subscript), or None where the sources do not say."""
    subs = []
    for m in matches:
        name = getattr(getattr(m.k_cache, "_dynamo_source", None), "name", None)
        if not isinstance(name, str):
            return None
        subs.append([int(x) for x in re.findall(r"\['?(\d+)'?\]", name)])
    if not subs[0] or any(len(x) != len(subs[0]) for x in subs):
        return None
    varying = [j for j in range(len(subs[0])) if len({x[j] for x in subs}) > 1]
    if len(varying) == 1:
        return [x[varying[0]] for x in subs]
    return [subs[0][0]] if len(subs) == 1 and len(subs[0]) == 1 else None


def _layer_order_unverified(cfg: KVQConfig, matches, report) -> str | None:
    """Why a config with per-layer settings cannot be applied to this graph (or None): its layers must be the
    model's layers 0 .. n-1, every one rewritten, in one graph (a graph break, or an attention layer left unchanged,
    e.g. a hybrid model's sliding layers, would shift every later layer's settings)."""
    if not _per_layer(cfg):
        return None
    if report.skipped:
        return ("per-layer settings (layer_bits, codebooks, XQuant's pattern or code sharing) need every attention "
                "layer of the model rewritten in graph order, and this graph leaves candidates unchanged (appends or "
                "attentions: `explain`), so its layer numbers or count would not be the model's")
    got = _layer_indices(matches)
    if got != list(range(len(matches))):
        return ("per-layer settings (layer_bits, codebooks, XQuant's pattern or code sharing) need the model's "
                f"attention layers 0 .. n-1 in one graph; this graph's are {got if got is not None else 'unknown'} "
                "(a graph break? compile with fullgraph=True)")
    return None


def _without_inputs(gm: torch.fx.GraphModule, caches) -> tuple[torch.fx.GraphModule, list[int]]:
    """(the graph to compile, the indices of the step's inputs it takes): a copy of gm without the placeholders of
    `caches` that nothing reads after the rewrite. A released cache (`release_storage`: zero strides) is then no
    input of the compiled graph, whose stride checks it would fail: torch 2.11 does not guard a module buffer's
    strides, so a step compiled before the release is called with it (a gpt-fast-style cache; torch 2.13
    recompiles). Dynamo's graph keeps every placeholder: it passes the step's inputs, and `_StepRunner`'s hooks
    read the caches among them."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    dead = [i for i, n in enumerate(placeholders) if n in caches and not n.users]
    if not dead:
        return gm, list(range(len(placeholders)))
    graph = copy.deepcopy(gm.graph)
    copies = [n for n in graph.nodes if n.op == "placeholder"]
    for old, new in zip(placeholders, copies):   # AOTAutograd reads each placeholder's source (static inputs)
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    for i in dead:
        graph.erase_node(copies[i])
    inner = torch.fx.GraphModule(gm, graph)
    inner.meta = gm.meta
    for name in ("_param_name_to_source", "_backend_id", "_source_to_user_stacks", "compile_subgraph_reason"):
        # Dynamo's metadata that AOTAutograd and Inductor read (static inputs, packaging, logs)
        if hasattr(gm, name):
            setattr(inner, name, getattr(gm, name))
    return inner, [i for i in range(len(placeholders)) if i not in dead]


def kvq_backend(cfg: KVQConfig | str, *, release_fp16_cache: bool = True, append_beside: bool | None = None,
                group_linears: bool | None = None, compiler: str = "inductor") -> KVQBackend:
    """A torch.compile backend for `cfg` (a KVQConfig or a preset name). compiler: what runs the rewritten graph,
    "inductor" (the default: fused code) or, to debug, "aot_eager" or "eager" (`COMPILERS`; same pass, same kvq
    ops, nothing generated; torch.compile's `mode` and `options` are Inductor's, ignored by those two).
    append_beside: `KVQBackend.beside`;
    group_linears: a decode graph's same-input projections as one `kvq::grouped_linear`, and its lone projections of
    at most 8 rows as one-weight launches (`passes/grouped_linear.py`; default on, KVQ_GROUP_LINEARS=0 turns the
    default off; KVQ_SINGLE_LINEARS=0 / 1 takes no lone projection / every one of at most 64 rows)."""
    if isinstance(cfg, str):
        cfg = KVQConfig.preset(cfg)
    return KVQBackend(cfg, release_fp16_cache=release_fp16_cache, compiler=compiler, append_beside=append_beside,
                      group_linears=group_linears)


def explain(target, *args, cfg: KVQConfig | str | None = None, **kwargs) -> str:
    """What the pass rewrote and what it left alone, and why.

    explain(backend)                       -> the reports of every graph `backend` compiled so far
    explain(fn, *args, cfg=..., **kwargs)  -> traces fn(*args, **kwargs) once (no Inductor) and reports
    """
    if isinstance(target, KVQBackend):
        return "\n".join(str(r) for r in target.reports) or "kvq: nothing compiled yet"
    if cfg is None:
        raise ValueError("explain(fn, ...) needs cfg=KVQConfig or a preset name")
    cfg = KVQConfig.preset(cfg) if isinstance(cfg, str) else cfg
    backend = KVQBackend(cfg, release_fp16_cache=False, compiler="eager")
    torch.compile(target, backend=backend)(*args, **kwargs)
    return explain(backend)
