"""What left padding costs a preset's decode-mode perplexity (CPU, reference ops, SmolLM2-135M, Austen).

    python bench/debug/sink_padding.py [--presets fp16,kivi-2,innerq-2,kvquant-4] [--pads 0,40] [--windows 2]
                                       [--prefix 192] [--tokens 128] [--chunk N]

Each window is decoded alone (batch 1: in a batch, float32 GEMMs on the CPU round a row differently with other rows
beside it, and quantization turns that into logit differences of up to 0.8 after a few steps, so batched
perplexities carry that noise) as bench_accuracy.decode_nll does (prefill `prefix` tokens, then one token a step
through KVQCache), once per pad count: `pad` pad tokens (attention mask 0) before the text, the same text after
them. fp16's perplexity does not depend on the padding; a preset whose does moves its quantization with the
positions: the sink window (before session 44 a padded row's sink held pads), the recent window and the groups over
tokens. --unfixed: without session 44's seating and pad neutralization (`store.seating`, `store.neutralized`)."""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from model import EVALUATION_NOVELS, load_model, token_windows  # noqa: E402

from kvq_compile import KVQConfig  # noqa: E402
from kvq_compile.hf import KVQCache  # noqa: E402


@torch.no_grad()
def padded_nll(model, ids: torch.Tensor, prefix: int, cfg: KVQConfig, pad: int, pad_id: int,
               chunk: int | None = None) -> float:
    """Mean NLL of ids[:, prefix + 1:] decoded one token a step after `pad` left pads; the prefill (pads and prefix)
    in chunks of `chunk` tokens where given (KVQCache's eager chunked prefill)."""
    B, L = ids.shape
    full = torch.cat([torch.full((B, pad), pad_id, dtype=ids.dtype), ids], 1)
    mask = torch.cat([torch.zeros(B, pad, dtype=torch.long), torch.ones_like(ids)], 1)
    cache = KVQCache(model, cfg, batch_size=B, max_cache_len=pad + L)
    P = pad + prefix

    def step(lo, hi):
        m = mask[:, :hi]
        pos = (m.cumsum(-1) - 1).clamp_min(0)[:, lo:hi]
        return model(full[:, lo:hi], attention_mask=m, position_ids=pos, past_key_values=cache).logits[:, -1]

    starts = list(range(0, P, chunk)) if chunk else [0]
    for lo, hi in zip(starts, starts[1:] + [P]):
        logits = step(lo, hi)
    nll = 0.0
    for i in range(P, pad + L - 1):
        nll += torch.nn.functional.cross_entropy(logits.float(), full[:, i], reduction="sum").item()
        logits = step(i, i + 1)
    nll += torch.nn.functional.cross_entropy(logits.float(), full[:, pad + L - 1], reduction="sum").item()
    return nll / (B * (L - prefix))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="fp16,kivi-2,innerq-2,kvquant-4")
    ap.add_argument("--pads", default="0,40")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=192)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--sink", type=int, default=None, help="override every preset's sink window")
    ap.add_argument("--unfixed", action="store_true", help="no seating, no pad neutralization")
    ap.add_argument("--chunk", type=int, default=None, help="prefill in chunks of this many tokens")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.unfixed:
        from kvq_compile import store as st
        st.seating = lambda keep, sink: torch.arange(keep.shape[-1]).expand_as(keep).clone()
        st.neutralized = lambda keep, *sides: list(sides)
    model, tok = load_model()
    wins = token_windows(tok, EVALUATION_NOVELS, a.prefix + a.tokens, a.windows)
    ids = torch.stack(list(wins)) if not torch.is_tensor(wins) else wins
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    pads = [int(p) for p in a.pads.split(",")]
    print(f"SmolLM2-135M, {ids.shape[0]} windows one at a time, prefix {a.prefix}, {a.tokens} decoded tokens, pad id "
          f"{pad_id}{', unfixed' if a.unfixed else ''}{f', prefill chunks of {a.chunk}' if a.chunk else ''}")
    print("| preset | " + " | ".join(f"ppl, {p} pads" for p in pads) + " |")
    print("|---|" + "---|" * len(pads))
    for name in a.presets.split(","):
        cfg = KVQConfig.preset(name)
        if a.sink is not None:
            cfg = dataclasses.replace(cfg, sink=a.sink)
            name = f"{name} (sink {a.sink})"
        ppl = [math.exp(sum(padded_nll(model, w[None], a.prefix, cfg, p, pad_id, a.chunk) for w in ids) / len(ids))
               for p in pads]
        print(f"| {name} | " + " | ".join(f"{x:.4f}" for x in ppl) + " |", flush=True)


if __name__ == "__main__":
    main()
