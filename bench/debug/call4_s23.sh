#!/bin/bash
# session 23, call 4: calibquant-1 with its codes through the TMA ring against plain loads (two rounds), then end to end
for r in 1 2; do
  for v in "tma|dag.POST_TMA = True" "plain|dag.POST_TMA = False"; do
    name=${v%%|*}; flags=${v#*|}
    python bench/debug/with_flags.py "$flags" bench/bench_decode_attention.py --presets calibquant-1 --mask bool \
      --out $OUT/bda_post_${name}_r$r.json 2>&1 | grep -v "^relative\|^device"
  done
done
python bench/bench_generate.py --layers 8 --gpu-time --shapes 32x4096,8x8192 --presets calibquant-1 --baselines "" \
  --out $OUT/gen_calibquant.json 2>&1 | grep -v "arn"
