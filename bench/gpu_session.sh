#!/bin/bash
# One device call: make the package importable without installing, run the GPU tests, then the benchmarks.
# usage: bash bench/gpu_session.sh "<pytest args>" "<bench command>"...
export PYTHONPATH=$PWD
ln -sfn $PWD/passes kvq_compile/passes
ln -sfn $PWD/templates kvq_compile/templates
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if [ -n "$1" ]; then python -m pytest -q -p no:logging -p no:cacheprovider $1 2>&1 | tail -25; fi
shift
for cmd in "$@"; do echo "== $cmd"; eval "$cmd"; done
