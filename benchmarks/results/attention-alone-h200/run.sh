#!/usr/bin/env bash
# The ten rounds of README.md, one after the other; each round's JSON and log go to $OUT
# (default /tmp/attention-alone). Run from the checkout's root on the GPU machine, after
# `source benchmarks/gpu_env.sh` (the rounds need torch, triton and servekit's kernels only).
set -euo pipefail
export OUT=${OUT:-/tmp/attention-alone}
mkdir -p "$OUT"
here=benchmarks/results/attention-alone-h200
for round in attn_micro attn_micro2 attn_micro3 attn_micro4 attn_micro5 attn_micro6 attn_micro7 attn_micro8 attn_micro9 attn_micro10; do
  python3 "$here/$round.py" 2>&1 | tee "$OUT/$round.log"
done
