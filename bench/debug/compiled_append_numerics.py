"""The Inductor-compiled decode append (`ops.compiled_decode_append`: KVQ_APPEND=inductor, and layouts the
template does not take) against the eager reference append on the GPU, compiled with Inductor's defaults and
with `compat.eager_numerics_options()`: buffer elements that differ, per preset, and the compiled append's
time at one position (median of triton.testing.do_bench, no CUDA graph: launch overhead included).
usage: python bench/debug/compiled_append_numerics.py [--graph]   (--graph: the times alone, in CUDA graphs, at
one of bench_append.py's shapes)"""
import sys

import torch
import triton

sys.path.insert(0, "tests")
from kvq_compile import compat  # noqa: E402
from kvq_compile import store as st  # noqa: E402
from kvq_compile.ops import decode_append_function  # noqa: E402
from models import LAYOUT_PRESETS, small_windows  # noqa: E402


def compiled(cfg, spec, geo, options, tag):
    return decode_append_function(cfg, spec, geo, f"probe_append_{tag}", options)


def compare(name, options, B=4, H=8, T=80, D=128, steps=72, seed=3):
    cfg = small_windows(name)
    geo = st.Geometry(B, H, T, D, "bfloat16")
    ref_store, cmp_store = st.ModelStore(cfg, 1, geo, "cuda"), st.ModelStore(cfg, 1, geo, "cuda")
    a, b = ref_store.layers[0], cmp_store.layers[0]
    fn = compiled(cfg, b.spec, geo, options, f"{name.replace('-', '_').replace('.', '_').replace('%', 'p')}_{len(options)}")
    gen = torch.Generator("cuda").manual_seed(seed)
    scale = 1 + 3 * torch.rand(1, H, 1, D, generator=gen, device="cuda")
    rnd = lambda *s, sc=scale: (torch.randn(*s, generator=gen, device="cuda") * sc).bfloat16()  # noqa: E731
    for p in range(steps):
        k, v = rnd(B, H, 1, D), rnd(B, H, 1, D)
        cs = (rnd(B, 1, D, sc=1), rnd(B, 1, D, sc=1)) if cfg.keys_before_rope else (None, None)
        st.append(dict(zip(*a.append_tensors())), cfg, a.spec, geo, k, v, p, *cs)
        fn(dict(zip(*b.append_tensors())), k, v, torch.tensor([p], device="cuda"), *cs)
    diff = {n: int((a.buffers[n] != b.buffers[n]).sum()) for n in a.buffers}
    diff = {n: d for n, d in diff.items() if d}
    bufs = dict(zip(*b.append_tensors()))
    pos = torch.tensor([steps], device="cuda")
    us = 1e3 * triton.testing.do_bench(lambda: fn(bufs, k, v, pos, *cs), warmup=20, rep=100)
    return diff, us


def graph_times(numerics):
    """The compiled append's time inside a CUDA graph (`bench_decode_attention.graph_time`: replays of 20 calls, no
    launch overhead), at (32, 4096) for four presets, a step that completes no group and a flush step, with Inductor's
    default options and with `numerics`."""
    sys.path.insert(0, "bench")
    from bench_append import append_setup, completes
    from bench_decode_attention import graph_time

    for B, ctx in ((32, 4096),):
        for name in ("int8", "kivi-2", "kvquant-4", "innerq-2"):
            cfg, ms, lay, bufs, k, v, flush = append_setup(name, B, ctx)
            quiet = next((p for p in range(ctx, ctx + 64) if not completes(cfg, p)), ctx)
            cs = (torch.randn(B, 1, k.shape[-1], device="cuda", dtype=k.dtype),) * 2 if cfg.keys_before_rope \
                else (None, None)
            row = []
            for label, opts in (("default", {}), ("eager-numerics", numerics)):
                torch._dynamo.reset()
                fn = compiled(cfg, lay.spec, ms.geo, opts, f"t{B}_{len(opts)}")
                for p in (quiet, flush):
                    pos = torch.tensor([p], device="cuda")
                    row.append(f"{label} {'flush' if p == flush else 'step'} "
                               f"{graph_time(lambda: fn(bufs, k, v, pos, *cs)):6.1f} us")
            print(f"graph {name:13s} B={B:2d} ctx={ctx:5d}  " + "  ".join(row), flush=True)
            del ms, bufs
            torch.cuda.empty_cache()


def main():
    print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
    numerics = compat.eager_numerics_options()
    print("eager_numerics_options:", numerics)
    if "--graph" in sys.argv:
        return graph_times(numerics)
    for name in LAYOUT_PRESETS + ["kivi-4"]:
        for label, opts in (("default", {}), ("eager-numerics", numerics)):
            torch._dynamo.reset()
            diff, us = compare(name, opts)
            print(f"{name:14s} {label:15s} differing elements {sum(diff.values()):6d} {diff}  append {us:7.1f} us")


if __name__ == "__main__":
    main()
