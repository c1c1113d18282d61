"""GPU check of the Gluon decode kernel (templates/decode_attention_gluon.py) against the reference op and the
Triton template, on stores filled by kvq::append (random K/V): relative errors of both, printed (the asserting
version is tests/test_decode_gluon.py). --time: its time next to the Triton template's and a profile of one call.

    python bench/check_gluon.py [--quick] [--time] [--sweep] [--pdl] [--no-check]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from bench_decode_attention import graph_time, random_store, copy_bandwidth, bytes_read  # noqa: E402

from kvq_compile import KVQConfig  # noqa: E402
from kvq_compile.ops import attend_cpu_reference  # noqa: E402
from kvq_compile.templates.decode_attention import decode_attention  # noqa: E402
from test_decode_gluon import _store, random_mask  # noqa: E402  (the test's store and masks)
from models import graph_of  # noqa: E402


def check(preset="kivi-2", quick=False):
    cfg = KVQConfig.preset(preset)
    worst = 0.0
    shapes = ((2, 2, 4, 640, 600), (3, 1, 3, 700, 333), (1, 3, 1, 512, 200), (2, 2, 8, 1100, 1031),
              (1, 1, 5, 300, 160), (2, 1, 4, 2000, 130))
    for dtype in (torch.float16, torch.bfloat16):
        for B, H, rep, T, n0 in shapes[:2] if quick else shapes:
            _, ms, lay, k, v, p = _store(preset, B, H, T, n0, dtype, "cuda", seed=B * 100 + n0)
            names, tensors = lay.attend_tensors()
            q = torch.randn(B, H * rep, 1, 128, device="cuda", dtype=dtype)
            for mk in ("none", "bool", "additive"):
                mask = random_mask(mk, B, T, n0, dtype, "cuda")
                ref = attend_cpu_reference(q, tensors, k, v, p, mask, 128 ** -0.5, False, lay.descriptor(names)).float()
                outs = {}
                for g in (False, True):
                    for ns, bt in ((None, None), (1, 16), (7, 32), (5, 16)):
                        outs[(g, ns)] = decode_attention(q, dict(zip(names, tensors)), k, v, p, mask, 128 ** -0.5,
                                                         False, cfg, lay.spec, ms.geo, gluon=g, num_splits=ns,
                                                         block_t=bt).float()
                errs = {key: ((o - ref).norm() / ref.norm()).item() for key, o in outs.items()}
                mx = {key: (o - ref).abs().max().item() for key, o in outs.items()}
                g_err = max(v for (g, _), v in errs.items() if g)
                t_err = max(v for (g, _), v in errs.items() if not g)
                worst = max(worst, g_err / max(t_err, 1e-4))
                print(f"{preset} {str(dtype)[6:]:8s} B={B} H={H} rep={rep} T={T} n0={n0} mask={mk:8s} rel err "
                      f"gluon {g_err:.2e} triton {t_err:.2e}  max abs gluon "
                      f"{max(v for (g, _), v in mx.items() if g):.2e} triton {max(v for (g, _), v in mx.items() if not g):.2e}",
                      flush=True)
    print(f"worst gluon/triton error ratio {worst:.2f}")


def decode_call(preset: str, B: int, ctx: int, dtype=torch.bfloat16, mask: bool = True):
    """(fn, bytes read): one decode-attention call over a random store of `preset` (Llama-3-8B attention shapes:
    32 query heads, 8 KV heads, head_dim 128) holding ctx tokens, with HF's bool mask (mask=False: none); fn(**kw)
    passes kw on to `decode_attention` (and keeps the store alive)."""
    from bench_decode_attention import pick_layer

    cfg = KVQConfig.preset(preset)
    li = pick_layer(cfg)
    ms = random_store(cfg, li, li + 1, B, ctx, dtype)
    lay = ms.layers[li]
    bufs = dict(zip(*lay.attend_tensors()))
    q = torch.randn(B, 32, 1, 128, device="cuda", dtype=dtype)
    kc = torch.randn(B, 8, 1, 128, device="cuda", dtype=dtype)
    am = torch.ones(B, 1, 1, ctx, dtype=torch.bool, device="cuda") if mask else None
    pos = torch.tensor([ctx - 1], device="cuda")

    def fn(**kw):
        return decode_attention(q, bufs, kc, kc, pos, am, 128 ** -0.5, False, cfg, lay.spec, ms.geo, **kw)

    return fn, bytes_read(lay, B, ctx, dtype)


def kernel_times(fn, calls: int = 20) -> str:
    """Each CUDA kernel's GPU time per fn() call (torch profiler over `calls` calls, after three warm-up calls),
    with how many times a call launches it."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return ", ".join(f"{e.key[:40]} x{e.count // calls} {e.device_time_total / calls:.1f} us"
                     for e in prof.key_averages() if e.device_type.name == "CUDA" and e.count)


def timing(presets=("kivi-2", "kivi-4", "xquant-1.38", "calibquant-1"),
           shapes=((32, 4096), (8, 8192), (1, 65536), (32, 16384))):
    """Decode attention, one call (CUDA-graph timed, HF's bool mask, so the KIVI-layout launch takes the TMA ring),
    with the Gluon launch's split count chosen two ways, session 10's (about 8 programs per SM) and the default (as
    many as the SMs hold at once, at most 8 per SM for KIVI's layout where those slices are short: `_gluon_splits`);
    then where one call's GPU time goes (default path). Session 11
    also timed a 128-register cap (16 programs per SM, a few spills), twice the default split count and post-scaled
    Keys (commit 176ac78): none faster (bench/RESULTS.md).
    (A second stream for the window launch, beside the Gluon launch, gained 0-3% in session 10: not kept.)"""
    from kvq_compile.templates import decode_attention as da
    from kvq_compile.templates import decode_attention_gluon as dag

    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()} copy {bw / 1e12:.2f} TB/s")
    for preset in presets:
        for B, ctx in shapes:
            fn, nbytes = decode_call(preset, B, ctx)
            old = da._num_splits(B * 8, ctx, dag.BT, torch.device("cuda"), 8)
            line = []
            for name, kw in (("old splits", dict(num_splits=old)), ("fill", {})):
                t = graph_time(lambda: fn(**kw))
                split = kw.get("num_splits", da.LAST_KERNELS["splits"])
                line.append(f"{name} ({split}) {t:.1f} us ({nbytes / (t * 1e-6) / bw * 100:.0f}%)")
            print(f"{preset} B={B} ctx={ctx}: " + ", ".join(line), flush=True)
            print("  profile (no graph, plain loads): " + kernel_times(fn))
            fn = None   # the store goes before the next one is built
            torch.cuda.empty_cache()


def sweep(presets=("kivi-2", "calibquant-1"), shapes=((32, 4096), (8, 8192), (1, 16384))):
    """The launches around the Gluon kernel, CUDA-graph timed: the window launch's tile and warps, then the final
    reduction's warps (the rest at their defaults)."""
    from kvq_compile.templates import decode_attention as da

    for preset in presets:
        for B, ctx in shapes:
            fn, _ = decode_call(preset, B, ctx)
            line = []
            for bt in (16, 32, 64):
                for w in (1, 2, 4, 8):
                    line.append(f"t{bt}w{w} {graph_time(lambda: fn(block_t=bt, window_warps=w)):.1f}")
            try:
                for w in (1, 2, 4, 8):
                    da.COMBINE_WARPS = w
                    line.append(f"combine w{w} {graph_time(fn):.1f}")
            finally:
                da.COMBINE_WARPS = None
            print(f"{preset} B={B} ctx={ctx} us: " + ", ".join(line), flush=True)
            fn = None   # the store goes before the next one is built
            torch.cuda.empty_cache()


def pdl(presets=("kivi-2", "kivi-4", "xquant-1.38", "calibquant-1", "int8", "kvquant-4"),
        shapes=((32, 4096), (8, 8192), (32, 16384), (1, 65536))):
    """The window launch and the final reduction as programmatic dependent launches (`decode_attention.PDL`, the
    default on sm_90+) against plain launches, CUDA-graph timed, and each output's difference from the plain one,
    computed with the partial-result buffers filled with NaN first (`decode_attention.POISON`: a slot read before
    it is written shows), launched directly and replayed from a CUDA graph."""
    from kvq_compile.templates import decode_attention as da

    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()} copy {bw / 1e12:.2f} TB/s")
    for preset in presets:
        for B, ctx in shapes:
            fn, nbytes = decode_call(preset, B, ctx)
            line = []
            saved = da.PDL
            try:
                da.PDL = False
                ref = fn().float()
                for name, on in (("plain", False), ("pdl", True)):
                    da.PDL = on
                    t = graph_time(fn)
                    da.POISON = True
                    diff = ((fn().float() - ref).norm() / ref.norm()).item()
                    g, o = graph_of(fn)   # and replayed from a CUDA graph (the TMA path, as in a decode step)
                    worst = 0.0
                    for _ in range(5):
                        o.zero_()
                        g.replay()
                        torch.cuda.synchronize()
                        worst = max(worst, ((o.float() - ref).norm() / ref.norm()).item())
                    da.POISON = False
                    line.append(f"{name} {t:.1f} us ({nbytes / (t * 1e-6) / bw * 100:.1f}%, {diff:.1e} from plain, "
                                f"graph {worst:.1e})")
            finally:
                da.PDL, da.POISON = saved, False
            print(f"{preset} B={B} ctx={ctx}: " + ", ".join(line), flush=True)
            fn = None   # the store goes before the next one is built
            torch.cuda.empty_cache()


if __name__ == "__main__":
    torch.manual_seed(0)
    if "--no-check" not in sys.argv:
        check(quick="--quick" in sys.argv)
    if "--time" in sys.argv:
        timing()
    if "--sweep" in sys.argv:
        sweep()
    if "--pdl" in sys.argv:
        pdl()
