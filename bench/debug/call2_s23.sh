#!/bin/bash
# session 23, call 2: kvquant-4 end to end with the codes' TMA ring (the default now), then the kernel's variants
python bench/bench_generate.py --layers 8 --gpu-time --shapes 32x4096,8x8192 --presets kvquant-4 --baselines "" \
  --out $OUT/gen_kvquant.json 2>&1 | grep -v Warning
for v in "C2|dag.LUT_TMA_ROPE = False" "C128|dag.LUT_MAXNREG = 128" "CNST3|dag.NSTAGES = 3" \
         "D2|dag.LUT_TMA_ROPE = True; dag.LUT_MAXNREG = 128"; do
  name=${v%%|*}; flags=${v#*|}
  python bench/debug/with_flags.py "$flags" bench/bench_decode_attention.py --presets kvquant-4 --mask bool \
    --out $OUT/bda_$name.json 2>&1 | grep -v "^relative\|^device"
done
