"""Same-input projections of a decode step in one launch: y_g = x @ W_g^T for g < G (the q / k / v projections of an
attention layer, the gate / up projections of its MLP), each weight read once, no split of the inner dimension.

Why. A decode step's GEMMs have as many rows as sequences (M = batch), so they are bound by reading the weights.
cuBLAS runs the small ones as split-K GEMMs with a separate reduction kernel: on an H200 at M = 32 the q, k and v
projections of a Llama-3-8B layer took 29.5 us in three launches against 15.8 us for one GEMM over the three
weights concatenated (bench/RESULTS.md, session 53, `bench/debug/skinny_gemm.py`). Concatenating the weights would
copy them (a second copy of every attention weight); this kernel instead takes the G weights as they are and
assigns each program BN output columns of one of them.

Math (one program = BN columns of one weight, BM rows of x):
    acc[n, m] = sum_k W_g[n, k] x[m, k]     (tl.dot of a [BN, BK] weight tile and the [BK, BM] x tile, fp32)
    y_g[m, n] = acc[n, m] rounded to the output dtype
The product is computed transposed, weights as the mma's rows, so a handful of rows of x pads the small side (BM
>= 16) and BN may be as small as 16.

Glossary: G the weights (<= 4), M the rows of x (product of its leading dimensions), K the inner dimension, N_g the
rows of W_g (columns of y_g), BN / BM / BK the tile sizes, P_g the first program of weight g (P_0 = 0).
"""
from __future__ import annotations

import functools
import os

import triton
import triton.language as tl

from kvq_compile import compat

compat.fix_triton_interpreter()
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

MAX_GROUP = 4       # weights in one launch
MAX_ROWS = 64       # the launch serves decode steps: x with at most this many rows (more: cuBLAS, `grouped_linear`)


@triton.jit
def _grouped_linear_kernel(X, W0, W1, W2, W3, Y0, Y1, Y2, Y3, M, K, N0, N1, N2, N3, P1, P2, P3, sxm,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INTERP: tl.constexpr):
    pid = tl.program_id(0)
    pm = tl.program_id(1)
    # this program's weight g: its pointers, its rows and its first program (scalar selects, no branch)
    g1, g2, g3 = pid >= P1, pid >= P2, pid >= P3
    w = tl.where(g3, W3, tl.where(g2, W2, tl.where(g1, W1, W0)))
    y = tl.where(g3, Y3, tl.where(g2, Y2, tl.where(g1, Y1, Y0)))
    n_rows = tl.where(g3, N3, tl.where(g2, N2, tl.where(g1, N1, N0)))
    p0 = tl.where(g3, P3, tl.where(g2, P2, tl.where(g1, P1, 0)))
    rn = (pid - p0) * BN + tl.arange(0, BN)
    rm = pm * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    wp = w + rn[:, None].to(tl.int64) * K + rk[None, :]
    xp = X + rm[None, :].to(tl.int64) * sxm + rk[:, None]
    acc = tl.zeros([BN, BM], tl.float32)
    for k0 in range(0, tl.cdiv(K, BK) * BK, BK):
        wt = tl.load(wp, mask=(rn[:, None] < n_rows) & (k0 + rk[None, :] < K), other=0.0)
        xt = tl.load(xp, mask=(rm[None, :] < M) & (k0 + rk[:, None] < K), other=0.0)
        if INTERP:   # triton 3.6's interpreter mis-multiplies bf16: the same numbers in fp32
            acc = tl.dot(wt.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(wt, xt, acc)
        wp += BK
        xp += BK
    out = y + rm[None, :].to(tl.int64) * n_rows + rn[:, None]
    tl.store(out, acc.to(y.dtype.element_ty), mask=(rm[None, :] < M) & (rn[:, None] < n_rows))


def config(M: int, K: int, N: tuple = (1 << 30,)) -> dict:
    """Tile sizes and pipeline depth: the fastest of 36 configurations at M = 32 and 8 for a Llama-3-8B layer's
    q / k / v (N = 6144 rows in all, K 4096: 96 programs of BN 64) on an H200 (`bench/debug/skinny_gemm.py`,
    session 53 call 3); for fewer weight rows N (a small model) BN halves until there are 64 programs or BN is 16 (a
    guess, not measured: one program a column block and no split of K leave SMs idle below that)."""
    cfg = dict(BN=64, BK=256, num_stages=4, num_warps=4) if M <= 16 else dict(BN=64, BK=128, num_stages=6, num_warps=4)
    while cfg["BN"] > 16 and sum(-(-n // cfg["BN"]) for n in N) < 64:
        cfg["BN"] //= 2
    return cfg


@functools.lru_cache(maxsize=None)
def _shared_limit(device: int) -> int:
    """The shared memory a program may take on this GPU (Triton's own limit)."""
    return triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"]


def fit_stages(stages: int, bn: int, bk: int, bm: int, elem: int, limit: int) -> int:
    """The pipeline depth cut to what the GPU's shared memory holds: each stage keeps a [bn, bk] weight tile and a
    [bk, bm] x tile (the offline sm_90 build at BN 64, BK 128, BM 32, 6 stages took 6 x 24 KiB = 147456 bytes;
    an A100 holds 6 stages only up to BM 32, a consumer GPU's 99 KiB 3 to 4)."""
    return max(1, min(stages, limit // ((bn * bk + bk * bm) * elem)))


def launch(x2, weights, outs, BN: int | None = None, BK: int | None = None, num_stages: int | None = None,
           num_warps: int | None = None) -> None:
    """y_g = x2 @ W_g^T into outs[g] (contiguous [M, N_g]) for x2 [M, K] (unit stride along K) and contiguous W_g
    [N_g, K], one launch; tile overrides for tests (the interpreter) and sweeps."""
    M, K = x2.shape
    G = len(weights)
    if not 1 <= G <= MAX_GROUP:
        raise ValueError(f"grouped_linear takes 1 to {MAX_GROUP} weights, got {G}")
    cfg = config(M, K, tuple(w.shape[0] for w in weights))
    cfg.update({k: v for k, v in dict(BN=BN, BK=BK, num_stages=num_stages, num_warps=num_warps).items()
                if v is not None})
    bn = cfg.pop("BN")
    BM = max(16, triton.next_power_of_2(M))
    if x2.is_cuda:
        cfg["num_stages"] = fit_stages(cfg["num_stages"], bn, cfg["BK"], BM, x2.element_size(),
                                       _shared_limit(x2.device.index if x2.device.index is not None else 0))
    ns = [w.shape[0] for w in weights] + [0] * (MAX_GROUP - G)
    ps, total = [], 0
    for n in ns:
        ps.append(total)
        total += triton.cdiv(n, bn)
    ws = list(weights) + [weights[0]] * (MAX_GROUP - G)
    ys = list(outs) + [outs[0]] * (MAX_GROUP - G)
    _grouped_linear_kernel[(total, triton.cdiv(M, BM))](
        x2, *ws, *ys, M, K, *ns, ps[1], ps[2], ps[3], x2.stride(0), BM=BM, BN=bn, INTERP=_INTERPRET, **cfg)
