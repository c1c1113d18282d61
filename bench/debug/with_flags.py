"""Run a benchmark script with module flags of the decode-attention templates set first (an A/B in separate
processes), e.g.

    python bench/debug/with_flags.py "da.WINDOW_FIRST = True" bench/bench_decode_attention.py --presets kivi-4 ...
    python bench/debug/with_flags.py "dag.WINDOW_INSIDE = ('post',)" bench/bench_generate.py ...

`da` is `kvq_compile.templates.decode_attention`, `dag` its Gluon module.
"""
import os
import runpy
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
from kvq_compile.templates import decode_attention as da  # noqa: E402,F401
from kvq_compile.templates import decode_attention_gluon as dag  # noqa: E402,F401

exec(sys.argv[1])  # noqa: S102  (the caller's own flag assignments)
print("flags:", sys.argv[1], flush=True)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
