"""Decode-attention kernel benchmark: the kvq Triton template per preset against torch SDPA (enable_gqa=True)
on fp16/bf16 K/V of the same valid length. Llama-3-8B attention shapes: 32 query heads, 8 KV heads, head_dim 128.

    python bench/bench_decode_attention.py [--quick] [--out results.json]
    python bench/bench_decode_attention.py --plot results.json --svg plot.svg   # no GPU: the plot of a saved run

Per (preset, batch, context): median GPU time of one call, from replays of a CUDA graph of 20 calls
(`graph_time`: launch overhead excluded, as in a reduce-overhead decode step; SDPA timed the same way), the bytes the kernel must read (every store
tensor over the valid length, the RoPE table for pre-RoPE keys, q, the output), effective bandwidth as a fraction
of the device-to-device copy bandwidth measured in the same run, and the speedup over SDPA. Each store is filled
with random codes and statistics (timing does not depend on the values; correctness is tests/test_templates.py),
sized so that the whole static buffer is the valid context. Before timing, the kernel is checked against the
reference op on a smaller context of the same preset. --mask adds an all-allowed attention mask to both kernels
(bool [B, 1, 1, ctx] is what HF passes in decode; its bytes are not counted); --flush-l2 writes 256 MiB before
every timed call and subtracts the writes' own time (the writes also evict dirty lines, which slightly penalizes
bandwidth-bound kernels).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from kvq_compile import KVQConfig  # noqa: E402
from kvq_compile.config import Symmetry  # noqa: E402
from kvq_compile import reference as ref  # noqa: E402
from kvq_compile import store as st  # noqa: E402
from kvq_compile.ops import attend_cpu_reference  # noqa: E402  (the reference, whatever device)
from kvq_compile.templates.decode_attention import decode_attention  # noqa: E402
from kvq_compile.templates import decode_attention as da  # noqa: E402  (its flags, for --variants)

@contextlib.contextmanager
def da_flags(flags: dict):
    """Module flags (upper-case names) of decode_attention (e.g. FILL_PER_SM, COMBINE_WARPS) or, where it has none of
    that name, of its Gluon module (e.g. MASK_SLICE), set inside the block and restored after it; SystemExit naming
    any that is neither's."""
    from kvq_compile.templates import decode_attention_gluon as dag

    mods = {}
    for k in flags:
        mods[k] = da if hasattr(da, k) else dag if hasattr(dag, k) else None
        if mods[k] is None:
            sys.exit(f"{k} is not a flag of kvq_compile.templates.decode_attention or its Gluon module")
    saved = {k: getattr(mods[k], k) for k in flags}
    for k, x in flags.items():
        setattr(mods[k], k, x)
    try:
        yield
    finally:
        for k, x in saved.items():
            setattr(mods[k], k, x)


PRESETS = ["fp16", "int8", "kivi-4", "kvquant-4", "kivi-2", "innerq-2", "xquant-1.38", "calibquant-1"]
HQ, H, D = 32, 8, 128


def copy_bandwidth() -> float:
    import triton.testing as tt

    x = torch.empty(2 ** 30 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = tt.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return 2 * x.numel() * 2 / (ms * 1e-3)


def random_store(cfg: KVQConfig, layer_index: int, layers: int, B: int, T: int, dtype,
                 device="cuda") -> st.ModelStore:
    geo = st.Geometry(B, H, T, D, st.dtype_name(dtype))
    ms = st.ModelStore(cfg, layers, geo, device)
    for lay in ms.layers[: layer_index + 1]:
        for name, t in lay.buffers.items():
            if name.endswith("levels"):
                continue
            if t.dtype == torch.int32:
                t.random_(-2 ** 31, 2 ** 31 - 1)
                if name.endswith("codes"):  # only codes a quantizer stores: int8 has 255 levels (code 255
                    # unused); hybrid groups' symmetric choice 2^B - 1
                    q = lay.spec.key if name.startswith("k.") else lay.spec.value
                    count = ref.level_count(q.bits, True) if q.symmetry is Symmetry.HYBRID else ref.levels_for(q).numel()
                    if count < 2 ** q.bits:
                        t.copy_(ref.pack_bits(ref.unpack_bits(t, q.bits, D).clamp_max(count - 1), q.bits))
            elif t.dtype in (torch.uint8, torch.int16):
                t.random_(0, D)
            elif name.endswith("half"):
                t.uniform_(0.05, 0.5)
                q = lay.spec.key if name.startswith("k.") else lay.spec.value
                if q.symmetry is Symmetry.HYBRID:   # half the groups symmetric (a negative half: store.signed_half)
                    t.mul_(torch.where(torch.rand(t.shape, device=device) < 0.5, -1.0, 1.0).to(t.dtype))
            elif name.endswith("norm"):
                t.uniform_(0.5, 2.0)
            else:
                t.normal_()
    for t in ms.rope.values():
        t.uniform_(-1, 1)
    return ms


def bytes_read(layer: st.LayerStore, B: int, T: int, dtype) -> int:
    names, tensors = layer.attend_tensors()
    total = 0
    for n, t in zip(names, tensors):
        if n.startswith("rope."):  # read by every KV head of a batch row; counted once (the heads share L2)
            total += t.numel() * t.element_size()
        elif not n.endswith("levels"):
            total += t.numel() * t.element_size()
    total += 2 * B * HQ * D * torch.empty((), dtype=dtype).element_size()  # q in, out
    return total


FLUSH = None  # --flush-l2: a 256 MiB buffer written between calls, so no call reads what the last one left in L2


def graph_time(fn, reps=20) -> float:
    """Median microseconds of one fn() call, from replays of a CUDA graph of `reps` calls (with --flush-l2, each
    call follows a write of FLUSH and the time of the writes alone, timed the same way, is subtracted)."""
    import triton.testing as tt

    def replay_us(body):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                body()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                body()
        return tt.do_bench(g.replay, warmup=10, rep=100, return_mode="median") * 1e3 / reps

    if FLUSH is None:
        return replay_us(fn)

    def flushed():
        FLUSH.fill_(1)
        fn()

    return replay_us(flushed) - replay_us(lambda: FLUSH.fill_(1))


def pick_layer(cfg: KVQConfig, layers: int = 32) -> int:
    """The benchmarked layer: one that reads shared codes when the config shares (XQuant), else layer 0."""
    specs = cfg.resolve(layers)
    for i, s in enumerate(specs):
        if s.share_key_codes_from is not None or s.share_value_codes_from is not None:
            return i
    return 0


def check_small(name: str, dtype) -> float:
    """Relative error of the template against the reference op on a small real store (filled by kvq::append)."""
    cfg = KVQConfig.preset(name)
    B, T, n0 = 2, 640, 600
    geo = st.Geometry(B, H, T, D, st.dtype_name(dtype))
    layers = 4 if name.startswith("xquant") else 1
    ms = st.ModelStore(cfg, layers, geo, "cuda")
    li = layers - 1
    pos = torch.arange(n0, device="cuda")
    cos = torch.cos(pos[None, :, None] * torch.linspace(0.01, 1, D, device="cuda")).expand(B, n0, D).to(dtype)
    sin = torch.sin(pos[None, :, None] * torch.linspace(0.01, 1, D, device="cuda")).expand(B, n0, D).to(dtype)
    for i, lay in enumerate(ms.layers):
        names, tensors = lay.append_tensors()
        k = torch.randn(B, H, n0, D, device="cuda", dtype=dtype)
        v = torch.randn(B, H, n0, D, device="cuda", dtype=dtype)
        c, s = (cos, sin) if cfg.keys_before_rope else (None, None)
        torch.ops.kvq.append(tensors, k, v, pos, c, s, lay.descriptor(names))
    lay = ms.layers[li]
    k = torch.randn(B, H, 1, D, device="cuda", dtype=dtype)
    v = torch.randn(B, H, 1, D, device="cuda", dtype=dtype)
    p = torch.tensor([n0], device="cuda")
    names, tensors = lay.append_tensors()
    c, s = (cos[:, :1], sin[:, :1]) if cfg.keys_before_rope else (None, None)
    torch.ops.kvq.append(tensors, k, v, p, c, s, lay.descriptor(names))
    names, tensors = lay.attend_tensors()
    q = torch.randn(B, HQ, 1, D, device="cuda", dtype=dtype)
    mask = torch.ones(B, 1, 1, T, dtype=torch.bool, device="cuda")
    mask[1, ..., :5] = False
    ref = attend_cpu_reference(q, tensors, k, v, p, mask, D ** -0.5, False, lay.descriptor(names)).float()
    out = decode_attention(q, dict(zip(names, tensors)), k, v, p, mask, D ** -0.5, False, cfg, lay.spec, geo).float()
    return ((out - ref).norm() / ref.norm()).item()


def svg_plot(result: dict, path: str) -> None:
    """Two panels of grouped bars, one group per (batch, context) and one bar per preset of a saved run: the speedup
    over SDPA (a dashed line at 1) and the effective bandwidth as a fraction of copy bandwidth (dashed: SDPA's)."""
    rows = result["rows"]
    shapes = list(dict.fromkeys((r["batch"], r["context"]) for r in rows))
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    cell = {(r["preset"], r["batch"], r["context"]): r for r in rows}
    colors = ["#7f7f7f", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
    PW, PH, L, B, T = 560, 300, 50, 60, 30   # panel width / height, left / bottom / top margins
    W, H = 2 * PW + 160, PH + B + T
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{W / 2}" y="16" text-anchor="middle" font-size="13">decode attention, {result["device"]}, '
           f'torch {result["torch"]}, {result.get("date", "")}</text>']
    panels = (("speedup over SDPA (x)", "speedup", lambda r: 1.0),
              ("effective bandwidth / copy bandwidth", "bw_frac", lambda r: r["sdpa_bw_frac"]))
    for k, (label, key, ref_of) in enumerate(panels):
        x0 = k * PW + L
        top = max(max(r[key] for r in rows), max(ref_of(r) for r in rows)) * 1.1
        sy = lambda v: T + PH - v / top * PH  # noqa: E731
        out += [f'<line x1="{x0}" y1="{T + PH}" x2="{x0 + PW - L}" y2="{T + PH}" stroke="black"/>',
                f'<line x1="{x0}" y1="{T}" x2="{x0}" y2="{T + PH}" stroke="black"/>',
                f'<text x="{x0 + (PW - L) / 2}" y="{T + PH + 44}" text-anchor="middle">{label}</text>']
        step = 0.5 if top <= 3 else 1.0 if top <= 6 else 2.0
        for i in range(int(top / step) + 1):
            v = i * step
            out.append(f'<text x="{x0 - 4}" y="{sy(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
        gw = (PW - L) / len(shapes)
        bw = gw * 0.8 / len(presets)
        for g, (b, c) in enumerate(shapes):
            gx = x0 + g * gw + gw * 0.1
            out.append(f'<text x="{gx + gw * 0.4:.1f}" y="{T + PH + 14}" text-anchor="middle">({b}, {c})</text>')
            for j, name in enumerate(presets):
                r = cell.get((name, b, c))
                if r is None:
                    continue
                y = sy(r[key])
                out.append(f'<rect x="{gx + j * bw:.1f}" y="{y:.1f}" width="{bw * 0.9:.1f}" height="{T + PH - y:.1f}" '
                           f'fill="{colors[j % len(colors)]}"><title>{name} ({b}, {c}): {r[key]:.3g}</title></rect>')
            ref = ref_of(cell[next((n, b, c) for n in presets if (n, b, c) in cell)])
            out.append(f'<line x1="{gx:.1f}" y1="{sy(ref):.1f}" x2="{gx + gw * 0.8:.1f}" y2="{sy(ref):.1f}" '
                       'stroke="black" stroke-dasharray="4 3"/>')
    for j, name in enumerate(presets):
        out.append(f'<rect x="{2 * PW + 20}" y="{T + 14 * j}" width="10" height="10" fill="{colors[j % len(colors)]}"/>')
        out.append(f'<text x="{2 * PW + 36}" y="{T + 9 + 14 * j}">{name}</text>')
    out.append(f'<text x="{2 * PW + 20}" y="{T + 14 * len(presets) + 12}">- - SDPA (fp16)</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plot", default=None, metavar="JSON", help="no benchmark: plot this saved run (--out) to --svg")
    ap.add_argument("--svg", default=None, help="the plot of this run (or of --plot's) as an SVG file")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--sweep", action="store_true", help="also try block_t x num_warps x num_splits per shape")
    ap.add_argument("--shapes", default=None, help="e.g. 32x16384,8x8192")
    ap.add_argument("--splits", default=None, help="sweep only these split counts (with --sweep), e.g. 2,4,8,16")
    ap.add_argument("--variants", default=None,
                    help="time these launches of each preset, e.g. 'default;block_t=32;block_t=128,num_warps=8' "
                         "(upper-case keys set flags of decode_attention or its Gluon module for that variant: "
                         "FILL_PER_SM=99, COMBINE_WARPS=4, MASK_SLICE=0)")
    ap.add_argument("--mask", default="none", choices=("none", "bool", "additive", "bool-heads"),
                    help="an attention mask for both kernels, every position allowed: [B, 1, 1, ctx] (HF's decode "
                         "mask is a bool one), or bool-heads: one row per query head [B, 32, 1, ctx]")
    ap.add_argument("--flush-l2", action="store_true",
                    help="write 256 MiB between timed calls (no call reads the last one's data from L2)")
    args = ap.parse_args()
    if args.plot:
        if not args.svg:
            ap.error("--plot needs --svg")
        with open(args.plot) as f:
            svg_plot(json.load(f), args.svg)
        return
    if args.flush_l2:
        global FLUSH
        FLUSH = torch.empty(2 ** 26, dtype=torch.float32, device="cuda")
    dtype = torch.bfloat16
    torch.manual_seed(0)
    presets = args.presets.split(",")
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  copy bandwidth {bw / 1e12:.2f} TB/s")
    errs = {n: check_small(n, dtype) for n in presets}
    print("relative error vs reference op (B=2, 601 tokens):", {k: f"{v:.1e}" for k, v in errs.items()})
    shapes = [(b, c) for b in (1, 8, 32) for c in (1024, 4096, 16384, 65536)]
    if args.quick:
        shapes = [(1, 16384), (8, 8192), (32, 4096), (32, 16384)]
    if args.shapes:
        shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    rows = []
    for B, ctx in shapes:
        q = torch.randn(B, HQ, 1, D, device="cuda", dtype=dtype)
        k = torch.randn(B, H, ctx, D, device="cuda", dtype=dtype)
        v = torch.randn(B, H, ctx, D, device="cuda", dtype=dtype)
        am = None
        if args.mask == "bool":
            am = torch.ones(B, 1, 1, ctx, dtype=torch.bool, device="cuda")
        elif args.mask == "additive":
            am = torch.zeros(B, 1, 1, ctx, dtype=dtype, device="cuda")
        elif args.mask == "bool-heads":
            am = torch.ones(B, HQ, 1, ctx, dtype=torch.bool, device="cuda")
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=am,  # noqa: E731
                                                                        enable_gqa=True)
        t_sdpa = graph_time(sdpa) / 1e3
        sdpa_bytes = 2 * k.numel() * 2 + 2 * q.numel() * 2
        del k, v
        for name in presets:
            cfg = KVQConfig.preset(name)
            li = pick_layer(cfg)
            ms = random_store(cfg, li, li + 1, B, ctx, dtype)
            lay = ms.layers[li]
            names, tensors = lay.attend_tensors()
            bufs = dict(zip(names, tensors))
            kc = torch.randn(B, H, 1, D, device="cuda", dtype=dtype)
            vc = torch.randn(B, H, 1, D, device="cuda", dtype=dtype)
            pos = torch.tensor([ctx - 1], device="cuda")
            variants = [dict()]
            if args.sweep:
                auto = max(1, -(-264 // (B * H)))
                variants = [dict(block_t=bt, num_warps=nw, num_splits=ns) for bt in (32, 64, 128) for nw in (4, 8)
                            for ns in sorted({auto, 2 * auto, 4 * auto})]
                if args.splits:
                    variants = [dict()] + [dict(block_t=64, num_warps=4, num_splits=int(n)) for n in args.splits.split(",")]
            if args.variants:
                variants = [dict((kv.split("=")[0], int(kv.split("=")[1])) for kv in v.split(",") if kv != "default")
                            for v in args.variants.split(";")]
            best = None
            for var in variants:
                # upper-case keys: flags of decode_attention (e.g. FILL_PER_SM, COMBINE_WARPS) set for this variant
                flags = {k: x for k, x in var.items() if k.isupper()}
                launch = {k: x for k, x in var.items() if not k.isupper()}
                fn = lambda: decode_attention(q, bufs, kc, vc, pos, am, D ** -0.5, False, cfg, lay.spec,  # noqa: E731
                                              ms.geo, **launch)
                try:
                    with da_flags(flags):
                        t = graph_time(fn) / 1e3  # ms, GPU time of one call (CUDA graph replay: no launch overhead)
                except Exception as e:  # a variant that does not fit (shared memory) is skipped
                    print(f"  {name} {var}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                if args.splits or args.variants:
                    print(f"  {name} B={B} ctx={ctx} {var or 'default'}: {t * 1e3:.1f} us", flush=True)
                from kvq_compile.templates.decode_attention import LAST_KERNELS
                if best is None or t < best[0]:   # with the kernel it ran (registers, spills of the best variant)
                    kern = LAST_KERNELS.get("main")
                    best = (t, var, (getattr(kern, "n_regs", None), getattr(kern, "n_spills", None)))
            regs = best[2]
            nbytes = bytes_read(lay, B, ctx, dtype)
            t = best[0]
            row = dict(preset=name, batch=B, context=ctx, ms=t, bytes=nbytes, bw_frac=nbytes / (t * 1e-3) / bw,
                       sdpa_ms=t_sdpa, sdpa_bw_frac=sdpa_bytes / (t_sdpa * 1e-3) / bw, speedup=t_sdpa / t,
                       bits=cfg.equivalent_bits(32, H, D, ctx), variant=best[1], regs_spills=regs)
            rows.append(row)
            print(f"{name:13s} B={B:2d} ctx={ctx:6d}  {t * 1e3:8.1f} us  {nbytes / 2**20:8.1f} MiB  "
                  f"{row['bw_frac'] * 100:5.1f}% bw  sdpa {t_sdpa * 1e3:8.1f} us ({row['sdpa_bw_frac'] * 100:5.1f}%)  "
                  f"x{row['speedup']:.2f}  {best[1]} regs/spills {regs}", flush=True)
            del ms, bufs, tensors
            torch.cuda.empty_cache()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw=bw, rows=rows,
                  check_rel_err=errs, date=time.strftime("%Y-%m-%d"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.svg:
        svg_plot(result, args.svg)


if __name__ == "__main__":
    main()
