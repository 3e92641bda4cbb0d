"""Decode-step kernels benchmark: ``kernels: torch`` (compiled blocks) vs ``kernels: triton`` (the
fused kernels of ``optimizations/kernels/triton_decode.py``), both inside CUDA graphs, on random weights in
real model shapes (SmolLM2-135M, Qwen2.5-0.5B) at batch 1..32.

Per (model, batch, variant): ms per greedy decode step (a captured ``DecodeStep`` replayed),
kernels per step (profiler, one graph replay), max |logit diff| of one step against the eager
model in the same dtype, and the share of the memory-bandwidth bound (weights + KV bytes read per
step / step time / the GPU's peak bandwidth).

Writes ``decode_kernels.json`` and ``decode_kernels.md`` (GPU, versions, date, command) into ``--out``.

    # GPU (a few minutes on an H100):
    python -m servekit.benchmarks.decode_kernels --out benchmarks/results/decode-kernels-h100
    # CPU smoke run of the same code on a tiny model, kernels under the Triton interpreter:
    TRITON_INTERPRET=1 python -m servekit.benchmarks.decode_kernels --out /tmp/dk --device cpu --tiny
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from servekit.benchmarks.llm_inprocess import environment, sync_device
from servekit.optimizations.llm.generate import LlamaRunner
from servekit.optimizations.models.llama import LlamaConfig, Transformer, init_random
from servekit.optimizations.llm.sampling import GREEDY, SamplingTensors

MODULE = "servekit.benchmarks.decode_kernels"
SHAPES = {
    "smollm2-135m": LlamaConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                                intermediate_size=1536, rope_base=100000.0, tie_embeddings=True),
    "qwen2.5-0.5b": LlamaConfig(vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64,
                                intermediate_size=4864, rope_base=1000000.0, norm_eps=1e-6, model_type="qwen2",
                                qkv_bias=True, tie_embeddings=True, max_position_embeddings=32768),
    "tiny": LlamaConfig.tiny(),
}
# Peak memory bandwidth (bytes/s) by GPU name; the first match wins.
PEAK_BANDWIDTH = [("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100", 2.0e12), ("L40S", 8.64e11)]


def peak_bandwidth(gpu: str | None) -> float | None:
    return next((bw for name, bw in PEAK_BANDWIDTH if gpu and name in gpu), None)


def bytes_per_step(model: Transformer, batch: int, mean_pos: float) -> int:
    """Weights read once per step (the embedding table counts once, as the lm_head, when tied; a
    lookup reads ``batch`` rows of it) + the KV cache slots attention reads."""
    c, elt = model.config, model.tok_embeddings.weight.element_size()
    params = {id(p): p.numel() for p in model.parameters()}
    weights = sum(params.values()) - (0 if c.tie_embeddings else model.tok_embeddings.weight.numel())
    kv = c.n_layers * 2 * c.n_kv_heads * c.head_dim * batch * (mean_pos + 1)
    return int((weights + kv) * elt)


def profile_kernels(fn) -> tuple[int, list[dict]]:
    """GPU kernels launched by ``fn()`` (a graph replay: its kernel nodes), by the profiler: their
    count, and per kernel name its launches and GPU time (µs, the kernels' own durations: the gaps
    between them are the rest of the step's time), longest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_name: dict[str, dict] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.name.startswith(("Memcpy", "Memset")):
            continue
        k = by_name.setdefault(e.name, {"kernel": e.name, "launches": 0, "us": 0.0})
        k["launches"] += 1
        k["us"] += e.device_time
    table = sorted(by_name.values(), key=lambda k: -k["us"])
    return sum(k["launches"] for k in table), table


def measure(runner: LlamaRunner, fwd, batch: int, kv_len: int, start_pos: int, steps: int, repeats: int,
            device: torch.device, count_uncaptured: bool = False, idle: int = 0) -> dict:
    """One variant at one batch: step time (captured on CUDA), kernel count, logits vs eager.
    ``idle``: that many of the batch's last rows (all but one at most) parked at the cache's last
    slot, as the engine parks free rows and rows whose prompt goes in."""
    model = runner.model
    state = runner.states[batch]
    greedy = SamplingTensors.build([0.0] * batch, [0] * batch, [1.0] * batch, [0] * batch, device)
    positions = torch.full((batch,), start_pos, dtype=torch.int64, device=device)
    positions[batch - min(idle, batch - 1):] = runner.max_seq_len - 1

    def reset() -> None:
        state.load(torch.full((batch,), 5, dtype=torch.int64, device=device), positions, greedy)

    step = runner.steps[(batch, GREEDY, kv_len)]
    reset()
    if device.type == "cuda":
        step.capture(torch.cuda.graph_pool_handle())  # warms (compiles, autotunes) on a side stream first
    else:
        step.run()
    times = []
    for _ in range(repeats):
        reset()
        sync_device(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step.run()
        sync_device(device)
        times.append((time.perf_counter() - t0) / steps * 1e3)
    kernels = kernels_eager = kernel_table = None
    if device.type == "cuda":  # the graph's kernel nodes as the profiler sees one replay, and a plain call's
        reset()
        kernels, kernel_table = profile_kernels(step.run)
        if count_uncaptured:  # a cross-check of the replay's count (one profiler session costs ~1 s)
            reset()
            kernels_eager, _ = profile_kernels(step._body)
    # One step's logits against the eager model in the same dtype, from the same cache prefix
    # (each call writes its own k/v at the step's position before reading it).
    tokens = torch.randint(3, model.config.vocab_size, (batch, 1), device=device)
    pos = torch.full((batch, 1), start_pos, device=device)
    with torch.no_grad():
        want = model(tokens, pos, kv_len=kv_len)
        got = fwd(tokens, pos, kv_len=kv_len)
    return {"ms_per_step": min(times), "ms_per_step_all": times, "kernels_per_step": kernels, "idle_rows": min(idle, batch - 1),
            "kernels_per_step_uncaptured": kernels_eager,
            "kernel_times": kernel_table,
            "max_abs_logit_diff": float((got - want).abs().max()), "mean_pos": start_pos + steps / 2}


def run_shape(name: str, config: LlamaConfig, args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
              say) -> list[dict]:
    model = init_random(config, seed=0, dtype=dtype).to(device)
    kv_len = args.kv_len
    batches = tuple(args.batches)
    # Positions of the measured steps: a prompt of half the kv bucket, then `steps` decode steps.
    start_pos = kv_len // 2
    steps = min(args.steps, kv_len - start_pos - 1)
    rows = []
    # With idle rows the cache is twice the bucket, so that their parked position lies past it, as
    # in serving (the engine's cache holds the whole context, its steps attend over a bucket of it).
    max_seq = 2 * kv_len if args.idle_rows else kv_len
    # Prefill every row once (eager), so attention reads real k/v.
    with torch.no_grad():
        model.fuse_projections()
        model.setup_caches(max(batches), max_seq)
        tokens = torch.randint(3, config.vocab_size, (max(batches), start_pos), device=device)
        model(tokens, torch.arange(start_pos, device=device).expand(max(batches), start_pos), kv_len=start_pos)
    for kernels in args.variants:
        t0 = time.perf_counter()
        compiled = kernels == "torch" and args.compile != "off"
        runner = LlamaRunner(model, max_seq, batches, prefill_buckets=(start_pos,), kv_buckets=(kv_len,),
                             compile_decode=compiled, compile_mode=args.compile if compiled else "default",
                             cuda_graphs=device.type == "cuda", kernels=kernels.removesuffix("-nopdl"))
        for block in runner.triton_model.blocks if runner.triton_model else ():
            block.pdl = block.pdl and kernels != "triton-nopdl"  # nopdl: each kernel launched after the last ends
            block.splits = args.splits or block.splits
        fwd = runner.triton_model or runner.compiled_model or model
        if args.warm_up == "engine":
            # As the engine starts: every step compiled, tuned and captured with its rows at
            # position 0, before measure() captures the measured steps again at their positions.
            say(f"{name} {kernels}: runner warm-up {runner.warmup()['decode_s']:.1f} s")
        for b in batches:
            r = measure(runner, fwd, b, kv_len, start_pos, steps, args.repeats, device, count_uncaptured=b == batches[0],
                        idle=args.idle_rows)
            bound = bytes_per_step(model, b, r["mean_pos"])
            bw = peak_bandwidth(torch.cuda.get_device_name(device) if device.type == "cuda" else None)
            r.update(model=name, kernels=kernels, compile=args.compile if kernels == "torch" else "off", batch=b,
                     kv_len=kv_len, bytes_per_step=bound,
                     bandwidth_share=(bound / bw / (r["ms_per_step"] / 1e3)) if bw else None)
            rows.append(r)
            say(f"{name} {kernels:6s} batch {b:2d}: {r['ms_per_step']:.3f} ms/step, "
                f"{r['kernels_per_step']} kernels, max |dlogit| {r['max_abs_logit_diff']:.3g}")
            for k in (r["kernel_times"] or [])[:8]:
                say(f"    {k['us']:8.1f} us in {k['launches']:3d} launches  {k['kernel'][:90]}")
        say(f"{name} {kernels}: {time.perf_counter() - t0:.0f} s with warm-up")
        del runner, fwd
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def markdown(res: dict) -> str:
    env = res["environment"]
    lines = [f"# Decode-step kernels: torch vs triton ({env['gpu'] or 'CPU'})", "",
             f"{env['date']}, torch {env['torch']}, triton {res['triton']}, CUDA {env['cuda']}, dtype {res['dtype']}, "
             f"kv bucket {res['kv_len']}, peak bandwidth {res['peak_bandwidth']}, warm-up {res.get('warm_up', 'steps')}.",
             "",
             f"Command: `{env['command']}`", "",
             "Random weights in the model's real shapes; a greedy decode step captured as a CUDA graph (on GPU), "
             "timed over consecutive replays (best of the repeats). `torch`: the transformer block compiled "
             f"(`compile: {res['compile']}`), as the shipped plan; `triton`: the fused decode kernels, not compiled.",
             "Kernels per step: the profiler's kernels of one graph replay (of one uncaptured call in brackets).",
             *([f"Idle rows: the last {res['idle_rows']} rows of each batch (all but one at most) parked at the "
                "cache's last slot, past the bucket, as the engine parks free rows and prompts going in."]
               if res.get("idle_rows") else []),
             "", "| model | batch | kernels | ms/step | kernels/step | max abs logit diff vs eager | bandwidth share |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        share = f"{r['bandwidth_share']:.1%}" if r["bandwidth_share"] is not None else "n/a"
        lines.append(f"| {r['model']} | {r['batch']} | {r['kernels']} | {r['ms_per_step']:.3f} | "
                     f"{_or_na(r['kernels_per_step'])} ({_or_na(r['kernels_per_step_uncaptured'])}) | "
                     f"{r['max_abs_logit_diff']:.3g} | {share} |")
    lines += ["", f"Wall time: {res['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def _or_na(v: object) -> str:
    return "n/a" if v is None else str(v)


def kernels_device(name: str) -> torch.device | None:
    """Where the fused kernels run: CUDA if asked for and present (None, the reason printed, if
    absent), or the CPU under the Triton interpreter, turned on here: before triton_decode defines
    its kernels, which CPU runs need."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --tiny (with TRITON_INTERPRET=1) for a smoke run", file=sys.stderr)
        return None
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    return device


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for decode_kernels.json and .md")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny test config only (CPU smoke run)")
    p.add_argument("--models", nargs="+", choices=[k for k in SHAPES if k != "tiny"],
                   default=["smollm2-135m", "qwen2.5-0.5b"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--variants", nargs="+", choices=("torch", "triton", "triton-nopdl"), default=["torch", "triton"],
                   help="triton-nopdl: the fused kernels without programmatic dependent launch")
    p.add_argument("--compile", default="default", choices=("off", "default", "max-autotune-no-cudagraphs"),
                   help="torch variant's compile mode (the shipped plan: default)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--splits", type=int, default=None,
                   help="attention cache splits per (row, kv head) for the triton variants (default: by batch and kv length)")
    p.add_argument("--warm-up", choices=("steps", "engine"), default="steps",
                   help="steps: each measured step compiled and tuned at the measured positions; engine: the "
                        "runner's warm-up first, as the engine starts (every step at position 0)")
    p.add_argument("--kv-len", type=int, default=512, help="kv bucket of the steps (positions from half of it)")
    p.add_argument("--idle-rows", type=int, default=0,
                   help="rows of each batch parked past the kv bucket, as the engine parks free rows and prompts going in")
    p.add_argument("--steps", type=int, default=100, help="replays per timing")
    p.add_argument("--repeats", type=int, default=3)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    t_start = time.perf_counter()
    device = kernels_device(args.device)
    if device is None:
        return 2
    import triton

    if args.tiny:
        args.models, args.batches, args.kv_len, args.steps, args.repeats = ["tiny"], [1, 4], 32, 3, 1
        args.compile = "off" if device.type == "cpu" else args.compile
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    say = lambda msg: print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)  # noqa: E731
    env = environment(argv, MODULE)
    rows = []
    for name in args.models:
        rows += run_shape(name, SHAPES[name], args, device, dtype, say)
    res = {"environment": env, "triton": triton.__version__, "dtype": str(dtype).removeprefix("torch."),
           "compile": args.compile, "kv_len": args.kv_len, "idle_rows": args.idle_rows, "warm_up": args.warm_up,
           "peak_bandwidth": peak_bandwidth(env["gpu"]),
           "rows": rows, "wall_s": time.perf_counter() - t_start}
    (out / "decode_kernels.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "decode_kernels.md").write_text(markdown(res))
    say(f"wrote {out / 'decode_kernels.json'} and decode_kernels.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
