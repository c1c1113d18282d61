"""Every private torch API kvq uses, in one place, with feature checks (torch 2.11 on GPU, 2.13+ on CPU)."""
from __future__ import annotations

import torch
import torch.fx as fx


def register_store_buffer(gm: fx.GraphModule, name: str, tensor: torch.Tensor) -> str:
    """Make `tensor` a buffer of the Dynamo graph module so AOTAutograd lifts it as a static input
    (fixed address: CUDA graphs neither copy nor re-record it). AOTAutograd asks Dynamo's metadata for
    every lifted buffer's source; a constant source names ours."""
    gm.register_buffer(name, tensor, persistent=False)
    if hasattr(gm, "_param_name_to_source"):
        from torch._dynamo.source import ConstantSource

        gm._param_name_to_source[name] = ConstantSource(f"kvq_{name}")
    return name


def inductor_config_patches(mode: str | None, options: dict | None) -> dict:
    """What torch.compile(mode=..., options=...) would hand Inductor."""
    import torch._inductor as inductor

    patches = dict(inductor.list_mode_options(mode)) if mode not in (None, "default") else {}
    patches.update(options or {})
    return patches


def compile_fx(gm: fx.GraphModule, example_inputs, config_patches: dict):
    from torch._inductor.compile_fx import compile_fx as _compile_fx

    return _compile_fx(gm, example_inputs, config_patches=config_patches)


def bump_counter(group: str, key: str, n: int = 1) -> None:
    from torch._dynamo.utils import counters

    counters[group][key] += n


def counter(group: str, key: str) -> int:
    from torch._dynamo.utils import counters

    return counters[group][key]


def fix_triton_interpreter() -> None:
    """Under TRITON_INTERPRET=1 (the CPU CI), triton 3.6's interpreter turns a loop bound computed from a
    loaded value into `int(array of shape (1,))`, which numpy >= 2 refuses. Patch its tensor `__index__`
    to take the single element. No effect on compiled GPU kernels."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import numpy as np
        from triton.runtime import interpreter as interp
    except ImportError:
        return
    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_kvq_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._kvq_fixed = True
    interp._patch_lang_tensor = patched
