#!/usr/bin/env bash
# The served structured benchmark under closed-loop streams (all constrained, then free at matched
# lengths) with py-spy on the engine process during each mix, every thread, idle samples included
# (run from a checkout on the GPU machine, after sourcing benchmarks/gpu_env.sh):
#   bash benchmarks/results/constrained-device-time-h200/served_profile.sh
set -u
out=$OUT/profile; mkdir -p $out
python3 -m servekit.benchmarks.structured_bench --out $out/bench --concurrency 32 --prompts 1 \
  --ttft-requests 3 --first-use 1 --rounds ${ROUNDS:-40} --mixes constrained matched --load streams > $out/bench.log 2>&1 &
bench=$!
wait_for() { for i in $(seq 1 3000); do grep -q "$1" $out/bench.log && return 0; kill -0 $bench 2>/dev/null || return 1; sleep 0.1; done; return 1; }
rec() {  # name duration
  eng=$(pgrep -f "engine_process import main" | head -1)
  py-spy record -p $eng -r 200 -d $2 --threads --idle --nonblocking --format raw -o $out/$1-engine.txt > $out/$1-engine.log 2>&1
}
wait_for "== TTFT" && sleep 1 && rec constrained ${D1:-4}
wait_for "mixed, all constrained" && sleep 1 && rec matched ${D2:-3}
wait $bench; echo "bench rc $?" >> $out/bench.log
gzip $out/*-engine.txt
grep -E "mixed|valid" $out/bench.log
