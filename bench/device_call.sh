#!/bin/bash
# One device call: GPU test selections in parallel (one process each: a -k filter of tests/test_decode_gluon.py,
# or a tests/ path), then, after the word BENCH, benchmark commands one at a time (nothing else running).
# usage: [TEST_TIMEOUT=seconds] bash bench/device_call.sh "<filter | tests/path | tests/path -k filter>"... BENCH "<command>"...
# TEST_TIMEOUT: stop each test selection after that long (0, the default: no limit), so the benchmarks still run
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
ln -sfn $PWD/passes kvq_compile/passes
ln -sfn $PWD/templates kvq_compile/templates
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
# pure-Python wheels carried in .whl/ (run with carry [".whl"]; e.g. optimum-quanto for bench_generate.py's quanto
# baselines), into the interpreter the tests and benchmarks run: `python -m pip`, not a bare `pip`, which may belong to
# another (session 37, call 3)
if ls .whl/*.whl > /dev/null 2>&1; then
  python -m pip install -q --no-deps .whl/*.whl 2>&1 | grep -v -i "warning" ; ls .whl/
fi
i=0
for sel in "$@"; do
  if [ "$sel" = "BENCH" ]; then break; fi
  if [[ "$sel" == tests/*" -k "* ]]; then target="${sel%% -k *}"; filter="${sel#* -k }"
  elif [[ "$sel" == tests/* ]]; then target="$sel"; filter=""
  else target=tests/test_decode_gluon.py; filter="$sel"; fi
  (timeout ${TEST_TIMEOUT:-0} python -m pytest -q -rA -p no:logging -p no:cacheprovider $target -k "$filter" > $OUT/t$i.log 2>&1
   last=$(tail -1 $OUT/t$i.log)
   # a -k filter that matches no test id (e.g. a dtype by name: the ids number them, dtype0 / dtype1) ends in
   # "N deselected" alone; say so, or a call's tests look run when none were (session 33, call 2)
   if [[ "$last" == *deselected* && "$last" != *passed* && "$last" != *failed* && "$last" != *error* ]]; then
     last="NO TEST SELECTED: $last"; fi
   echo "== [$sel] $last") &
  i=$((i+1))
done
wait
for f in $OUT/t*.log; do grep -E "^(FAILED|E  )" $f | head -20; done
seen=0
for arg in "$@"; do
  if [ $seen = 1 ]; then echo "== $arg"; eval "$arg"; fi
  if [ "$arg" = "BENCH" ]; then seen=1; fi
done
