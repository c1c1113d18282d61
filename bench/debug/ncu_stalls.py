"""Read `ncu_stalls.sh`'s per-SASS-instruction CSV: the warp stall samples by reason over the whole kernel, by opcode,
the instructions with the most samples, the shared-memory accesses with excess wavefronts (bank conflicts) and the
global loads' excess sectors.

    python bench/debug/ncu_stalls.py <name>_sass.csv [top]
"""
from __future__ import annotations

import collections
import csv
import re
import sys


def num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main(path: str, top: int = 40):
    rows = list(csv.reader(open(path)))
    hdr = rows[1]
    col = {h: i for i, h in enumerate(hdr)}
    body = [r for r in rows[2:] if len(r) == len(hdr)]
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    tot = collections.Counter()
    by_op = collections.defaultdict(collections.Counter)
    execd = collections.Counter()
    for r in body:
        op = re.sub(r"^@!?U?P\w+\s+", "", r[col["Source"]].strip()).split(" ")[0].split(".")[0]
        execd[op] += num(r[col["Instructions Executed"]])
        for h in reasons:
            v = num(r[col[h]])
            tot[h] += v
            by_op[op][h] += v
    n = sum(tot.values())
    print(f"{path}: {n:.0f} samples, {sum(execd.values()):.0f} warp instructions executed")
    print("by reason:", ", ".join(f"{h[6:]} {100 * v / n:.1f}%" for h, v in tot.most_common() if v))
    print("by opcode (samples %, top reasons; executed):")
    for op, c in sorted(by_op.items(), key=lambda kv: -sum(kv[1].values()))[:25]:
        s = sum(c.values())
        print(f"  {op:8s} {100 * s / n:5.1f}%  " + ", ".join(f"{h[6:]} {100 * v / n:.1f}" for h, v in c.most_common(3) if v)
              + f"; executed {execd[op]:.0f}")
    print(f"top {top} instructions:")
    ranked = sorted(body, key=lambda r: -num(r[col["Warp Stall Sampling (All Samples)"]]))[:top]
    for r in ranked:
        c = {h[6:]: num(r[col[h]]) for h in reasons if num(r[col[h]])}
        best = sorted(c.items(), key=lambda kv: -kv[1])[:3]
        print(f"  {r[col['Address']]:>6s} {100 * num(r[col['Warp Stall Sampling (All Samples)']]) / n:5.2f}%  "
              f"{r[col['Source']].strip()[:60]:60s} {best}")
    glob = [(r[col["Address"]], r[col["Source"]].strip()[:50], num(r[col["L2 Theoretical Sectors Global"]]),
             num(r[col["L2 Theoretical Sectors Global Excessive"]])) for r in body
            if num(r[col["L2 Theoretical Sectors Global"]])]
    shared = [(r[col["Address"]], r[col["Source"]].strip()[:50], num(r[col["Instructions Executed"]]),
               num(r[col["L1 Wavefronts Shared"]]), num(r[col["L1 Wavefronts Shared Ideal"]]))
              for r in body if num(r[col["L1 Wavefronts Shared Excessive"]])]
    print("shared accesses with excess wavefronts (address, instruction, executed, wavefronts, ideal):")
    for g in sorted(shared, key=lambda g: g[4] - g[3])[:12]:
        print("  ", g)
    print("global accesses (address, instruction, sectors, excessive):")
    for g in sorted(glob, key=lambda g: -g[2])[:12]:
        print("  ", g)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
