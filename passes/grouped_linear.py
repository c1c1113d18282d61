"""Group a decode graph's same-input projections into one `kvq::grouped_linear` (the q / k / v projections of an
attention layer, the gate / up projections of its MLP), so that a decode step reads their weights in one launch.

A decode step's GEMMs have one row per sequence and are bound by reading the weights; cuBLAS runs the small ones as
split-K GEMMs with a reduction kernel each. Matched: `torch._C._nn.linear` / `F.linear` calls without bias on the
same input node, on CUDA tensors (`DEVICES`; on the CPU the op would only be the linears again), their weights 2-D
and defined before the group's first call, the input's rows (the product of its leading dimensions) static and at
most `templates.grouped_linear.MAX_ROWS`, no grad-mode switch, autocast boundary or in-place write between two
members (the op runs where the group's first call was). Left unchanged, with the reason logged: a bias, a symbolic
or larger row count (a prefill chunk: cuBLAS does well there), a weight computed inside the group, a weight or
input that is a tensor subclass (a quantized weight: its linear is its own), and every linear of a graph traced
under autocast or with an autocast region (the op would not be cast as the linears are), or without Triton. The
op's CUDA kernel falls back to the linears where its launch does not fit (`ops.grouped_launch_fits`: dtype,
strides); its backward is the linears' (`ops._grouped_linear_backward`).

Lone linears (o_proj, down_proj, lm_head) become one-weight launches where their input has at most `SINGLE_ROWS`
(8) rows (`singles="auto"`, the default): in isolation on an H200 the launch beat cuBLAS at 1 row for all three
(o_proj 11.03 -> 9.62 us, down_proj 32.22 -> 31.63, lm_head 250.66 -> 241.17) and at 8 rows for down_proj and lm_head
(o_proj within 0.1 us), but lost at 32 rows for o_proj and down_proj, where end to end it was within the measure's
spread (bench/RESULTS.md, session 54). `singles=True` / `KVQ_SINGLE_LINEARS=1` takes every eligible lone linear,
`False` / `0` none.
"""
from __future__ import annotations

import logging
import operator
import os

import torch
import torch.fx as fx

from .kv_cache_attention import _val as _value

log = logging.getLogger("kvq_compile")

ENABLED = os.environ.get("KVQ_GROUP_LINEARS", "1") != "0"   # the backend's default (`kvq_backend(group_linears=)`)
SINGLES = {"0": False, "1": True}.get(os.environ.get("KVQ_SINGLE_LINEARS", ""), "auto")   # lone linears (see above)
SINGLE_ROWS = 8   # "auto": a lone linear whose input has at most this many rows becomes a one-weight launch
DEVICES = ("cuda",)    # the devices whose linears are grouped (tests add "cpu": the op's reference kernel there)
DTYPES = (torch.float16, torch.bfloat16)   # the launch's dtypes (others would fall back to the linears at run time)
LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)
_INPLACE_OPERATORS = (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift, operator.imatmul)


def _linear_args(n: fx.Node):
    """(input, weight, bias) of a linear call."""
    args = list(n.args) + [None] * (3 - len(n.args))
    return n.kwargs.get("input", args[0]), n.kwargs.get("weight", args[1]), n.kwargs.get("bias", args[2])


def _plain(v) -> bool:
    """A plain tensor's fake (or the tensor itself), not a subclass that brings its own linear."""
    from torch._subclasses.fake_tensor import FakeTensor

    return type(v) in (FakeTensor, torch.Tensor, torch.nn.Parameter)


def _barrier(n: fx.Node) -> bool:
    """A node that a later linear must not be moved above: a grad-mode or inference-mode switch, an autocast
    boundary, an in-place write (a method or function named with a trailing underscore, an in-place operator, an
    `out=` argument, an op whose schema mutates, overload or packet), a module call."""
    if n.op == "call_module" or "out" in n.kwargs:
        return True
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if n.op == "call_method":
        return name.endswith("_") and not name.startswith("__")
    if n.op != "call_function":
        return False
    if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
        return True
    if isinstance(n.target, torch._ops.OpOverloadPacket) and any(
            getattr(n.target, o)._schema.is_mutable for o in n.target.overloads()):
        return True
    return (n.target in _INPLACE_OPERATORS or any(k in name for k in ("grad_enabled", "inference_mode", "autocast"))
            or (name.endswith("_") and not name.startswith("__")))


def _autocast_on() -> bool:
    for device in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(device):
                return True
        except TypeError:   # an older signature: no device argument (CUDA's state)
            return torch.is_autocast_enabled()
    return False


def _eligible(n: fx.Node, max_rows: int) -> str | None:
    """Why linear call n cannot join a group (None: it can)."""
    x, w, bias = _linear_args(n)
    xv, wv = _value(x), _value(w)
    if bias is not None:
        return "it has a bias"
    if not isinstance(xv, torch.Tensor) or not isinstance(wv, torch.Tensor) or wv.dim() != 2:
        return "no tensor metadata for its input or a 2-D weight"
    if not (_plain(xv) and _plain(wv)):
        return f"its input or weight is a tensor subclass ({type(xv).__name__}, {type(wv).__name__})"
    if xv.device.type not in DEVICES:
        return f"its input is on {xv.device.type}"
    if xv.dtype not in DTYPES or wv.dtype != xv.dtype:
        return f"dtypes {xv.dtype}, {wv.dtype} (the launch takes {DTYPES} alike)"
    if not all(isinstance(s, int) for s in xv.shape) or _rows(x) > max_rows:
        return f"{tuple(xv.shape[:-1])} rows (symbolic or more than {max_rows})"
    return None


def _rows(x: fx.Node) -> int:
    """The rows of an eligible linear's input (the product of its static leading dimensions)."""
    xv = _value(x)
    return xv.numel() // max(xv.shape[-1], 1)


def _runs(members: list[fx.Node], nodes: list[fx.Node], order: dict) -> list[list[fx.Node]]:
    """members (in graph order) split where a barrier lies between two of them, each run without the members whose
    weight is not defined before the run's first call."""
    runs, run = [], [members[0]]
    for a, b in zip(members, members[1:]):
        if any(_barrier(n) for n in nodes[order[a] + 1:order[b]]):
            runs.append(run)
            run = []
        run.append(b)
    runs.append(run)
    out = []
    for run in runs:
        first = run[0]
        late = [m for m in run if order[_linear_args(m)[1]] > order[first]]
        if late:
            log.info("kvq: %s left ungrouped: a weight is computed after the group's first call", late)
        out.append([m for m in run if m not in late])
    return out


def group_linears(gm: fx.GraphModule, singles: bool | str | None = None) -> int:
    """Rewrite gm in place; the number of `kvq::grouped_linear` nodes inserted. singles: whether a lone eligible
    linear becomes a one-weight launch too: True, False, or "auto" (at most `SINGLE_ROWS` rows); None: `SINGLES`."""
    singles = SINGLES if singles is None else singles
    if not (isinstance(singles, bool) or singles == "auto"):
        raise ValueError(f"singles must be True, False or 'auto', not {singles!r}")

    def takes(run: list[fx.Node]) -> bool:
        if len(run) >= 2 or singles is True:
            return True
        return singles == "auto" and _rows(_linear_args(run[0])[0]) <= SINGLE_ROWS
    try:
        from ..templates.grouped_linear import MAX_GROUP, MAX_ROWS
    except ImportError as e:   # no Triton: no launch to group for
        log.info("kvq: linears left ungrouped: %s", e)
        return 0
    if _autocast_on() or any(n.op == "call_function" and "autocast" in getattr(n.target, "__name__", "")
                             for n in gm.graph.nodes):
        log.info("kvq: linears left ungrouped: the graph is traced under autocast or has an autocast region")
        return 0
    inserted, done = 0, set()
    while True:   # one group at a time, each found in the graph as the last rewrite left it
        nodes = list(gm.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        by_input: dict[fx.Node, list[fx.Node]] = {}
        for n in nodes:
            if n.op != "call_function" or n.target not in LINEAR or n in done:
                continue
            why = _eligible(n, MAX_ROWS)
            if why is None and isinstance(_linear_args(n)[1], fx.Node):
                by_input.setdefault(_linear_args(n)[0], []).append(n)
            else:
                done.add(n)
                log.debug("kvq: %s left alone: %s", n.name, why or "its weight is no graph node")
        part = None
        for members in by_input.values():
            part = next((run[:MAX_GROUP] for run in _runs(members, nodes, order) if run and takes(run)), None)
            if part is not None:
                break
            done.update(members)
        if part is None:
            break
        _rewrite(gm, part)
        inserted += 1
    if inserted:
        gm.graph.lint()
        gm.recompile()
    return inserted


def _rewrite(gm: fx.GraphModule, part: list[fx.Node]) -> None:
    """The linears of part (graph order, one input) -> one kvq::grouped_linear before the first, an output each."""
    x = _linear_args(part[0])[0]
    with gm.graph.inserting_before(part[0]):
        node = gm.graph.call_function(torch.ops.kvq.grouped_linear.default, (x, [_linear_args(m)[1] for m in part]))
        outs = [gm.graph.call_function(operator.getitem, (node, j)) for j in range(len(part))]
    node.meta["example_value"] = [_value(m) for m in part]
    for m, out in zip(part, outs):
        out.meta.update(m.meta)
        m.replace_all_uses_with(out)
        gm.graph.erase_node(m)
