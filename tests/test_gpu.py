"""On CUDA only: compiled generate with the Triton decode path, CUDA graphs, against the eager simulation."""
import pytest
import torch

from kvq_compile import kvq_backend
from kvq_compile.simulate import HFSimulation
from models import hf_model, prompts, small_windows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GEN = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp16", "int8", "kivi-2", "kvquant-4-1%", "innerq-2", "xquant-1.38",
                                  "calibquant-1"])
def test_reduce_overhead_generate_matches_simulation(name):
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model = hf_model("llama", kv_heads=2, gqa=4, head_dim=128, layers=4).cuda()
    cfg = small_windows(name)
    ids, mask = prompts(3, 37, pad=(0, 5, 2))
    ids, mask = ids.cuda(), mask.cuda()
    sim = HFSimulation(model, cfg).generate(ids, attention_mask=mask, max_new_tokens=12, **GEN)
    counters.clear()
    be = kvq_backend(cfg)
    cc = CompileConfig(backend=be, fullgraph=True, mode="reduce-overhead")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, cache_implementation="static",
                         compile_config=cc, **GEN)
    assert all(len(r.rewritten) == 4 for r in be.reports), "\n".join(map(str, be.reports))
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    # float32 model: the template's dots run in IEEE fp32, so the first decode step agrees to float tolerance
    torch.testing.assert_close(out.logits[1], sim.logits[1], atol=1e-3, rtol=1e-3)
    for a, b in zip(sim.logits, out.logits):
        torch.testing.assert_close(b, a, atol=5e-2, rtol=0)
