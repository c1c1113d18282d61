"""Means of an A/B run of `bench_decode_attention.py` through `with_flags.py` (debug): per preset and shape, each
setting's timings in the order they ran, their mean against the first setting's, and the mean speedup over SDPA.

    python bench/debug/ab_means.py LOG FLAG      e.g. bench/results/results_session24_call1_stdout_2026-11-24.log INNER_TMA
"""
import collections
import re
import sys


def main(path: str, flag: str) -> None:
    cur, runs = None, collections.defaultdict(list)
    for line in open(path):
        m = re.match(r"flags: dag\.(\w+) = (.+)", line.strip())
        if m:
            cur = m.group(2) if m.group(1) == flag else None
            continue
        m = re.match(r"(\S+)\s+B=\s*(\d+) ctx=\s*(\d+)\s+([\d.]+) us.*?x([\d.]+)", line)
        if m and cur is not None:
            runs[(m.group(1), int(m.group(2)), int(m.group(3)), cur)].append((float(m.group(4)), float(m.group(5))))
    settings = list(dict.fromkeys(k[3] for k in runs))
    for preset, B, ctx in sorted({k[:3] for k in runs}):
        cells, base = [f"{preset} ({B}, {ctx})"], None
        for s in settings:
            got = runs.get((preset, B, ctx, s))
            if not got:
                cells.append(f"{s}: -")
                continue
            mean = sum(t for t, _ in got) / len(got)
            base = base or mean
            cells.append(f"{s}: {' / '.join(f'{t:.1f}' for t, _ in got)} us ({100 * (mean / base - 1):+.1f}%), "
                         f"x{sum(x for _, x in got) / len(got):.2f}")
        print(" | ".join(cells))


if __name__ == "__main__":
    main(*sys.argv[1:3])
