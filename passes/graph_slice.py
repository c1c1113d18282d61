"""Cut a side-effect-free subgraph out of a Dynamo graph, to evaluate some nodes outside the compiled step.

The backend uses it to read, before a compiled step runs, the positions the step will write (how much
prefix eager code already stored) and the RoPE cos/sin that produced stored keys.
"""
from __future__ import annotations

import torch.fx as fx


def slice_graph(gm: fx.GraphModule, targets: list[fx.Node]):
    """(GraphModule computing `targets` from the placeholders it needs, their indices among gm's
    placeholders) or (None, reason). Refuses in-place ops and placeholders mutated before a target."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    need, stack = set(), list(targets)
    while stack:
        n = stack.pop()
        if n in need:
            continue
        need.add(n)
        if n.op in ("call_method", "call_function"):
            name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
            if isinstance(name, str) and name.endswith("_") and not name.endswith("__"):
                return None, f"{n.name} is an in-place op"
        elif n.op not in ("placeholder", "get_attr"):
            return None, f"{n.name} is a {n.op}"
        stack.extend(x for x in n.all_input_nodes)
    last = max(order[t] for t in targets)
    for p in (n for n in need if n.op == "placeholder"):
        for u in p.users:
            name = u.target if u.op == "call_method" else getattr(u.target, "__name__", "")
            if isinstance(name, str) and name.endswith("_") and not name.endswith("__") and order[u] < last:
                return None, f"{p.name} is mutated by {u.name} before it is read"
    g = fx.Graph()
    env = {}
    used = [p for p in placeholders if p in need]
    for n in gm.graph.nodes:
        if n in need:
            env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[t] for t in targets))
    return fx.GraphModule(gm, g), [placeholders.index(p) for p in used]
