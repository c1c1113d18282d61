"""Group a decode graph's same-input projections into one `kvq::grouped_linear` (the q / k / v projections of an
attention layer, the gate / up projections of its MLP), so that a decode step reads their weights in one launch.

A decode step's GEMMs have one row per sequence and are bound by reading the weights; cuBLAS runs the small ones as
split-K GEMMs with a reduction kernel each. Matched: `torch._C._nn.linear` / `F.linear` calls without bias on the
same input node, their weights 2-D graph inputs (or nodes defined before the group's first call), the input's rows
(the product of its leading dimensions) static and at most `templates.grouped_linear.MAX_ROWS`. Left unchanged, with
the reason logged: a bias, a symbolic or larger row count (a prefill chunk: cuBLAS does better there), a weight
computed inside the group, a weight or input that is a tensor subclass (a quantized weight: its linear is its own),
and every linear of a graph with an autocast region (the op would not be cast as the linears are). The op's CPU
kernel is one linear per weight (the same values); on CUDA it falls back to that where its launch does not fit
(`ops.grouped_launch_fits`: dtype, strides); its backward is the linears' (`ops._grouped_linear_backward`).
"""
from __future__ import annotations

import logging
import operator
import os

import torch
import torch.fx as fx

log = logging.getLogger("kvq_compile")

ENABLED = os.environ.get("KVQ_GROUP_LINEARS", "1") != "0"   # the backend's default (`kvq_backend(group_linears=)`)
LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)


def _value(n):
    return n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else None


def _linear_args(n: fx.Node):
    """(input, weight, bias) of a linear call."""
    args = list(n.args) + [None] * (3 - len(n.args))
    return n.kwargs.get("input", args[0]), n.kwargs.get("weight", args[1]), n.kwargs.get("bias", args[2])


def _plain(v) -> bool:
    """A plain tensor's fake (or the tensor itself), not a subclass that brings its own linear."""
    from torch._subclasses.fake_tensor import FakeTensor

    return type(v) in (FakeTensor, torch.Tensor, torch.nn.Parameter)


def group_linears(gm: fx.GraphModule) -> int:
    """Rewrite gm in place; the number of `kvq::grouped_linear` nodes inserted."""
    from ..templates.grouped_linear import MAX_GROUP, MAX_ROWS

    if any(n.op == "call_function" and "autocast" in getattr(n.target, "__name__", "") for n in gm.graph.nodes):
        log.info("kvq: linears left ungrouped: the graph has an autocast region")
        return 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in LINEAR:
            continue
        x, w, bias = _linear_args(n)
        xv, wv = _value(x), _value(w)
        if bias is not None:
            log.info("kvq: %s left alone: it has a bias", n.name)
        elif not isinstance(xv, torch.Tensor) or not isinstance(wv, torch.Tensor) or wv.dim() != 2:
            log.info("kvq: %s left alone: no tensor metadata for its input or a 2-D weight", n.name)
        elif not (_plain(xv) and _plain(wv)):
            log.info("kvq: %s left alone: its input or weight is a tensor subclass (%s, %s)", n.name,
                     type(xv).__name__, type(wv).__name__)
        elif not all(isinstance(s, int) for s in xv.shape) or xv.numel() // max(xv.shape[-1], 1) > MAX_ROWS:
            log.debug("kvq: %s left alone: %s rows (symbolic or more than %d)", n.name, tuple(xv.shape[:-1]),
                      MAX_ROWS)
        else:
            groups.setdefault(x, []).append(n)
    inserted = 0
    for x, members in groups.items():
        for i in range(0, len(members), MAX_GROUP):
            part = members[i:i + MAX_GROUP]
            first = min(part, key=order.get)
            late = [m for m in part if not isinstance(_linear_args(m)[1], fx.Node)
                    or order[_linear_args(m)[1]] > order[first]]
            if late:
                log.info("kvq: %s left ungrouped: a weight is computed after the group's first call", late)
                part = [m for m in part if m not in late]
            if len(part) < 2:
                continue
            with gm.graph.inserting_before(first):
                node = gm.graph.call_function(torch.ops.kvq.grouped_linear.default,
                                              (x, [_linear_args(m)[1] for m in part]))
                outs = [gm.graph.call_function(operator.getitem, (node, j)) for j in range(len(part))]
            node.meta["example_value"] = [_value(m) for m in part]
            for m, out in zip(part, outs):
                out.meta.update(m.meta)
                m.replace_all_uses_with(out)
                gm.graph.erase_node(m)
            inserted += 1
    if inserted:
        gm.graph.lint()
        gm.recompile()
    return inserted
