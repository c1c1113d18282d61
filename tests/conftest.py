import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors through the interpreter (set before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    # `-n N` (the README's `-n 2` on 2 cores): one intra-op thread a worker. torch's default, a thread per core in
    # every worker, oversubscribed the cores: tests/test_store.py plus three compiled test_hf_cache.py tests (141
    # tests, cold Inductor caches, -n 2) took 447.6 s with it and 270.1 s without (session 55, this machine; session
    # 54's whole-suite comparison that reverted this most likely mixed warm and cold compile caches)
    os.environ["OMP_NUM_THREADS"] = "1"   # (Inductor's compile workers, started later, inherit it)
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
