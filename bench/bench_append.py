"""Quantize-on-append cost per layer and decode step, against the decode attention of the same step.

    python bench/bench_append.py [--quick]

For each preset at (batch, context): kvq::append of one token per sequence as the CUDA op runs it (the Triton
template `templates/quantize_append.py`, K and V in one launch), the sync-free torch implementation compiled by
Inductor (KVQ_APPEND=inductor), the same uncompiled, and decode attention, each timed by replaying a captured
CUDA graph of 20 calls (launch overhead excluded as in a reduce-overhead decode step). The template is timed at a
step that completes no channel group and at one that completes a group on both sides (KIVI's Keys: one step in
32), and their mean over a group's steps.

    python bench/bench_append.py --sweep   # the template only, at each FLUSH_CHANNELS x RING_VEC x num_warps
                                           # (FLUSH_PROGRAMS_PER_SM off; GROUP_RESHAPE as set)
    python bench/bench_append.py --in-step # what the append adds to a step: append + attention against attention

--in-step times CUDA graphs of 20 steps of (append, attention) and of the attention alone, at a step that
completes no group and at a flush step, and the same with a small kernel in front of the attention (a stand-in for
the query's RoPE, which Inductor may put between the two); the append's share of the step is the difference.
"beside" times the append handed to the attention (`decode_attention`'s append: for presets with a recent window,
launched after the window launch as its programmatic dependent, its programs beside the attention's; session 42).
(Session 38 ran it with the attention's Gluon launch as the append's programmatic dependent, HEAD_PDL, on and off:
bench/debug/head_pdl_tried.patch.)
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode_attention import D, H, HQ, graph_time, pick_layer, random_store  # noqa: E402

from kvq_compile import KVQConfig  # noqa: E402
from kvq_compile import store as st  # noqa: E402
from kvq_compile.ops import compiled_decode_append  # noqa: E402
from kvq_compile.templates.decode_attention import decode_attention  # noqa: E402
from kvq_compile.templates.quantize_append import append_decode  # noqa: E402


def completes(cfg, p: int) -> bool:
    """Whether the decode step at position p codes a group on both sides (a flush: `store.code_boundary` moves)."""
    return all(st.code_boundary(p + 1, cfg.sink, cfg.recent, q.tokens_per_group)
               > st.code_boundary(p, cfg.sink, cfg.recent, q.tokens_per_group) for q in (cfg.key, cfg.value))


def append_setup(name: str, B: int, ctx: int, dtype=torch.bfloat16):
    """(cfg, model store, layer, append buffers by name, key, value, first flush position >= ctx) of one layer of
    `name` holding ctx random tokens."""
    cfg = KVQConfig.preset(name)
    li = pick_layer(cfg)
    ms = random_store(cfg, li, li + 1, B, ctx + 64, dtype)
    lay = ms.layers[li]
    bufs = dict(zip(*lay.append_tensors()))
    k, v = (torch.randn(B, H, 1, D, device="cuda", dtype=dtype) for _ in range(2))
    return cfg, ms, lay, bufs, k, v, next(p for p in range(ctx, ctx + 64) if completes(cfg, p))


def main(quick: bool = False):
    """quick: the template and the attention only (not the Inductor-compiled and eager appends)."""
    dtype = torch.bfloat16
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    for B, ctx in ((8, 8192), (32, 4096)):
        for name in ("int8", "kivi-4", "kivi-2", "kvquant-4", "innerq-2", "xquant-1.38", "calibquant-1"):
            cfg, ms, lay, bufs, k, v, flush = append_setup(name, B, ctx, dtype)
            layout = lay.descriptor(list(bufs))
            # a step that completes no group on a side (per-token groups on both sides: every step completes one)
            quiet = next((p for p in range(ctx, ctx + 64) if not completes(cfg, p)), ctx)
            pos = torch.tensor([quiet], device="cuda")
            cs = (torch.randn(B, 1, D, device="cuda", dtype=dtype),) * 2 if cfg.keys_before_rope else (None, None)
            t_op = graph_time(lambda: append_decode(bufs, cfg, lay.spec, ms.geo, k, v, pos, *cs))
            pos_f = torch.tensor([flush], device="cuda")
            t_flush = graph_time(lambda: append_decode(bufs, cfg, lay.spec, ms.geo, k, v, pos_f, *cs))
            t_ind = t_eager = float("nan")
            if not quick:
                t_ind = graph_time(lambda: compiled_decode_append(layout)(bufs, k, v, pos, *cs))
                t_eager = graph_time(lambda: st.append_decode(bufs, cfg, lay.spec, ms.geo, k, v, pos, *cs))
            an, at = lay.attend_tensors()
            ab = dict(zip(an, at))
            q = torch.randn(B, HQ, 1, D, device="cuda", dtype=dtype)
            t_att = graph_time(lambda: decode_attention(q, ab, k, v, pos, None, D ** -0.5, False, cfg, lay.spec,
                                                        ms.geo))
            g = max(q.tokens_per_group for q in (cfg.key, cfg.value))   # a flush every g steps at most
            t_mean = t_op + (t_flush - t_op) / g
            print(f"{name:13s} B={B:2d} ctx={ctx:5d}  append (triton) {t_op:7.1f} us (group flush {t_flush:6.1f}, "
                  f"mean over {g} steps {t_mean:6.1f})  append (inductor) {t_ind:7.1f} us  append (eager ops) "
                  f"{t_eager:7.1f} us  attention {t_att:7.1f} us  append/attention {t_op / t_att:5.3f} (flush "
                  f"{t_flush / t_att:5.3f}, mean {t_mean / t_att:5.3f})", flush=True)
            del ms, bufs, ab, at
            torch.cuda.empty_cache()


def sweep():
    """The template's step and flush-step times for the presets with channel groups spanning tokens, at each
    channel split (`quantize_append.FLUSH_CHANNELS`), ring load (`RING_VEC`, 0: the group loaded as [tokens, words,
    codes]) and warp count. (Session 38 swept `GROUP_RESHAPE` in its place; it is kept as set now.)"""
    from kvq_compile.templates import quantize_append as qa

    dtype = torch.bfloat16
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    default = qa.FLUSH_CHANNELS, qa.RING_VEC, qa.FLUSH_PROGRAMS_PER_SM
    qa.FLUSH_PROGRAMS_PER_SM = 0   # the channel split as swept, uncapped
    try:
        _sweep(qa, dtype)
    finally:
        qa.FLUSH_CHANNELS, qa.RING_VEC, qa.FLUSH_PROGRAMS_PER_SM = default


def _sweep(qa, dtype):
    for B, ctx in ((8, 8192), (32, 4096)):
        for name in ("kivi-2", "kivi-4", "xquant-1.38", "innerq-2"):
            cfg, ms, lay, bufs, k, v, flush = append_setup(name, B, ctx, dtype)
            pos, pos_f = torch.tensor([flush + 1], device="cuda"), torch.tensor([flush], device="cuda")
            for ch in (32, 16):
                qa.FLUSH_CHANNELS = ch
                for vec in (0, 2, 4):
                    qa.RING_VEC = vec
                    for nw in (1, 2, 4):
                        t_op = graph_time(lambda: append_decode(bufs, cfg, lay.spec, ms.geo, k, v, pos, num_warps=nw))
                        t_fl = graph_time(lambda: append_decode(bufs, cfg, lay.spec, ms.geo, k, v, pos_f,
                                                                num_warps=nw))
                        print(f"sweep {name:12s} B={B:2d} ctx={ctx:5d} channels/program {ch:3d} ring_vec {vec} "
                              f"warps {nw}  step {t_op:6.1f} us  flush {t_fl:6.1f} us", flush=True)
            del ms, bufs
            torch.cuda.empty_cache()


def in_step():
    """The append's increment to a step's time: graphs of (append, attention) against the attention alone, each
    also with a query kernel in front of the attention (module docstring)."""
    dtype = torch.bfloat16
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    for B, ctx in ((8, 8192), (32, 4096)):
        for name in ("int8", "kivi-4", "kivi-2", "kvquant-4", "innerq-2", "xquant-1.38", "calibquant-1"):
            cfg, ms, lay, bufs, k, v, flush = append_setup(name, B, ctx, dtype)
            quiet = next((p for p in range(ctx, ctx + 64) if not completes(cfg, p)), ctx)
            cs = (torch.randn(B, 1, D, device="cuda", dtype=dtype),) * 2 if cfg.keys_before_rope else (None, None)
            an, at = lay.attend_tensors()
            ab = dict(zip(an, at))
            q0 = torch.randn(B, HQ, 1, D, device="cuda", dtype=dtype)
            g = max(q.tokens_per_group for q in (cfg.key, cfg.value))   # a flush every g steps at most
            row = []
            for label, p in (("quiet", quiet), ("flush", flush)):
                pos = torch.tensor([p], device="cuda")

                def attend(q, pos=pos):
                    return decode_attention(q, ab, k, v, pos, None, D ** -0.5, False, cfg, lay.spec, ms.geo)

                def append(pos=pos):
                    append_decode(bufs, cfg, lay.spec, ms.geo, k, v, pos, *cs)

                def beside(q, pos=pos):  # the append handed to the attention (`decode_attention`'s append)
                    return decode_attention(q, ab, k, v, pos, None, D ** -0.5, False, cfg, lay.spec, ms.geo,
                                            append=lambda **kw: append_decode(bufs, cfg, lay.spec, ms.geo, k, v,
                                                                              pos, *cs, **kw))

                t_att = graph_time(lambda: attend(q0))
                t_step = graph_time(lambda: (append(), attend(q0)))
                t_bstep = graph_time(lambda: beside(q0))
                t_qatt = graph_time(lambda: attend(q0 * 1.0))
                t_qstep = graph_time(lambda: (append(), attend(q0 * 1.0)))
                row.append(f"{label}: attention {t_att:6.1f} us, + append {t_step - t_att:5.1f} us "
                           f"({(t_step - t_att) / t_att:5.3f}), beside {t_bstep - t_att:5.1f} us "
                           f"({(t_bstep - t_att) / t_att:5.3f}); q kernel between: attention {t_qatt:6.1f}, "
                           f"+ append {t_qstep - t_qatt:5.1f} us ({(t_qstep - t_qatt) / t_qatt:5.3f})")
            print(f"in-step {name:13s} B={B:2d} ctx={ctx:5d} (flush 1 step in {g})  " + "  |  ".join(row), flush=True)
            del ms, bufs, ab, at
            torch.cuda.empty_cache()


if __name__ == "__main__":
    if "--in-step" in sys.argv:
        in_step()
    elif "--sweep" in sys.argv:
        sweep()
    else:
        main(quick="--quick" in sys.argv)
