"""How often a JSON schema's grammar refuses the token a model picks without the grammar's mask:
the share of steps at which sampling first and masking only on a refusal would have to go back.

Each schema of the structured benchmark (benchmarks/structured_bench.py) with its prompt, as the
served benchmark sends them (the prompt names a topic, not the schema), decoded under llguidance's
mask on the model's own tokenizer; at every step the token picked from the unmasked logits is
compared with the one picked under the mask, with the same Gumbel noise (so "allowed" means "the
same token"). Greedy and sampled (temperature 0.8, the served benchmark's).

Also where the masked pick ranks among the unmasked (noised) scores: 0 when the unmasked pick is
allowed, r when r better-scored tokens are refused before it. Picking a row's token as the first
allowed one among its k best candidates, checked one by one on the host, gives exactly the masked
pick whenever its rank is below k, with no mask filled; a row needs its mask only past rank k. Per
k: the share of steps past it, and what that makes the chance that at least one of 32 rows needs
its mask in a step. Steps whose mask allows one token only (the grammar forces it) are counted
apart: the engine knows those tokens without a mask (forced runs). And what that check costs the
host: at each step with a choice, ``try_consume_tokens`` with each candidate in score order until
one is taken (up to the largest k), on a second matcher kept in step with the row's that fills no
masks, timed beside the time to fill the row's mask. Last, how many tokens a row would take per
step if every run of two or more tokens the grammar forces went in one step (``compute_ff_tokens``
at each position), and if each run went in the forward of the sampled token before it, as the
engine feeds them (it takes them only where they ride in a packed forward, see
``ContinuousBatcher._prefill``).

    python -m servekit.benchmarks.grammar_refusals ~/.cache/servekit/smollm2-135m-instruct-bfloat16
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable

import llguidance
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from servekit.benchmarks.bench.stats import percentile
from servekit.benchmarks.structured_bench import PROMPTS, SCHEMAS
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.grammar import JSON_FORMAT, llg_tokenizer
from servekit.optimizations.llm.plan import stop_token_ids


def timed_mask(matcher: llguidance.LLMatcher, vocab: int,
               clock: Callable[[], float] = time.perf_counter) -> tuple[torch.Tensor, float]:
    """The matcher's next-token mask as booleans ``(vocab,)``, and the µs llguidance took to fill it
    on ``clock`` (``time.thread_time``: this thread's CPU time, where llguidance fills a lone mask)."""
    words = torch.empty(1, (vocab + 31) // 32, dtype=torch.int32)
    t0 = clock()
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.shape[1] * 4)
    us = (clock() - t0) * 1e6
    bits = (words[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].bool(), us


def allowed_tokens(matcher: llguidance.LLMatcher, vocab: int) -> torch.Tensor:
    """The matcher's next-token mask as booleans ``(vocab,)``."""
    return timed_mask(matcher, vocab)[0]


# Candidates per row a host check would look at: the ranks the report cuts at.
CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 256)
ROWS = 32  # rows in a step, for the chance that one of them needs its mask


def decode(model: Any, hf: Any, tokenizer: llguidance.LLTokenizer, schema: dict, prompt: str,
           temperature: float, max_tokens: int, gen: torch.Generator,
           costs: dict[str, list[float]] | None = None) -> list[tuple[int, bool, int]]:
    """One constrained answer; per step, the masked pick's rank among the unmasked scores, whether
    the mask allowed that one token only, and the length of the run of tokens the grammar forces
    from there (0: none). ``costs``: at each step with a choice, the host µs of
    checking candidates in score order until one is taken ("check", while within the largest of
    CANDIDATES), of filling the row's mask ("mask") and of taking the picked token after it
    ("consume after the mask", as the engine does now) are appended. The checks run on a second
    matcher in step with the first that never fills a mask, as a row checked that way would not."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)
    matcher, checker = llguidance.LLMatcher(tokenizer, grammar), llguidance.LLMatcher(tokenizer, grammar)
    ids = hf.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                 return_tensors="pt", return_dict=True)["input_ids"]
    vocab = model.config.vocab_size
    past, ranks = None, []
    for _ in range(max_tokens):
        with torch.no_grad():
            out = model(input_ids=ids, cache=past, use_cache=True)
        past, logits = out.cache, out.logits[0, -1].float()
        if temperature > 0:
            u = torch.rand(logits.shape, generator=gen).clamp_(1e-10, 1.0)
            logits = logits / temperature - torch.log(-torch.log(u))
        allowed, mask_us = timed_mask(matcher, vocab)
        run = len(matcher.compute_ff_tokens())  # after the mask, as the engine asks for it
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        # Ties broken as argmax breaks them (the lowest id first).
        ahead = int((logits > logits[token]).sum() + (logits[:token] == logits[token]).sum())
        forced = int(allowed.sum()) == 1
        ranks.append((ahead, forced, run))
        timed = costs is not None and not forced and ahead < CANDIDATES[-1]
        if timed:
            order = torch.sort(logits, descending=True, stable=True).indices[:ahead + 1].tolist()
            t0 = time.perf_counter()
            taken = next((c for c in order if checker.try_consume_tokens([c])), None)
            costs["check"].append((time.perf_counter() - t0) * 1e6)
            costs["mask"].append(mask_us)
            if taken != token:  # the first candidate taken must be the masked pick
                costs.setdefault("other pick", []).append(float(ahead))
                break
        else:
            checker.consume_token(token)
        t0 = time.perf_counter()
        ok = matcher.consume_token(token)
        if timed:
            costs["consume after the mask"].append((time.perf_counter() - t0) * 1e6)
        if not ok or matcher.is_stopped():
            break
        ids = torch.tensor([[token]])
    return ranks


def cost_summary(us: list[float]) -> dict[str, float]:
    """Mean and percentiles (nearest rank) of host microseconds (empty: zeros)."""
    if not us:
        return {"n": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    return {"n": len(us), "mean": round(sum(us) / len(us), 1),
            **{f"p{q}": round(percentile(us, q), 1) for q in (50, 90, 99)}}


def steps_with_runs(runs: list[int]) -> int:
    """Steps one answer takes when each run of two or more forced tokens (``runs[i]``: the run from
    position i) goes in one step, the position after it sampled in the next."""
    steps = i = 0
    while i < len(runs):
        steps += 1
        i += runs[i] if runs[i] >= 2 else 1
    return steps


def steps_with_runs_after(runs: list[int]) -> int:
    """Steps one answer takes as the engine decodes it: each sampled token's forward also feeds
    the run of tokens the grammar forces after it (``runs[i + 1]``, any length), and the position
    after that run is sampled in the next step."""
    steps = i = 0
    while i < len(runs):
        steps += 1
        i += 1 + (runs[i + 1] if i + 1 < len(runs) else 0)
    return steps


def rank_report(ranks: list[tuple[int, bool, int]], rows: int = ROWS) -> dict[str, Any]:
    """The steps, the refusals (rank above 0), the forced steps and, per candidate count k, the share
    of the steps with a choice whose masked pick ranks k or lower, and the chance that one of ``rows``
    such rows does."""
    chosen = [r for r, forced, _ in ranks if not forced]
    out: dict[str, Any] = {"steps": len(ranks), "refused": sum(r > 0 for r, _, _ in ranks),
                           "forced": len(ranks) - len(chosen)}
    out["share"] = round(out["refused"] / len(ranks), 4) if ranks else 0.0
    past = {k: sum(r >= k for r in chosen) / len(chosen) if chosen else 0.0 for k in CANDIDATES}
    out["past_k"] = {str(k): round(v, 4) for k, v in past.items()}
    out[f"any_of_{rows}_rows_past_k"] = {str(k): round(1 - (1 - v) ** rows, 4) for k, v in past.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", type=Path, help="a Hugging Face model folder (SmolLM2: servekit's bundled one)")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = p.parse_args(argv)
    if not (args.model_dir / "config.json").is_file():
        p.error(f"{args.model_dir} is not a model folder (no config.json)")
    hf = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    # The engine's own llguidance tokenizer (servekit's mask slices), so that masks cost what they
    # cost the engine; the masks are llguidance's whatever the slices.
    chat = ChatTokenizer(args.model_dir)
    tokenizer, _ = llg_tokenizer(chat, model.config.vocab_size, stop_token_ids(args.model_dir, chat))
    res: dict[str, Any] = {"model_dir": str(args.model_dir), "schemas": len(SCHEMAS)}
    for name, temperature in (("greedy", 0.0), ("sampled", 0.8)):
        gen = torch.Generator().manual_seed(args.seed)
        ranks: list[tuple[int, bool, int]] = []
        steps = steps_after = 0
        costs: dict[str, list[float]] = {"check": [], "mask": [], "consume after the mask": []}
        for i, (schema_name, topic, schema) in enumerate(SCHEMAS):
            got = decode(model, hf, tokenizer, schema, PROMPTS[i % len(PROMPTS)].format(topic=topic), temperature,
                         args.max_tokens, gen, costs)
            ranks += got
            steps += steps_with_runs([run for _, _, run in got])
            steps_after += steps_with_runs_after([run for _, _, run in got])
            print(f"  {name} {schema_name}: {sum(r > 0 for r, _, _ in got)} of {len(got)} steps refused",
                  flush=True)
        r = res[name] = rank_report(ranks)
        r["check_took_another_token"] = len(costs.pop("other pick", []))
        r["tokens_per_step_with_runs"] = round(len(ranks) / steps, 3) if steps else 0.0
        r["tokens_per_step_with_runs_after_sampled"] = round(len(ranks) / steps_after, 3) if steps_after else 0.0
        r["host_us"] = {k: cost_summary(v) for k, v in costs.items()}
        print(f"{name}: the grammar refused the unmasked pick at {r['refused']} of {r['steps']} steps "
              f"({100 * r['share']:.1f}%); {r['forced']} steps forced one token", flush=True)
        print(f"  {name}, steps with a choice whose masked pick ranks k or lower: "
              + ", ".join(f"k={k}: {v:.1%}" for k, v in r["past_k"].items()), flush=True)
        print(f"  {name}, chance that one of {ROWS} such rows does: "
              + ", ".join(f"k={k}: {v:.1%}" for k, v in r[f"any_of_{ROWS}_rows_past_k"].items()), flush=True)
        for k, v in r["host_us"].items():
            print(f"  {name}, host µs a row at steps with a choice, {k}: {v}", flush=True)
        print(f"  {name}, steps whose check took another token than the mask's pick: "
              f"{r['check_took_another_token']}", flush=True)
        print(f"  {name}, tokens a row takes per step with every forced run of 2+ in one step: "
              f"{r['tokens_per_step_with_runs']}; with each run fed beside the sampled token before it "
              f"(as the engine does): {r['tokens_per_step_with_runs_after_sampled']}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
