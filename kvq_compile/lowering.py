"""Inductor lowering of `kvq::attend`: how a decode step's attention becomes an autotuned GPU kernel.

    FX node  kvq::attend(query, store[...], key, value, positions, attn_mask?, scale, is_causal, layout)
      -> lower_attend (Inductor's lowering of the op, registered by `register()`)
         CUDA, one query token, shapes static:
             autotune_select_algorithm("kvq_attend", choices) over
             - TritonTemplate choices (`_template_choices`, where `use_template` says so): the whole call in one
               Inductor-generated Triton launch, one per TEMPLATE_CONFIGS entry (MAX_AUTOTUNE_TEMPLATE_CONFIGS under
               max_autotune). Its source (`_template_source`)
               loads the query rows through Inductor's `load_input` (so a pointwise producer of the query, RoPE,
               can be fused in as a prologue), calls `templates.decode_attention._fused_decode` (the quantized
               region's slices and the exact windows in one grid, the last program of each KV head merges the
               partial results) and stores through `store_output` (epilogue fusion). Its scratch (partial results,
               per-head counters zeroed by a fill kernel) are graph buffers it mutates. No calibrated softmax there.
             - ExternKernelChoice choices: the hand-written launches of templates/decode_attention.py (Gluon kernels
               where they serve the layer, the Triton kernel elsewhere: window, split main region, combine), one
               per LaunchConfig, all of the extern kernel `kvq_attend` with the configuration as keywords: the
               default launch alone (CONFIGS), or under max_autotune MAX_AUTOTUNE_CONFIGS.
             Inductor benchmarks the choices once per layer layout and shape when there are several (on the full
             cache length, see `_input_generators`) and emits a call of the fastest.
         anything else (CPU, prefill chunks, symbolic shapes): the op as an opaque kernel (the reference
             path, or the CUDA kernel ops.py registers), exactly what Inductor does without a lowering.

Inductor times an extern choice with its Python launch (three launches), so against a one-launch template its
time includes host overhead that a CUDA graph does not pay, and the template's kernel is slower than the extern
launches on the GPU (bench/RESULTS.md, session 26): the template is therefore offered only when asked for
(`TEMPLATE`, KVQ_TEMPLATE=1), alone, or under max_autotune next to the extern choices.

Inductor's compile cache keys on the graph and its config, not on the source of third-party lowerings:
`cache_key_pass()` returns a post-grad CustomGraphPass (doing nothing) whose uuid() hashes this package's
sources, so an upgraded kvq never gets kernels compiled by an older one.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import threading
from dataclasses import dataclass

import torch

from . import compat

log = logging.getLogger("kvq_compile")


@dataclass(frozen=True)
class LaunchConfig:
    """One launch of `decode_attention`: tokens per tile, warps and pipeline stages of the main launch, and
    programs per SM that set the split-K count."""

    block_t: int  # 0: the template's default for the layout (`decode_attention.default_block_t`)
    num_warps: int
    num_stages: int
    programs_per_sm: int

    def __str__(self) -> str:
        return f"t{self.block_t or 'default'}_w{self.num_warps}_s{self.num_stages}_p{self.programs_per_sm}"


DEVICES = {"cuda"}  # the CPU test suite adds "cpu": the template then runs under TRITON_INTERPRET=1
DEFAULT_CONFIG = LaunchConfig(0, 4, 2, 16)  # what the opaque CUDA kernel uses
# Without max_autotune one choice: Inductor times an extern choice with its Python launch (three Triton launches:
# 0.42-0.58 ms per call against 0.19 ms of GPU time for kivi-2 at (32, 4096) on an H100, bench/RESULTS.md sessions 5
# and 7), so its pick among launch configurations was noise, and took 32-token tiles, 1.5x slower for KIVI layouts.
CONFIGS = (DEFAULT_CONFIG,)
TUNED_CONFIGS = (DEFAULT_CONFIG, LaunchConfig(32, 4, 2, 16), LaunchConfig(64, 4, 2, 16), LaunchConfig(128, 4, 2, 16),
                 LaunchConfig(64, 4, 3, 32))  # the first of the max_autotune list
MAX_AUTOTUNE_CONFIGS = TUNED_CONFIGS + tuple(
    LaunchConfig(t, w, s, p) for t in (32, 64, 128) for w in (4, 8) for s in (2, 3) for p in (8, 32)
    if LaunchConfig(t, w, s, p) not in TUNED_CONFIGS)


def _template_switch(value: str) -> bool | None:
    if value not in ("", "0", "1", "auto"):
        log.warning("KVQ_TEMPLATE=%r is none of 0, 1, auto: the Inductor template stays off", value)
    return {"1": True, "auto": None}.get(value, False)


# The one-launch TritonTemplate (`_template_choices`): True = offered for every layer it can serve (the only choice,
# or one of several under max_autotune), None = where no Gluon kernel serves the layer, False = never. Off unless
# KVQ_TEMPLATE=1: on an H200 its kernel was slower than the extern launches at every layout and shape measured,
# 2-6% where no Gluon kernel serves the layer (kvquant-3, innerq-k3v2), 5-48% against the same Triton kernel's three
# launches elsewhere, and several times the Gluon kernels' time (bench/RESULTS.md, session 26); Inductor would also
# time the extern choices with their Python launch (see the module doc).
TEMPLATE = _template_switch(os.environ.get("KVQ_TEMPLATE", "0"))
# 16 programs per SM (at most `decode_attention.FUSED_MAX_SPLITS` slices per KV head); max_autotune also tries 4
# programs per SM, 8 warps, 32- and 64-token tiles.
TEMPLATE_CONFIGS = (DEFAULT_CONFIG,)
MAX_AUTOTUNE_TEMPLATE_CONFIGS = TEMPLATE_CONFIGS + (
    LaunchConfig(0, 4, 2, 4), LaunchConfig(0, 8, 2, 16), LaunchConfig(32, 4, 2, 16), LaunchConfig(64, 4, 3, 16))
TEMPLATE_IMPORT = "from kvq_compile.templates.decode_attention import _fused_decode"


def launch(*tensors, out, kvq_layout: str, scale: float, is_causal: bool, n_store: int, has_mask: bool,
           block_t: int, num_warps: int, num_stages: int, programs_per_sm: int) -> None:
    """The extern kernel `extern_kernels.kvq_attend` that every choice calls with its LaunchConfig as keywords:
    tensors = (query, key, value, positions, *store, [attn_mask], ...): tensors after these (the template choices'
    scratch, which Inductor also hands every extern choice it benchmarks next to them) are ignored; kvq_layout: the
    op's layout string
    (`layout` is taken by Inductor's bind()). One name for all configurations, registered by `register()`,
    so that graphs loaded from Inductor's cache in a new process find it."""
    from .ops import _decode_layout
    from .templates.decode_attention import decode_attention

    query, key, value, positions = tensors[:4]
    store = tensors[4:4 + n_store]
    mask = tensors[4 + n_store] if has_mask else None
    cfg, geo, spec, names = _decode_layout(kvq_layout)
    decode_attention(query, dict(zip(names, store)), key, value, positions, mask, scale, is_causal, cfg, spec, geo,
                     block_t=block_t or None, num_warps=num_warps, num_stages=num_stages,
                     programs_per_sm=programs_per_sm,
                     out=out)


def kvq_attend(*tensors, out, **kwargs):  # the registered callable: resolves `launch` at call time
    launch(*tensors, out=out, **kwargs)


def _choice():
    return compat.extern_choice(kvq_attend, "kvq_attend")


def _input_generators(layout: str, n_store: int, has_mask: bool) -> dict:
    """Benchmark inputs that exercise the whole cache: positions = max_len - 1 (Inductor's defaults are zeros
    for integer tensors, a one-token cache); integer store tensors (codes, outlier channel indices) stay zeros,
    valid everywhere; a boolean mask allows every position."""
    from .ops import _decode_layout

    geo = _decode_layout(layout)[1]

    def positions(buf):
        return torch.full([int(s) for s in buf.get_size()], geo.max_len - 1, dtype=buf.get_dtype(),
                          device=buf.get_device())

    gens = {3: positions}
    if has_mask:
        def mask(buf):
            size = [int(s) for s in buf.get_size()]
            if buf.get_dtype() == torch.bool:
                return torch.ones(size, dtype=torch.bool, device=buf.get_device())
            return torch.zeros(size, dtype=buf.get_dtype(), device=buf.get_device())

        gens[4 + n_store] = mask
    return gens


def _meta(node) -> torch.Tensor:
    """A meta tensor with the size, strides and dtype of a realized IR node (what the launcher's planning reads)."""
    return torch.empty_strided(compat.static_size(node), compat.frozen_strides(node), dtype=node.get_dtype(),
                               device="meta")


def use_template(layout: str, query, store, mask, is_causal: bool) -> str | None:
    """None when the one-launch template is offered for this layer, else why not: TEMPLATE False, a calibrated
    softmax (its range pass must end first), a CPU graph (Inductor has no Triton driver there), or (TEMPLATE
    None) a Gluon kernel that serves the layer: on an H100 / H200 those beat the Triton kernel the template runs
    (bench/RESULTS.md), and Inductor would time them with their Python launch."""
    from .ops import _decode_layout
    from .templates import decode_attention as da
    from .templates import decode_attention_gluon as dag

    cfg, geo, spec, names = _decode_layout(layout)
    if TEMPLATE is False:
        return "TEMPLATE is False"
    if cfg.softmax_tau is not None:
        return "a calibrated softmax needs its range pass before its attention pass"
    device = query.get_device()
    if device is None or device.type != "cuda":
        return "not a CUDA graph"
    if TEMPLATE is None and dag.enabled() and spec.key.quantized and spec.value.quantized:
        B, Hq, _, D = compat.static_size(query)
        bufs = {n: _meta(x) for n, x in zip(names, store)}
        kp, kc = da._side_args(bufs, "k", spec.key, geo, cfg)
        vp, vc = da._side_args(bufs, "v", spec.value, geo, cfg)
        mask_kind = 0 if mask is None else (1 if mask.get_dtype() == torch.bool else 2)
        shared = mask is None or compat.static_size(mask)[1] == 1
        q = torch.empty(B, Hq, 1, D, dtype=query.get_dtype(), device=device)
        if dag.supports(q, Hq // geo.heads, kc, vc, kp, cfg.keys_before_rope, mask_kind, shared, is_causal,
                        cfg.softmax_tau) is None:
            return "a Gluon kernel serves this layer"
    return None


def _grid(g0, g1, meta):
    return g0, g1, 1


def _template_source(args: list[str], names: list[str]) -> str:
    """The Inductor template (jinja) of one decode-attention call: `_fused_decode`'s positional arguments after q
    (`args`: kernel argument names, literals and constexpr names), the template's input names (`names`, in
    def_kernel order). idx_* index the output [B, Hq, 1, D] (and the query: one GQA group's REP_PAD x D tile)."""
    call = ",\n        ".join(", ".join(args[i:i + 8]) for i in range(0, len(args), 8))
    return f"""{TEMPLATE_IMPORT}


{{{{def_kernel({", ".join(repr(n) for n in names)})}}}}
    bh = tl.program_id(0)
    r = tl.arange(0, REP_PAD)
    idx_b = bh // H
    idx_h = ((bh % H) * REP + r)[:, None]
    idx_d = tl.arange(0, D)[None, :]
    idx_m = idx_d * 0
    qmask = (r < REP)[:, None] & (idx_d < D)
    {{{{load_input("Q", "q", ("idx_b", "idx_h", "idx_m", "idx_d"), mask="qmask", other=0.0,
                  index_shape=("REP_PAD", "D"))}}}}
    last, out = _fused_decode(
        q, {call})
    if last:
        {{{{store_output(("idx_b", "idx_h", "idx_m", "idx_d"), "out", "qmask", indent_width=8,
                        val_shape=("REP_PAD", "D"))}}}}
"""


def _template_choices(layout: str, inputs: list, n_store: int, has_mask: bool, scale: float, is_causal: bool,
                      out_layout, configs) -> tuple[list, list, dict]:
    """(choices, scratch input nodes, input generators) of the one-launch template: one choice per config that
    `fused_plan` accepts. Raises where the private API moved (the caller then keeps the extern choices)."""
    from .ops import _decode_layout
    from .templates import decode_attention as da

    cfg, geo, spec, names = _decode_layout(layout)
    query, key, value, positions = inputs[:4]
    store = inputs[4:4 + n_store]
    mask = inputs[4 + n_store] if has_mask else None
    device = query.get_device()
    B, Hq, _, D = compat.static_size(query)
    qm = torch.empty(B, Hq, 1, D, dtype=query.get_dtype(), device="meta")
    km, vm, pm = _meta(key), _meta(value), _meta(positions)
    bufs = {n: _meta(x) for n, x in zip(names, store)}
    mm = _meta(mask) if has_mask else None
    for name, t in (("key", km), ("value", vm), ("attn_mask", mm)):
        if t is not None and (t.dim() != 4 or t.stride(-1) != 1):
            # the kernel reads them with unit last strides (the launcher makes them contiguous; `fused_plan` would
            # then plan a new tensor, which the argument names below cannot follow)
            raise ValueError(f"{name}: 4 dims with a unit last stride expected, got {tuple(t.shape)} {t.stride()}")
    # the planned arguments are mapped back to template inputs by identity. The query stands in for absent buffers
    # (never read); it is given the key chunk's name, since the template's Q input disappears when a prologue is
    # fused into it
    ids = {id(qm): "KCH", id(km): "KCH", id(vm): "VCH", id(pm): "POS"}
    ids.update({id(t): f"S{i}" for i, t in enumerate(bufs.values())})
    if has_mask:
        ids[id(mm)] = "AMASK"
    kinds = dict(m="OUT_M", l="OUT_L", acc="OUT_ACC", cnt="CNT")
    plans, sizes = [], dict.fromkeys(kinds, 0)
    tile = da.layout_block_t(cfg, spec, names)
    for c in distinct_launches(configs, layout):
        def alloc(kind, n):
            t = torch.empty(n, dtype=torch.int32 if kind == "cnt" else torch.float32, device="meta")
            ids[id(t)] = kinds[kind]
            sizes[kind] = max(sizes[kind], n)
            return t

        nsplit = da.fused_splits(B * geo.heads, geo.max_len, c.block_t or tile, device, c.programs_per_sm)
        try:
            plan = da.fused_plan(qm, bufs, km, vm, pm, mm, scale, is_causal, cfg, spec, geo, alloc,
                                 block_t=c.block_t or None, num_splits=nsplit)
        except ValueError as e:
            log.info("kvq::attend template: config %s not offered: %s", c, e)
            continue
        plans.append((c, plan))
    if not plans:
        return [], [], {}
    pnames = list(da._fused_decode.arg_names)[1:]
    nargs = len(plans[0][1]["args"])

    def render(name, v):
        if name == "NSPLIT":
            return "NSPLIT"   # per config: a constexpr of the choice
        if isinstance(v, torch.Tensor):
            return ids[id(v)]
        if isinstance(v, (bool, int, float)):
            return repr(v)
        raise TypeError(f"cannot render argument {name}={v!r} into the template")

    args = [render(n, v) for n, v in zip(pnames, plans[0][1]["args"])] + pnames[nargs:]
    for c, plan in plans[1:]:   # one source for every config: only NSPLIT and the constexprs may differ
        if [render(n, v) for n, v in zip(pnames, plan["args"])] + pnames[nargs:] != args:
            raise ValueError(f"config {c} plans other arguments than {plans[0][0]}")
    arg_names = ["Q", "KCH", "VCH", "POS", *(f"S{i}" for i in range(n_store))] + (["AMASK"] if has_mask else []) + [
        "OUT_M", "OUT_L", "OUT_ACC", "CNT"]
    source = _template_source(args, arg_names)
    template = compat.triton_template(f"kvq_decode_{hashlib.sha256(source.encode()).hexdigest()[:12]}", source,
                                      _grid)
    scratch = [compat.scratch(sizes[k], torch.int32 if k == "cnt" else torch.float32, device, zero=k == "cnt")
               for k in kinds]
    choices = []
    for c, plan in plans:
        err = template.maybe_append_choice(
            choices, input_nodes=[*inputs, *scratch], layout=out_layout, num_stages=c.num_stages,
            num_warps=c.num_warps, mutated_inputs=scratch, call_sizes=list(plan["grid"]),
            NSPLIT=plan["nsplit"], **plan["consts"])
        if err is not None:
            log.info("kvq::attend template: config %s not offered: %s", c, err)
    def zeros(buf):   # the counters start at zero (Inductor's benchmark inputs are random otherwise)
        return torch.zeros([int(n) for n in buf.get_size()], dtype=buf.get_dtype(), device=buf.get_device())

    gens = {len(inputs) + list(kinds).index("cnt"): zeros}
    return choices, scratch, gens


def picks_default_launch(patches: dict) -> bool:
    """Whether lowering a CUDA decode step's kvq::attend ends in the opaque kernel's own launch: DEFAULT_CONFIG the
    only extern choice, no template choice (TEMPLATE False) and no max_autotune (in this compile's `patches` or
    Inductor's config). Then an op that Inductor leaves opaque (kvq::append_attend, `backend.KVQBackend.beside`)
    runs the same launch."""
    return (CONFIGS == (DEFAULT_CONFIG,) and TEMPLATE is False
            and not patches.get("max_autotune", compat.max_autotune()))


def beside_by_default(patches: dict) -> bool:
    """The default of `append_beside` (kvq_backend, KVQCache) on CUDA: KVQ_APPEND_BESIDE (1, the default, or 0) and
    `picks_default_launch(patches)`."""
    choice = os.environ.get("KVQ_APPEND_BESIDE") or "1"   # unset or empty: the default
    if choice not in ("0", "1"):
        raise ValueError(f"KVQ_APPEND_BESIDE={choice!r}: use 1 (default) or 0")
    return choice == "1" and picks_default_launch(patches)


def distinct_launches(configs, layout: str) -> tuple[LaunchConfig, ...]:
    """The configurations that launch differently for this layout: the default tile (block_t 0) resolved to the
    layout's (`decode_attention.layout_block_t`), later equal launches dropped (Inductor would time them twice)."""
    from .ops import _decode_layout
    from .templates.decode_attention import layout_block_t

    cfg, _, spec, names = _decode_layout(layout)
    tile = layout_block_t(cfg, spec, names)
    seen = {}
    for c in configs:
        seen.setdefault(dataclasses.replace(c, block_t=c.block_t or tile), c)
    return tuple(seen.values())


def lower_attend(query, store, key, value, positions, attn_mask, scale, is_causal, layout):
    op = torch.ops.kvq.attend.default
    device = query.get_device()
    try:
        shape = compat.static_size(query)
    except TypeError:
        shape = None
    if (device is None or device.type not in DEVICES or shape is None or shape[2] != 1
            or os.environ.get("KVQ_REFERENCE_KERNELS") == "1"):
        return compat.fallback_kernel(op, query, store, key, value, positions, attn_mask, scale, is_causal, layout)
    has_mask = attn_mask is not None
    inputs = compat.realize_inputs(query, key, value, positions, *store, *([attn_mask] if has_mask else []))
    out_layout = compat.fixed_layout(device, query.get_dtype(), shape)
    kwargs = dict(kvq_layout=layout, scale=float(scale), is_causal=bool(is_causal), n_store=len(store),
                  has_mask=has_mask)
    autotune = compat.max_autotune()
    choices, scratch, gens = [], [], _input_generators(layout, len(store), has_mask)
    why = use_template(layout, inputs[0], inputs[4:4 + len(store)], inputs[4 + len(store)] if has_mask else None,
                       bool(is_causal))
    if why is None:
        try:
            choices, scratch, tgens = _template_choices(
                layout, inputs, len(store), has_mask, float(scale), bool(is_causal), out_layout,
                MAX_AUTOTUNE_TEMPLATE_CONFIGS if autotune else TEMPLATE_CONFIGS)
            gens.update(tgens)
        except Exception as e:  # noqa: BLE001  (private API moved: the extern choices still serve the op)
            log.warning("kvq::attend: the Inductor template is not offered (%s: %s)", type(e).__name__, e,
                        exc_info=log.isEnabledFor(logging.DEBUG))
            NOT_OFFERED.append(f"{type(e).__name__}: {e}")
            choices, scratch = [], []
    else:
        log.info("kvq::attend: no template choice: %s", why)
    if why is None and not choices:
        NOT_OFFERED.append(layout)
    if not choices or autotune:
        configs = distinct_launches(MAX_AUTOTUNE_CONFIGS if autotune else CONFIGS, layout)
        choices += [_choice().bind(inputs, out_layout, **kwargs, **dataclasses.asdict(c)) for c in configs]
    node = compat.autotune_select("kvq_attend", choices, [*inputs, *scratch], out_layout, gens)
    if compat.is_template_node(node):
        chosen = "template"
    else:
        chosen = compat.chosen_kwargs(node)
        chosen = None if chosen is None else LaunchConfig(**{f: chosen[f] for f in LaunchConfig.__dataclass_fields__})
    SELECTED.append((layout, chosen))
    log.info("kvq::attend lowered to %s (of %d choices)", chosen, len(choices))
    return node


# (layout, chosen launch: a LaunchConfig of the extern kernel or "template") of the latest lowered calls, for bench/
# and logs
SELECTED: collections.deque[tuple[str, LaunchConfig | str | None]] = collections.deque(maxlen=4096)
# why the template was asked for and not offered: the exception, and the layout when no choice was made
NOT_OFFERED: collections.deque[str] = collections.deque(maxlen=64)
_REGISTERED: list[bool] = []
_LOCK = threading.Lock()


def register() -> bool:
    """Register the lowering once per process. When Inductor's private API does not take it, the op keeps
    running as an opaque kernel (its CUDA template, untuned) and a warning says why."""
    with _LOCK:
        if _REGISTERED:
            return _REGISTERED[0]
        try:
            _choice()
            compat.register_lowering(torch.ops.kvq.attend.default, lower_attend)
            ok = True
        except Exception as e:  # noqa: BLE001  (private API moved: keep working, unfused)
            import warnings

            warnings.warn(f"kvq: cannot register the Inductor lowering of kvq::attend ({type(e).__name__}: {e}); "
                          "decode attention runs as an opaque kernel with its default launch configuration")
            ok = False
        _REGISTERED.append(ok)
        return ok


def source_files() -> tuple[str, ...]:
    """Every source file whose change must invalidate compiled graphs: the package, its passes and templates."""
    import importlib

    files = []
    for mod in ("kvq_compile", "kvq_compile.passes", "kvq_compile.templates"):
        for d in importlib.import_module(mod).__path__:
            files += [os.path.realpath(os.path.join(d, f)) for f in sorted(os.listdir(d)) if f.endswith(".py")]
    return tuple(dict.fromkeys(files))


def install_cache_key_pass() -> None:
    """Chain `cache_key_pass` into Inductor's global post-grad pass, for compiles that do not go through
    `kvq_backend` (a `KVQCache` under HF's CompileConfig or a user's torch.compile). Idempotent: a kvq pass
    already there is replaced, the user's pass it wraps kept."""
    with _LOCK:
        compat.set_post_grad_pass(cache_key_pass)


def cache_key_pass(previous=None):
    """The post-grad pass that carries `source_files()`' hash, and the lowering's state (devices, launch
    configurations, KVQ_REFERENCE_KERNELS), into Inductor's cache key (see the module doc)."""
    def state():
        from .templates import decode_attention_gluon as dag

        return repr((sorted(DEVICES), CONFIGS, MAX_AUTOTUNE_CONFIGS, TEMPLATE, TEMPLATE_CONFIGS,
                     MAX_AUTOTUNE_TEMPLATE_CONFIGS, dag.enabled(), os.environ.get("KVQ_REFERENCE_KERNELS"),
                     _REGISTERED))

    return compat.source_hash_pass(source_files(), previous, state)
