#!/bin/bash
# session 23, call 5: calibquant-1 end to end at (32, 4096), its codes through the TMA ring against plain loads
for r in 1 2; do
  for v in "tma|dag.POST_TMA = True" "plain|dag.POST_TMA = False"; do
    name=${v%%|*}; flags=${v#*|}
    python bench/debug/with_flags.py "$flags" bench/bench_generate.py --layers 8 --gpu-time --shapes 32x4096 \
      --presets calibquant-1 --baselines "" --out $OUT/gen_post_${name}_r$r.json 2>&1 | grep -v "arn\|autotuned"
  done
done
