"""Decode-mode perplexity of SmolLM2-135M on held-out Austen text, per preset (CPU, reference ops).

    python bench/bench_accuracy.py [--presets fp16,int8,kivi-2] [--windows 4] [--prefix 512] [--tokens 1024]
                                   [--agreement 20]
                                   [--calibration DIR [DIR ...]] [--out rows.json] [--svg plot.svg]
    python bench/bench_accuracy.py --replot run.log --svg plot.svg    # the plot from a printed table

Each window: prefill `prefix` tokens, then teacher-forced decoding of the next `tokens` tokens, one token
per step, every step appending to and attending over the quantized store through the kvq ops (`KVQCache`
drives the same `kvq::append` / `kvq::attend` the backend's rewrite emits). Perplexity is over the decoded
tokens; the `fp16` preset is the unquantized reference of the same procedure. Greedy agreement: the fraction
of 64 greedily generated tokens (per prompt, N prompts of 128 tokens) identical to the fp16 preset's. Text: evaluation novels of
bench/model.py (never the calibration ones).

Besides preset names, `--presets` takes `<name>/K` or `<name>/V` (only that side quantized), `asymkv-<bits>` (AsymKV-style mixed 2/1-bit layers without code sharing)
and `xquant-<bits>-map` (XQuant's bit map and code sharing from `calibrate.xquant_config`) at <bits> code bits.

--calibration adds one row per directory written by `python -m kvq_compile calibrate` (or
`kvq_compile.save_calibration`), after the presets; calibrate on bench/model.py's CALIBRATION_NOVELS.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from model import EVALUATION_NOVELS, load_model, token_windows  # noqa: E402

from kvq_compile import KVQConfig, load_calibration  # noqa: E402
from kvq_compile.calibrate import asymkv_config, xquant_config  # noqa: E402
from kvq_compile.hf import KVQCache  # noqa: E402


@torch.no_grad()
def decode_nll(model, ids: torch.Tensor, prefix: int, cfg: KVQConfig) -> tuple[float, int]:
    """Summed negative log-likelihood of ids[:, prefix + 1:] decoded one token at a time, and the count."""
    B, L = ids.shape
    cache = KVQCache(model, cfg, batch_size=B, max_cache_len=L)
    logits = model(ids[:, :prefix], past_key_values=cache).logits[:, -1]
    nll, count = 0.0, 0
    for i in range(prefix, L - 1):
        nll += torch.nn.functional.cross_entropy(logits.float(), ids[:, i], reduction="sum").item()
        count += B
        logits = model(ids[:, i:i + 1], past_key_values=cache).logits[:, -1]
    nll += torch.nn.functional.cross_entropy(logits.float(), ids[:, L - 1], reduction="sum").item()
    return nll, count + B


@torch.no_grad()
def greedy_tokens(model, prompts: torch.Tensor, cfg: KVQConfig, new: int) -> torch.Tensor:
    """[N, new] greedy continuations of equal-length prompts, decoded through KVQCache with `cfg`."""
    B, P = prompts.shape
    cache = KVQCache(model, cfg, batch_size=B, max_cache_len=P + new)
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), past_key_values=cache, do_sample=False,
                         max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    return out[:, P:]


def config_named(name: str, layers: int) -> KVQConfig:
    """A preset, or `asymkv-<bits>` / `xquant-<bits>-map` built for `layers` layers; a suffix `/K` (`/V`)
    keeps only the Keys (Values) quantized, the other side exact: which side limits a preset."""
    if name.endswith(("/K", "/V")):
        import dataclasses

        from kvq_compile import QuantizerSpec

        cfg = config_named(name[:-2], layers)
        if cfg.xquant_pattern or cfg.layer_bits:
            raise ValueError(f"{name}: per-layer bit widths set both sides; /K and /V need a uniform config")
        exact = "value" if name.endswith("/K") else "key"
        cfg = dataclasses.replace(cfg, **{exact: QuantizerSpec(bits=16)},
                                  **({"key_norm": False, "keys_before_rope": False} if exact == "key" else {}))
        cfg.name = name
        return cfg
    m = re.fullmatch(r"asymkv-([0-9.]+)|xquant-([0-9.]+)-map", name)
    if m is None:
        return KVQConfig.preset(name)
    cfg = asymkv_config(layers, float(m[1])) if m[1] else xquant_config(layers, float(m[2]))
    cfg.name = name
    return cfg


def agreement(tokens: torch.Tensor, reference: torch.Tensor) -> float:
    """Fraction of generated tokens identical to the fp16 run's at the same position."""
    return (tokens == reference).float().mean().item()


def rows_from_table(text: str) -> list[dict]:
    """Rows (name, bits, ppl, increase, agreement) of the markdown table this script prints."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[1].replace(".", "").isdigit():
            rows.append(dict(name=cells[0], bits=float(cells[1]), ppl=float(cells[2]),
                             increase=float(cells[3].rstrip("%")), agreement=cells[4]))
    return rows


def known_rows(logs: list[str], windows: int, prefix: int, tokens: int) -> dict[str, dict]:
    """Rows measured by an earlier run of this script (its printed log), by name, for reuse instead of
    recomputing; a log whose header names another protocol is refused. The caller vouches that the code
    that decides the numbers (kvq_compile, bench/model.py, decode_nll) is unchanged since that run."""
    want = f"SmolLM2-135M, {windows} windows x ({prefix} prefix + {tokens} decoded),"  # the header's protocol
    rows = {}
    for path in logs:
        with open(path) as f:
            text = f.read()
        if want not in text:
            raise ValueError(f"{path}: not a run of the protocol '{want}'")
        rows.update({r["name"]: dict(r, reused_from=path) for r in rows_from_table(text)})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="fp16,int8,kivi-4,kivi-2,kvquant-4-1%,kvquant-3-1%,kvquant-2-1%,innerq-2,"
                                          "xquant-1.38,calibquant-1")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--agreement", type=int, default=0, metavar="N",
                    help="also greedy agreement with fp16: N prompts of 128 evaluation tokens, 64 new tokens each")
    ap.add_argument("--calibration", nargs="+", default=[], metavar="DIR",
                    help="calibrated configs (save_calibration directories) evaluated after the presets")
    ap.add_argument("--out", default=None, help="rows as JSON")
    ap.add_argument("--svg", default=None, help="perplexity increase against equivalent bits, one line per family")
    ap.add_argument("--known", nargs="+", default=[], metavar="LOG",
                    help="reuse rows printed by earlier runs of the same protocol and code (their logs)")
    ap.add_argument("--replot", default=None, metavar="LOG", help="only plot the table printed in LOG to --svg")
    args = ap.parse_args()
    from bench_findings import svg_plot  # noqa: E402  (same plot as the findings)

    if args.replot:
        with open(args.replot) as f:
            svg_plot(rows_from_table(f.read()), args.svg)
        return
    calibrated = [load_calibration(d) for d in args.calibration]  # fail early on a bad directory
    known = known_rows(args.known, args.windows, args.prefix, args.tokens)
    torch.manual_seed(0)
    model, tok = load_model()
    cfg0 = model.config
    ids = token_windows(tok, EVALUATION_NOVELS, args.prefix + args.tokens, args.windows)
    print(f"SmolLM2-135M, {args.windows} windows x ({args.prefix} prefix + {args.tokens} decoded), torch "
          f"{torch.__version__}, {time.strftime('%Y-%m-%d')}")
    prompts = token_windows(tok, EVALUATION_NOVELS, 128, args.agreement) if args.agreement else None
    ref_tokens = None
    print("| preset | equivalent bits | decode-mode perplexity | vs fp16 | greedy agreement | seconds |")
    print("|---|---|---|---|---|---|")
    base, rows = None, []
    configs = [config_named(name, cfg0.num_hidden_layers) for name in args.presets.split(",") if name]
    for cfg in configs + calibrated:
        name = cfg.name
        if name in known and (not args.agreement or known[name]["agreement"] != "-"):
            r = known[name]
            base = base or r["ppl"]
            print(f"| {name} | {r['bits']:.2f} | {r['ppl']:.3f} | {100 * (r['ppl'] / base - 1):+.2f}% | "
                  f"{r['agreement']} | reused |", flush=True)
            rows.append(dict(r, increase=100 * (r["ppl"] / base - 1)))
            continue
        if args.agreement and ref_tokens is None:
            ref_tokens = greedy_tokens(model, prompts, KVQConfig.preset("fp16"), 64)
        t = time.time()
        nll, n = decode_nll(model, ids, args.prefix, cfg)
        ppl = math.exp(nll / n)
        base = base or ppl
        bits = cfg.equivalent_bits(cfg0.num_hidden_layers, cfg0.num_key_value_heads, 64, ids.shape[1])
        agree = f"{agreement(greedy_tokens(model, prompts, cfg, 64), ref_tokens):.3f}" if args.agreement else "-"
        print(f"| {name} | {bits:.2f} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% | {agree} | {time.time() - t:.0f} |",
              flush=True)
        rows.append(dict(name=name, bits=bits, ppl=ppl, increase=100 * (ppl / base - 1), agreement=agree))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows, windows=args.windows, prefix=args.prefix, tokens=args.tokens,
                           torch=torch.__version__, date=time.strftime("%Y-%m-%d")), f, indent=1)
    if args.svg:
        svg_plot(rows, args.svg)


if __name__ == "__main__":
    main()
