#!/usr/bin/env bash
# Alternate two commits' decode kernels (optimizations/kernels/triton_decode.py) in this checkout and
# time SmolLM2's decode step with each, in a process of its own per run; the checkout's own file is
# put back at the end. Run from the checkout's root on the GPU machine, after
# `source benchmarks/gpu_env.sh <packs>` (the benchmark imports the LLM engine: llguidance, jsonschema).
#   bash benchmarks/results/attention-by-warp-h200/run.sh BEFORE AFTER "ORDER" "KV_BUCKETS" "BATCHES" TAG
#   e.g. run.sh 01fc439 HEAD "before after" "2048 8192" "32 1" r1
set -euo pipefail
before=$1 after=$2 order=$3 kvs=$4 batches=$5 tag=$6
export OUT=${OUT:-/tmp/attention-by-warp}
mkdir -p "$OUT"
kernels=optimizations/kernels/triton_decode.py
saved=$(mktemp) && cp "$kernels" "$saved"
trap 'cp "$saved" "$kernels"' EXIT
for code in $order; do
  rev=$before; [ "$code" = after ] && rev=$after
  git show "$rev:$kernels" > "$kernels"
  for kv in $kvs; do
    d=$OUT/$tag-$code-kv$kv
    TRITON_PRINT_AUTOTUNING=1 python3 -m servekit.benchmarks.decode_kernels --out "$d" --models smollm2-135m \
      --variants triton --repeats 3 --batches $batches --kv-len "$kv" > "$d.log" 2>&1
    echo "$tag $code kv$kv: $(grep -h '| triton |' "$d/decode_kernels.md" | cut -d'|' -f3,5 | tr '\n' ' ') picks:" \
      "$(grep -h -A4 'Triton autotuning for function _attention_kernel' "$d.log" | grep -o 'BLOCK_S: [0-9]*, WARPS: [0-9]*' | sort | uniq -c | tr '\n' ' ')"
  done
done
