"""Decode steps in a tight loop, gpt-fast style: the compiled `model.forward` over HF's StaticCache, the greedy
next token chosen on the device, no host synchronization between steps, so a step's wall-clock is its GPU time
plus whatever host time the GPU cannot hide. HF's compiled static cache (inductor, reduce-overhead), HF's
QuantizedCache with the optimum-quanto backend (`quanto-2`, `quanto-4`: eager, as that cache cannot be compiled;
needs optimum-quanto) and kvq_backend presets (reduce-overhead), on bench_generate's random-weight
Llama-3-8B-shaped model.

    python bench/bench_decode_loop.py --layers 8 --shapes 32x4096,8x8192 --presets quanto-2,kivi-2,kivi-4

What `generate` adds on top (its Python loop syncs every step) is bench_generate's wall-clock minus this.
Tokens/s = batch / (wall-clock of `--steps` steps / steps), after `--warmup` steps (compilation, CUDA-graph
recording); roofline as in bench_generate (weights read per step + KV bytes at the mean context, over the copy
bandwidth measured here).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_generate import build, copy_bandwidth, roofline_tok_s, write_rows  # noqa: E402


@torch.no_grad()
def decode_loop(model, ids, step_fn, warmup: int, steps: int, quanto_bits: int = 0, prof=None) -> float:
    """Seconds per decode step: an eager prefill into a fresh StaticCache, then warmup + steps steps of step_fn
    (compiled). quanto_bits: HF's QuantizedCache instead (quanto backend, its defaults otherwise: group 64, a
    128-token residual, so these few steps never requantize), the mask growing each step, step_fn eager. prof: a
    torch profiler, started and stopped around the timed steps."""
    from transformers import StaticCache

    B, P = ids.shape
    T = P + warmup + steps + 1
    if quanto_bits:
        from transformers import QuantizedCache

        cache = QuantizedCache("quanto", model.config, nbits=quanto_bits)
    else:
        cache = StaticCache(config=model.config, max_cache_len=T)
    mask = torch.ones(B, T, dtype=torch.long, device=ids.device)   # fixed shape: no recompilation per step
    pos = torch.arange(T, device=ids.device)
    out = model(ids, attention_mask=mask[:, :P], past_key_values=cache, cache_position=pos[:P], use_cache=True)
    tok = out.logits[:, -1:].argmax(-1)
    del out
    t0 = None
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            if prof is not None:
                prof.start()
            t0 = time.perf_counter()
        torch.compiler.cudagraph_mark_step_begin()
        # position ids passed in ([B, 1]): the kvq pass recomputes the rotation tables of the eagerly written
        # prefix from them for Keys stored before RoPE (kvquant), and declines the rewrite without them
        logits = step_fn(tok, attention_mask=mask[:, :P + i + 1] if quanto_bits else mask, past_key_values=cache,
                         cache_position=pos[P + i:P + i + 1], position_ids=pos[P + i:P + i + 1].expand(B, 1),
                         use_cache=True).logits
        tok = logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    if prof is not None:
        prof.stop()
    return (time.perf_counter() - t0) / steps


def main():
    from kvq_compile import kvq_backend
    from kvq_compile.templates import decode_attention as da

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shapes", default="32x4096,8x8192")
    ap.add_argument("--presets", default="kivi-2,kivi-4")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-hf", action="store_true", help="leave out HF's compiled static cache")
    args = ap.parse_args()
    bw = copy_bandwidth()
    model = build(args.layers)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} copy {bw / 1e12:.2f} TB/s, {args.layers} layers",
          flush=True)
    rows = []
    for shape in args.shapes.split(","):
        B, P = map(int, shape.split("x"))
        ids = torch.randint(100, 120000, (B, P), device="cuda")
        for preset in ([] if args.skip_hf else ["hf-compiled"]) + args.presets.split(","):
            torch._dynamo.reset()
            torch.cuda.empty_cache()
            quanto_bits = int(preset.split("-")[1]) if preset.startswith("quanto-") else 0
            if preset == "hf-compiled":
                fn = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            elif quanto_bits:
                fn = model.forward
            else:
                fn = torch.compile(model.forward, backend=kvq_backend(preset), mode="reduce-overhead", fullgraph=True)
            da.LAST_KERNELS.clear()
            try:
                step = decode_loop(model, ids, fn, args.warmup, args.steps, quanto_bits)
            except Exception as e:  # noqa: BLE001  report and go on
                print(f"{preset} B={B} P={P}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            if preset != "hf-compiled" and not quanto_bits and "main" not in da.LAST_KERNELS:
                # the pass declined: not a kvq number
                print(f"{preset} B={B} P={P}: no kvq decode kernel ran (the pass left the graph unchanged: see the "
                      f"kvq_compile log); not reported", flush=True)
                continue
            # HF: an fp16 cache of the valid length (quanto's too: its bytes are not modelled, its % is of that)
            roof = roofline_tok_s(model, None if preset == "hf-compiled" or quanto_bits else preset, args.layers, B,
                                  P + (args.warmup + args.steps) // 2, bw)
            row = dict(preset=preset, batch=B, prompt=P, ms_step=step * 1e3, tok_s=B / step, roofline_tok_s=roof)
            rows.append(row)
            print(f"loop {preset:12s} B={B:2d} P={P:6d}  {B / step:9.1f} tok/s  {step * 1e3:7.2f} ms/step  "
                  f"roofline {roof:9.1f} tok/s ({100 * B / step / roof:5.1f}%)", flush=True)
    if args.out:
        write_rows(args.out, bw, args.layers, rows)


if __name__ == "__main__":
    main()
