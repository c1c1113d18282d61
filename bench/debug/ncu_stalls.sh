#!/bin/bash
# Where the KIVI-layout Gluon kernel's warps stall (Nsight Compute on the device, one launch per spec): the details
# page (scheduler and warp-state statistics, pipe utilization, memory) and the per-SASS-instruction source page with
# its stall samples, as CSV, into $OUT/<name>_details.txt and $OUT/<name>_sass.csv; read them with
# bench/debug/ncu_stalls.py.   usage: bash bench/debug/ncu_stalls.sh kivi-2:32x16384:tma [more specs]
# KERNEL and SCRIPT pick another kernel and its driver, e.g. the append's (session 39):
#   KERNEL=_append_kernel SCRIPT=bench/ncu_append.py bash bench/debug/ncu_stalls.sh kivi-2:32x4096:16:2
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
ln -sfn $PWD/passes kvq_compile/passes
ln -sfn $PWD/templates kvq_compile/templates
ncu --version | tail -1
for spec in "$@"; do
  name=$(echo "$spec" | tr ':' '_')
  ncu --clock-control none -k regex:${KERNEL:-_kivi_decode_kernel} -c 1 --launch-skip 1 \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats \
      --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section InstructionStats --section SourceCounters \
      --export $OUT/$name --force-overwrite python ${SCRIPT:-bench/ncu_decode.py} "$spec" > $OUT/${name}_run.log 2>&1
  tail -3 $OUT/${name}_run.log
  ncu --import $OUT/$name.ncu-rep --page details > $OUT/${name}_details.txt 2>&1
  ncu --import $OUT/$name.ncu-rep --page source --csv --print-source sass > $OUT/${name}_sass.csv 2>&1
  ls -la $OUT/${name}_*; head -c 600 $OUT/${name}_sass.csv; echo
  rm -f $OUT/$name.ncu-rep
done
