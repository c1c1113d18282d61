"""The four papers' findings on SmolLM2-135M, each as a pair (or triple) of configs that differ in one thing,
measured by decode-mode perplexity (bench_accuracy.decode_nll) on held-out Austen text, CPU.

    python bench/bench_findings.py [--windows 2] [--prefix 512] [--tokens 256] [--out findings.json]
                                   [--svg bench/accuracy_vs_bits.svg] [--only kvquant]
                                   [--known bench_accuracy.log ...] [--rows findings.json.partial ...]

Every config is a preset with one field changed (see FINDINGS); the calibrated KVQuant codebooks come from
`kvq_compile.calibrate` on the calibration novels (never the evaluation ones), 4 sequences of 1024 tokens,
cached under $KVQ_MODEL_CACHE. A finding "holds" when the config the paper favours has the lower perplexity;
differences below the run-to-run noise (~0.5%) are reported as such, not as a result.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_accuracy import decode_nll, known_rows  # noqa: E402
from model import CALIBRATION_NOVELS, EVALUATION_NOVELS, load_model, novel_text, token_windows  # noqa: E402

from kvq_compile import KVQConfig, QuantizerSpec, calibrate, load_calibration, save_calibration  # noqa: E402
from kvq_compile.calibrate import asymkv_config, xquant_config  # noqa: E402
from kvq_compile.config import Axis, Levels, Symmetry  # noqa: E402

NOISE = 0.005


def _with(name: str, new_name: str, **changes) -> KVQConfig:
    """Preset `name` with top-level fields and key/value quantizer fields changed (key__bits=3, ...)."""
    cfg = KVQConfig.preset(name)
    for side in ("key", "value"):
        sub = {k.split("__", 1)[1]: v for k, v in changes.items() if k.startswith(side + "__")}
        if sub:
            setattr(cfg, side, dataclasses.replace(getattr(cfg, side), **sub))
    top = {k: v for k, v in changes.items() if "__" not in k}
    cfg = dataclasses.replace(cfg, **top)
    cfg.name = new_name
    return cfg


def configs(calibrated_dir: str, layers: int) -> dict[str, KVQConfig]:
    c = {n: KVQConfig.preset(n) for n in ("fp16", "kivi-2", "kvquant-3", "kvquant-2", "kvquant-3-1%",
                                          "kvquant-2-1%", "calibquant-1", "xquant-1.38", "innerq-2")}
    c["kivi-2 K per-token"] = _with("kivi-2", "kivi-2 K per-token", key__axis=Axis.TOKEN)
    c["kivi-3"] = _with("kivi-2", "kivi-3", key__bits=3, value__bits=3)
    c["kivi-3 K per-token"] = _with("kivi-2", "kivi-3 K per-token", key__bits=3, value__bits=3, key__axis=Axis.TOKEN)
    c["kvquant-3 K after RoPE"] = _with("kvquant-3", "kvquant-3 K after RoPE", keys_before_rope=False)
    c["kvquant-3 uniform"] = _with("kvquant-3", "kvquant-3 uniform", key__levels=Levels.UNIFORM,
                                   value__levels=Levels.UNIFORM)
    c["kvquant-3 Fisher"] = load_calibration(calibrated_dir)
    c["kvquant-3 Fisher"].name = "kvquant-3 Fisher"
    c["kvquant-2-1% no fp16 first token"] = _with("kvquant-2-1%", "kvquant-2-1% no fp16 first token", sink=0)
    c["calibquant-1 no calibration"] = _with("calibquant-1", "calibquant-1 no calibration", softmax_tau=None)
    c["calibquant-1 V per-token"] = _with("calibquant-1", "calibquant-1 V per-token",
                                          value=QuantizerSpec(bits=1, axis=Axis.TOKEN, group_size=None))
    c["xquant-1.38 eta 0"] = _with("xquant-1.38", "xquant-1.38 eta 0", eta={})
    for b in (1.38, 1.16):
        x, a = xquant_config(layers, b), asymkv_config(layers, b)
        c[f"xquant-{b}-map"], c[f"asymkv-{b}"] = x, a
        x.name, a.name = f"xquant-{b}-map", f"asymkv-{b}"
    c["innerq-2 symmetric"] = _with("innerq-2", "innerq-2 symmetric", key__symmetry=Symmetry.SYMMETRIC,
                                    value__symmetry=Symmetry.SYMMETRIC)
    c["innerq-2 asymmetric"] = _with("innerq-2", "innerq-2 asymmetric", key__symmetry=Symmetry.ASYMMETRIC,
                                     value__symmetry=Symmetry.ASYMMETRIC)
    c["innerq-2 no sink"] = _with("innerq-2", "innerq-2 no sink", sink=0, recent=128)
    c["kivi-2 sink 32"] = _with("kivi-2", "kivi-2 sink 32", sink=32, recent=96)
    return c


# (finding, source, the config the paper favours first, then the ones it should beat)
FINDINGS = [
    ("per-channel Keys beat per-token Keys at 2 bits", "KVQuant §3.1; KIVI", ["kivi-2", "kivi-2 K per-token"]),
    ("per-channel Keys beat per-token Keys at 3 bits", "KVQuant §3.1; KIVI", ["kivi-3", "kivi-3 K per-token"]),
    ("Keys before RoPE beat after RoPE at 3 bits", "KVQuant App. H", ["kvquant-3", "kvquant-3 K after RoPE"]),
    ("Fisher-weighted non-uniform levels beat uniform at 3 bits", "KVQuant App. I",
     ["kvquant-3 Fisher", "kvquant-3 uniform"]),
    ("1% dense-and-sparse outliers improve 3-bit", "KVQuant App. J", ["kvquant-3-1%", "kvquant-3"]),
    ("1% dense-and-sparse outliers improve 2-bit", "KVQuant App. J", ["kvquant-2-1%", "kvquant-2"]),
    ("an fp16 first token helps 2-bit", "KVQuant App. K", ["kvquant-2-1%", "kvquant-2-1% no fp16 first token"]),
    ("the softmax calibration beats none at 1 bit", "CalibQuant Tab. 4",
     ["calibquant-1", "calibquant-1 no calibration"]),
    ("channel-wise Values beat per-token Values at 1 bit", "CalibQuant §4.1",
     ["calibquant-1", "calibquant-1 V per-token"]),
    ("eta > 0 beats eta = 0", "XQuant Tab. 4", ["xquant-1.38", "xquant-1.38 eta 0"]),
    ("XQuant beats AsymKV-style mixed precision at ~1.38 code bits", "XQuant Tab. 7",
     ["xquant-1.38-map", "asymkv-1.38"]),
    ("XQuant beats AsymKV-style mixed precision at ~1.16 code bits", "XQuant Tab. 7",
     ["xquant-1.16-map", "asymkv-1.16"]),
    ("hybrid >= symmetric > asymmetric at 2 bits", "InnerQ Tab. 2",
     ["innerq-2", "innerq-2 symmetric", "innerq-2 asymmetric"]),
    ("the sink window matters more for outer-grouped (KIVI) caches", "InnerQ Fig. 5",
     ["innerq-2", "innerq-2 no sink", "kivi-2 sink 32", "kivi-2"]),
]

FAMILIES = {"KIVI": "kivi-", "KVQuant": "kvquant-", "CalibQuant": "calibquant-", "XQuant": "xquant-",
            "InnerQ": "innerq-", "AsymKV": "asymkv-"}  # family -> config-name prefix


def ensure_calibration(model, tok, directory: str) -> str:
    """KVQuant-3 codebooks calibrated on the calibration novels (computed once, then loaded)."""
    if not os.path.exists(os.path.join(directory, "kvq_config.json")):
        t = time.time()
        cfg = calibrate(model, [novel_text(CALIBRATION_NOVELS)], KVQConfig.preset("kvquant-3"), tokenizer=tok,
                        seq_len=1024, num_sequences=4, seed=0)
        save_calibration(cfg, directory, metadata=dict(novels=list(CALIBRATION_NOVELS), seq_len=1024, sequences=4))
        print(f"calibrated kvquant-3 in {time.time() - t:.0f} s -> {directory}", flush=True)
    return directory


def svg_plot(rows: list[dict], path: str) -> None:
    """Perplexity increase over fp16 (%, log scale) against equivalent bits, one polyline per family."""
    W, H, L, B = 640, 420, 60, 50
    pts = {f: sorted((r["bits"], r["increase"]) for r in rows if r["name"].startswith(pre) and r["increase"] > 0)
           for f, pre in FAMILIES.items()}
    pts = {f: p for f, p in pts.items() if p}
    xs = [b for p in pts.values() for b, _ in p] or [1, 4]
    ys = [math.log10(v) for p in pts.values() for _, v in p] or [0, 2]
    x0, x1, y0, y1 = min(xs) - 0.1, max(xs) + 0.1, min(ys) - 0.1, max(ys) + 0.1
    sx = lambda b: L + (b - x0) / (x1 - x0) * (W - L - 20)  # noqa: E731
    sy = lambda v: H - B - (math.log10(v) - y0) / (y1 - y0) * (H - B - 20)  # noqa: E731
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - 20}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="20" x2="{L}" y2="{H - B}" stroke="black"/>',
           f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">equivalent bits per cached element</text>',
           f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" text-anchor="middle">'
           f'decode perplexity increase over fp16 (%, log)</text>']
    for e in range(math.floor(y0), math.ceil(y1) + 1):
        if y0 <= e <= y1:
            out.append(f'<text x="{L - 6}" y="{sy(10 ** e) + 4}" text-anchor="end">{10 ** e:g}</text>')
    for b in range(math.ceil(x0), math.floor(x1) + 1):
        out.append(f'<text x="{sx(b)}" y="{H - B + 16}" text-anchor="middle">{b}</text>')
    for i, (fam, p) in enumerate(sorted(pts.items())):
        col = colors[i % len(colors)]
        out.append(f'<polyline fill="none" stroke="{col}" stroke-width="2" points="'
                   + " ".join(f"{sx(b):.1f},{sy(v):.1f}" for b, v in p) + '"/>')
        out += [f'<circle cx="{sx(b):.1f}" cy="{sy(v):.1f}" r="3" fill="{col}"/>' for b, v in p]
        out.append(f'<text x="{W - 120}" y="{30 + 16 * i}" fill="{col}">{fam}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    ap.add_argument("--svg", default=None)
    ap.add_argument("--only", default=None, help="run only findings whose text or source contains this")
    ap.add_argument("--rows", nargs="+", default=[], metavar="JSON",
                    help="reuse rows of earlier runs of this script: their --out file, or its .partial (which does "
                         "not record the protocol: the caller vouches for it)")
    ap.add_argument("--known", nargs="+", default=[], metavar="LOG",
                    help="reuse rows that bench_accuracy.py printed for the same protocol and code (its logs)")
    ap.add_argument("--table-only", action="store_true",
                    help="no model: the findings table of the reused rows; a finding with a missing row says so")
    args = ap.parse_args()
    known = known_rows(args.known, args.windows, args.prefix, args.tokens)  # fail early on a wrong log
    for path in args.rows:  # rows of earlier (possibly interrupted, or parallel) runs of this script
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, dict):
            if (data["windows"], data["prefix"], data["tokens"]) != (args.windows, args.prefix, args.tokens):
                raise ValueError(f"{path}: rows of another protocol")
            data = data["results"]
        known.update({r["name"]: dict(r, reused_from=r.get("reused_from") or path) for r in data})
    findings = [f for f in FINDINGS if not args.only or args.only in f[0] or args.only in f[1]]
    names = ["fp16"] + list(dict.fromkeys(n for f in findings for n in f[2]))
    if args.table_only:
        names = [n for n in names if n in known]
    else:
        torch.manual_seed(0)
        model, tok = load_model()
        cache_root = os.environ.get("KVQ_MODEL_CACHE", os.path.expanduser("~/.cache/kvq"))
        calib = ensure_calibration(model, tok, os.path.join(cache_root, "calibration-kvquant-3"))
        nl, kvh, hd = model.config.num_hidden_layers, model.config.num_key_value_heads, 64
        cfgs = configs(calib, nl)
        ids = token_windows(tok, EVALUATION_NOVELS, args.prefix + args.tokens, args.windows)
    print(f"SmolLM2-135M, {args.windows} windows x ({args.prefix} prefix + {args.tokens} decoded), torch "
          f"{torch.__version__}, {time.strftime('%Y-%m-%d')}", flush=True)
    res = {}
    for n in names:
        if n in known:
            res[n] = dict(name=n, ppl=known[n]["ppl"], bits=known[n]["bits"],
                          reused_from=known[n].get("reused_from"))
            print(f"  {n:40s} {res[n]['bits']:5.2f} bits  ppl {res[n]['ppl']:9.3f}  (reused)", flush=True)
            continue
        t = time.time()
        nll, cnt = decode_nll(model, ids, args.prefix, cfgs[n])
        ppl = math.exp(nll / cnt)
        bits = cfgs[n].equivalent_bits(nl, kvh, hd, ids.shape[1])
        res[n] = dict(name=n, ppl=ppl, bits=bits)
        print(f"  {n:40s} {bits:5.2f} bits  ppl {ppl:9.3f}  ({time.time() - t:.0f} s)", flush=True)
        if args.out:  # partial results survive an interrupted run
            with open(args.out + ".partial", "w") as f:
                json.dump(list(res.values()), f, indent=1)
    base = res["fp16"]["ppl"]
    for r in res.values():
        r["increase"] = 100 * (r["ppl"] / base - 1)
    print("\n| finding | source | configs (perplexity, equivalent bits) | holds? |\n|---|---|---|---|")
    verdicts = []
    for text, src, group in findings:
        missing = [n for n in group if n not in res]
        if missing:
            verdicts.append(dict(finding=text, source=src, configs=group, holds="not run", missing=missing))
            print(f"| {text} | {src} | not run at this protocol: {', '.join(missing)} | - |")
            continue
        p = [res[n]["ppl"] for n in group]
        cells = "; ".join(f"{n}: {res[n]['ppl']:.2f} ({res[n]['bits']:.2f} b)" for n in group)
        if text.startswith("the sink window"):  # (innerq, innerq no sink, kivi sink, kivi)
            gain_inner, gain_outer = p[1] / p[0] - 1, p[3] / p[2] - 1
            holds = "yes" if gain_outer > gain_inner + NOISE else ("no" if gain_inner > gain_outer + NOISE else "within noise")
            cells += f"; sink gain inner {100 * gain_inner:+.1f}%, outer {100 * gain_outer:+.1f}%"
        elif text.startswith("hybrid"):
            holds = "yes" if p[0] <= p[1] * (1 + NOISE) and p[1] < p[2] * (1 - NOISE) else "no"
        else:
            d = p[1] / p[0] - 1
            holds = "yes" if d > NOISE else ("no" if d < -NOISE else "within noise")
        verdicts.append(dict(finding=text, source=src, configs=group, holds=holds))
        print(f"| {text} | {src} | {cells} | {holds} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(results=list(res.values()), findings=verdicts, windows=args.windows, prefix=args.prefix,
                           tokens=args.tokens, date=time.strftime("%Y-%m-%d")), f, indent=1)
    if args.svg:
        svg_plot(list(res.values()), args.svg)


if __name__ == "__main__":
    main()
