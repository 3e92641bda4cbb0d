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
#        shaped         model folders in real shapes, random weights (benchmarks/shaped_models.py) into shaped/
#        families-cuda  the CUDA tests of every decoder and encoder family (compile, CUDA graphs, bf16/fp16)
#        encoder-plans  the BERT-base-shaped encoder in-process: servekit's encoder vs transformers' (after shaped)
#        byom-sweep     the BERT-base-shaped encoder through TorchServe (benchmarks/sweeps/bert-base-gpu.yaml)
#        byom-llm       the Qwen2.5-0.5B-shaped decoder through TorchServe under continuous batching
#        spec-cb        SmolLM2 heads trained for 150 s (into /opt/spec/heads), then served inside the continuous batch
#        decode-steps   SmolLM2 and the Qwen2.5-0.5B shape in-process, batch 1, 8 and 32 (after shaped)
#        bulk           the bulk-embedding sweep (benchmarks/sweeps/minilm-gpu-bulk.yaml)
#        llm-workload   SmolLM2 served, shipped config, every prompt set (benchmarks/llm_workload_bench.py)
#        llm-split      where SmolLM2's batch-1 TTFT and 32-stream time go: the same requests through the engine
#                       in-process (host ms per engine phase) and served (the handler's own TTFT beside the client's)
#        llm-plan-keys  SmolLM2 served with the shipped config but other values of its keys, one served
#                       run per variant of $LLM_VARIANTS (default "max_num_batched_tokens=4096"; a variant is
#                       key=value[,key=value]: a key the config has at its top level, such as maxBatchDelay, is
#                       set there, any other in its servekit: plan): the measures of $LLM_MEASURES (default
#                       "ttft prefill streams": batch-1 TTFT, prefill throughput, 32 streams) of short and passages
#        llm-sweep      the LLM goodput sweep on the mixed prompt set (benchmarks/sweeps/smollm2-gpu.yaml)
#        llm-shapes     the Qwen2.5-0.5B and Gemma-3-270M shapes served (built into shaped/ when missing):
#                       batch 1 (with its share of the bandwidth bound) and 32 streams
#        llm-shapes-8b  the same for the Llama-3.1-8B shape (16 GB of weights: a step of its own; serving it holds
#                       the weights three times, 63 GB of the H100 machine's disk in use; benchmarks/results/llm-8b-h100/
#                       ran it with that folder's model-config, whose warm-up fits the call)
#        llm-8b-inprocess  the Llama-3.1-8B shape through the engine in-process (no archive: 16 GB of disk), with
#                       benchmarks/results/llm-8b-h100/model-config.yaml: batch 1 (share of the bandwidth bound),
#                       600-token TTFT, 32 streams; the shape's build and the run are two calls (each under 10 min)
# Each LLM step is capped by `timeout` below the 10-minute call and tees its log into its folder.
# The MiniLM steps also need orjson (servekit's embedding handler writes its answers with it) and
# the sweep needs locust, rich, matplotlib and nvidia-ml-py: carry their wheels too.
set -uo pipefail
out=${OUT_DIR:-${OUT:-gpu-out}}
heads=${SPEC_HEADS:-/opt/spec/heads}
steps=" llm-inprocess spec serve oom plans-ready sweep soak shaped families-cuda encoder-plans byom-sweep byom-llm spec-cb decode-steps bulk llm-workload llm-split llm-plan-keys llm-sweep llm-shapes llm-shapes-8b llm-8b-inprocess "
for step in "$@"; do
  [[ $steps == *" $step "* ]] || { echo "unknown step: $step (see the header of $0)" >&2; exit 2; }
done
for step in "$@"; do
  mkdir -p "$out/$step"
  echo "== $step -> $out/$step"
  case $step in
    llm-inprocess) python3 -m servekit.benchmarks.llm_inprocess --out "$out/$step" --variants graphs compile-graphs hf-eager --repeats 3 ;;
    spec) python3 -m servekit.benchmarks.spec_bench --out "$(dirname "$heads")" --max-train-seconds 150 --train-topic-prompts 8000 \
            --batches 1 --rows 16 --fp32-check off \
            && cp "$(dirname "$heads")"/spec_bench.* "$out/$step/" ;;
    serve) python3 -m servekit.benchmarks.llm_serve_bench --out "$out/$step" --speculator "$heads" --rounds 4 ;;
    oom) python3 -m servekit.benchmarks.gpu_oom --out "$out/$step" ;;
    plans-ready) python3 -m servekit.benchmarks.plan_bench ready --out "$out/$step" --plan fp16-compile-graphs ;;
    sweep) python3 -m servekit.benchmarks.bench.runner benchmarks/sweeps/minilm-gpu.yaml --out "$out/$step" ;;
    soak) python3 -m servekit.benchmarks.soak --minutes 10 --out "$out/$step" ;;
    shaped) python3 -m servekit.benchmarks.shaped_models --out shaped --models bert-base ms-marco-minilm-l6 \
              bert-base-classifier qwen2.5-0.5b ;;
    families-cuda) python3 -m pytest -q -p no:cacheprovider tests/test_decoder_families_cuda.py \
                     tests/test_embedding_architectures_cuda.py 2>&1 | tail -25 ;;
    encoder-plans) python3 -m servekit.benchmarks.plan_bench run --out "$out/$step" --model-dir shaped/bert-base \
                     --plans fp16-eager fp16-compile-graphs transformers-fp16-eager transformers-fp16-compile-graphs \
                     --batch-sizes 1 8 32 64 --seq-lens 32 128 512 --iters 20 ;;
    byom-sweep) python3 -m servekit.benchmarks.bench.runner benchmarks/sweeps/bert-base-gpu.yaml --out "$out/$step" ;;
    byom-llm) python3 -m servekit.benchmarks.llm_continuous_bench --out "$out/$step" --model shaped/qwen2.5-0.5b \
                --variants continuous --rounds 2 ;;
    spec-cb) python3 -m servekit.optimizations.training.train_speculator --out "$heads" --topic-prompts 3000 \
               --max-train-seconds 150 --draft-vocab 8192 && cp "$heads"/*.json "$out/$step/" \
             && python3 -m servekit.benchmarks.llm_continuous_bench --out "$out/$step" --variants continuous-spec \
               --speculator "$heads" --solo 5 --concurrency 32 --rounds 2 ;;
    decode-steps) python3 -m servekit.benchmarks.llm_inprocess --out "$out/$step/smollm2" --variants compile-graphs \
                    --batches 1 8 32 --new-tokens 128 --repeats 3 \
                  && python3 -m servekit.benchmarks.llm_inprocess --out "$out/$step/qwen2.5-0.5b" \
                    --model-dir shaped/qwen2.5-0.5b --variants compile-graphs --batches 1 8 32 --new-tokens 128 --repeats 3 ;;
    bulk) python3 -m servekit.benchmarks.bench.runner benchmarks/sweeps/minilm-gpu-bulk.yaml --out "$out/$step" ;;
    llm-workload) timeout 520 python3 -m servekit.benchmarks.llm_workload_bench --out "$out/$step" 2>&1 \
                    | tee "$out/$step/log.txt" ;;
    llm-split)
      for how in in-process served; do
        timeout 260 python3 -m servekit.benchmarks.llm_workload_bench --out "$out/$step/$how" $([[ $how == in-process ]] && echo --in-process) \
          --measures ttft batch1 streams followup --sets short passages --lengths 100 600 1900 --ttft-again 2>&1 \
          | tee "$out/$step/$how.log" || echo "llm-split $how failed" >&2
      done ;;
    llm-plan-keys)
      for variant in ${LLM_VARIANTS:-max_num_batched_tokens=4096}; do
        python3 -c "import sys, yaml; c = yaml.safe_load(open('config/models/smollm2.yaml'))
for k, v in (kv.split('=') for kv in sys.argv[1].split(',')): (c if k in c else c['servekit'])[k] = int(v)
yaml.safe_dump(c, sys.stdout)" "$variant" > "$out/$step/${variant//[=,]/-}.yaml"
        timeout 240 python3 -m servekit.benchmarks.llm_workload_bench --out "$out/$step/${variant//[=,]/-}" \
          --config "$out/$step/${variant//[=,]/-}.yaml" --measures ${LLM_MEASURES:-ttft prefill streams} --sets short passages \
          --lengths 600 2>&1 | tee "$out/$step/${variant//[=,]/-}.log" || echo "llm-plan-keys $variant failed" >&2
      done ;;
    llm-sweep) timeout 520 python3 -m servekit.benchmarks.bench.runner benchmarks/sweeps/smollm2-gpu.yaml \
                 --out "$out/$step" 2>&1 | tee "$out/$step/log.txt" ;;
    llm-shapes|llm-shapes-8b)
      # building a shape (once per machine) and serving it stay within the call: 2 x (60 + 200) s; the 8B shape's
      # build (~50 s) and serving (~230 s, with llm-8b-h100's model-config) fit a call each, or one together
      models="qwen2.5-0.5b gemma3-270m"; build=60; cap=200; batch1=8; cfg=()
      [[ $step == llm-shapes-8b ]] && models="llama-3.1-8b" build=180 cap=400 batch1=4 \
        cfg=(--config benchmarks/results/llm-8b-h100/model-config.yaml)
      for m in $models; do
        { [ -f "shaped/$m/tokenizer.json" ] || timeout $build python3 -m servekit.benchmarks.shaped_models --out shaped --models "$m"; } \
          && timeout $cap python3 -m servekit.benchmarks.llm_workload_bench --out "$out/$step/$m" --model-dir "shaped/$m" "${cfg[@]}" \
               --measures ttft batch1 streams --sets short passages --lengths 600 --later 3 --batch1 $batch1 --stream-requests 2 2>&1 \
          | tee "$out/$step/$m.log" || echo "model $m failed" >&2
      done ;;
    llm-8b-inprocess)
      [ -f shaped/llama-3.1-8b/tokenizer.json ] || timeout 300 python3 -m servekit.benchmarks.shaped_models --out shaped --models llama-3.1-8b
      timeout 550 python3 -m servekit.benchmarks.llm_workload_bench --out "$out/$step" --in-process --model-dir shaped/llama-3.1-8b \
        --config benchmarks/results/llm-8b-h100/model-config.yaml --measures ttft batch1 streams --sets short passages \
        --lengths 600 --later 3 --batch1 4 --stream-requests 1 2>&1 | tee "$out/$step/console.log" ;;
  esac || echo "step $step failed (exit $?)" >&2
done
