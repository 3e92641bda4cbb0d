#!/usr/bin/env bash
# The served structured benchmark (32 closed-loop streams: all constrained, then free answers of
# the constrained answers' lengths) with ttft-trace.diff applied, then where each kind's time to
# first token went (trace_stages.py). From a copy of the checkout's root on the GPU machine (the
# patch edits it), OUT set:
#   bash benchmarks/results/served-cpu-contention-h200/trace.sh
source benchmarks/gpu_env.sh >/dev/null 2>&1
here=benchmarks/results/served-cpu-contention-h200
patch -p1 < $here/ttft-trace.diff || exit 1
d=$OUT/trace; mkdir -p $d; rm -rf /tmp/trace
timeout 280 python3 -m servekit.benchmarks.structured_bench --out /tmp/sb/trace --concurrency 32 --prompts 1 \
  --ttft-requests 3 --first-use 1 --rounds ${ROUNDS:-120} --mixes constrained matched --load streams > $d/bench.log 2>&1
grep -E "mixed|valid|Streams" $d/bench.log
python3 $here/trace_stages.py /tmp/trace ${LAST:-3000} | tee $d/stages.txt
cp /tmp/trace/stages.json $d/; cat /tmp/trace/*.jsonl | gzip > $d/marks.jsonl.gz
cp /tmp/sb/trace/structured_bench.json $d/ 2>/dev/null
