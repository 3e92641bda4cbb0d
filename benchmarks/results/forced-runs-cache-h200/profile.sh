#!/usr/bin/env bash
# The served structured benchmark (all constrained, then free at matched lengths) with py-spy on the
# engine process and the TorchServe worker during each mix (run from a checkout on the GPU machine,
# after sourcing benchmarks/gpu_env.sh): bash benchmarks/results/forced-runs-cache-h200/profile.sh
set -u
out=$OUT/prof; mkdir -p $out
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $out/gpu.txt 2>&1
python3 -m servekit.benchmarks.structured_bench --out $out/bench --concurrency 32 --prompts 1 \
  --ttft-requests 3 --first-use 1 --rounds ${ROUNDS:-40} --mixes constrained matched > $out/bench.log 2>&1 &
bench=$!
wait_for() { for i in $(seq 1 3000); do grep -q "$1" $out/bench.log && return 0; kill -0 $bench 2>/dev/null || return 1; sleep 0.1; done; return 1; }
rec() {  # name duration
  eng=$(pgrep -f "engine_process import main" | head -1); wrk=$(pgrep -f model_service_worker | head -1)
  echo "$1: engine $eng worker $wrk" >> $out/pids.txt
  py-spy record -p $eng -r 200 -d $2 --threads --idle --nonblocking --format raw -o $out/$1-engine.txt > $out/$1-engine.log 2>&1 &
  p1=$!
  py-spy record -p $wrk -r 200 -d $2 --threads --idle --nonblocking --format raw -o $out/$1-worker.txt > $out/$1-worker.log 2>&1 &
  wait $p1 $!  # not a bare wait: that would wait for the benchmark too
}
wait_for "== TTFT" && sleep 1 && rec constrained ${D1:-6}
wait_for "mixed, all constrained" && sleep 1 && rec matched ${D2:-5}
wait $bench; echo "bench rc $?" >> $out/bench.log
tail -5 $out/bench.log
