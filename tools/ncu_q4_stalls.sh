#!/usr/bin/env bash
# Nsight Compute's stall reasons of chosen CUDA 4-bit GEMV configs (M = 1, Qwen3-8B shapes, L2 flushed by ncu):
# time, DRAM and SM utilisation, achieved warps, issue rate, instructions and the per-issue stall cycles by reason.
#
#     bash tools/ncu_q4_stalls.sh qkv:5,8,11 gate_up:6,12 down:6,8    # SHAPE:configs (cuda_q4_mma.CONFIGS indices)
#
# Runs tools/probe_q4_kernel.py under ncu once per shape; needs ncu on PATH (or under /usr/local/cuda*/bin).
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,sm__cycles_active.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active
M=$M,smsp__issue_active.avg.per_cycle_active,smsp__inst_executed.sum,launch__grid_size,launch__registers_per_thread
for r in long_scoreboard short_scoreboard barrier wait math_pipe_throttle mio_throttle lg_throttle not_selected \
         selected no_instruction membar sleeping dispatch_stall imc_miss branch_resolving tex_throttle drain; do
  M=$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
done
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for spec in "$@"; do
  shape=${spec%%:*}
  cfgs=${spec#*:}
  "$NCU" --clock-control none --kernel-name regex:q4_mma --metrics "$M" \
    python3 "$(dirname "$0")/probe_q4_kernel.py" --shape "$shape" --rows 1 --kernel mma --configs "$cfgs" --calls 1 \
    2>&1 | grep -v "^==PROF=="
done
