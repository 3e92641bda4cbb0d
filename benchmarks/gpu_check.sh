#!/usr/bin/env bash
# GPU check of the runtime after a change to it (a check, not figures: short runs), one step per
# call, logs into OUT_DIR (default: $OUT, else ./gpu-out), after `source benchmarks/gpu_env.sh ...`:
#   bash benchmarks/gpu_check.sh tests spec      # then, in the next call: bash benchmarks/gpu_check.sh serve
# Steps: tests  the CUDA-only tests (captured and compiled steps, speculative verify graphs vs eager)
#        spec   SmolLM2 speculator heads trained briefly and measured in-process (into /opt/gpucheck)
#        serve  SmolLM2 through TorchServe with and without the heads of `spec`
#        openai the openai SDK's models / multi-turn / logprobs / n / penalties on the GPU plan
set -uo pipefail
out=${OUT_DIR:-${OUT:-gpu-out}}
work=/opt/gpucheck
mkdir -p "$out" "$work"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"
for step in "$@"; do
  case $step in
    tests) timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_generate_cuda.py 2>&1 | tail -15 \
             | tee "$out/cuda-tests.log" ;;
    spec) timeout 420 python3 -m servekit.benchmarks.spec_bench --out "$work/spec" --max-train-seconds 45 \
            --train-topic-prompts 0 --batches 1 4 --rows 8 --new-tokens 64 --fp32-check off 2>&1 | tail -25 \
            | tee "$out/spec.log"; cp "$work"/spec/spec_bench.* "$out/" 2>/dev/null ;;
    serve) timeout 560 python3 -m servekit.benchmarks.llm_serve_bench --out "$work/serve" \
             --speculator "$work/spec/heads" --concurrency 1 4 --rounds 1 --max-tokens 128 2>&1 | tail -30 \
             | tee "$out/serve.log"; cp "$work"/serve/llm_serve_bench.* "$out/" 2>/dev/null ;;
    openai) timeout 560 python3 -m servekit.benchmarks.openai_check --out "$out/openai" 2>&1 | tail -15 \
              | tee "$out/openai.log" ;;
    *) echo "unknown step: $step (see the header of $0)" >&2; exit 2 ;;
  esac
done
