import sys, types, torch
sys.path.insert(0, "tests")
from kvq_compile import compat, store as st
from models import small_windows
print("torch", torch.__version__, "CPU")
two = {k: v for k, v in compat.eager_numerics_options().items() if k != "pattern_matcher"}
for label, opts in (("default", {}), ("two options", two), ("eager_numerics_options", compat.eager_numerics_options())):
    torch._dynamo.reset()
    cfg = small_windows("innerq-2"); B, H, T, D = 4, 8, 80, 128
    geo = st.Geometry(B, H, T, D, "bfloat16")
    a, b = (st.ModelStore(cfg, 1, geo, "cpu").layers[0] for _ in range(2))
    def run(bufs, key, value, positions, cos, sin):
        st.append_decode(bufs, cfg, b.spec, geo, key, value, positions, cos, sin)
    code = run.__code__.replace(co_name=f"cpu_two_{len(opts)}")
    fn = torch.compile(types.FunctionType(code, run.__globals__, code.co_name, None, run.__closure__),
                       fullgraph=True, dynamic=False, options=opts)
    gen = torch.Generator().manual_seed(3)
    scale = 1 + 3 * torch.rand(1, H, 1, D, generator=gen)
    for p in range(72):
        k, v = ((torch.randn(B, H, 1, D, generator=gen) * scale).bfloat16() for _ in range(2))
        st.append(a.buffers, cfg, a.spec, geo, k, v, p)
        fn(b.buffers, k, v, torch.tensor([p]), None, None)
    print(label, opts, {n: int((a.buffers[n] != b.buffers[n]).sum()) for n in a.buffers if not torch.equal(a.buffers[n], b.buffers[n])})
