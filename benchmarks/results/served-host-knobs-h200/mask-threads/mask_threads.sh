#!/bin/bash
# llguidance's mask-fill threads (SK_MASK_THREADS), patched into this checkout's grammar.py
# (_executor), then one fresh TorchServe per NAME:VALUE, served structured streams:
#   bash benchmarks/results/served-host-knobs-h200/mask-threads/mask_threads.sh t8a:8 t4a:4 t2a:2
# From a copy of the checkout's root (the patch edits it), with OUT set to the folder for the results.
source benchmarks/gpu_env.sh >/dev/null 2>&1
sed -i 's|    threads = min(8, (os.cpu_count() or 1) // 2)|    threads = int(os.environ.get("SK_MASK_THREADS", min(8, (os.cpu_count() or 1) // 2)))|' optimizations/llm/grammar.py
grep -c SK_MASK_THREADS optimizations/llm/grammar.py
mkdir -p $OUT/mt
for v in "$@"; do
  name=${v%%:*}; val=${v#*:}
  echo "== $name SK_MASK_THREADS=$val $(date +%T)" | tee -a $OUT/mt/console.log
  SK_MASK_THREADS=$val timeout 250 python3 -m servekit.benchmarks.structured_bench --out /tmp/mt/$name --concurrency 32 --prompts 1 \
    --ttft-requests 3 --first-use 1 --rounds 20 --mixes constrained matched --load streams 2>&1 | grep -E "mixed|Error|error" | tee -a $OUT/mt/console.log
  cp /tmp/mt/$name/structured_bench.json $OUT/mt/$name.json 2>/dev/null
done
