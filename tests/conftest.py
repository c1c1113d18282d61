import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors through the interpreter (set before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Inductor's CPU kernels built scalar instead of vectorized: faster C++ builds for the compile-bound tests (one
    # test cold 57.2 -> 45.6 s, session 55). They are the model's own ops (embeddings, norms, RoPE, activations;
    # the kvq ops stay opaque calls on the CPU) and, in test_store.py's compiled-append tests, the kvq append itself
    # compiled by Inductor (a GPU path, checked there in scalar C++). Which ISA Inductor picks is the machine's (a
    # CPU without AVX2 gets scalar code anyway).
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    # `-n N` (the README's `-n 2` on 2 cores): one intra-op thread a worker. torch's default, a thread per core in
    # every worker, oversubscribed the cores: tests/test_store.py plus three compiled test_hf_cache.py tests (141
    # tests, cold Inductor caches, -n 2) took 447.6 s with it and 270.1 s without (session 55, this machine; session
    # 54's whole-suite comparison that reverted this most likely mixed warm and cold compile caches)
    os.environ["OMP_NUM_THREADS"] = "1"   # (Inductor's compile workers, started later, inherit it)
    torch.set_num_threads(1)


def _interpreter_patches_language_once_a_launch():
    """Triton 3.6's interpreter patches `triton.language` (inspect.getmembers over tl, tl.tensor, tl.math: about 0.2
    ms) again on every call of a @triton.jit helper inside a kernel, though the launch (`GridExecutor`) has patched
    those same module objects for its whole run and restores them after it: a tenth or more of an interpreted
    template's time (test_append_template.py, session 56). A helper call inside a launch now patches only when its
    module sees a language module that neither the launch's kernel nor an earlier helper of the launch saw (then
    as before). Outside Triton 3.6.0 nothing changes."""
    import inspect

    import triton
    from triton.runtime import interpreter as ti

    if triton.__version__ != "3.6.0" or not all(hasattr(ti, n) for n in (
            "GridExecutor", "InterpretedFunction", "InterpreterError", "_patch_lang")):
        return
    import triton.language as tl

    def langs(fn):
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    patched = []   # per nested launch: ids of the language modules it patched
    launch = ti.GridExecutor.__call__

    def grid_call(self, *args, **kwargs):
        patched.append(langs(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def device_call(self, *args, **kwargs):
        seen = langs(self.fn)
        if not patched or not seen <= patched[-1]:
            ti._patch_lang(self.fn)   # (as before: a helper's patches are never restored, so they hold to the end)
            if patched:
                patched[-1] |= seen
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    ti.GridExecutor.__call__ = grid_call
    ti.InterpretedFunction.__call__ = device_call


def _interpreter_skips_unasserted_overflow_checks():
    """Triton 3.6's interpreter sanitizes every int32 add, sub and mul (`binary_op_sanitize_overflow_impl`: the op
    again in int64, two compares, an and) and hands the result to `device_assert`, which returns at once unless
    the builder's options ask for `debug`; the interpreter's never do (`InterpreterOptions.debug` is False; neither
    TRITON_DEBUG nor `jit(debug=True)` reaches it). The check is computed and dropped: about 40% of an interpreted
    quantize-on-append launch (cProfile of test_append_template.py::test_every_layout[xquant-1.38], session 58).
    Now it is skipped where `device_assert` would drop it (debug off, read on every call, as `device_assert` reads
    it); with debug on it runs and asserts as before. Nothing a kernel computes or stores changes."""
    import triton
    from triton.language import semantic

    sem = getattr(semantic, "TritonSemantic", None)
    check = getattr(sem, "binary_op_sanitize_overflow_impl", None)
    if triton.__version__ != "3.6.0" or check is None:
        return

    def sanitize_if_asserted(self, lhs, rhs, binary_op):
        if getattr(self.builder.options, "debug", True):
            return check(self, lhs, rhs, binary_op)

    sem.binary_op_sanitize_overflow_impl = sanitize_if_asserted


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_patches_language_once_a_launch()
    _interpreter_skips_unasserted_overflow_checks()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
