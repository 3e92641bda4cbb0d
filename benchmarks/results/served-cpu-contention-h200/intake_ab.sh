#!/usr/bin/env bash
# Split steps admitting the requests that arrived since the step began (the code: the engine
# thread's intake, called midway) against admitting only what the step found at its start (the
# code before), one fresh TorchServe per NAME:MODE in the order given (MODE new or old; old sets
# SK_INTAKE=0, read by a patch of this checkout, not in the code), each with ttft-trace.diff's
# trace and trace_stages.py's stages. From a copy of the checkout's root on the GPU machine (the
# patches edit it), OUT set:
#   bash benchmarks/results/served-cpu-contention-h200/intake_ab.sh new1:new old1:old
source benchmarks/gpu_env.sh >/dev/null 2>&1
here=benchmarks/results/served-cpu-contention-h200
file=optimizations/llm/continuous.py
patch -p1 < $here/ttft-trace.diff >/dev/null || exit 1
sed -i 's/^                if self.intake is not None:$/                if self.intake is not None and __import__("os").environ.get("SK_INTAKE", "1") == "1":/' $file
grep -q SK_INTAKE $file || { echo "the switch did not apply to $file" >&2; exit 1; }
for v in "$@"; do
  name=${v%%:*}; mode=${v#*:}; d=$OUT/$name; mkdir -p $d; rm -rf /tmp/trace
  echo "== $name $mode $(date +%T)" | tee -a $OUT/console.log
  env SK_INTAKE=$([ "$mode" = old ] && echo 0 || echo 1) timeout 280 python3 -m servekit.benchmarks.structured_bench \
    --out /tmp/sb/$name --concurrency 32 --prompts 1 --ttft-requests 3 --first-use 1 --rounds ${ROUNDS:-120} \
    --mixes constrained matched --load streams > $d/bench.log 2>&1
  grep -E "mixed|valid|Streams" $d/bench.log | tee -a $OUT/console.log
  python3 $here/trace_stages.py /tmp/trace ${LAST:-3000} | tee $d/stages.txt | tee -a $OUT/console.log
  cat /tmp/trace/*.jsonl | gzip > $d/marks.jsonl.gz
done
