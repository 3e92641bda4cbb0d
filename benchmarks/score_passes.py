"""In-process time of a cross-encoder's rerank requests on the GPU plan: each captured bucket's
replay time and each request's stages, one process, no TorchServe.

    python -m servekit.benchmarks.shaped_models --out shaped --models ms-marco-minilm-l6
    python -m servekit.benchmarks.score_passes --model-dir shaped/ms-marco-minilm-l6 --out DIR

Requests are TEI `/rerank` bodies of one query and `--documents` documents of about `--doc-tokens`
tokens, every text of the run different (score_tokenize_bench's bodies: runs of the standard
library's docstring prose). Each is run as the score handler runs it: parse, tokenize, then
`ScoreRunner.logits` over the chunks it cuts (padding into buckets, the graphs' replays, the one
copy back), one request after another. Prints the buckets' replay times and the stages' mean and
p99 wall time, and writes `score-passes[-<label>].json` into `--out`. `--profile PAIRSxTOKENS`
also runs torch.profiler over ten passes of that bucket through the plan's forward (compiled, not
replayed: kernels of a replayed graph are not listed one by one) and prints the kernels by GPU time.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

STAGES = ("parse", "tokenize", "forward")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import yaml

    from servekit.benchmarks.score_tokenize_bench import make_bodies
    from servekit.handlers.score_requests import parse_score_request
    from servekit.optimizations.plan import parse_plan
    from servekit.optimizations.score.runner import ScoreRunner
    from servekit.resources import model_config

    torch.set_num_threads(1)  # as a GPU worker runs
    config = Path(args.config) if args.config else model_config("cross-encoder-gpu")
    plan = parse_plan(yaml.safe_load(config.read_text())["servekit"])
    runner = ScoreRunner(Path(args.model_dir), plan)
    bodies = make_bodies(args.warmup + args.requests, args.documents, args.doc_tokens, args.seed,
                         Path(args.model_dir) / "tokenizer.json")
    limits = runner.plan.limits
    wall: dict[str, list[float]] = {s: [] for s in STAGES}
    tokens, padded = [], []
    t_run = time.perf_counter()
    for k, body in enumerate(bodies):
        if k == args.warmup:
            t_run = time.perf_counter()
        t0 = time.perf_counter()
        req = parse_score_request({"body": body}, "rerank", "rerank", limits.max_texts_per_request,
                                  limits.max_chars_per_text)
        t1 = time.perf_counter()
        ids, types, _ = runner.tokenize(req.inputs)
        t2 = time.perf_counter()
        chunks = runner.chunks(ids)
        out = runner.logits(ids, types, chunks)
        t3 = time.perf_counter()
        assert out.shape[0] == len(req.inputs)
        if k >= args.warmup:
            for s, a, b in zip(STAGES, (t0, t1, t2), (t1, t2, t3)):
                wall[s].append(b - a)
            tokens.append(sum(map(len, ids)))
            padded.append(sum(c.batch * c.seq for c in chunks))
    elapsed = time.perf_counter() - t_run
    total = [sum(x) for x in zip(*wall.values())]
    stat = lambda xs: {"mean_ms": round(float(np.mean(xs)) * 1e3, 3),  # noqa: E731
                       "p50_ms": round(float(np.percentile(xs, 50)) * 1e3, 3),
                       "p99_ms": round(float(np.percentile(xs, 99)) * 1e3, 3)}
    return {
        "label": args.label, "date": dt.date.today().isoformat(), "config": str(config), "model_dir": args.model_dir,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__, "python": platform.python_version(),
        "requests": args.requests, "documents": args.documents, "doc_tokens": args.doc_tokens,
        "tokens_per_request": round(float(np.mean(tokens)), 1),
        "padding": round(1 - sum(tokens) / sum(padded), 4),
        "stages": {s: stat(v) for s, v in wall.items()}, "total": stat(total),
        "pairs_per_s": round(args.requests * args.documents / elapsed, 1),
        "buckets": runner.report()["buckets"], "accuracy": runner.accuracy,
        "profile": profile(runner, args.profile) if args.profile else None,
    }


def profile(runner: Any, shape: str) -> str:
    """torch.profiler's kernel table of ten passes of one (pairs, tokens) bucket."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    b, s = (int(x) for x in shape.lower().split("x"))
    fw = runner.forward
    inputs = (torch.full((b, s), runner.pad_id, dtype=torch.long, device=runner.device),
              torch.ones((b, s), dtype=torch.long, device=runner.device),
              torch.zeros((b, s), dtype=torch.long, device=runner.device))
    cuda = runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        fw._forward(*inputs)
    sync()
    with torch_profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        for _ in range(10):
            fw._forward(*inputs)
        sync()
    return prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=25,
                                     max_name_column_width=70)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True, help="a cross-encoder folder (shaped_models writes one)")
    ap.add_argument("--config", help="model-config YAML whose `servekit:` plan to run (default: cross-encoder-gpu)")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--documents", type=int, default=100)
    ap.add_argument("--doc-tokens", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", metavar="PAIRSxTOKENS", help="also profile ten passes of this bucket, e.g. 128x128")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.profile and not re.fullmatch(r"\d+x\d+", args.profile.lower()):
        ap.error(f"--profile {args.profile!r}: give a bucket as PAIRSxTOKENS, e.g. 128x128")
    if args.requests < 1 or args.documents < 1 or args.doc_tokens < 8:
        ap.error("--requests and --documents must be >= 1, --doc-tokens >= 8")
    if not (Path(args.model_dir) / "config.json").is_file():
        ap.error(f"--model-dir {args.model_dir}: no config.json (write one with servekit.benchmarks.shaped_models)")
    result = measure(args)
    print(f"{result['gpu']}: {result['tokens_per_request']} tokens per request, padding {result['padding']:.1%}")
    print("bucket (pairs x tokens) replay ms: " + ", ".join(
        f"{b['batch']}x{b['seq']} {b['replay_ms']}" for b in result["buckets"]
        if b["batch"] >= 32 and 64 <= b["seq"] <= 192))
    print("stage     mean ms  p50 ms  p99 ms")
    for name, s in [*result["stages"].items(), ("total", result["total"])]:
        print(f"{name:<9} {s['mean_ms']:>7} {s['p50_ms']:>7} {s['p99_ms']:>7}")
    print(f"one process, one request after another: {result['pairs_per_s']:,.0f} pairs/s")
    if result["profile"]:
        print(result["profile"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"score-passes{'-' + args.label if args.label else ''}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
