#!/bin/bash
# session 23, call 1: kvquant-4's kernel with the TMA ring (codes, RoPE rows) against plain loads, bool mask
for v in "B|dag.LUT_TMA_ROPE = True" "A|dag.USE_TMA = False" "D|dag.LUT_MAXNREG = 128" "C|dag.LUT_TMA_ROPE = False" \
         "F|dag.LUT_MAXNREG = None" "E|dag.LUT_RNST = 2"; do
  name=${v%%|*}; flags=${v#*|}
  python bench/debug/with_flags.py "$flags" bench/bench_decode_attention.py --presets kvquant-4 --mask bool \
    --out $OUT/bda_$name.json 2>&1 | grep -v "^relative\|^device" 
done
