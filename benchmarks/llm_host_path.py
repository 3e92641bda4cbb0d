"""Host time of an LLM worker's calls outside the engine: what the handler thread holds the GIL for
while the engine thread steps the model, and what a worker's first request pays that later ones do not.

    python -m servekit.benchmarks.llm_host_path --out benchmarks/results/llm-host-path-cpu

In this process, on real bytes, with SmolLM2's own tokenizer and chat template (no TorchServe
process; the engine is not run):

  call   one continuous-batching call of the handler with --streams streamed chats running, each
         given --tokens new tokens (answers of real passages, from benchmarks/llm_prompts.py):
         - decode: the frame TorchServe sends (every running request again, with the 17 headers
           the openai SDK sends), through TorchServe's own reader and through servekit's
           (handlers/worker_io.py);
         - requests: TorchServe's ``Service.retrieve_data_for_inference`` on it, and servekit's
           (``worker_io.requests_for_inference``);
         - answers: each request's chunk (``Answer.add``: detokenizing, the server-sent event);
         - frame: the response frame of those chunks, by TorchServe's ``create_predict_response``
           and by servekit's (``worker_io.encode_response``).
  first  in a fresh Python process each (the tokenizer's thread pool lives as long as its
         process): the host work of a new chat of --first-tokens prompt tokens (parsing, chat
         template, tokenizing, its first chunk), for the first request and for later ones (other
         texts of the same length), once after the handler's request-path warm-up
         (``OpenAIApi.warm_up``, what ``initialize()`` runs) and once without it.

Prints a table and writes ``llm_host_path.json`` into --out.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from servekit.benchmarks.host import cpu_model
from servekit.benchmarks.llm_prompts import PromptGenerator, tokenizer_counter
from servekit.benchmarks.worker_overhead import OPENAI_SDK_HEADERS, best_of, bench_decode, predict_frame
from servekit.handlers.worker_io import (encode_response, parse_requests, requests_for_inference, stock_requests,
                                        stock_response)
from servekit.resources import model_config


def _api(warm: bool, seed: int) -> tuple[Any, PromptGenerator]:
    """The LLM handler's request/answer code as initialize() builds it, over SmolLM2's CPU plan, and
    a prompt generator counting that model's tokens."""
    from servekit.handlers.llm_openai import OpenAIApi
    from servekit.optimizations.llm.chat_template import ChatTokenizer
    from servekit.optimizations.llm.grammar import GrammarCompiler
    from servekit.benchmarks.llm_inprocess import plan_runner
    from servekit.optimizations.llm.plan import stop_token_ids

    # The engine never runs here: no warm-up of its shapes.
    runner, plan, model_dir = plan_runner({**yaml.safe_load(model_config("smollm2-cpu").read_text())["servekit"],
                                              "warmup": False})
    tokenizer = ChatTokenizer(model_dir)
    stops = tuple(stop_token_ids(model_dir, tokenizer))
    api = OpenAIApi(runner.shape, plan.limits, tokenizer, stops, GrammarCompiler(tokenizer, runner.model.config.vocab_size,
                                                                           stops), "smollm2", "servekit-bench")
    if warm:
        api.warm_up()
    return api, PromptGenerator(seed=seed, count_tokens=tokenizer_counter(model_dir),
                                max_seq_len=runner.model.max_seq_len)


def _new_request_ms(api: Any, body: dict[str, Any], rid: str) -> float:
    """Host milliseconds of a new chat up to its first chunk: parse, template, tokenize, answer."""
    from servekit.handlers.llm_openai import CHAT_ROUTE

    t0 = time.perf_counter()
    prepared = {0: api.prepare({"body": json.dumps(body).encode()}, CHAT_ROUTE)}
    req = api.tokenize(prepared)[0]
    answer = api.answer(req, rid)
    answer.add(0, req.choices[0][0][-1:], None, None)
    return (time.perf_counter() - t0) * 1e3


def first_request(warm: bool, tokens: int, later: int, seed: int) -> dict[str, Any]:
    """In this (fresh) process: the first new request's host ms and the later ones'."""
    api, gen = _api(warm, seed)
    prompts = [gen.of_tokens(tokens, 8) for _ in range(1 + later)]
    times = [_new_request_ms(api, p.body(max_tokens=8), f"r{i}") for i, p in enumerate(prompts)]
    return {"warm_up": warm, "prompt_tokens": [p.tokens for p in prompts], "first_ms": round(times[0], 3),
            "later_ms": [round(t, 3) for t in times[1:]], "later_ms_p50": round(statistics.median(times[1:]), 3)}


def _first_in_subprocess(warm: bool, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "servekit.benchmarks.llm_host_path", "--first-only", "on" if warm else "off",
           "--first-tokens", str(args.first_tokens), "--later", str(args.later), "--seed", str(args.seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def one_call(streams: int, tokens: int, reps: int, seed: int) -> dict[str, Any]:
    """Microseconds of each stage of one handler call with `streams` streamed chats running."""
    from ts.context import Context, RequestProcessor

    from servekit.handlers.llm_openai import CHAT_ROUTE

    api, gen = _api(True, seed)
    prompts = gen.passages(streams)
    # Each stream answers with its own passage's ids (real text of varied characters), in turn.
    answers_ids = [api.tokenizer.encode(p.text) for p in prompts]
    frame = predict_frame([b""] * streams, OPENAI_SDK_HEADERS, "")
    row: dict[str, Any] = {"streams": streams, "tokens_per_chunk": tokens, "frame_bytes": len(frame)}
    stock, ours = bench_decode(frame, reps, False), bench_decode(frame, reps, True)
    row["decode_us"] = {"torchserve": round(stock * 1e6, 1), "servekit": round(ours * 1e6, 1)}

    batch, _ = parse_requests(bytearray(frame), 1)  # the requests that frame decodes to (after its command byte)
    row["requests_us"] = {name: round(best_of(lambda f=f: f(batch), reps) * 1e6, 1)
                          for name, f in (("torchserve", stock_requests), ("servekit", requests_for_inference))}

    reqs = [api.tokenize({0: api.prepare({"body": json.dumps(p.body(max_tokens=256)).encode()}, CHAT_ROUTE)})[0]
            for p in prompts]
    state = {"answers": [api.answer(r, f"r{i}") for i, r in enumerate(reqs)], "at": 0}

    def chunks() -> list[str]:
        at = state["at"]
        if at + tokens > min(len(ids) for ids in answers_ids):  # answers run out: fresh ones, same texts
            state["answers"], at = [api.answer(r, f"r{i}") for i, r in enumerate(reqs)], 0
        state["at"] = at + tokens
        return [a.add(0, ids[at:at + tokens], None, None)[0] for a, ids in zip(state["answers"], answers_ids)]

    row["answers_us"] = round(best_of(chunks, reps) * 1e6, 1)
    out = chunks()
    ctx = Context("smollm2", "", {}, streams, None, "0.12.0")
    ids = {i: f"req-{i:08d}" for i in range(streams)}
    ctx.request_ids, ctx.request_processor = ids, [RequestProcessor({}) for _ in range(streams)]

    def response(encode: Any) -> None:
        for i in range(streams):
            ctx.set_response_content_type(i, "text/event-stream")
        ctx.stopping_criteria = [lambda _: False] * streams
        encode(out, ids, "Prediction success", 200, context=ctx)

    row["frame_us"] = {name: round(best_of(lambda f=f: response(f), reps) * 1e6, 1)
                       for name, f in (("torchserve", stock_response), ("servekit", encode_response))}
    row["chunk_bytes_mean"] = round(statistics.mean(len(c.encode()) for c in out), 1)
    row["total_us"] = {k: round(row["decode_us"][k] + row["requests_us"][k] + row["answers_us"] + row["frame_us"][k], 1)
                       for k in ("torchserve", "servekit")}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.llm_host_path", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="folder for llm_host_path.json")
    p.add_argument("--streams", type=int, default=32, help="streamed chats running (default 32)")
    p.add_argument("--tokens", type=int, default=3, help="new tokens per stream and call (default 3)")
    p.add_argument("--reps", type=int, default=200, help="calls per timing round; the best of 5 rounds counts")
    p.add_argument("--first-tokens", type=int, default=600, help="prompt tokens of the new requests (default 600)")
    p.add_argument("--later", type=int, default=8, help="requests timed after the first (default 8)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--first-only", choices=("on", "off"), help=argparse.SUPPRESS)  # the child process's job
    args = p.parse_args(argv)
    if args.streams < 1 or args.tokens < 1 or args.reps < 1 or args.later < 1 or not 16 <= args.first_tokens <= 900:
        p.error("--streams, --tokens, --reps and --later must be positive, --first-tokens 16..900")
    torch.set_num_threads(1)  # an LLM worker's host work runs on its own threads beside the engine's
    if args.first_only:
        print(json.dumps(first_request(args.first_only == "on", args.first_tokens, args.later, args.seed)))
        return 0
    call = one_call(args.streams, args.tokens, args.reps, args.seed)
    ts_, sk = "torchserve", "servekit"
    print(f"one call, {args.streams} streams x {args.tokens} tokens, TorchServe's code / servekit's: decode "
          f"{call['decode_us'][ts_]:.0f} / {call['decode_us'][sk]:.0f} us, requests {call['requests_us'][ts_]:.0f} / "
          f"{call['requests_us'][sk]:.0f} us, answers {call['answers_us']:.0f} us, frame {call['frame_us'][ts_]:.0f} / "
          f"{call['frame_us'][sk]:.0f} us; total {call['total_us'][ts_]:.0f} / {call['total_us'][sk]:.0f} us", flush=True)
    first = [_first_in_subprocess(warm, args) for warm in (False, True)]
    for f in first:
        print(f"new {args.first_tokens}-token chat, warm-up {'on ' if f['warm_up'] else 'off'}: first "
              f"{f['first_ms']:.2f} ms, later p50 {f['later_ms_p50']:.2f} ms", flush=True)
    import tokenizers
    import ts

    result = {"call": call, "first_request": first, "date": dt.date.today().isoformat(),
              "command": "python -m servekit.benchmarks.llm_host_path " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": {"cpu": cpu_model(), "python": platform.python_version(), "torch": torch.__version__,
                          "torchserve": ts.__version__, "tokenizers": tokenizers.__version__}}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "llm_host_path.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out / 'llm_host_path.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
