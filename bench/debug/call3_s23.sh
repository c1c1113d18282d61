#!/bin/bash
# session 23, call 3: kvquant-4 end to end again; the codes' TMA ring against plain loads without a mask and with
# outliers (kvquant-4-1%)
python bench/bench_generate.py --layers 8 --gpu-time --shapes 32x4096,8x8192 --presets kvquant-4 --baselines "" \
  --out $OUT/gen_kvquant_r2.json 2>&1 | grep -v "arn"
for v in "tma|dag.USE_TMA = None" "plain|dag.USE_TMA = False"; do
  name=${v%%|*}; flags=${v#*|}
  for m in none bool; do
    python bench/debug/with_flags.py "$flags" bench/bench_decode_attention.py --presets kvquant-4,kvquant-4-1% \
      --mask $m --out $OUT/bda_${name}_$m.json 2>&1 | grep -v "^relative\|^device"
  done
done
