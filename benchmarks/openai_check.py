"""The official openai SDK against SmolLM2 served with a plan (the GPU plan by default): what clients
use beyond plain chat, checked on a live TorchServe, with the speed of the slow path measured.

Checks: ``models.list()`` / ``models.retrieve()``; a multi-turn conversation that sends the SDK's
own ``message.model_dump()`` back; ``logprobs`` + ``top_logprobs`` (JSON and streamed: the tokens'
texts make up the answer, greedy picks the most likely token, the same values both ways) and the
legacy integer ``logprobs`` of ``/v1/completions``; ``n=2`` (choice k equals the request alone
with seed + k); presence/frequency penalties. Then tokens/s of one greedy request of
``--max-tokens`` tokens with and without logprobs and with penalties (those decode without CUDA
graphs or speculation).

    python3 -m servekit.benchmarks.openai_check --out DIR                      # config/models/smollm2.yaml
    python -m servekit.benchmarks.openai_check --out /tmp/oa --config config/models/smollm2-cpu.yaml --max-tokens 16

Writes ``openai_check.json`` and prints one line per check; exits 1 if any check fails.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from servekit.benchmarks.llm_inprocess import environment as llm_environment
from servekit.resources import model_config
from servekit.torchserve import TorchServe

MODEL = "smollm2"
MESSAGES = [{"role": "user", "content": "Name three rivers of Europe and say one thing about each."}]


def _checks(client: Any, max_tokens: int) -> dict[str, Callable[[], str]]:
    """Each check returns a short description of what it saw, or raises AssertionError."""

    def models() -> str:
        ids = [m.id for m in client.models.list().data]
        assert ids == [MODEL], ids
        assert client.models.retrieve(MODEL).id == MODEL
        return f"list {ids}, retrieve ok"

    def multi_turn() -> str:
        first = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
        turn = first.choices[0].message.model_dump()
        second = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=16, messages=[
            *MESSAGES, turn, {"role": "user", "content": "Which is the longest?"}])
        assert second.choices[0].message.content, "empty second turn"
        return f"2nd turn after model_dump() with keys {sorted(turn)}: {second.choices[0].message.content[:40]!r}"

    def logprobs() -> str:
        kw = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, logprobs=True, top_logprobs=5)
        r = client.chat.completions.create(**kw)
        content = r.choices[0].logprobs.content
        text = r.choices[0].message.content
        joined = b"".join(bytes(t.bytes) for t in content).decode()
        assert joined == text, f"tokens' bytes make {joined!r}, the answer is {text!r}"
        assert all(t.logprob <= 0 and len(t.top_logprobs) == 5 for t in content), "a logprob > 0 or not 5 top"
        assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-6 for t in content), "greedy is not the top token"
        streamed = [t for ch in client.chat.completions.create(**kw, stream=True)
                    if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
        assert [t.token for t in streamed] == [t.token for t in content], "streamed tokens differ"
        assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < 1e-3, "streamed logprobs differ"
        plain = client.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None})
        assert plain.choices[0].message.content == text, f"without logprobs: {plain.choices[0].message.content!r}"
        c = client.completions.create(model=MODEL, prompt="The three primary colors are", max_tokens=8,
                                      temperature=0, logprobs=3).choices[0]
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs), "completions: tokens vs token_logprobs"
        assert all(len(a) == 3 for a in c.logprobs.top_logprobs), "completions: not 3 alternatives per token"
        return f"{len(content)} tokens, first {content[0].token!r} {content[0].logprob:.4f}; completions ok"

    def n_choices() -> str:
        kw = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=1.0)
        both = client.chat.completions.create(n=2, seed=21, **kw)
        alone = [client.chat.completions.create(seed=21 + k, **kw).choices[0].message.content for k in (0, 1)]
        assert [c.message.content for c in both.choices] == alone
        return f"2 choices, each equal to its request alone ({alone[0][:24]!r}, {alone[1][:24]!r})"

    def penalties() -> str:
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write the word cat twenty times."}],
                  max_tokens=40, temperature=0)
        plain = client.chat.completions.create(**kw).choices[0].message.content
        penalized = client.chat.completions.create(frequency_penalty=1.5, presence_penalty=0.5, **kw)
        text = penalized.choices[0].message.content
        assert text, "empty answer"
        return f"plain {plain.count('cat')} x 'cat', penalized {text.count('cat')} x 'cat'"

    return {"models": models, "multi_turn_model_dump": multi_turn, "logprobs": logprobs, "n_2": n_choices,
            "penalties": penalties}


def _tokens_per_s(client: Any, max_tokens: int, **extra: Any) -> float:
    prompt = [{"role": "user", "content": "Tell a long story about a lighthouse keeper."}]
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=max_tokens, temperature=0, **extra)
    return r.usage.completion_tokens / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    import openai

    from servekit.archive import build_archive

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for openai_check.json")
    p.add_argument("--config", type=Path, default=model_config(MODEL), help="model-config (plan) to serve")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request of the speed comparison")
    p.add_argument("--ready-timeout", type=int, default=900, help="seconds for the worker to warm up")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"environment": llm_environment(sys.argv[1:], "servekit.benchmarks.openai_check"),
                               "config": str(args.config), "checks": {}}
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        build_archive(MODEL, store, config=args.config, compress=False)
        with TorchServe(Path(tmp) / "run", store) as ts:
            ts.register(f"{MODEL}.mar", MODEL, timeout=args.ready_timeout)
            client = openai.OpenAI(base_url=f"{ts.inference_url}/predictions/{MODEL}/1.0/v1", api_key="unused",
                                   max_retries=0, timeout=300)
            for name, check in _checks(client, args.max_tokens).items():
                try:
                    results["checks"][name] = {"ok": True, "saw": check()}
                except Exception as e:  # every check runs and is reported
                    results["checks"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
                print(f"{'PASS' if results['checks'][name]['ok'] else 'FAIL'} {name}: "
                      f"{results['checks'][name].get('saw') or results['checks'][name]['error']}", flush=True)
            _tokens_per_s(client, 8)  # warm the paths once
            speed = {"plain": _tokens_per_s(client, args.max_tokens),
                     "logprobs_top5": _tokens_per_s(client, args.max_tokens, logprobs=True, top_logprobs=5),
                     "penalties": _tokens_per_s(client, args.max_tokens, frequency_penalty=0.5)}
            results["tokens_per_s_batch1"] = speed
            print("tokens/s at batch 1 (incl. TTFT):", json.dumps({k: round(v, 1) for k, v in speed.items()}))
    (args.out / "openai_check.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(c["ok"] for c in results["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
