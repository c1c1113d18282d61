"""Command line: `python -m kvq_compile calibrate ...` (offline calibration, see `kvq_compile.calibrate`).

    python -m kvq_compile calibrate --model PATH --preset kvquant-3-1% --text a.txt b.txt --out calib/ \\
        [--seq-len 2048] [--sequences 16] [--seed 0]

writes calib/kvq_config.json and calib/kvq_tables.safetensors; load them with `kvq_compile.load_calibration`.
"""
from __future__ import annotations

import argparse
import sys
import time


def _progress():
    """A progress(stage, done, total) callback drawing one tqdm bar per stage."""
    from tqdm import tqdm

    bars = {}

    def update(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = tqdm(total=total, desc=stage, unit="seq")
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update


def cmd_calibrate(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .calibrate import calibrate, save_calibration
    from .config import KVQConfig

    cfg = KVQConfig.preset(args.preset)
    texts = []
    for path in args.text:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    t = time.time()
    report = {}
    out = calibrate(model, texts, cfg, tokenizer=tok, seq_len=args.seq_len, num_sequences=args.sequences,
                    seed=args.seed, progress=_progress(), report=report)
    seconds = time.time() - t
    meta = {"model": args.model, "preset": args.preset, "text": args.text, "wall_seconds": seconds,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "report": report}
    save_calibration(out, args.out, meta)
    if not report["calibrated"]:
        print(f"{args.preset} has nothing to calibrate offline (no NormalFloat codebooks, softmax_tau or XQuant eta): "
              f"its config is saved unchanged -> {args.out}")
        return 0
    print(f"calibrated {args.preset} ({', '.join(report['calibrated'])}) on {report['sequences']} x "
          f"{report['seq_len']} tokens in {seconds:.0f} s -> {args.out}")
    if out.codebooks:
        print(f"  codebooks: {len(out.codebooks)} tables")
        for name, e in report.get("codebook_error", {}).items():
            print(f"    {name}: Fisher-weighted MSE {e['normal_float']:.3g} (normal-float) -> {e['calibrated']:.3g}")
    if out.softmax_tau is not None:
        print(f"  softmax_tau: {out.softmax_tau} (mean attention KL {min(report['tau_distortion'].values()):.4g})")
    if out.eta:
        print(f"  eta: {out.eta}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvq_compile", description="kvq-compile tools")
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("calibrate", help="calibrate a preset on a model and text files (codebooks, tau, eta)",
                       description="Offline calibration of a preset (see kvq_compile.calibrate): KVQuant codebooks, "
                                   "CalibQuant (tau1, tau2), XQuant eta; writes kvq_config.json and "
                                   "kvq_tables.safetensors to --out.")
    c.add_argument("--model", required=True, help="a HuggingFace causal LM folder (or hub name)")
    c.add_argument("--preset", required=True, help="a kvq preset, e.g. kvquant-3-1%%, calibquant-1, xquant-1.38")
    c.add_argument("--text", required=True, nargs="+", metavar="FILE", help="calibration text files")
    c.add_argument("--out", required=True, metavar="DIR", help="output directory")
    c.add_argument("--seq-len", type=int, default=2048, help="tokens per calibration sequence (default 2048)")
    c.add_argument("--sequences", type=int, default=16, help="number of calibration sequences (default 16)")
    c.add_argument("--seed", type=int, default=0, help="seed of the window choice (default 0)")
    c.set_defaults(func=cmd_calibrate)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
