#!/usr/bin/env bash
# The GPU measurements behind benchmarks/results/*-h100, one step per call of a GPU machine that has
# no registry access (wheels arrive as packs, see benchmarks/gpu_env.sh). Each step writes into
# OUT_DIR/<step> (default: $OUT, else ./gpu-out):
#   source benchmarks/gpu_env.sh .gpu/l1 .gpu/l2      # whatever packs this call carried
#   bash benchmarks/gpu_run.sh llm-inprocess spec serve oom
# Steps: llm-inprocess  SmolLM2 in-process: captured prefill, regional compile, transformers eager
#        spec           train speculator heads (into /opt/spec/heads) and measure them in-process
#        serve          SmolLM2 through TorchServe, plain and with the heads of `spec`
#        oom            a real CUDA out-of-memory error in the LLM handler
#        plans-ready    MiniLM worker-ready time, cold and with the compile cache
#        sweep          the MiniLM auto-benchmark (benchmarks/sweeps/minilm-gpu.yaml)
#        soak           10 minutes of steady MiniLM load: memory growth, errors, latency drift
# The MiniLM steps also need orjson (servekit's embedding handler writes its answers with it) and
# the sweep needs locust, rich, matplotlib and nvidia-ml-py: carry their wheels too.
set -uo pipefail
out=${OUT_DIR:-${OUT:-gpu-out}}
heads=${SPEC_HEADS:-/opt/spec/heads}
steps=" llm-inprocess spec serve oom plans-ready sweep soak "
for step in "$@"; do
  [[ $steps == *" $step "* ]] || { echo "unknown step: $step (see the header of $0)" >&2; exit 2; }
done
for step in "$@"; do
  mkdir -p "$out/$step"
  echo "== $step -> $out/$step"
  case $step in
    llm-inprocess) python3 -m servekit.benchmarks.llm_inprocess --out "$out/$step" --variants graphs-prefill compile-graphs hf-eager --repeats 3 ;;
    spec) python3 -m servekit.benchmarks.spec_bench --out "$(dirname "$heads")" --max-train-seconds 150 --train-topic-prompts 8000 \
            --batches 1 --rows 16 --fp32-check off \
            && cp "$(dirname "$heads")"/spec_bench.* "$out/$step/" ;;
    serve) python3 -m servekit.benchmarks.llm_serve_bench --out "$out/$step" --speculator "$heads" --rounds 4 ;;
    oom) python3 -m servekit.benchmarks.gpu_oom --out "$out/$step" ;;
    plans-ready) python3 -m servekit.benchmarks.plan_bench ready --out "$out/$step" --plan fp16-compile-graphs ;;
    sweep) python3 -m servekit.benchmarks.bench.runner benchmarks/sweeps/minilm-gpu.yaml --out "$out/$step" ;;
    soak) python3 -m servekit.benchmarks.soak --minutes 10 --out "$out/$step" ;;
  esac || echo "step $step failed (exit $?)" >&2
done
