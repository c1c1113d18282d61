import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors through the interpreter (set before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    # `-n N` (the README's `-n 2` on 2 cores): one intra-op thread a worker. torch's default, a thread per core in
    # every worker, oversubscribed the cores: tests/test_store.py took 177 s with it and 48 s
    # without (session 54, this machine)
    os.environ["OMP_NUM_THREADS"] = "1"   # (Inductor's compile workers, started later, inherit it)
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
