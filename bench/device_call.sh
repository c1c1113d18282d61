#!/bin/bash
# session 10 device call: GPU tests in parallel (one process per layout), then the benchmark alone
export PYTHONPATH=$PWD
ln -sfn $PWD/passes kvq_compile/passes
ln -sfn $PWD/templates kvq_compile/templates
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
i=0
for sel in "$@"; do
  if [ "$sel" = "BENCH" ]; then break; fi
  (python -m pytest -q -p no:logging -p no:cacheprovider tests/test_decode_gluon.py -k "$sel" > $OUT/t$i.log 2>&1; echo "== [$sel] $(tail -1 $OUT/t$i.log)") &
  i=$((i+1))
done
wait
for f in $OUT/t*.log; do grep -E "^(FAILED|E  )" $f | head -20; done
seen=0
for arg in "$@"; do
  if [ $seen = 1 ]; then echo "== $arg"; eval "$arg"; fi
  if [ "$arg" = "BENCH" ]; then seen=1; fi
done
