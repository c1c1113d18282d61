"""A Python mirror of `decode_attention_gluon._slice` with WCOST > 0 (calibquant's slices shortened where a program
also takes exact-window tiles): checks that the programs' [start, stop) cover the quantized region exactly once,
with no gap or overlap, over slice counts, lengths, window tiles and weights (the kernel runs on a GPU only).

    python bench/debug/slice_wcost_check.py        (prints "bad 0")
"""
import itertools


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def slice_of(split: int, nsplit: int, qlen: int, bt: int, wcost: int, nwin: int, sink: int = 0) -> tuple[int, int]:
    """(start, stop) of program `split`, as `_slice` computes them with WCOST > 0."""
    tiles = cdiv(qlen, bt)
    per = max(cdiv(tiles + wcost * nwin, nsplit), wcost * cdiv(nwin, nsplit))
    w_lo = nwin // nsplit * split + min(split, nwin % nsplit)            # window tiles of the programs before
    w_hi = nwin // nsplit * (split + 1) + min(split + 1, nwin % nsplit)
    lo, hi = split * per - wcost * w_lo, (split + 1) * per - wcost * w_hi
    return sink + min(lo, tiles) * bt, min(sink + min(hi, tiles) * bt, sink + qlen)


def main() -> None:
    bad = 0
    for nsplit, qlen, nwin, wcost in itertools.product([1, 2, 3, 7, 8, 16, 200], [0, 1, 31, 32, 33, 500, 3968, 65000],
                                                       [0, 1, 4, 5, 9, 10], [1, 2, 4, 8]):
        covered = [(a, b) for a, b in (slice_of(i, nsplit, qlen, 32, wcost, nwin) for i in range(nsplit)) if b > a]
        pos = 0
        for a, b in covered:
            if a != pos:
                bad += 1
                print("gap or overlap:", nsplit, qlen, nwin, wcost, covered[:5])
                break
            pos = b
        if qlen > 0 and pos != qlen:
            bad += 1
            print("does not reach the end:", nsplit, qlen, nwin, wcost, pos)
    print("bad", bad)


if __name__ == "__main__":
    main()
