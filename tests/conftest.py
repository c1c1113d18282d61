import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors through the interpreter (set before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
