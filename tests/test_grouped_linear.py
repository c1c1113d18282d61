"""`kvq::grouped_linear` (a decode step's same-input projections in one launch): its Triton kernel against torch's
linear (under TRITON_INTERPRET=1 on the CPU, at small odd shapes; on CUDA at a Llama-3-8B layer's), the pass that
groups a traced model's linears, and what it leaves alone."""
import operator

import pytest
import torch

from kvq_compile import kvq_backend, ops
from kvq_compile.passes import grouped_linear as gp
from kvq_compile.templates import grouped_linear as gt
from models import compile_config, hf_model, small_windows

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"   # the kernel tests: compiled on a GPU, under TRITON_INTERPRET=1 on the CPU


def _case(M, K, ns, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    ws = [(torch.randn(n, K, generator=g) / K ** 0.5).to(device, dtype) for n in ns]
    return x, ws


def _check(x, ws, outs):
    for w, y in zip(ws, outs):
        ref = x.double() @ w.double().T
        err = (y.double() - ref).abs().max().item()
        tol = (2 ** -8 if y.dtype == torch.bfloat16 else 2 ** -11) * ref.abs().max().item() * 2 + 1e-6
        assert y.shape == ref.shape and err <= tol, (tuple(w.shape), err, tol)


@pytest.mark.parametrize("M,K,ns,tiles", [
    (5, 80, (48, 17, 33), dict(BN=16, BK=32)),          # odd rows, a partial K tile, partial weight tiles
    (1, 96, (16,), dict(BN=16, BK=32)),                  # one row, one weight
    (64, 64, (20, 20, 20, 9), dict(BN=16, BK=64)),       # the most rows and weights a launch takes
    (3, 48, (40, 8), dict(BN=32, BK=16)),                # a weight smaller than one tile
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_linear(M, K, ns, tiles, dtype):
    """Each output against x @ W^T in float64, within two roundings of the output (fp32 accumulation); every
    weight's rows land in its own output (equal row counts too: a swapped pointer would fail)."""
    x, ws = _case(M, K, ns, dtype, DEVICE, seed=M * 7 + K)
    outs = [torch.full((M, n), float("nan"), dtype=dtype, device=DEVICE) for n in ns]
    gt.launch(x, ws, outs, **tiles)
    _check(x, ws, outs)


def test_kernel_rows_of_a_strided_input():
    """x with a row stride larger than K (a slice of a wider tensor): the launch reads rows at its stride."""
    x, ws = _case(6, 64, (32, 16), torch.float16, DEVICE, seed=3)
    wide = torch.zeros(6, 100, dtype=torch.float16, device=DEVICE)
    wide[:, 10:74] = x
    outs = [torch.empty(6, n, dtype=torch.float16, device=DEVICE) for n in (32, 16)]
    gt.launch(wide[:, 10:74], ws, outs, BN=16, BK=32)
    _check(x, ws, outs)


def test_pipeline_depth_fits_the_shared_memory():
    """`fit_stages`: the measured configurations keep their depth on an H100 / H200 (227 KiB a program), and fewer
    stages where a GPU holds less (A100 163 KiB, consumer 99 KiB), never below one."""
    h100, a100, small = 232448, 166912, 101376
    assert gt.fit_stages(6, 64, 128, 32, 2, h100) == 6 and gt.fit_stages(6, 64, 128, 64, 2, h100) == 6
    assert gt.fit_stages(4, 64, 256, 16, 2, h100) == 4
    assert gt.fit_stages(6, 64, 128, 64, 2, a100) == 5 and gt.fit_stages(6, 64, 128, 32, 2, a100) == 6
    assert gt.fit_stages(6, 64, 128, 64, 2, small) == 3 and gt.fit_stages(6, 64, 128, 64, 2, 1000) == 1


def test_launch_fits_only_decode_shapes():
    """`ops.grouped_launch_fits`: few rows, fp16 / bf16 throughout, contiguous weights of the input's K."""
    x, ws = _case(4, 32, (16, 8), torch.bfloat16, "cpu", seed=1)
    assert ops.grouped_launch_fits(x, ws)
    assert ops.grouped_launch_fits(x.view(2, 2, 32), ws)
    assert not ops.grouped_launch_fits(torch.zeros(gt.MAX_ROWS + 1, 32, dtype=torch.bfloat16), ws)
    assert not ops.grouped_launch_fits(x.float(), [w.float() for w in ws])
    assert not ops.grouped_launch_fits(x, [ws[0], ws[1].half()])
    assert not ops.grouped_launch_fits(x, [ws[0].T.contiguous().T])
    assert not ops.grouped_launch_fits(x, [torch.zeros(8, 31, dtype=torch.bfloat16)])
    assert not ops.grouped_launch_fits(x, ws * 3)


def test_op_is_the_linears():
    """The op's reference kernel is one linear per weight (bit for bit), and it passes torch's op checks."""
    x, ws = _case(3, 24, (8, 5), torch.float32, "cpu", seed=2)
    x = x.view(3, 1, 24)
    outs = torch.ops.kvq.grouped_linear(x, ws)
    for w, y in zip(ws, outs):
        assert torch.equal(y, torch.nn.functional.linear(x, w))
    torch.library.opcheck(torch.ops.kvq.grouped_linear.default, (x, ws))


def test_op_backward_is_the_linears():
    """The op's backward (its `register_autograd`): gradients of x and of every weight, float64 gradcheck, one
    output unused."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 1, 8, generator=g, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(n, 8, generator=g, dtype=torch.float64, requires_grad=True) for n in (5, 4)]
    assert torch.autograd.gradcheck(lambda x, a, b: tuple(torch.ops.kvq.grouped_linear(x, [a, b])), (x, *ws))
    assert torch.autograd.gradcheck(lambda x, a, b: torch.ops.kvq.grouped_linear(x, [a, b])[1].sum(), (x, *ws))


def test_launch_leaves_tensor_subclasses_to_their_own_linear():
    """A weight of a tensor subclass (a quantized weight brings its own linear) never takes the launch."""
    class Sub(torch.Tensor):
        pass

    x, ws = _case(4, 32, (16,), torch.bfloat16, "cpu", seed=5)
    assert ops.grouped_launch_fits(x, ws)
    assert not ops.grouped_launch_fits(x, [torch.Tensor._make_subclass(Sub, ws[0])])
    assert not gp._plain(torch.Tensor._make_subclass(Sub, ws[0])) and gp._plain(ws[0])


def _graph(fn, *args):
    gm = torch.fx.symbolic_trace(fn)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*args)
    for n in gm.graph.nodes:
        n.meta["example_value"] = n.meta.get("val")
    return gm


@pytest.fixture
def cpu_groups(monkeypatch):
    """The pass groups CPU and float32 linears too (by default CUDA's fp16 / bf16 alone: on the CPU the op is the
    linears again, and the launch takes no float32)."""
    monkeypatch.setattr(gp, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(gp, "DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    monkeypatch.setattr(gp, "SINGLES", False)   # groups alone (lone linears: test_pass_takes_lone_linears_of_few_rows)


def test_pass_groups_same_input_linears_and_leaves_the_rest(cpu_groups):
    """Three projections of one input become one op (its outputs in their places); a linear with a bias, one of
    another input and one whose input has more rows than a launch takes stay linears."""
    F = torch.nn.functional

    def fn(x, big, wq, wk, wv, wo, b):
        q, k, v = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
        o = F.linear(q + 1, wo)
        return q, k * 2, v, o, F.linear(x, wk, b), F.linear(big, wq), F.linear(big, wk)

    args = (torch.randn(2, 1, 16), torch.randn(4, 20, 16), torch.randn(16, 16), torch.randn(8, 16),
            torch.randn(8, 16), torch.randn(16, 16), torch.randn(8))
    want = fn(*args)
    gm = _graph(fn, *args)
    assert gp.group_linears(gm) == 1
    grouped = [n for n in gm.graph.nodes if n.target == torch.ops.kvq.grouped_linear.default]
    assert len(grouped) == 1 and len(grouped[0].args[1]) == 3
    assert len([n for n in gm.graph.nodes if n.target is operator.getitem]) == 3
    assert len([n for n in gm.graph.nodes if n.target in gp.LINEAR]) == 4   # o, the biased one, the two of `big`
    for a, b in zip(gm(*args), want):
        assert torch.equal(a, b)


def test_pass_takes_lone_linears_of_few_rows(cpu_groups, monkeypatch):
    """A lone eligible linear (o_proj's place) becomes a one-weight launch where its input has at most SINGLE_ROWS
    rows ("auto", the default), always (True) or never (False); a biased linear and rows above the launch's stay
    linears either way."""
    F = torch.nn.functional

    def fn(x, big, wq, wk, wo, b):
        q, k = F.linear(x, wq), F.linear(x, wk)
        return q, k, F.linear(q - 1, wo), F.linear(q, wo, b), F.linear(big, wo)

    def args(rows):
        return (torch.randn(rows, 1, 24), torch.randn(2, 40, 24), torch.randn(24, 24), torch.randn(8, 24),
                torch.randn(24, 24), torch.randn(24))

    few, more = args(gp.SINGLE_ROWS), args(gp.SINGLE_ROWS + 1)
    for singles, x, sizes in ((False, few, [2]), (True, more, [2, 1]), ("auto", few, [2, 1]), ("auto", more, [2])):
        want = fn(*x)
        gm = _graph(fn, *x)
        assert gp.group_linears(gm, singles=singles) == len(sizes)
        got = [len(n.args[1]) for n in gm.graph.nodes if n.target == torch.ops.kvq.grouped_linear.default]
        assert got == sizes, (singles, got)
        assert len([n for n in gm.graph.nodes if n.target in gp.LINEAR]) == 5 - sum(sizes)
        for a, b in zip(gm(*x), want):
            assert torch.equal(a, b)
    monkeypatch.setattr(gp, "SINGLES", "auto")   # the default (KVQ_SINGLE_LINEARS unset)
    assert gp.group_linears(_graph(fn, *few)) == 2
    with pytest.raises(ValueError, match="singles"):
        gp.group_linears(_graph(fn, *few), singles="yes")


def test_pass_leaves_graphs_with_autocast_alone(cpu_groups):
    """Linears inside an autocast region run in its dtype; the op would not be cast: a Dynamo graph with an
    autocast region keeps every linear."""
    seen = {}

    def backend(gm, example_inputs):
        seen["grouped"] = gp.group_linears(gm)
        seen["linears"] = sum(n.target in gp.LINEAR for n in gm.graph.nodes)
        return gm.forward

    def fn(x, w1, w2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.nn.functional.linear(x, w1), torch.nn.functional.linear(x, w2)

    args = (torch.randn(2, 8), torch.randn(4, 8), torch.randn(3, 8))
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert seen == {"grouped": 0, "linears": 2} and out[0].dtype == torch.bfloat16


def _compiled(fn, args, **kw):
    """fn compiled by a backend that runs the pass; (outputs, groups inserted, linears left)."""
    seen = {}

    def backend(gm, example_inputs):
        seen["grouped"] = gp.group_linears(gm)
        seen["linears"] = sum(n.target in gp.LINEAR for n in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args, **kw)
    return out, seen["grouped"], seen["linears"]


def test_pass_groups_nothing_on_the_cpu_by_default():
    F = torch.nn.functional
    _, grouped, linears = _compiled(lambda x, a, b: (F.linear(x, a), F.linear(x, b)),
                                    (torch.randn(2, 8), torch.randn(4, 8), torch.randn(3, 8)))
    assert (grouped, linears) == (0, 2)


def test_pass_keeps_order_across_grad_mode_and_in_place_writes(cpu_groups):
    """A later linear is not moved above a grad-mode switch (its output would lose its gradient) or an in-place write
    to its input (it would read the old values); linears on either side of one still group among themselves."""
    F = torch.nn.functional

    def grad_switch(x, w1, w2, w3):
        with torch.no_grad():
            a = F.linear(x, w1)
        return a, F.linear(x, w2), F.linear(x, w3)

    x = torch.randn(2, 8)
    ws = [torch.randn(n, 8, requires_grad=True) for n in (4, 3, 5)]
    out, grouped, linears = _compiled(grad_switch, (x, *ws))
    assert (grouped, linears) == (1, 1)
    assert not out[0].requires_grad and out[1].requires_grad and out[2].requires_grad

    def mutate(x, w1, w2, w3):
        a = F.linear(x, w1)
        x.mul_(2)
        return a, F.linear(x, w2), F.linear(x, w3)

    args = (torch.randn(2, 8), torch.randn(4, 8), torch.randn(3, 8), torch.randn(5, 8))
    want = mutate(args[0].clone(), *args[1:])
    out, grouped, linears = _compiled(mutate, (args[0].clone(), *args[1:]))
    assert (grouped, linears) == (1, 1)
    for a, b in zip(out, want):
        torch.testing.assert_close(a, b)


@torch.library.custom_op("kvq_test::scale_", mutates_args=("x",))
def _scale_in_place(x: torch.Tensor) -> None:
    x.mul_(3)


@_scale_in_place.register_fake
def _(x):
    return None


def test_pass_keeps_order_across_other_writes(cpu_groups):
    """Writes a linear must not be moved above, in the forms Dynamo emits: an `out=` argument, a mutating custom op
    (a packet in the graph), an inference-mode block's exit; and no float32 group (the launch takes fp16 / bf16)."""
    F = torch.nn.functional

    def out_arg(x, w1, w2):
        p = F.linear(x, w1)
        torch.mul(x, 3, out=x)
        return p, F.linear(x, w2)

    def custom_op(x, w1, w2):
        p = F.linear(x, w1)
        torch.ops.kvq_test.scale_(x)
        return p, F.linear(x, w2)

    for fn in (out_arg, custom_op):
        args = (torch.ones(2, 8), torch.ones(4, 8), torch.ones(3, 8))
        want = fn(args[0].clone(), *args[1:])
        out, grouped, linears = _compiled(fn, (args[0].clone(), *args[1:]))
        assert (grouped, linears) == (0, 2), fn.__name__
        for a, b in zip(out, want):
            torch.testing.assert_close(a, b)

    def inference(x, w1, w2):
        with torch.inference_mode():
            a = F.linear(x, w1)
        return a, F.linear(x, w2)

    ws = [torch.randn(n, 8, requires_grad=True) for n in (4, 3)]
    out, grouped, linears = _compiled(inference, (torch.randn(2, 8), *ws))
    assert (grouped, linears) == (0, 2) and out[1].requires_grad and not out[1].is_inference()

    gp.DTYPES = (torch.float16, torch.bfloat16)   # (restored by the fixture's monkeypatch)
    args = (torch.randn(2, 8), torch.randn(4, 8), torch.randn(3, 8))
    for dtype, groups in ((torch.float32, 0), (torch.bfloat16, 1)):
        _, grouped, _ = _compiled(lambda x, a, b: (F.linear(x, a), F.linear(x, b)), [a.to(dtype) for a in args])
        assert grouped == groups, dtype


def test_pass_regroups_on_the_graph_it_rewrote(cpu_groups):
    """Grouped outputs that feed further groups (as input, or as another group's weight), more members than one
    launch takes, and linear's keyword form: every group built on the graph the last rewrite left."""
    F = torch.nn.functional

    def chain(h, w1, w2, w3, w4):
        a = F.linear(h, w1)
        b = F.linear(h, w2)
        return F.linear(a, w3), F.linear(a, w4), b

    def as_weight(x, y, w1, w2, w3):
        a = F.linear(x, w1)
        b = F.linear(x, w2)
        return F.linear(y, a), F.linear(y, w3), b

    def many(x, *ws):
        return [F.linear(input=x, weight=w) for w in ws]

    for fn, args in ((chain, (torch.randn(2, 8), torch.randn(6, 8), torch.randn(5, 8), torch.randn(4, 6),
                              torch.randn(3, 6))),
                     (as_weight, (torch.randn(4, 6), torch.randn(3, 8), torch.randn(8, 6), torch.randn(2, 6),
                                  torch.randn(5, 8))),
                     (many, (torch.randn(3, 8), *[torch.randn(n + 2, 8) for n in range(gt.MAX_GROUP + 2)]))):
        out, grouped, linears = _compiled(fn, args)
        assert (grouped, linears) == (2, 0), fn.__name__
        for a, b in zip(out, fn(*args)):
            torch.testing.assert_close(a, b)


def test_pass_leaves_a_graph_traced_under_autocast(cpu_groups):
    """A compiled call made under autocast (no autocast node in its graph): the linears stay, so they are cast."""
    F = torch.nn.functional
    args = (torch.randn(2, 8), torch.randn(4, 8), torch.randn(3, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grouped, linears = _compiled(lambda x, a, b: (F.linear(x, a), F.linear(x, b)), args)
    assert (grouped, linears) == (0, 2) and out[0].dtype == torch.bfloat16


def test_pass_without_triton_groups_nothing(cpu_groups, monkeypatch):
    """Without Triton (the template's import fails) the pass leaves every linear and the compile still works."""
    import sys

    monkeypatch.setitem(sys.modules, "kvq_compile.templates.grouped_linear", None)
    F = torch.nn.functional
    _, grouped, linears = _compiled(lambda x, a, b: (F.linear(x, a), F.linear(x, b)),
                                    (torch.randn(2, 8), torch.randn(4, 8), torch.randn(3, 8)))
    assert (grouped, linears) == (0, 2)


def test_pass_leaves_a_weight_computed_inside_the_group(cpu_groups):
    """A weight computed after the group's first linear (here from that linear's output) is not grouped; the
    others still are, where two are left."""
    F = torch.nn.functional

    def fn(x, w1, w2, w3):
        a = F.linear(x, w1)
        b = F.linear(x, w2)
        w4 = w3 * a.sum()
        return a, b, F.linear(x, w4)

    args = (torch.randn(3, 8), torch.randn(4, 8), torch.randn(5, 8), torch.randn(6, 8))
    want = fn(*args)
    gm = _graph(fn, *args)
    assert gp.group_linears(gm) == 1
    grouped = [n for n in gm.graph.nodes if n.target == torch.ops.kvq.grouped_linear.default]
    assert len(grouped[0].args[1]) == 2
    for a, b in zip(gm(*args), want):
        torch.testing.assert_close(a, b)


def test_backend_groups_every_layer_and_keeps_the_tokens(cpu_groups):
    """kvq_backend on a 2-layer Llama: q / k / v and gate / up of each layer grouped in the decode graph (the op's
    CPU kernel: the same logits as without grouping, bit for bit); `group_linears=False` groups nothing."""
    from torch._dynamo.utils import counters

    model = hf_model(layers=2)
    ids = torch.randint(3, 90, (2, 20), generator=torch.Generator().manual_seed(0))
    logits = {}
    for group in (False, True):
        torch._dynamo.reset()
        counters.clear()
        be = kvq_backend(small_windows("kivi-2"), group_linears=group)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             cache_implementation="static", compile_config=compile_config(be),
                             output_logits=True, return_dict_in_generate=True)
        logits[group] = torch.stack(out.logits)
        assert counters["kvq"]["grouped_linear"] == (4 * 2 if group else 0), dict(counters["kvq"])
    assert torch.equal(logits[True], logits[False])


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("M", [1, 8, 32, 33, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_llama_projections_on_gpu(M, dtype, monkeypatch):
    """A Llama-3-8B layer's q / k / v (4096, 1024, 1024 rows) and gate / up (14336 each) through the CUDA kernel
    (its launch counted: not the linears' fallback) against float64, and against cuBLAS within one output rounding
    more; x as [M, 1, K] (a decode step's hidden states) for M > 32."""
    launches = []
    launch = gt.launch
    monkeypatch.setattr(gt, "launch", lambda *a, **k: launches.append(1) or launch(*a, **k))
    for ns in ((4096, 1024, 1024), (14336, 14336)):
        x, ws = _case(M, 4096, ns, dtype, "cuda", seed=M)
        outs = torch.ops.kvq.grouped_linear(x.view(M, 1, 4096) if M > 32 else x, ws)
        outs = [y.view(M, -1) for y in outs]
        _check(x, ws, outs)
        for w, y in zip(ws, outs):
            ref = torch.nn.functional.linear(x, w)
            assert (y.float() - ref.float()).abs().max() <= 2 * 2 ** -7 * ref.float().abs().max()
    assert len(launches) == 2


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_compiled_generate_with_grouped_linears_on_gpu():
    """A bf16 Llama (head_dim 128, 4 layers) compiled by kvq_backend with CUDA graphs: grouped and ungrouped decode
    steps give the same greedy tokens and logits within bf16 noise, with no cudagraph skip."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    from models import prompts

    model = hf_model("llama", kv_heads=2, gqa=4, head_dim=128, layers=4, dtype=torch.bfloat16).cuda()
    ids, mask = prompts(3, 37, pad=(0, 5, 2))
    ids, mask = ids.cuda(), mask.cuda()
    outs = {}
    for group in (False, True):
        torch._dynamo.reset()
        counters.clear()
        be = kvq_backend(small_windows("kivi-2"), group_linears=group)
        cc = CompileConfig(backend=be, fullgraph=True, mode="reduce-overhead")
        outs[group] = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                     cache_implementation="static", compile_config=cc, output_logits=True,
                                     return_dict_in_generate=True)
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
        assert (counters["kvq"]["grouped_linear"] > 0) == group
    a, b = torch.stack(outs[True].logits).float(), torch.stack(outs[False].logits).float()
    assert (a - b).abs().max() <= 0.05 * b.abs().max(), (a - b).abs().max()
