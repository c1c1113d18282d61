"""When each program of one decode-attention call runs (debug, GPU): the KIVI-layout Gluon launch, the window launch
and the final reduction write timer records (`decode_attention.TRACE`: `%globaltimer` reads and `%smid`) inside a
CUDA graph of 20 calls like the benchmark's, and this prints, per launch, when its programs start, wait and end,
relative to the end of the previous call's final reduction. Also the graph time per call with and without the
records (their cost), and for the Gluon launch the programs per SM and the phases of a program: its setup, its
first ring slot's landing, its loop, its stores.

    python bench/debug/timeline.py [presets] [shapes] [variants]
        e.g. kivi-2,kivi-4 1x65536,32x4096 'default;FILL_PER_SM=99'   (variants: upper-case flags of decode_attention)

Presets whose layers take the KIVI-layout Gluon launch (kivi-*, xquant-*, innerq-*) only: the other Gluon launches
write no records, and `decode_attention_gluon.launch` refuses a record buffer for them (ValueError).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_decode_attention import da_flags, graph_time  # noqa: E402
from check_gluon import decode_call  # noqa: E402

from kvq_compile.templates import decode_attention as da  # noqa: E402

REPS = 20
N = 1 << 16   # records per launch and buffer set (programs: at most B * H * slices)


def _buffers():
    return {k: torch.zeros(N, 8, dtype=torch.int64, device="cuda") for k in ("main", "window", "combine")}


def traced_graph(fn, sets):
    """A CUDA graph of REPS calls of fn, call i writing its records into sets[i % 2]."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            da.TRACE = sets[i % 2]
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(REPS):
            da.TRACE = sets[i % 2]
            fn()
    da.TRACE = None
    return g


def _rows(buf):
    """The records written (a nonzero start time), on the CPU."""
    return buf[buf[:, 0] != 0].cpu()


def _q(x, scale=1e-3, qs=(0, 0.5, 0.9, 1.0)):
    """min / median / p90 / max of x times `scale` (ns to us by default)."""
    x = x.double()
    return "/".join(f"{torch.quantile(x, q).item() * scale:.1f}" for q in qs)


def summarize(sets, last: int):
    """The last call's records (set `last`) against the previous call's (the other set)."""
    cur, prev = sets[last], sets[1 - last]
    main, win, comb = (_rows(cur[k]) for k in ("main", "window", "combine"))
    pcomb = _rows(prev["combine"])
    if not len(main):
        print("  no records from the Gluon launch (the layer took the Triton launch)")
        return
    t_zero = pcomb[:, 4].max() if len(pcomb) else main[:, 0].min()
    rel = lambda x: x - t_zero  # noqa: E731
    lines = ["  zero = previous call's final reduction end; times us as min/median/p90/max"]
    per_sm = torch.bincount(main[:, 5], minlength=1)
    lines.append(f"  main: {len(main)} programs on {int((per_sm > 0).sum())} SMs, {int(per_sm.max())} at most a SM"
                 f" (median {int(per_sm[per_sm > 0].median())}); tiles {_q(main[:, 6], 1)}")
    lines.append(f"    start {_q(rel(main[:, 0]))} | setup {_q(main[:, 1] - main[:, 0])} | first slot "
                 f"{_q(main[:, 2] - main[:, 1])} | loop {_q(main[:, 3] - main[:, 2])} | stores "
                 f"{_q(main[:, 4] - main[:, 3])} | end {_q(rel(main[:, 4]))}")
    busy = (main[:, 4] - main[:, 0]).double()
    ns_tile = ((main[:, 3] - main[:, 2]).double() / main[:, 6].clamp(min=1).double())
    lines.append(f"    program {_q(busy)} | loop ns per tile {_q(ns_tile, 1)}")
    if len(win):
        lines.append(f"  window: {len(win)} programs; start {_q(rel(win[:, 0]))} | computed {_q(rel(win[:, 1]))} "
                     f"| released {_q(rel(win[:, 2]))} | end {_q(rel(win[:, 4]))}")
        # window programs that started while the Gluon launch still ran on their SM
        last_main = torch.zeros(int(max(main[:, 5].max(), win[:, 5].max())) + 1, dtype=torch.int64)
        last_main.scatter_reduce_(0, main[:, 5], main[:, 4], reduce="amax")
        beside = (win[:, 0] < last_main[win[:, 5]]).sum().item()
        lines.append(f"    {beside} of {len(win)} started beside the Gluon launch's programs on their SM; compute "
                     f"{_q(win[:, 1] - win[:, 0])}")
    if len(comb):
        lines.append(f"  combine: {len(comb)} programs; start {_q(rel(comb[:, 0]))} | after wait "
                     f"{_q(rel(comb[:, 1]))} | end {_q(rel(comb[:, 4]))} | own {_q(comb[:, 4] - comb[:, 1])}")
        lines.append(f"  span: Gluon start (min) -> reduction end (max) "
                     f"{(comb[:, 4].max() - main[:, 0].min()).item() / 1e3:.1f} us; previous end -> reduction end "
                     f"{rel(comb[:, 4]).max().item() / 1e3:.1f} us")
    print("\n".join(lines), flush=True)


def main():
    presets = (sys.argv[1] if len(sys.argv) > 1 else "kivi-2,kivi-4").split(",")
    shapes = [tuple(map(int, s.split("x"))) for s in (sys.argv[2] if len(sys.argv) > 2 else
                                                       "1x65536,32x4096").split(",")]
    variants = (sys.argv[3] if len(sys.argv) > 3 else "default").split(";")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    sets = [_buffers(), _buffers()]
    for preset in presets:
        for B, ctx in shapes:
            fn, _ = decode_call(preset, B, ctx)
            for var in variants:
                flags = {k: int(x) for k, x in (kv.split("=") for kv in var.split(",") if kv != "default")}
                with da_flags(flags):
                    base = graph_time(fn)
                    for st in sets:
                        for b in st.values():
                            b.zero_()
                    g = traced_graph(fn, sets)
                    g.replay()
                    torch.cuda.synchronize()
                    t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t[0].record()
                    for _ in range(5):
                        g.replay()
                    t[1].record()
                    torch.cuda.synchronize()
                    traced = t[0].elapsed_time(t[1]) * 1e3 / (5 * REPS)
                    print(f"{preset} ({B}, {ctx}) {var}: {base:.1f} us a call untraced, {traced:.1f} traced; "
                          f"slices {da.LAST_KERNELS.get('splits')}", flush=True)
                    summarize(sets, (REPS - 1) % 2)
                    del g


if __name__ == "__main__":
    main()
