"""Continuous batching of SmolLM2 through TorchServe, with and without speculation: time to first
token under load.

For each variant -- continuous batching (``continuous``: requests join the running batch), also
with speculative decoding (``continuous-spec``: the base config plus a ``speculation`` section and
the heads in ``--speculator``) -- with ``batchSize`` and the plan's largest batch bucket set to
``--max-num-seqs``, the script builds the archive, starts its own TorchServe and measures streamed
greedy chat completions:

1. batch 1: ``--solo`` requests one after another (TTFT, tokens/s per sequence);
2. head of line: a ``--long-tokens`` request, then 100 ms later a 16-token one (its TTFT);
   long prompt: while 4 streams decode, a request with a ~``--long-prompt``-token prompt arrives:
   the longest gap between the running streams' chunks while it goes in (prefill_chunk bounds it);
3. ``--concurrency`` concurrent streams: as many clients, each sending ``--rounds`` requests of
   ``--max-tokens`` one after another (closed loop: a stream's next request follows its last at
   once), all starting at the same instant (TTFT p50/p99/max, ITL, total tokens/s over the run).

Prompts are the held-out part of the speculator prompt file (not the ones any plan was tuned on).

    python3 -m servekit.benchmarks.llm_continuous_bench --out benchmarks/results/llm-continuous-h100
    python3 -m servekit.benchmarks.llm_continuous_bench --out DIR --variants continuous continuous-spec \
        --speculator heads/
    python3 -m servekit.benchmarks.llm_continuous_bench --out DIR --model path/to/model-folder --variants continuous
    python -m servekit.benchmarks.llm_continuous_bench --out /tmp/cb --config config/models/smollm2-cpu.yaml \\
        --max-num-seqs 4 --concurrency 4 --max-tokens 16 --long-tokens 64 --solo 1 --rounds 1
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from servekit.benchmarks.llm_serve_bench import MODEL, Timing, run_together, stream_chat, summarize
from servekit.benchmarks.llm_inprocess import environment
from servekit.resources import model_config
from servekit.torchserve import TorchServe


VARIANTS = ("continuous", "continuous-spec")


def variant_config(base: dict[str, Any], variant: str, max_num_seqs: int, spec_max_batch: int = 8,
                   spec_heads: int | None = None) -> dict[str, Any]:
    cfg = copy.deepcopy(base)
    cfg.update({"batchSize": max_num_seqs, "continuousBatching": True})
    if variant.endswith("-spec"):
        cfg["servekit"]["speculation"] = {"heads": "speculator", "max_batch": spec_max_batch}
        if spec_heads:  # the first n of the trained heads (fewer drafts: cheaper verify steps)
            cfg["servekit"]["speculation"]["n_heads"] = spec_heads
    else:
        cfg["servekit"].pop("speculation", None)
    buckets = cfg["servekit"].setdefault("buckets", {})
    sizes = [b for b in buckets.get("batch_sizes", [1]) if b < max_num_seqs]
    while sizes and sizes[-1] * 2 < max_num_seqs:
        sizes.append(sizes[-1] * 2)
    buckets["batch_sizes"] = sizes + [max_num_seqs]
    return cfg


def served_name(model: str) -> str:
    """The name the model is archived and registered under: the bundled name, or the folder's."""
    from servekit.model_source import sanitize_name

    return model if model == MODEL else sanitize_name(Path(model).name)


def head_of_line(url: str, prompts: list[str], long_tokens: int) -> dict[str, Any]:
    """A short request sent 100 ms after a long one: its TTFT, and the long one's."""
    out: dict[str, Any] = {}

    def long() -> None:
        out["long"] = stream_chat(url, prompts[0], long_tokens)

    thread = threading.Thread(target=long)
    thread.start()
    time.sleep(0.1)
    short = stream_chat(url, prompts[1], 16)
    thread.join()
    return {"short_ttft_ms": None if short.ttft_s is None else round(short.ttft_s * 1e3, 1),
            "short_total_ms": None if short.last_s is None else round(short.last_s * 1e3, 1),
            "long_tokens": out["long"].tokens,
            "long_total_ms": None if out["long"].last_s is None else round(out["long"].last_s * 1e3, 1)}


def closed_loop(url: str, prompts: list[str], streams: int, per_stream: int, max_tokens: int
                ) -> tuple[list[Timing], float]:
    """``streams`` clients starting together, each sending ``per_stream`` requests back to back."""
    out: list[list[Timing]] = [[] for _ in range(streams)]

    def client(i: int) -> None:
        for k in range(per_stream):
            out[i].append(stream_chat(url, prompts[(k * streams + i) % len(prompts)], max_tokens))

    wall = run_together(client, streams)
    return [t for ts in out for t in ts], wall


def chunk_gaps(url: str, prompt: str, max_tokens: int, t_from: float, t_to: float, out: list[float],
               t0: float) -> None:
    """Stream one request; append the gaps (ms) between its chunks that end within [t_from, t_to]
    (seconds after ``t0``)."""
    import requests

    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    last = None
    with requests.post(url, json=body, stream=True, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                now = time.perf_counter() - t0
                if last is not None and t_from <= now <= t_to:
                    out.append((now - last) * 1e3)
                last = now


def long_prompt_stall(url: str, prompts: list[str], long_prompt_tokens: int) -> dict[str, Any]:
    """Four streams decode; 1 s in, a request with a long prompt arrives. The running streams'
    longest gap between chunks in the 2 s after it, and the long request's TTFT."""
    gaps: list[float] = []
    t0 = time.perf_counter()
    streams = [threading.Thread(target=chunk_gaps, args=(url, prompts[i], 1000, 1.0, 3.0, gaps, t0))
               for i in range(4)]
    for t in streams:
        t.start()
    time.sleep(1.0)
    long = stream_chat(url, " ".join(["Summarise this text."] + ["The river flows to the sea."] *
                                     (long_prompt_tokens // 7)), 8)
    for t in streams:
        t.join()
    return {"long_prompt_tokens": long.prompt_tokens,
            "long_ttft_ms": None if long.ttft_s is None else round(long.ttft_s * 1e3, 1),
            "running_max_gap_ms": round(max(gaps), 2) if gaps else None,
            "running_p50_gap_ms": round(sorted(gaps)[len(gaps) // 2], 2) if gaps else None}


def run_variant(name: str, cfg: dict[str, Any], args: argparse.Namespace, prompts: list[str], work: Path
                ) -> dict[str, Any]:
    from servekit.archive import build_archive

    from servekit.benchmarks.bench.archives import model_spec

    config = work / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    store = work / f"store-{name}"
    model = served_name(args.model)
    build_archive(model, store, config=config, compress=False, spec=model_spec(args.model),
                  speculator=args.speculator if name.endswith("-spec") else None)
    with TorchServe(work / f"run-{name}", store) as ts:
        t0 = time.perf_counter()
        ts.register(f"{model}.mar", model, timeout=args.ready_timeout)
        ready_s = round(time.perf_counter() - t0, 1)
        print(f"== {name}: worker READY after {ready_s} s", flush=True)
        url = f"{ts.inference_url}/predictions/{model}/1.0/v1/chat/completions"
        stream_chat(url, prompts[0], 8)  # first request after start: not measured
        solo = [stream_chat(url, prompts[i % len(prompts)], args.max_tokens) for i in range(args.solo)]
        res: dict[str, Any] = {"variant": name, "ready_s": ready_s, "batch1": summarize(solo, sum(
            t.last_s or 0 for t in solo))}
        print(f"  batch 1: {json.dumps(res['batch1'])}", flush=True)
        res["head_of_line"] = head_of_line(url, prompts, args.long_tokens)
        print(f"  head of line: {json.dumps(res['head_of_line'])}", flush=True)
        res["long_prompt"] = long_prompt_stall(url, prompts, args.long_prompt)
        print(f"  long prompt: {json.dumps(res['long_prompt'])}", flush=True)
        timings, wall = closed_loop(url, prompts, args.concurrency, args.rounds, args.max_tokens)
        res["concurrent"] = {"concurrency": args.concurrency, **summarize(timings, wall),
                             "ttft_ms_max": round(max((t.ttft_s or 0) for t in timings) * 1e3, 1)}
        print(f"  c={args.concurrency}: {json.dumps(res['concurrent'])}", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.llm_continuous_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder for llm_continuous_bench.json")
    p.add_argument("--model", default=MODEL,
                   help=f"the bundled {MODEL} (default) or a model folder, as `servekit archive PATH` takes it")
    p.add_argument("--config", type=Path,
                   help="base model-config (default: the bundled model's, or the one `servekit archive PATH` generates)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=["continuous"])
    p.add_argument("--speculator", type=Path, help="trained heads (servekit train-speculator --out) for -spec variants")
    p.add_argument("--spec-max-batch", type=int, default=8, help="-spec variants: largest batch that speculates")
    p.add_argument("--spec-heads", type=int, help="-spec variants: drafts per step, the first N heads (default: all)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="batchSize: requests running at once")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4, help="requests per concurrent stream")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--long-tokens", type=int, default=512)
    p.add_argument("--long-prompt", type=int, default=1800, help="prompt tokens of the long-prompt check")
    p.add_argument("--solo", type=int, default=5, help="batch-1 requests")
    p.add_argument("--ready-timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    if args.config is not None and not args.config.is_file():
        p.error(f"--config {args.config}: no such file")
    if args.model != MODEL and not Path(args.model).is_dir():
        p.error(f"--model {args.model}: neither {MODEL} nor a model folder")
    if min(args.max_num_seqs, args.concurrency, args.rounds, args.solo) < 1 or args.max_tokens < 2:
        p.error("--max-num-seqs, --concurrency, --rounds and --solo must be >= 1, --max-tokens >= 2")
    if any(v.endswith("-spec") for v in args.variants) and (args.speculator is None or not args.speculator.is_dir()):
        p.error("the -spec variants need --speculator DIR (a folder written by servekit train-speculator)")
    from servekit.optimizations.training.train_speculator import load_prompts, split_prompts

    prompts = split_prompts(load_prompts())[1]
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"environment": environment(argv, "servekit.benchmarks.llm_continuous_bench"),
                           "args": {k: str(v) for k, v in vars(args).items()}, "variants": []}
    from servekit.benchmarks.bench.archives import variant_config as model_base

    try:
        base = model_base(args.model, args.config or (model_config(MODEL) if args.model == MODEL else None), {}, {})
    except (ValueError, FileNotFoundError) as e:
        p.error(f"--model {args.model}: {e}")
    with tempfile.TemporaryDirectory(prefix="servekit-cb-bench-") as tmp:
        for name in args.variants:
            cfg = variant_config(base, name, args.max_num_seqs, args.spec_max_batch, args.spec_heads)
            try:
                res["variants"].append(run_variant(name, cfg, args, prompts, Path(tmp)))
            except Exception as e:  # one variant failing must not lose the other's figures
                res["variants"].append({"variant": name, "error": f"{type(e).__name__}: {e}"})
            (args.out / "llm_continuous_bench.json").write_text(json.dumps(res, indent=1))
    return 0 if all("error" not in v for v in res["variants"]) else 1


if __name__ == "__main__":
    sys.exit(main())
