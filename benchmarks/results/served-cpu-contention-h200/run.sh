#!/usr/bin/env bash
# The served structured benchmark (32 closed-loop streams, all constrained, then free answers of
# the constrained answers' lengths), one fresh TorchServe per NAME:MODE in the order given, with
# threads.py sampling every thread on the host for SECS seconds inside each mix. MODE "plain": as
# shipped; "pin": once the server is warm, the engine thread (comm servekit-engine) gets CPU 15 to
# itself and every other thread on the host CPUs 0-14 (a diagnostic, not in the code). From the
# checkout's root on the GPU machine, OUT set:
#   bash benchmarks/results/served-cpu-contention-h200/run.sh p1:plain n1:pin
source benchmarks/gpu_env.sh >/dev/null 2>&1
here=benchmarks/results/served-cpu-contention-h200
last=$(( $(nproc) - 1 ))
pin() {  # the engine thread alone on the last CPU, everything else off it
  python3 - "$last" <<'PY'
import os, sys
last = int(sys.argv[1]); rest = set(range(last)); n = 0
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            comm = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            try:
                os.sched_setaffinity(int(tid), {last} if comm == "servekit-engine" else rest); n += 1
            except OSError:
                pass  # kernel threads bound to their CPU
    except FileNotFoundError:
        pass
print(f"pinned: {n} threads", flush=True)
PY
}
for v in "$@"; do
  name=${v%%:*}; mode=${v#*:}; d=$OUT/$name; mkdir -p $d
  echo "== $name $mode $(date +%T)" | tee -a $OUT/console.log
  taskset -pc 0-$last $$ >/dev/null
  timeout 280 python3 -m servekit.benchmarks.structured_bench --out /tmp/sb/$name --concurrency 32 --prompts 1 \
    --ttft-requests 3 --first-use 1 --rounds ${ROUNDS:-120} --mixes constrained matched --load streams > $d/bench.log 2>&1 &
  bench=$!
  wait_for() { for i in $(seq 1 2500); do grep -q "$1" $d/bench.log && return 0; kill -0 $bench 2>/dev/null || return 1; sleep 0.1; done; return 1; }
  if wait_for "== TTFT"; then
    [ "$mode" = pin ] && pin | tee -a $OUT/console.log
    sleep 1; python3 $here/threads.py ${SECS:-5} $d/constrained-threads.json > $d/constrained-threads.txt
  fi
  wait_for "mixed, all constrained" && sleep 1 && python3 $here/threads.py ${SECS2:-4} $d/matched-threads.json > $d/matched-threads.txt
  wait $bench
  grep -E "mixed|valid|Streams" $d/bench.log | tee -a $OUT/console.log
  head -8 $d/constrained-threads.txt | tee -a $OUT/console.log
  cp /tmp/sb/$name/structured_bench.json $d/ 2>/dev/null
done
