"""Inductor lowering of `kvq::attend`: how a decode step's attention becomes an autotuned Triton kernel.

    FX node  kvq::attend(query, store[...], key, value, positions, attn_mask?, scale, is_causal, layout)
      -> lower_attend (Inductor's lowering of the op, registered by `register()`)
         CUDA, one query token, shapes static:
             autotune_select_algorithm("kvq_attend", one ExternKernelCaller per LaunchConfig of
             templates/decode_attention.py, all of the extern kernel `kvq_attend` with the configuration as
             keywords): the default launch alone (CONFIGS), or under max_autotune MAX_AUTOTUNE_CONFIGS, which
             Inductor benchmarks once per layer layout and shape (on the full cache length, see
             `_input_generators`) and emits a call of the fastest.
         anything else (CPU, prefill chunks, symbolic shapes): the op as an opaque kernel (the reference
             path, or the CUDA kernel ops.py registers), exactly what Inductor does without a lowering.

The choices are launch configurations of one hand-written Triton template, called as extern kernels; an
Inductor-generated TritonTemplate (prologue fusion of RoPE and the mask into the kernel) is not built: the
kernel is three launches (window, split main region, combine), which one TritonTemplate cannot express.

Inductor's compile cache keys on the graph and its config, not on the source of third-party lowerings:
`cache_key_pass()` returns a post-grad CustomGraphPass (doing nothing) whose uuid() hashes this package's
sources, so an upgraded kvq never gets kernels compiled by an older one.
"""
from __future__ import annotations

import collections
import dataclasses
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


def launch(*tensors, out, kvq_layout: str, scale: float, is_causal: bool, n_store: int, has_mask: bool,
           block_t: int, num_warps: int, num_stages: int, programs_per_sm: int) -> None:
    """The extern kernel `extern_kernels.kvq_attend` that every choice calls with its LaunchConfig as keywords:
    tensors = (query, key, value, positions, *store, [attn_mask]); kvq_layout: the op's layout string
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
    for integer tensors, a one-token cache); integer store tensors (codes, outlier channel indices, hybrid
    masks) stay zeros, valid everywhere; a boolean mask allows every position."""
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
    configs = distinct_launches(MAX_AUTOTUNE_CONFIGS if compat.max_autotune() else CONFIGS, layout)
    choices = [_choice().bind(inputs, out_layout, **kwargs, **dataclasses.asdict(c)) for c in configs]
    node = compat.autotune_select("kvq_attend", choices, inputs, out_layout,
                                  _input_generators(layout, len(store), has_mask))
    chosen = compat.chosen_kwargs(node)
    chosen = None if chosen is None else LaunchConfig(**{f: chosen[f] for f in LaunchConfig.__dataclass_fields__})
    SELECTED.append((layout, chosen))
    log.info("kvq::attend lowered to kvq_attend %s (of %d launch configurations)", chosen, len(choices))
    return node


# (layout, chosen launch) of the latest lowered calls, for bench/ and logs
SELECTED: collections.deque[tuple[str, LaunchConfig | None]] = collections.deque(maxlen=4096)
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
        return repr((sorted(DEVICES), CONFIGS, MAX_AUTOTUNE_CONFIGS, os.environ.get("KVQ_REFERENCE_KERNELS"),
                     _REGISTERED))

    return compat.source_hash_pass(source_files(), previous, state)
