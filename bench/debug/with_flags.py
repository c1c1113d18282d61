"""Run a benchmark script with module flags of the decode-attention templates set first (an A/B in separate
processes), e.g.

    python bench/debug/with_flags.py "dag.POST_WCOST = {1: 0, 2: 0}" bench/bench_decode_attention.py --presets ...
    python bench/debug/with_flags.py "dag.WINDOW_INSIDE = False" bench/bench_generate.py --shapes 32x4096 ...

`da` is `kvq_compile.templates.decode_attention`, `dag` its Gluon module. Every assignment must name a flag the
module has (a misspelled or removed one would otherwise make an A/B of two identical builds). bench_generate.py runs
each of several shapes in a process of its own: those start through this script with the same flags
(KVQ_WITH_FLAGS; before session 24 they ran with the defaults, so a multi-shape end-to-end A/B compared the defaults
with themselves).
"""
import ast
import os
import runpy
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
from kvq_compile.templates import decode_attention as da  # noqa: E402
from kvq_compile.templates import decode_attention_gluon as dag  # noqa: E402

for node in ast.walk(ast.parse(sys.argv[1])):
    if isinstance(node, ast.Assign):
        for target in node.targets:
            ok = isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and \
                target.value.id in ("da", "dag") and hasattr({"da": da, "dag": dag}[target.value.id], target.attr)
            if not ok:
                sys.exit(f"with_flags: {ast.unparse(target)} is not a flag of decode_attention (da) or its Gluon "
                         "module (dag)")
exec(sys.argv[1])  # noqa: S102  (the caller's own flag assignments, checked above)
os.environ["KVQ_WITH_FLAGS"] = sys.argv[1]   # bench_generate.py's per-shape processes set them too
print("flags:", sys.argv[1], flush=True)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
