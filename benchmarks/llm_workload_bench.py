"""A served LLM on prompts of realistic lengths: TTFT, prefill throughput, concurrent streams, Poisson
arrivals and a follow-up turn, through TorchServe with streamed OpenAI chat completions.

The script builds the archive from a model-config (default: the shipped config/models/smollm2.yaml,
as it is: batchSize, batch delay and plan), starts its own TorchServe, registers the model and
measures, with prompts from benchmarks/llm_prompts.py (every request a different text, lengths in
the served model's own tokens):

  ttft      batch 1, one request at a time, for each prompt length of --lengths (tokens): the first
            request of that length (the first the worker ever saw of it) and --later more of the
            same length (other texts), reported apart, each with its cached prompt tokens and its
            own split; nothing is sent before the first one but a GET /ping that opens the kept-alive
            connection they all go on. One more request of each length goes on a new connection
            (reported apart: its TTFT includes opening it).
  sequence  (only when named) --sequence short streamed chats one after another, 2 tokens each, every
            one a different text of --sequence-tokens: client TTFT, the handler's own TTFT and the
            time outside the handler (frontend, worker socket) by request index (1, 2-10, 11-50,
            51-100, 101-200, ...): how a fresh server's request path warms up over its first
            requests. On one kept-alive connection opened before the first. Runs after ttft;
            alone, its first request is the server's first.
  prefill   --prefill-streams prompts of --prefill-tokens sent together, 16 max tokens, --prefill-rounds
            rounds: prompt tokens / time to the last first token, and TTFT.
  batch1    per set (--sets): requests one after another: TTFT, time per output token (TPOT, the
            mean gap after the first token), tokens/s of one sequence (1 / TPOT).
  streams   per set: --streams closed-loop clients, each sending --stream-requests requests back to
            back: total tokens/s (completion tokens / the whole load's wall time, the tail of the
            longest answers included), tokens/s at full load (while every client is busy: from
            the last client's first token to the first client's last answer), TTFT p50/p99, TPOT.
  decode    per set: --batch1 requests one after another, then --streams requests sent together,
            all with ignore_eos (each runs to --max-tokens, so every row decodes every step and no
            prompt arrives between the steps): TPOT (the served decode step) of each and their
            ratio, against the streams measure's TPOT, where answers end and prompts arrive.
  poisson   per set: open-loop Poisson arrivals at --rate requests/s for --duration s, each request
            in its own thread, timed from its scheduled send: TTFT p50/p99, TPOT, tokens/s.
  followup  --conversations chats of ~1,500 tokens: the chat is sent, then its follow-up turn (the
            chat, the model's answer, the next question): the follow-up's TTFT and the server's
            usage.prompt_tokens_details.cached_tokens (a prefix-cache hit), beside the same kind of
            follow-up sent cold (no earlier turn).

Where the time went: served, each measure also reports the handler's own mean TTFT and inter-token
latency (its metrics, scraped before and after), so client TTFT minus handler TTFT is TorchServe's
share (queue, batch delay, IPC, HTTP). --in-process drives the same engine with the same requests in
this process, no TorchServe (the engine's share), and reports host milliseconds per engine step in
each phase. --ttft-again repeats the batch-1 probe after every other measure.

Sets: short (<= 60 words), passages (450-700 tokens), mixed (20-2,000 tokens). Every set's
max_tokens is --max-tokens (the mixed set's per prompt, 32 to --max-tokens), capped so that prompt
and answer fit max_seq_len. Answers stop where the model stops (a real model's early stop counts
fewer tokens: mean completion tokens are reported). A model folder's batch-1 tokens/s is also given
as a share of the memory-bandwidth bound: tokens/s x bytes of weights read per token / the GPU's
memory bandwidth (a table of known GPUs). Writes llm_workload_bench.json and .md into --out, and
the server's model_log.log and ts_log.log, also when the worker never got ready or the run was
stopped with SIGTERM (`timeout`), which stops the server too.

    python3 -m servekit.benchmarks.llm_workload_bench --out benchmarks/results/llm-workload-h100
    python3 -m servekit.benchmarks.llm_workload_bench --out DIR --model-dir shaped/llama-3.1-8b \\
        --measures ttft batch1 streams --sets short passages
    python3 -m servekit.benchmarks.llm_workload_bench --out DIR --in-process --measures ttft batch1 streams
    python -m servekit.benchmarks.llm_workload_bench --out /tmp/llm-workload-cpu --smoke   # CPU, < 2 min
"""
from __future__ import annotations

import argparse
import collections
import copy
import functools
import json
import math
import struct
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import yaml

from servekit.benchmarks.llm_prompts import PromptGenerator, Prompt, corpus_digest, tokenizer_counter
from servekit.benchmarks.llm_serve_bench import Session, Timing, run_together, summarize
from servekit.resources import model_config
from servekit.torchserve import TorchServe

MODEL = "smollm2"
MEASURES = ("ttft", "prefill", "batch1", "streams", "decode", "poisson", "followup", "sequence")
DEFAULT_MEASURES = [m for m in MEASURES if m != "sequence"]  # sequence: asked for by name
SETS = ("short", "passages", "mixed")
# Peak memory bandwidth (bytes/s) by a substring of the GPU's name, most specific first.
HBM_BYTES_PER_S = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
                   ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12),
                   ("L40S", 0.864e12), ("L4", 0.3e12))
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4,
               "I8": 1, "U8": 1, "BOOL": 1}
SMOKE = {"lengths": [32, 128], "later": 1, "prefill_streams": 2, "prefill_tokens": 128, "prefill_rounds": 1,
         "batch1": 1, "streams": 2, "stream_requests": 1, "rate": 0.5, "duration": 3.0, "conversations": 1,
         "conversation_tokens": 200, "max_tokens": 4, "sets": ["short"], "sequence": 12}


# -- the model and its figures ---------------------------------------------------------------------
def bandwidth(gpu: str | None) -> float | None:
    """Peak memory bandwidth of a known GPU (bytes/s), None for others and CPU."""
    return next((bw for key, bw in HBM_BYTES_PER_S if gpu and key in gpu), None)


def safetensors_params(model_dir: Path) -> dict[str, int]:
    """Elements per tensor of a checkpoint, from the safetensors headers (no tensor is read)."""
    out: dict[str, int] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = int(np.prod(meta["shape"], dtype=np.int64))
    return out


def weight_bytes_per_token(model_dir: Path, precision: str) -> int:
    """Bytes of weights one decode step reads at batch 1: every weight, except the token embedding
    table when a separate output matrix exists (a step reads one row of it); tied models read the
    table once, as the output matrix."""
    params = safetensors_params(model_dir)
    total = sum(params.values())
    embed = sum(n for k, n in params.items() if k.endswith("embed_tokens.weight"))
    if any(k.endswith("lm_head.weight") for k in params):
        total -= embed
    return total * DTYPE_BYTES[precision]


# -- load shapes -----------------------------------------------------------------------------------
# One streamed chat, greedy unless --temperature: (messages, max_tokens, t0: the perf_counter time
# to time from or None) -> its timing. Served: an HTTP request (stream_chat); --in-process: the
# engine driven directly.
Chat = Callable[..., Timing]  # (messages, max_tokens, t0, ignore_eos=False)


class HttpChat(Session):
    """A ``Chat`` over HTTP: each client thread keeps its connection alive across its requests, as an
    SDK's session does. ``open`` and ``fresh`` let the batch-1 probe tell a new connection's cost
    from the server's first request of a length (the in-process engine has no connection)."""

    __call__ = Session.chat


def one_by_one(chat: Chat, prompts: list[Prompt]) -> list[Timing]:
    return [chat(list(p.messages), p.max_tokens, None) for p in prompts]


def batch1_figures(chat: Chat, prompts: list[Prompt], split: Split) -> dict[str, Any]:
    """``prompts`` one after another: their figures (the wall time their answers took, end to end)
    and ``split``'s over them."""
    split.start()
    got = one_by_one(chat, prompts)
    return {**figures(got, sum(t.last_s or 0 for t in got)), **split.stop()}


def closed_loop(chat: Chat, prompts: list[Prompt], streams: int) -> tuple[list[Timing], float, list[float]]:
    """`streams` clients starting together, client i sending prompts i, i + streams, ... back to back.
    Returns the timings client by client, the wall time, and each request's send (perf_counter)."""
    out: list[list[tuple[float, Timing]]] = [[] for _ in range(streams)]

    def client(i: int) -> None:
        for p in prompts[i::streams]:
            sent = time.perf_counter()
            out[i].append((sent, chat(list(p.messages), p.max_tokens, None)))

    wall = run_together(client, streams)
    return [t for ts in out for _, t in ts], wall, [s for ts in out for s, _ in ts]


def full_load(timings: list[Timing], sends: list[float], per_stream: int) -> dict[str, Any]:
    """Tokens/s while every closed-loop stream is busy: from when the last stream got its first token
    to when the first stream had its last answer (before, streams are still starting; after, fewer
    of them run and the longest answers set the pace: `tok/s total` counts both). A request's
    tokens are spread evenly between its first and last token, as TPOT takes them. None where a
    request failed or no stream overlapped all the others."""
    none = {"tok_per_s_full_load": None, "full_load_s": None}
    if any(t.status != 200 or t.ttft_s is None or t.last_s is None for t in timings) or not timings:
        return none
    firsts = [sends[i] + timings[i].ttft_s for i in range(0, len(timings), per_stream)]
    lasts = [sends[i] + timings[i].last_s for i in range(per_stream - 1, len(timings), per_stream)]
    a, b = max(firsts), min(lasts)
    if b <= a:
        return none
    tokens = 0
    for sent, t in zip(sends, timings):
        first, last, n = sent + t.ttft_s, sent + t.last_s, t.tokens
        if n <= 1 or last <= first:  # one token, or all of them in one chunk
            tokens += n * (a <= first <= b)
            continue
        gap = (last - first) / (n - 1)
        lo, hi = max(0, math.ceil((a - first) / gap)), min(n - 1, math.floor((b - first) / gap))
        tokens += max(0, hi - lo + 1)
    return {"tok_per_s_full_load": round(tokens / (b - a), 1), "full_load_s": round(b - a, 3)}


def poisson(chat: Chat, prompts: list[Prompt], rate: float, duration: float, seed: int
            ) -> tuple[list[Timing], float, list[float]]:
    """Open loop: prompts sent at Poisson arrival times (rate/s) over `duration` s, each from its own
    thread and timed from its scheduled send. Returns the timings, the time until the last answer,
    and each send's lateness behind its schedule (s)."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=int(rate * duration * 2) + 10)
    arrivals = np.cumsum(gaps)
    arrivals = arrivals[arrivals < duration][:len(prompts)]
    out: list[Timing | None] = [None] * len(arrivals)
    late: list[float] = []
    threads = []
    start = time.perf_counter() + 0.05

    def one(i: int, at: float) -> None:
        late.append(time.perf_counter() - at)
        out[i] = chat(list(prompts[i].messages), prompts[i].max_tokens, at)

    for i, a in enumerate(arrivals):
        at = start + float(a)
        time.sleep(max(0.0, at - time.perf_counter()))
        threads.append(threading.Thread(target=one, args=(i, at)))
        threads[-1].start()
    for t in threads:
        t.join()
    return [t for t in out if t is not None], time.perf_counter() - start, late


# -- measurements ----------------------------------------------------------------------------------
def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)


def _p50(xs: list[float]) -> float | None:
    """The median of ``xs`` to two decimals; None when there is none."""
    return round(float(np.median(xs)), 2) if xs else None


def request_windows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``sequence``'s requests in windows of request index (1, 2-10, 11-50, 51-100, then doubling):
    p50 of client TTFT, of the handler's TTFT and of their difference, over the requests that have
    them."""
    bounds, hi = [1, 10, 50, 100], 100
    while hi < len(rows):
        hi *= 2
        bounds.append(hi)
    out, lo = [], 0
    for hi in bounds:
        part = rows[lo:hi]
        if not part:
            break
        ttft = [r["ttft_ms"] for r in part if r["ttft_ms"] is not None]
        both = [(r["ttft_ms"], r["handler_ttft_ms"]) for r in part
                if r["ttft_ms"] is not None and r.get("handler_ttft_ms") is not None]
        out.append({"from": lo + 1, "to": lo + len(part), "answered": len(ttft), "ttft_ms_p50": _p50(ttft),
                    "handler_ttft_ms_p50": _p50([h for _, h in both]),
                    "outside_ms_p50": _p50([t - h for t, h in both])})
        lo = hi
    return out


def sequence(chat: Chat, gen: PromptGenerator, n: int, tokens: int, split: Split | None = None) -> dict[str, Any]:
    """``n`` streamed chats of ``tokens`` prompt tokens (each a different text), 2 tokens each, one
    after another; ``split`` (the handler's metrics) is read around each, for its own TTFT."""
    split = split or Split()
    if isinstance(chat, HttpChat):
        chat.open()  # as in ttft_by_length: no request pays for opening the connection
    rows = []
    for _ in range(n):
        split.start()
        t = chat(list(gen.of_tokens(tokens, 2).messages), 2, None)
        own = split.stop()
        rows.append({"ttft_ms": _ms(t.ttft_s), "handler_ttft_ms": own.get("handler_ttft_ms_mean"),
                     "error": t.error or None})
    return {"requests": n, "prompt_tokens": tokens, "failed": sum(r["ttft_ms"] is None for r in rows),
            "windows": request_windows(rows), "per_request": rows}


def ttft_by_length(chat: Chat, gen: PromptGenerator, lengths: list[int], later: int,
                   split: Split | None = None, idle: float = 0.0) -> list[dict[str, Any]]:
    """Batch 1 per prompt length: the first request of that length, then `later` more (other texts
    of the same length: they share at most the chat template's head and the instruction with the
    first). `split` says where the first request's time went apart from the later ones'; the
    server's cached prompt tokens of each show whether a later one found more of itself in the
    prefix cache than the first did. With ``idle`` (seconds), `later` more of each length follow, each
    after that long a pause with nothing running: a request after an idle spell, apart from a
    server's very first."""
    split = split or Split()
    if isinstance(chat, HttpChat):
        # The first request goes on an open connection, as the later ones do: a new connection's
        # cost is no first-request cost of the server, and each length's row measures it apart.
        chat.open()
    rows = []
    for n in lengths:
        split.start()
        first = chat(list(gen.of_tokens(n, 8).messages), 8, None)
        first_split = split.stop()
        split.start()
        rest = [chat(list(gen.of_tokens(n, 8).messages), 8, None) for _ in range(later)]
        later_split = split.stop()
        ok = [t.ttft_s * 1e3 for t in rest if t.ttft_s is not None]
        cached = [t.cached_tokens for t in rest if t.cached_tokens is not None]
        paused = []
        for _ in range(later if idle > 0 else 0):
            time.sleep(idle)
            paused.append(chat(list(gen.of_tokens(n, 8).messages), 8, None))
        after_idle = [t.ttft_s * 1e3 for t in paused if t.ttft_s is not None]
        fresh = chat.fresh(list(gen.of_tokens(n, 8).messages), 8) if isinstance(chat, HttpChat) else None
        rows.append({"tokens": n, "prompt_tokens": first.prompt_tokens, "first_ttft_ms": _ms(first.ttft_s),
                     "first_error": first.error or None, "later": len(rest), "later_failed": len(rest) - len(ok),
                     "later_ttft_ms_p50": _p50(ok),
                     "later_ttft_ms_max": round(max(ok), 2) if ok else None,
                     "idle_s": idle or None,
                     "after_idle_ttft_ms_p50": _p50(after_idle),
                     "new_connection_ttft_ms": _ms(fresh.ttft_s) if fresh is not None else None,
                     "first_cached_tokens": first.cached_tokens,
                     "later_cached_tokens_max": max(cached) if cached else None,
                     "first_split": first_split, "later_split": later_split})
        print(f"  ttft {n} tokens: {json.dumps(rows[-1])}", flush=True)
    return rows


def prefill(chat: Chat, gen: PromptGenerator, streams: int, tokens: int, rounds: int) -> dict[str, Any]:
    """`streams` prompts of `tokens` sent together (16 max tokens), `rounds` times: prompt tokens
    per second up to the last first token."""
    per_round, timings = [], []
    for _ in range(rounds):
        prompts = [gen.of_tokens(tokens, 16) for _ in range(streams)]
        got, _, _ = closed_loop(chat, prompts, streams)
        timings += got
        firsts = [t.ttft_s for t in got if t.ttft_s is not None]
        if len(firsts) == len(got):
            per_round.append(sum(t.prompt_tokens for t in got) / max(firsts))
    s = summarize(timings, sum(t.last_s or 0 for t in timings))
    return {"streams": streams, "tokens": tokens, "rounds": rounds, "max_tokens": 16,
            "prompt_tokens_per_request": round(float(np.mean([t.prompt_tokens for t in timings])), 1),
            "prompt_tok_per_s_p50": round(float(np.median(per_round)), 0) if per_round else None,
            "prompt_tok_per_s_max": round(max(per_round), 0) if per_round else None,
            **{k: s[k] for k in ("requests", "failed", "errors", "ttft_ms_p50", "ttft_ms_p99")}}


def decode_steps(chat: Chat, prompts: list[Prompt], alone: int, together: int, split: Split) -> dict[str, Any]:
    """The decode step served, as TPOT: ``alone`` requests one after another, then ``together`` sent
    at once, every one with ignore_eos, so that all of them run to max_tokens, the rows decode in
    lockstep after the burst's prefill and no prompt arrives between the steps. Returns the
    figures of each, the handler's split of each, and the ratio of their TPOT p50. A request
    admitted early in the burst rides in the prefills of the rest, so its TPOT counts some longer
    steps; the request that got its first token last decoded only beside rows already decoding,
    until all of them ended together: its TPOT is the decode step at the full batch
    (``tpot_ms_last_started``, and ``tpot_ratio_full_batch`` against batch 1)."""
    def ignoring(messages: list[dict[str, str]], max_tokens: int, t0: float | None) -> Timing:
        return chat(messages, max_tokens, t0, ignore_eos=True)

    out: dict[str, Any] = {"batch1": batch1_figures(ignoring, prompts[:alone], split)}
    split.start()
    got, wall, _ = closed_loop(ignoring, prompts[alone:alone + together], together)
    ok = [t for t in got if t.status == 200 and t.ttft_s is not None and t.itl_s is not None]
    # rounded before the ratio, so that the ratio is the one the report's two figures give
    last = round(max(ok, key=lambda t: t.ttft_s).itl_s * 1e3, 3) if len(ok) == len(got) and ok else None
    out[f"batch{together}"] = {**figures(got, wall), **split.stop(), "tpot_ms_last_started": last or None}
    one, many = out["batch1"]["itl_ms_p50"], out[f"batch{together}"]["itl_ms_p50"]
    out["tpot_ratio"] = round(many / one, 3) if one and many else None
    out["tpot_ratio_full_batch"] = round(last / one, 3) if one and last else None
    return out


def figures(timings: list[Timing], wall_s: float) -> dict[str, Any]:
    """summarize()'s figures (ITL = TPOT) and the requests' prompt tokens."""
    s = summarize(timings, wall_s)
    prompt = [t.prompt_tokens for t in timings if t.status == 200]
    return {**s, "prompt_tokens_p50": int(np.median(prompt)) if prompt else None,
            "prompt_tokens_max": max(prompt) if prompt else None, "wall_s": round(wall_s, 2)}


def followup(chat: Chat, gen: PromptGenerator, n: int, tokens: int) -> dict[str, Any]:
    """Chats sent, then their follow-up turns (prefix-cache hits where the server caches), beside
    follow-ups of other chats sent cold."""
    hits, cold = [], []
    for conv in gen.conversation(n, tokens):
        first = chat(list(conv.messages), conv.max_tokens, None)
        turn = [*conv.messages, {"role": "assistant", "content": first.text}, {"role": "user", "content": conv.followup}]
        hits.append(chat(turn, 16, None))
    for conv in gen.conversation(n, tokens):  # the same shape, its earlier turns never sent
        answer = gen.of_tokens(80, 1).messages[0]["content"]
        cold.append(chat([*conv.messages, {"role": "assistant", "content": answer},
                          {"role": "user", "content": conv.followup}], 16, None))

    def row(ts: list[Timing]) -> dict[str, Any]:
        ok = [t.ttft_s * 1e3 for t in ts if t.ttft_s is not None]
        return {"requests": len(ts), "failed": len(ts) - len(ok), "prompt_tokens": [t.prompt_tokens for t in ts],
                "cached_tokens": [t.cached_tokens for t in ts],
                "ttft_ms_p50": _p50(ok),
                "ttft_ms_max": round(max(ok), 2) if ok else None}

    return {"conversation_tokens": tokens, "followup": row(hits), "cold": row(cold)}


# -- the run ---------------------------------------------------------------------------------------
def base_config(args: argparse.Namespace) -> dict[str, Any]:
    from servekit.benchmarks.bench.archives import variant_config

    if args.model_dir is None:
        return yaml.safe_load((args.config or model_config(MODEL)).read_text())
    return variant_config(str(args.model_dir), args.config, {}, {})


def checkpoint_dir(args: argparse.Namespace, precision: str) -> Path:
    """The folder of the served weights and tokenizer."""
    if args.model_dir is not None:
        return args.model_dir
    import torch

    from servekit.optimizations.models.gguf_weights import smollm2_archive_files

    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    return smollm2_archive_files(dtype)[0].parent


# -- where the time went ------------------------------------------------------------------------------
class Split:
    """Figures beside a measure's client-side ones that say where its time went (none here)."""

    def start(self) -> None:
        pass

    def stop(self) -> dict[str, Any]:
        return {}


class HandlerSplit(Split):
    """Served: the handler's own TTFT and inter-token latency over the measure (its Prometheus
    histograms' sums and counts on TorchServe's metrics port): TTFT from the handler call that took
    the request in to the call that has its first token. Client TTFT minus this is the frontend's
    queue, batch delay, IPC and HTTP."""

    NAMES = ("servekit_llm_ttft_seconds_sum", "servekit_llm_ttft_seconds_count", "servekit_llm_itl_seconds_sum",
             "servekit_llm_itl_seconds_count")

    def __init__(self, metrics_url: str) -> None:
        self.url, self.before = f"{metrics_url}/metrics", {}

    def _scrape(self) -> dict[str, float]:
        import requests

        out = dict.fromkeys(self.NAMES, 0.0)
        try:
            text = requests.get(self.url, timeout=10).text
        except requests.RequestException:
            return out
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
        return out

    def start(self) -> None:
        self.before = self._scrape()

    def stop(self) -> dict[str, Any]:
        d = {k: v - self.before.get(k, 0.0) for k, v in self._scrape().items()}

        def mean_ms(kind: str) -> float | None:
            n = d[f"servekit_llm_{kind}_seconds_count"]
            return round(d[f"servekit_llm_{kind}_seconds_sum"] / n * 1e3, 3) if n else None

        return {"handler_ttft_ms_mean": mean_ms("ttft"), "handler_itl_ms_mean": mean_ms("itl")}


def set_runs(sets: list[str]) -> list[tuple[str, str]]:
    """(key in the report, set) for each of --sets in order: a set named again runs again on the
    same server, reported as "short #2", "short #3" (a fresh server's first burst against later ones)."""
    return [(name if sets[:i].count(name) == 0 else f"{name} #{sets[:i].count(name) + 1}", name)
            for i, name in enumerate(sets)]


def measure(chat: Chat, args: argparse.Namespace, gen: PromptGenerator, res: dict[str, Any], save,
            split: Split | None = None) -> None:
    """Every measure of --measures against the model, saving after each; `split` adds where each
    measure's time went."""
    split = split or Split()

    def probe(lengths_key: str = "ttft") -> None:
        split.start()
        # its own copy: the rows' start and stop must not move the probe's own starting point
        rows = ttft_by_length(chat, gen, args.lengths, args.later, copy.copy(split), args.idle)
        res[lengths_key] = rows
        res.setdefault("splits", {})[lengths_key] = split.stop()
        print(f"  {lengths_key} split: {json.dumps(res['splits'][lengths_key])}", flush=True)
        save()

    if "ttft" in args.measures:
        probe()
    if "sequence" in args.measures:
        res["sequence"] = sequence(chat, gen, args.sequence, args.sequence_tokens, split)
        for w in res["sequence"]["windows"]:
            print(f"  sequence {json.dumps(w)}", flush=True)
        save()
    if "prefill" in args.measures:
        split.start()
        res["prefill"] = {**prefill(chat, gen, args.prefill_streams, args.prefill_tokens, args.prefill_rounds),
                          **split.stop()}
        print(f"  prefill: {json.dumps(res['prefill'])}", flush=True)
        save()
    for key, name in set_runs(args.sets):
        per: dict[str, Any] = res["sets"].setdefault(key, {})
        take = {"short": lambda k: gen.short(k, args.max_tokens), "passages": lambda k: gen.passages(k, args.max_tokens),
                "mixed": lambda k: gen.mixed(k, (min(32, args.max_tokens), args.max_tokens))}[name]
        if "batch1" in args.measures:
            per["batch1"] = batch1_figures(chat, take(args.batch1), split)
            print(f"  {key} batch 1: {json.dumps(per['batch1'])}", flush=True)
        if "streams" in args.measures:
            split.start()
            got, wall, sends = closed_loop(chat, take(args.streams * args.stream_requests), args.streams)
            # Each client's first request arrives with the other clients' (a burst of `streams`);
            # the later ones as requests end.
            burst = [(t.ttft_s or 0) * 1e3 for t in got[::args.stream_requests]]
            later = [(t.ttft_s or 0) * 1e3 for i, t in enumerate(got) if i % args.stream_requests]
            per["streams"] = {"streams": args.streams, **figures(got, wall), **full_load(got, sends, args.stream_requests),
                              "ttft_ms_max": round(max((t.ttft_s or 0) for t in got) * 1e3, 2),
                              "ttft_ms_p99_burst": round(float(np.percentile(burst, 99)), 2),
                              "ttft_ms_p99_later": round(float(np.percentile(later, 99)), 2) if later else None,
                              **split.stop()}
            print(f"  {key} {args.streams} streams: {json.dumps(per['streams'])}", flush=True)
        if "decode" in args.measures:
            per["decode"] = decode_steps(chat, take(args.batch1 + args.streams), args.batch1, args.streams, split)
            print(f"  {key} decode: {json.dumps(per['decode'])}", flush=True)
        if "poisson" in args.measures:
            prompts = take(int(args.rate * args.duration * 1.5) + 10)
            split.start()
            got, wall, late = poisson(chat, prompts, args.rate, args.duration, args.seed)
            per["poisson"] = {"rate": args.rate, "duration_s": args.duration, **figures(got, wall),
                              "achieved_rate": round(len(got) / args.duration, 2),
                              "send_late_ms_p99": round(float(np.percentile(late, 99)) * 1e3, 2) if late else None,
                              **split.stop()}
            print(f"  {key} poisson {args.rate}/s: {json.dumps(per['poisson'])}", flush=True)
        save()
    if "followup" in args.measures:
        split.start()
        res["followup"] = {**followup(chat, gen, args.conversations, args.conversation_tokens), **split.stop()}
        print(f"  followup: {json.dumps(res['followup'])}", flush=True)
        save()
    if args.ttft_again:  # the same probe once everything else ran: after READY against warm
        probe("ttft_again")


# -- the engine in this process ----------------------------------------------------------------------
ENGINE_PHASES = {"step": "step", "_admit": "admit", "_prefill": "prefill", "_first_tokens": "first tokens",
                 "_decode_from": "sample mixed decode", "_launch": "launch decode", "_read_all": "read decode"}


class PhaseTimer:
    """Host seconds spent in an object's methods (or a module's functions), summed per label, and
    the calls per label: `instrument` replaces the attribute with a timed wrapper. A phase that
    waits for the device counts that wait. ``exclusive``: a phase's time leaves out the timed
    phases it calls on the same thread (they count once, as themselves), so the phases add up to
    the thread's time in them; otherwise a phase includes them."""

    def __init__(self, exclusive: bool = False) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.exclusive = exclusive
        self._nested = threading.local()  # per thread: the timed time of the calls inside each open phase

    def instrument(self, owner: Any, attr: str, label: str) -> None:
        fn = getattr(owner, attr)
        self.seconds[label] += 0.0  # listed from the start, called or not

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = self._nested.__dict__.setdefault("stack", [])
            stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - t0
                inner = stack.pop()
                if stack:
                    stack[-1] += spent
                self.seconds[label] += spent - inner if self.exclusive else spent
                self.calls[label] += 1

        setattr(owner, attr, timed)


@dataclass(frozen=True)
class BuiltEngine:
    """A model-config's engine in this process, built as the LLM worker's engine process builds it."""

    batcher: Any  # the ContinuousBatcher, warmed up
    tokenizer: Any  # the model's ChatTokenizer
    stops: tuple[int, ...]  # the stop token ids the handler passes
    built: dict[str, Any]  # what the batcher's warm-up built
    frozen_objects: int
    ready_s: float


def build_engine(cfg: dict[str, Any], folder: Path) -> BuiltEngine:
    """The plan, batch size (``batchSize``), warm-up and frozen heap of the engine process
    (optimizations/llm/engine_process.py), with no TorchServe, worker or pipe around it."""
    from servekit.optimizations.heap import freeze_heap
    from servekit.optimizations.llm.chat_template import ChatTokenizer
    from servekit.optimizations.llm.continuous import ContinuousBatcher
    from servekit.optimizations.llm.plan import load_llm_runner, parse_llm_plan, stop_token_ids

    t0 = time.perf_counter()
    runner, plan, _ = load_llm_runner(str(folder), parse_llm_plan(cfg.get("servekit")))
    tokenizer = ChatTokenizer(folder)
    stops = tuple(stop_token_ids(folder, tokenizer))
    batcher = ContinuousBatcher(runner, int(cfg.get("batchSize") or runner.max_batch), plan.prefill_chunk,
                                plan.max_num_batched_tokens, prefix_caching=plan.prefix_caching)
    built = batcher.warmup()
    frozen = freeze_heap()  # as the engine process does once built
    return BuiltEngine(batcher, tokenizer, stops, built, frozen, round(time.perf_counter() - t0, 1))


class EngineChat:
    """--in-process: the model-config's engine in this process, driven as the LLM handler drives
    it (same plan, batch size, chat template, stop tokens, sampling parameters) but with no
    TorchServe, HTTP or handler in between: the engine's own share of every figure. A request's
    TTFT runs from its submission (the prompt is tokenized before) to the engine's first update."""

    def __init__(self, cfg: dict[str, Any], folder: Path, temperature: float = 0.0) -> None:
        from servekit.optimizations.llm.continuous import EngineThread

        engine = build_engine(cfg, folder)
        self.batcher, self.tokenizer, self.stops = engine.batcher, engine.tokenizer, engine.stops
        self.built, self.ready_s = engine.built, engine.ready_s
        self.timer = PhaseTimer()
        for attr, label in ENGINE_PHASES.items():
            self.timer.instrument(self.batcher, attr, label)
        self.engine = EngineThread(self.batcher, self.batcher.r.device)
        self._keys = iter(range(1 << 62))
        self.temperature = temperature
        self._lock = threading.Lock()

    def __call__(self, messages: list[dict[str, str]], max_tokens: int, t0: float | None = None,
                 ignore_eos: bool = False) -> Timing:
        from servekit.optimizations.llm.continuous import FINISH_ERROR
        from servekit.optimizations.llm.generate import SamplingParams

        prompt = self.tokenizer.encode_chat(messages)
        with self._lock:
            key = next(self._keys)
        t0 = time.perf_counter() if t0 is None else t0
        self.engine.submit(key, prompt, SamplingParams(max_tokens=max_tokens, temperature=self.temperature, seed=0,
                                                       stop_token_ids=() if ignore_eos else self.stops))
        first = last = None
        out: list[int] = []
        chunks = cached = 0
        while True:
            u = self.engine.take([key], 120.0).get(key)
            if u is None or u.finish_reason == FINISH_ERROR:
                return Timing(500, None, None, 0, len(prompt), 0, "", f"engine: {u.error if u else 'no update in 120 s'}")
            now = time.perf_counter() - t0
            if u.tokens:
                first = now if first is None else first
                last, chunks = now, chunks + 1
                out += u.tokens
                cached = cached or u.cached_tokens
            if u.finish_reason is not None:
                text = self.tokenizer.decode([t for t in out if t not in self.stops])
                return Timing(200, first, last, len(out), len(prompt), chunks, text, cached_tokens=cached)


class EngineSplit(Split):
    """--in-process: host milliseconds per engine step in each phase over the measure, and steps."""

    def __init__(self, chat: EngineChat) -> None:
        self.chat, self.before, self.steps0, self.t0 = chat, {}, 0, 0.0

    def start(self) -> None:
        timer = self.chat.timer
        self.before, self.steps0, self.t0 = dict(timer.seconds), timer.calls["step"], time.perf_counter()

    def stop(self) -> dict[str, Any]:
        timer = self.chat.timer
        steps = timer.calls["step"] - self.steps0
        wall = time.perf_counter() - self.t0
        per = {k: round((v - self.before[k]) / steps * 1e3, 3) for k, v in timer.seconds.items()} if steps else {}
        return {"engine_steps": steps, "engine_steps_per_s": round(steps / wall, 1), "engine_ms_per_step": per}


def _warm_up_note(res: dict[str, Any]) -> str:
    w = res.get("warm_up")
    if not w:
        return ""
    return f", its inference warm-up {w['models_requests']} models-route requests and {w['chats']} streamed chats"


def warm_up_counts(ts: Any, name: str, settle_s: float = 3.0) -> dict[str, int]:
    """The requests registration's inference warm-up sent (``servekit.torchserve.warm_up_inference``)
    by route, from TorchServe's access log; it is written asynchronously, so read until it stops growing."""
    path = f'"POST /predictions/{name}/1.0/v1/'
    last: dict[str, int] | None = None
    deadline = time.monotonic() + settle_s
    while True:
        text = ts.log_text("access_log.log")
        counts = {"models_requests": text.count(path + "models HTTP"),
                  "chats": text.count(path + "chat/completions HTTP")}
        if counts == last or time.monotonic() > deadline:
            return counts
        last = counts
        time.sleep(0.3)


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Build, serve and measure; the result is saved into --out after every measure."""
    from servekit.archive import build_archive
    from servekit.benchmarks.bench.archives import model_spec
    from servekit.benchmarks.bench.runner import versions
    from servekit.benchmarks.llm_continuous_bench import served_name
    from servekit.benchmarks.llm_inprocess import environment

    cfg = base_config(args)
    plan = cfg.get("servekit") or {}
    folder = checkpoint_dir(args, plan.get("precision", "bf16"))
    gen = PromptGenerator(args.seed, tokenizer_counter(folder), max_seq_len=int(plan.get("max_seq_len", 2048)))
    env = {**versions(), **environment(argv, "servekit.benchmarks.llm_workload_bench")}
    res: dict[str, Any] = {"environment": env, "model": str(args.model_dir or MODEL),
                           "config": {k: v for k, v in cfg.items() if k != "servekit"}, "plan": plan,
                           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "prompts": {"seed": args.seed, "corpus": corpus_digest()}, "sets": {}}
    precision = plan.get("precision", "bf16")
    res["weights"] = {"bytes_per_token": weight_bytes_per_token(folder, precision), "precision": precision,
                      "hbm_bytes_per_s": bandwidth(env.get("gpu"))}
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (args.out / "llm_workload_bench.json").write_text(json.dumps(res, indent=1))

    res["mode"] = "in-process" if args.in_process else "served"
    if args.in_process:
        chat = EngineChat(cfg, folder, args.temperature)
        res["ready_s"], res["engine_warmup"] = chat.ready_s, chat.built
        print(f"== {res['model']} in-process: engine ready after {chat.ready_s} s", flush=True)
        save()
        measure(chat, args, gen, res, save, EngineSplit(chat))
        share(res)
        save()
        return res
    name = served_name(str(args.model_dir) if args.model_dir else MODEL)
    with tempfile.TemporaryDirectory(prefix="servekit-llm-workload-") as tmp:
        work = Path(tmp)
        (work / "model-config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        t0 = time.perf_counter()
        build_archive(name, work / "store", config=work / "model-config.yaml", compress=False,
                      spec=model_spec(str(args.model_dir) if args.model_dir else MODEL))
        res["archive_s"] = round(time.perf_counter() - t0, 1)
        print(f"== {name}: archive {res['archive_s']} s; waiting for its worker (at most {args.ready_timeout:g} s)",
              flush=True)
        with TorchServe(work / "run", work / "store") as ts:
            try:
                t0 = time.perf_counter()
                ts.register(f"{name}.mar", name, timeout=args.ready_timeout)
                res["ready_s"] = round(time.perf_counter() - t0, 1)
                res["warm_up"] = warm_up_counts(ts, name)
                print(f"== {name}: archive {res['archive_s']} s, worker READY after {res['ready_s']} s; inference "
                      f"warm-up {json.dumps(res['warm_up'])}", flush=True)
                save()
                measure(HttpChat(f"{ts.inference_url}/predictions/{name}/1.0/v1/chat/completions", args.temperature),
                        args, gen, res, save, HandlerSplit(ts.metrics_url))
            finally:
                # The worker's own account beside the figures; also when its start failed or took too
                # long, or the run was stopped (SIGTERM ends it through here: TorchServe.start).
                for log in ("model_log.log", "ts_log.log"):
                    src = work / "run" / "logs" / log
                    if src.is_file():
                        (args.out / log).write_bytes(src.read_bytes()[-2_000_000:])
    share(res)
    save()
    return res


def share(res: dict[str, Any]) -> None:
    """Batch-1 tokens/s of one sequence as a share of the bandwidth bound, per set."""
    w = res["weights"]
    if not w["hbm_bytes_per_s"]:
        return
    bound = w["hbm_bytes_per_s"] / w["bytes_per_token"]
    w["bound_tok_per_s"] = round(bound, 1)
    for per in res["sets"].values():
        b = per.get("batch1")
        if b and b.get("tok_per_s_per_seq_p50"):
            b["bandwidth_share"] = round(b["tok_per_s_per_seq_p50"] / bound, 3)


def markdown(res: dict[str, Any]) -> str:
    env, w = res["environment"], res["weights"]
    how = ("in-process engine, no TorchServe" if res.get("mode") == "in-process" else "served through TorchServe")
    L = [f"# {Path(res['model']).name} ({how}): realistic prompt lengths ({env.get('gpu') or 'CPU'})",
         "", f"{env['date']}; torch {env.get('torch')}, CUDA {env.get('cuda')}, TorchServe {env.get('torchserve')}, "
         f"transformers {env.get('transformers')}, Python {env.get('python')}, {env.get('cpu_count')} CPUs. "
         f"Command: `{env['command']}`.", "",
         f"Plan: precision {res['plan'].get('precision')}, compile {res['plan'].get('compile')}, kernels "
         f"{res['plan'].get('kernels', 'torch')}, batchSize {res['config'].get('batchSize')}, maxBatchDelay "
         f"{res['config'].get('maxBatchDelay')} ms. Worker READY after {res.get('ready_s')} s"
         f"{_warm_up_note(res)}. Prompts: seed "
         f"{res['prompts']['seed']}, corpus {res['prompts']['corpus']} (stdlib docstrings of Python {env.get('python')}), "
         "every request a different text. Streamed "
         + (f"chat completions sampled at temperature {t} (seed 0)" if (t := res["args"].get("temperature", 0.0)) > 0
            else "greedy chat completions")
         + "; TTFT from the send (Poisson: from the "
         "scheduled send); TPOT = (last token - first token) / (tokens - 1). "
         + ("Client: each client thread keeps one HTTP connection alive across its requests, events timed as "
            "their lines arrive and decoded after the answer." if res.get("mode") != "in-process" else ""), ""]
    if w.get("bound_tok_per_s"):
        L += [f"Weights read per decode token: {w['bytes_per_token'] / 1e9:.3f} GB ({w['precision']}); at "
              f"{w['hbm_bytes_per_s'] / 1e12:.2f} TB/s the batch-1 bound is {w['bound_tok_per_s']} tokens/s.", ""]
    for key, title in (("ttft", "Batch-1 TTFT by prompt length"),
                       ("ttft_again", "Batch-1 TTFT by prompt length, again after every other measure")):
        if not res.get(key):
            continue
        L += [f"## {title}", "", "| tokens | served prompt tokens | first request ms | "
              "later p50 ms | later max ms | on a new connection ms | cached tokens first / later max |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
        L += [f"| {r['tokens']} | {r['prompt_tokens']} | {r['first_ttft_ms']} | {r['later_ttft_ms_p50']} | "
              f"{r['later_ttft_ms_max']} | {r.get('new_connection_ttft_ms')} | "
              f"{r.get('first_cached_tokens')} / {r.get('later_cached_tokens_max')} |"
              for r in res[key]]
        if any(r.get("after_idle_ttft_ms_p50") is not None for r in res[key]):
            L += ["", "After an idle pause: " + "; ".join(
                f"{r['tokens']} tokens, {r['later']} more requests each {r['idle_s']} s after the last one ended: "
                f"TTFT p50 {r['after_idle_ttft_ms_p50']} ms" for r in res[key]) + "."]
        if any(r.get("new_connection_ttft_ms") is not None for r in res[key]):
            L += ["", "Every request but the last of each length goes on one kept-alive connection, opened "
                  "before the first; the last opens a new one, and its TTFT includes that."]
        L += ["", "Where the first request's time went, then the later ones':"]
        L += [f"- {r['tokens']} tokens: first `{json.dumps(r.get('first_split', {}))}`, later "
              f"`{json.dumps(r.get('later_split', {}))}`" for r in res[key]]
        L += ["", f"Where the time went: `{json.dumps(res.get('splits', {}).get(key, {}))}`", ""]
    if res.get("sequence"):
        q = res["sequence"]
        L += ["## A sequence of short requests", "", f"{q['requests']} streamed chats of {q['prompt_tokens']} prompt "
              f"tokens, 2 tokens each, one after another ({q['failed']} failed); outside = client TTFT minus the "
              "handler's own:", "", "| requests | answered | TTFT p50 ms | handler TTFT p50 ms | outside p50 ms |",
              "| --- | --- | --- | --- | --- |"]
        L += [f"| {w['from']}-{w['to']} | {w['answered']} | {w['ttft_ms_p50']} | {w['handler_ttft_ms_p50']} | "
              f"{w['outside_ms_p50']} |" for w in q["windows"]]
        L += [""]
    if res.get("prefill"):
        p = res["prefill"]
        L += ["## Prefill throughput", "", f"{p['streams']} prompts of {p['tokens']} tokens ({p['prompt_tokens_per_request']} "
              f"served) sent together, {p['max_tokens']} max tokens, {p['rounds']} rounds: **{p['prompt_tok_per_s_p50']} "
              f"prompt tokens/s** (p50 of rounds; best {p['prompt_tok_per_s_max']}), TTFT p50 {p['ttft_ms_p50']} ms, "
              f"p99 {p['ttft_ms_p99']} ms, {p['failed']} failed.", ""]
    rows = []
    for name, per in res["sets"].items():
        for kind, r in per.items():
            # decode: its rows, each with ignore_eos
            rows += [(name, f"decode, {k.removeprefix('batch')} at once", v) for k, v in r.items()
                     if k.startswith("batch")] if kind == "decode" else [(name, kind, r)]
    if rows:
        L += ["## Per prompt set", "", "| set | load | requests (failed) | prompt tokens p50 / max | tokens/req | "
              "TTFT p50 / p99 ms | TPOT p50 / p99 ms | tok/s per seq | tok/s total | tok/s at full load | "
              "bandwidth share |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, kind, r in rows:
            load = {"batch1": "batch 1", "streams": f"{r.get('streams')} streams",
                    "poisson": f"Poisson {r.get('rate')}/s"}.get(kind, kind)
            L.append(f"| {name} | {load} | {r['requests']} ({r['failed']}) | {r['prompt_tokens_p50']} / "
                     f"{r['prompt_tokens_max']} | {r['mean_completion_tokens']} | {r['ttft_ms_p50']} / {r['ttft_ms_p99']} | "
                     f"{r['itl_ms_p50']} / {r['itl_ms_p99']} | {r['tok_per_s_per_seq_p50']} | {r['tok_per_s_total']} | "
                     f"{r.get('tok_per_s_full_load') or ''} | {r.get('bandwidth_share', '')} |")
        L.append("")
        ratios = [(name, per["decode"]) for name, per in res["sets"].items() if "decode" in per]
        L += [f"Decode (ignore_eos, every row decoding every step), {name}: TPOT p50 of "
              f"{[k for k in d if k.startswith('batch')][-1].removeprefix('batch')} at once / batch 1 = "
              f"{d['tpot_ratio']}; of the request that started last (the full batch's decode step) / batch 1 "
              f"= {d.get('tpot_ratio_full_batch')}." for name, d in ratios] + ([""] if ratios else [])
    if res.get("followup"):
        f = res["followup"]
        L += ["## Follow-up turn", "", f"A chat of ~{f['conversation_tokens']} tokens, then its follow-up turn: TTFT "
              f"p50 {f['followup']['ttft_ms_p50']} ms (max {f['followup']['ttft_ms_max']}), prompt tokens "
              f"{f['followup']['prompt_tokens']}, cached tokens {f['followup']['cached_tokens']}. The same kind of "
              f"follow-up sent cold: TTFT p50 {f['cold']['ttft_ms_p50']} ms, cached tokens {f['cold']['cached_tokens']}.", ""]
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.llm_workload_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder for llm_workload_bench.json / .md")
    p.add_argument("--model-dir", type=Path, help="a model folder (`servekit archive PATH`), default: bundled SmolLM2")
    p.add_argument("--config", type=Path, help="model-config (default: config/models/smollm2.yaml, or the one "
                                               "`servekit archive PATH` generates for --model-dir)")
    p.add_argument("--measures", nargs="+", choices=MEASURES, default=DEFAULT_MEASURES,
                   help=f"default: {' '.join(DEFAULT_MEASURES)} (sequence only when named)")
    p.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS),
                   help="a set named again runs again on the same server, reported as 'short #2', ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (the committed figures); above 0, every request sampled at it with seed 0")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--lengths", nargs="+", type=int, default=[100, 300, 600, 1000, 1500, 1900])
    p.add_argument("--later", type=int, default=5, help="ttft: requests after the first of each length")
    p.add_argument("--idle", type=float, default=0.0,
                   help="ttft: seconds of pause before each of --later more requests of each length, "
                        "reported apart (a request after an idle spell); 0: none")
    p.add_argument("--prefill-streams", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=600)
    p.add_argument("--prefill-rounds", type=int, default=5)
    p.add_argument("--batch1", type=int, default=8, help="batch-1 requests per set")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--stream-requests", type=int, default=4, help="requests per closed-loop stream")
    p.add_argument("--rate", type=float, default=32.0, help="Poisson arrivals per second")
    p.add_argument("--duration", type=float, default=20.0, help="s of Poisson arrivals per set")
    p.add_argument("--conversations", type=int, default=5)
    p.add_argument("--conversation-tokens", type=int, default=1500)
    p.add_argument("--sequence", type=int, default=400, help="sequence: requests one after another")
    p.add_argument("--sequence-tokens", type=int, default=40, help="sequence: prompt tokens of each")
    p.add_argument("--ready-timeout", type=float, default=1800.0)
    p.add_argument("--in-process", action="store_true",
                   help="drive the model-config's engine in this process (no TorchServe): the engine's share of each figure")
    p.add_argument("--ttft-again", action="store_true",
                   help="run the batch-1 TTFT probe again after every other measure (after READY against warm)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke run: config/models/smollm2-cpu.yaml, tiny counts, the short set (~2 min on 2 cores)")
    args = p.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            if p.get_default(k) == getattr(args, k):  # what the command line gave stays
                setattr(args, k, v)
        args.config = args.config or model_config("smollm2-cpu")
    for path in (args.config, args.model_dir):
        if path is not None and not path.exists():
            p.error(f"{path}: no such file or folder")
    if min(args.later, args.prefill_streams, args.prefill_rounds, args.batch1, args.streams, args.stream_requests,
           args.conversations, args.sequence, args.sequence_tokens) < 1 or args.max_tokens < 2 or args.rate <= 0 or args.duration <= 0:
        p.error("counts must be >= 1, --max-tokens >= 2, --rate and --duration > 0")
    if args.idle < 0:
        p.error(f"--idle must be >= 0 seconds, got {args.idle}")
    res = run(args, argv)
    (args.out / "llm_workload_bench.md").write_text(markdown(res))
    print(markdown(res))
    failed = sum(r.get("failed", 0) for per in res["sets"].values() for r in per.values())
    failed += sum(1 for r in res.get("ttft", []) + res.get("ttft_again", [])
                  if r["first_ttft_ms"] is None or r["later_failed"])
    failed += (res.get("prefill") or {}).get("failed", 0) + (res.get("sequence") or {}).get("failed", 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
