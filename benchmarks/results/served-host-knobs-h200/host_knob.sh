#!/bin/bash
# One host setting of the engine read from an environment variable (a patch of this checkout, not
# in the code), then one fresh TorchServe per NAME:VALUE, served structured streams:
#   bash benchmarks/results/served-host-knobs-h200/host_knob.sh switch a1:0.0005 b1:0.005 c1:0.00005
#   bash benchmarks/results/served-host-knobs-h200/host_knob.sh threads t8a:8 t4a:4 t2a:2
# switch: the engine process's GIL switch interval in seconds (SK_SWITCH, continuous.EngineThread);
# threads: llguidance's mask-fill threads (SK_MASK_THREADS, grammar._executor).
# From a copy of the checkout's root (the patch edits it), with OUT set to the folder for the results.
source benchmarks/gpu_env.sh >/dev/null 2>&1
knob=$1; shift
case $knob in
  switch) var=SK_SWITCH; file=optimizations/llm/continuous.py
    sed -i 's/sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))/sys.setswitchinterval(float(__import__("os").environ.get("SK_SWITCH", "0.0005")))/' $file ;;
  threads) var=SK_MASK_THREADS; file=optimizations/llm/grammar.py
    sed -i 's|    threads = min(8, (os.cpu_count() or 1) // 2)|    threads = int(os.environ.get("SK_MASK_THREADS", min(8, (os.cpu_count() or 1) // 2)))|' $file ;;
  *) echo "usage: host_knob.sh switch|threads NAME:VALUE ..." >&2; exit 2 ;;
esac
grep -q $var $file || { echo "the patch did not apply to $file" >&2; exit 1; }
mkdir -p $OUT/$knob
for v in "$@"; do
  name=${v%%:*}; val=${v#*:}
  echo "== $name $var=$val $(date +%T)" | tee -a $OUT/$knob/console.log
  env $var=$val timeout 250 python3 -m servekit.benchmarks.structured_bench --out /tmp/$knob/$name --concurrency 32 \
    --prompts 1 --ttft-requests 3 --first-use 1 --rounds 20 --mixes constrained matched --load streams 2>&1 \
    | grep -E "mixed|TTFT|valid|Error|error" | tee -a $OUT/$knob/console.log
  cp /tmp/$knob/$name/structured_bench.json $OUT/$knob/$name.json 2>/dev/null
done
