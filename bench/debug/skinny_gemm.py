"""Decode-step GEMMs y = x @ W^T with few rows (x [M, K], W [N, K], bf16): cuBLAS (`torch.nn.functional.linear`)
against a plain Triton kernel that reads each weight row once with no split of K (one program per BN output
columns and BM rows, the weights' loads pipelined), at the projection shapes of a Llama-3-8B layer (debug). Written
when a profile of the (32, 4096) decode step showed the q / k / v / o projections at 36-66% of copy bandwidth with
cuBLAS's split-K reduction kernels beside them (bench/RESULTS.md, sessions 28 and 32). Also a q / k / v launch that
reads the three weights in one grid (no concatenated copy of the weights).

    python bench/debug/skinny_gemm.py [M,...] [op]      e.g. 32,8 op   (op: also time kvq::grouped_linear)
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_mm(X, W, Y, M, N, K, sxm, swn, sym, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y[m, n] = sum_k x[m, k] w[n, k], the product transposed (acc [BN, BM] = W_tile @ x_tile^T: the weights'
    rows are the mma's M side, so BN may be as small as 16 and a few rows of x pad only the N side)."""
    pn = tl.program_id(0)
    pm = tl.program_id(1)
    rn = pn * BN + tl.arange(0, BN)
    rm = pm * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BN, BM], tl.float32)
    wp = W + rn[:, None].to(tl.int64) * swn + rk[None, :]
    xp = X + rm[None, :] * sxm + rk[:, None]
    for k0 in range(0, tl.cdiv(K, BK) * BK, BK):
        w = tl.load(wp, mask=(rn[:, None] < N) & (k0 + rk[None, :] < K), other=0.0)
        x = tl.load(xp, mask=(rm[None, :] < M) & (k0 + rk[:, None] < K), other=0.0)
        acc = tl.dot(w, x, acc)
        wp += BK
        xp += BK
    tl.store(Y + rm[None, :] * sym + rn[:, None], acc.to(Y.dtype.element_ty), mask=(rm[None, :] < M) & (rn[:, None] < N))


def skinny_mm(x, w, out=None, BN=32, BK=256, stages=4, warps=4):
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    BM = max(16, triton.next_power_of_2(min(M, 64)))
    _skinny_mm[(triton.cdiv(N, BN), triton.cdiv(M, BM))](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                                         BM=BM, BN=BN, BK=BK, num_stages=stages, num_warps=warps)
    return y


def graph_us(fn, reps=50):
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=reps) * 1e3


def copy_bandwidth(dev="cuda") -> float:
    """Bytes per second of a 256 MiB device copy (read and written), CUDA-graph timed."""
    buf = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(buf)
    return 2 * buf.numel() / (graph_us(lambda: dst.copy_(buf)) * 1e-6)


def main():
    Ms = [int(m) for m in (sys.argv[1] if len(sys.argv) > 1 else "32,8").split(",")]
    dev = "cuda"
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} copy {bw / 1e12:.2f} TB/s")
    shapes = {"k/v": (1024, 4096), "q/o": (4096, 4096), "qkv": (6144, 4096), "gate/up": (14336, 4096),
              "down": (4096, 14336)}
    configs = [(bn, bk, st, wp) for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 4, 6) for wp in (2, 4)]
    if len(sys.argv) > 2:   # the op's timing only: one configuration for the plain kernel
        configs = [(64, 128, 6, 4)]
    for M in Ms:
        for name, (N, K) in shapes.items():
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
            ref = torch.nn.functional.linear(x, w)
            nbytes = N * K * 2
            t_cu = graph_us(lambda: torch.nn.functional.linear(x, w))
            best = None
            for bn, bk, st, wp in configs:
                try:
                    y = skinny_mm(x, w, BN=bn, BK=bk, stages=st, warps=wp)
                    err = (y.float() - ref.float()).abs().max().item()
                    assert err < 2e-2 * ref.abs().max().item(), err
                    tt = graph_us(lambda: skinny_mm(x, w, BN=bn, BK=bk, stages=st, warps=wp))
                except Exception as e:  # noqa: BLE001
                    print(f"  {name} M={M} {bn},{bk},{st},{wp}: {type(e).__name__} {str(e)[:80]}")
                    continue
                if best is None or tt < best[0]:
                    best = (tt, (bn, bk, st, wp))
            print(f"M={M:3d} {name:8s} N={N:6d} K={K:6d}  cuBLAS {t_cu:7.2f} us ({nbytes / (t_cu * 1e-6) / bw:5.1%})  "
                  f"triton {best[0]:7.2f} us ({nbytes / (best[0] * 1e-6) / bw:5.1%}) BN,BK,stages,warps={best[1]}",
                  flush=True)
        # q, k, v one after another (cuBLAS, three launches) against one Triton launch per weight
        x = torch.randn(M, 4096, device=dev, dtype=torch.bfloat16)
        ws = [torch.randn(n, 4096, device=dev, dtype=torch.bfloat16) for n in (4096, 1024, 1024)]
        t3 = graph_us(lambda: [torch.nn.functional.linear(x, w) for w in ws])
        t3t = graph_us(lambda: [skinny_mm(x, w, BN=16 if w.shape[0] == 1024 else 32) for w in ws])
        print(f"M={M:3d} q,k,v (three launches) cuBLAS {t3:7.2f} us  triton {t3t:7.2f} us "
              f"(50.3 MB: {50.3e6 / (t3 * 1e-6) / bw:5.1%} / {50.3e6 / (t3t * 1e-6) / bw:5.1%})", flush=True)
        if len(sys.argv) > 2:   # kvq::grouped_linear (one launch) against cuBLAS's launches, q / k / v and gate / up
            import kvq_compile.ops  # noqa: F401
            wgu = [torch.randn(14336, 4096, device=dev, dtype=torch.bfloat16) for _ in range(2)]
            for name, group, mb in (("q,k,v", ws, 50.3e6), ("gate,up", wgu, 234.9e6)):
                tc = graph_us(lambda: [torch.nn.functional.linear(x, w) for w in group])
                tg = graph_us(lambda: torch.ops.kvq.grouped_linear(x, group))
                outs = torch.ops.kvq.grouped_linear(x, group)
                err = max((o.float() - torch.nn.functional.linear(x, w).float()).abs().max().item()
                          for o, w in zip(outs, group))
                print(f"M={M:3d} {name:8s} cuBLAS {tc:7.2f} us ({mb / (tc * 1e-6) / bw:5.1%})  kvq::grouped_linear "
                      f"{tg:7.2f} us ({mb / (tg * 1e-6) / bw:5.1%})  max diff {err:.3g}", flush=True)


if __name__ == "__main__":
    main()
