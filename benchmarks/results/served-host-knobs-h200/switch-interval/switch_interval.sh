#!/bin/bash
# The engine process's GIL switch interval (SK_SWITCH, seconds), patched into this checkout's
# continuous.py (EngineThread sets it), then one fresh TorchServe per NAME:VALUE, served structured streams:
#   bash benchmarks/results/served-host-knobs-h200/switch-interval/switch_interval.sh a1:0.0005 b1:0.005 c1:0.00005
# From a copy of the checkout's root (the patch edits it), with OUT set to the folder for the results.
source benchmarks/gpu_env.sh >/dev/null 2>&1
sed -i 's/sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))/sys.setswitchinterval(float(__import__("os").environ.get("SK_SWITCH", "0.0005")))/' optimizations/llm/continuous.py
grep -c SK_SWITCH optimizations/llm/continuous.py
mkdir -p $OUT/sw
for v in "$@"; do
  name=${v%%:*}; val=${v#*:}
  echo "== $name SK_SWITCH=$val $(date +%T)" | tee -a $OUT/sw/console.log
  SK_SWITCH=$val timeout 250 python3 -m servekit.benchmarks.structured_bench --out /tmp/sw/$name --concurrency 32 --prompts 1 \
    --ttft-requests 3 --first-use 1 --rounds 20 --mixes constrained matched --load streams 2>&1 | grep -E "mixed|TTFT|valid|Error|error" | tee -a $OUT/sw/console.log
  cp /tmp/sw/$name/structured_bench.json $OUT/sw/$name.json 2>/dev/null
done
