#!/bin/bash
# Served structured streams with split steps launching first (the engine's rule) and reading
# first, one fresh TorchServe per NAME:MS, in the order given; MS is the forward time below which
# split steps launch first (LAUNCH_FIRST_BELOW_MS, read from SK_LAUNCH_FIRST_BELOW_MS by a patch of
# this checkout, not in the code; 0: always read first):
#   bash benchmarks/results/constrained-device-time-h200/served_ab.sh new1:2.0 read1:0 read2:0 new2:2.0
# With rule-variant.diff applied, from a copy of the checkout's root (the patch edits it), with OUT set to the folder for the results.
source benchmarks/gpu_env.sh >/dev/null 2>&1
file=optimizations/llm/continuous.py
sed -i 's/^LAUNCH_FIRST_BELOW_MS = 2.0$/LAUNCH_FIRST_BELOW_MS = float(__import__("os").environ.get("SK_LAUNCH_FIRST_BELOW_MS", "2.0"))/' $file
grep -q SK_LAUNCH_FIRST_BELOW_MS $file || { echo "the patch did not apply to $file" >&2; exit 1; }
mkdir -p $OUT/served
for v in "$@"; do
  name=${v%%:*}; val=${v#*:}
  echo "== $name SK_LAUNCH_FIRST_BELOW_MS=$val $(date +%T)" | tee -a $OUT/served/console.log
  env SK_LAUNCH_FIRST_BELOW_MS=$val timeout 250 python3 -m servekit.benchmarks.structured_bench --out /tmp/served/$name \
    --concurrency 32 --prompts 1 --ttft-requests 3 --first-use 1 --rounds 20 --mixes constrained matched \
    --load streams 2>&1 | grep -E "mixed|TTFT|valid|Error|error" | tee -a $OUT/served/console.log
  cp /tmp/served/$name/structured_bench.json $OUT/served/$name.json 2>/dev/null
done
