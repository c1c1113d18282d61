"""Where a GPU append differs from the eager reference, buffer by buffer, at the first step that differs.
A: the Triton append template (`quantize_append.append_decode`) at each RING_VEC on the channel-grouped Keys with
   outliers of tests/test_append_template.py::test_channel_groups_either_ring_load (which failed at RING_VEC 0 on
   an H200, session 40 call 1): the outlier choices of a differing token and the reference's scores there.
B: innerq-2 and kivi-2, eager `store.append` vs eager `store.append_decode` vs the Inductor-compiled
   `append_decode` with `compat.eager_numerics_options()` ("compiled") and with Inductor's defaults ("default"),
   bfloat16: the buffers that differ at the first step that differs and after the last step (and, where the
   first difference includes InnerQ's hybrid Value statistics, one group whose choice differs (the sign of its
   half, `store.signed_half`): its center and half).
usage: python bench/debug/append_mismatch.py [A|B]..."""
import sys

import torch

sys.path.insert(0, "tests")
from kvq_compile import KVQConfig, QuantizerSpec  # noqa: E402
from kvq_compile import reference as ref  # noqa: E402
from kvq_compile import store as st  # noqa: E402
from kvq_compile.config import Axis, Levels, Symmetry  # noqa: E402
from models import small_windows  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def q(bits, axis, group, sym=Symmetry.ASYMMETRIC, outliers=0.0):
    return QuantizerSpec(bits=bits, axis=axis, group_size=group, symmetry=sym, levels=Levels.UNIFORM,
                         outlier_fraction=outliers, range_scale=1.0)


def differing(a, b):
    return {n: int((a[n] != b[n]).sum()) for n in a if not torch.equal(a[n], b[n])}


def part_a():
    from kvq_compile.templates import quantize_append as qa

    cfg = KVQConfig(key=q(4, Axis.CHANNEL, 4, outliers=0.05), value=q(2, Axis.CHANNEL, 4), sink=1, recent=4)
    B, H, D, T, prefill = 2, 3, 64, 40, 9
    for vec in (0, 2, 4):
        qa.RING_VEC = vec
        for seed in range(6):
            gen = torch.Generator(device=DEV).manual_seed(seed)
            rnd = lambda *s: torch.randn(*s, generator=gen, device=DEV)  # noqa: E731
            geo = st.Geometry(B, H, T, D, "float32")
            lr, lt = (st.ModelStore(cfg, 1, geo, DEV).layers[0] for _ in range(2))
            k, v = rnd(B, H, prefill, D), rnd(B, H, prefill, D)
            for lay in (lr, lt):
                st.append(lay.buffers, cfg, lay.spec, geo, k, v, 0)
            hist = [k]
            first = None
            for p in range(prefill, prefill + 14):
                k, v = rnd(B, H, 1, D), rnd(B, H, 1, D)
                hist.append(k)
                pos = torch.tensor([p], device=DEV)
                st.append_decode(lr.buffers, cfg, lr.spec, geo, k, v, pos)
                qa.append_decode(lt.buffers, cfg, lt.spec, geo, k, v, pos)
                d = differing(lr.buffers, lt.buffers)
                if d and first is None:
                    first = (p, d)
                    oi_r, oi_t = lr.buffers["k.out_idx"], lt.buffers["k.out_idx"]
                    rows = (oi_r != oi_t).any(-1).nonzero()
                    keys = torch.cat(hist, 2)
                    for b_, h_, t_ in rows[:3].tolist():
                        g0 = t_ - (t_ - 1) % 4  # group start (sink 1, groups of 4)
                        grp = keys[b_, h_, g0:g0 + 4].float()
                        c0, h0 = (grp.amax(0) + grp.amin(0)) / 2, (grp.amax(0) - grp.amin(0)) / 2
                        score = (keys[b_, h_, t_].float() - c0).abs() / h0.clamp_min(ref.EPS)
                        top = score.sort(descending=True, stable=True)
                        print(f"   token (b {b_}, h {h_}, t {t_}) ref idx {oi_r[b_, h_, t_].tolist()} "
                              f"template idx {oi_t[b_, h_, t_].tolist()}; ref top scores "
                              f"{[(i, f'{s:.9g}') for s, i in zip(top.values[:6].tolist(), top.indices[:6].tolist())]}")
            print(f"A RING_VEC {vec} seed {seed}: first difference {first}")


def part_b():
    from kvq_compile import compat
    from kvq_compile.ops import decode_append_function

    for name in ("innerq-2", "kivi-2"):
        cfg = small_windows(name)
        B, H, T, D, steps = 4, 8, 80, 128, 72
        geo = st.Geometry(B, H, T, D, "bfloat16")
        stores = {m: st.ModelStore(cfg, 1, geo, DEV).layers[0] for m in ("append", "decode", "compiled", "default")}
        spec = stores["append"].spec

        tag = name.replace("-", "_")
        fns = {"compiled": decode_append_function(cfg, spec, geo, f"mismatch_compiled_{tag}",
                                                  compat.eager_numerics_options()),
               "default": decode_append_function(cfg, spec, geo, f"mismatch_default_{tag}", {})}
        gen = torch.Generator(DEV).manual_seed(3)
        scale = 1 + 3 * torch.rand(1, H, 1, D, generator=gen, device=DEV)
        shown = set()
        for p in range(steps):
            k = (torch.randn(B, H, 1, D, generator=gen, device=DEV) * scale).bfloat16()
            v = (torch.randn(B, H, 1, D, generator=gen, device=DEV) * scale).bfloat16()
            st.append(stores["append"].buffers, cfg, spec, geo, k, v, p)
            pos = torch.tensor([p], device=DEV)
            st.append_decode(stores["decode"].buffers, cfg, spec, geo, k, v, pos)
            for m, fn in fns.items():
                fn(stores[m].buffers, k, v, pos, None, None)
            for m in ("decode", "compiled", "default"):
                d = differing(stores["append"].buffers, stores[m].buffers)
                if d and m not in shown:
                    shown.add(m)
                    print(f"B {name} {m} vs eager append: first difference after position {p}: {d}")
                    ma, mb = (s.buffers["v.half"] < 0 for s in (stores["append"], stores[m]))
                    if "v.half" in d and (ma != mb).any():   # a hybrid group chose differently
                        idx = (ma != mb).nonzero()[0].tolist()
                        print(f"   v choice index {idx}: append {ma[tuple(idx)].item()} {m} {mb[tuple(idx)].item()}; "
                              f"center {stores['append'].buffers['v.center'][tuple(idx)].item()} / "
                              f"{stores[m].buffers['v.center'][tuple(idx)].item()}, half "
                              f"{stores['append'].buffers['v.half'][tuple(idx)].item()} / "
                              f"{stores[m].buffers['v.half'][tuple(idx)].item()}")
        for m in ("decode", "compiled", "default"):
            print(f"B {name} {m} vs eager append after {steps} steps: {differing(stores['append'].buffers, stores[m].buffers)}")


if __name__ == "__main__":
    for part in sys.argv[1:] or ["A", "B"]:
        {"A": part_a, "B": part_b}[part]()
