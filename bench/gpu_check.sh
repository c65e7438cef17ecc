#!/usr/bin/env bash
# The GPU check, prepared to run in a few minutes on a machine with one CUDA GPU (one GPU cannot host two NCCL ranks,
# so everything here is single-rank):
#   1. the model and its layers on CUDA: short single-rank runs of the tiny MoE and dense recipes in bf16;
#   2. the planner's calibration for this GPU type (docs/planner.md): Qwen3-30B-A3B's model cut to one GPU (every
#      expert local, 8 micro-batches of 1 x 4096 tokens, at 2 and at 4 layers; `overlap plan --calibrate`), the
#      layers' measured compute efficiency written with the type's published figures to bench/results/cluster_GPU.json;
#   3. the MoE guide's plan (EP16 on two nodes of 8) on that profile, with every overlap switch off and on.
# Usage: bash bench/gpu_check.sh [GPU]   GPU: the -g name of this machine's GPU type (default h100; an H200 has the
# H100's dense BF16 peak and NVLink, and the harness knows it as h100).
set -euo pipefail
gpu=${1:-h100}
out=bench/results
overlap run -m qwen -mr qwen3_moe_tiny -g "$gpu" -ng 1 -ms 5 -c bf16
overlap run -m qwen -mr dense_tiny -g "$gpu" -ng 1 -ms 5 -c bf16
overlap plan -m qwen -mr qwen3_30b_a3b -g "$gpu" -ng 16 -ep 16 -c bf16 --calibrate --cluster "$out/cluster_$gpu.json" \
  --json "$out/plan_qwen3_30b_a3b_$gpu.json" --markdown "$out/plan_qwen3_30b_a3b_$gpu.md"
