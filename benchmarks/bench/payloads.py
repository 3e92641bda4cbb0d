"""Request bodies for a run: a JSONL file (one body per line), one fixed body, synthetic texts, or
generated chat prompts (benchmarks/llm_prompts.py); optionally with top-level keys set in every
body (`payloads.set`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from servekit.benchmarks.bench.schema import Payloads, SchemaError

# A neutral vocabulary for synthetic texts (the shipped file benchmarks/payloads/texts.jsonl is
# more realistic; this is for quick sweeps with a controlled length mix).
WORDS = ("the model serves requests from many clients while the queue grows and shrinks with traffic "
         "every batch pads its texts to the nearest bucket so compiled graphs are reused a worker answers "
         "each request with a vector that captures the meaning of the text users search documents "
         "support tickets product reviews and short questions in several languages").split()


def load_bodies(p: Payloads, streamed: bool = False) -> list[str]:
    """Each body serialised once, as it will be sent. `streamed`: every body must ask for a
    server-sent-events answer (`"stream": true`), the answers `request.stream: sse` reads."""
    where, texts = _read(p)
    bodies = [json.loads(t) for t in texts]
    if p.set_keys:
        for n, b in enumerate(bodies):
            if not isinstance(b, dict):
                raise SchemaError(f"payloads.set: {where(n)} is not a JSON object to set keys in")
            b.update(p.set_keys)
        texts = [json.dumps(b, ensure_ascii=False) for b in bodies]
    if streamed:
        for n, b in enumerate(bodies):
            if not (isinstance(b, dict) and b.get("stream") is True):
                raise SchemaError(f"payloads: {where(n)} lacks \"stream\": true, which `request.stream: sse` needs "
                                  "(or add it to every body with `payloads.set: {stream: true}`)")
    return texts


def _read(p: Payloads) -> tuple[Callable[[int], str], list[str]]:
    """(body index -> where it came from, for errors; each body as given)."""
    if p.file is not None:
        lines, texts = [], []
        for n, line in enumerate(p.file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except ValueError as e:
                raise SchemaError(f"payloads.file: {p.file}:{n}: not a JSON value ({e})") from None
            lines.append(n)
            texts.append(line.strip())
        if not texts:
            raise SchemaError(f"payloads.file: {p.file} holds no request bodies")
        return (lambda k: f"{p.file}:{lines[k]}"), texts
    if p.chat is not None:
        return (lambda k: f"generated chat body {k}"), chat_bodies(p.chat)
    if p.generate is None:
        return (lambda k: "payloads.body"), [json.dumps(p.body)]
    g = p.generate
    rng = np.random.default_rng(g["seed"])
    w = np.asarray(g["weights"], dtype=float)
    lengths = rng.choice(g["words"], size=g["count"], p=w / w.sum())
    if g.get("text") == "prose":
        texts = prose_texts(rng, lengths, max(g["words"]))
    else:
        texts = [" ".join(rng.choice(WORDS, size=int(n))) for n in lengths]
    return (lambda k: f"generated body {k}"), [json.dumps({g["field"]: t}) for t in texts]


def prose_texts(rng: np.random.Generator, lengths: Sequence[int], longest: int) -> list[str]:
    """Runs of English prose (the stdlib's docstrings, `llm_prompts.corpus`) of ``lengths`` words,
    each from a random start at least ``longest`` words before the corpus ends."""
    from servekit.benchmarks.llm_prompts import corpus

    prose = " ".join(" ".join(p) for p in corpus()).split()
    starts = rng.integers(0, len(prose) - longest, size=len(lengths))
    return [" ".join(prose[s:s + int(n)]) for s, n in zip(starts, lengths)]


def chat_bodies(c: dict[str, Any]) -> list[str]:
    """`payloads.chat`: streamed greedy chat bodies of a prompt set, every prompt a different text."""
    from servekit.benchmarks import llm_prompts

    count = None
    if c["tokenizer"] == "smollm2":
        import torch

        from servekit.optimizations.models.gguf_weights import smollm2_archive_files

        count = llm_prompts.tokenizer_counter(smollm2_archive_files(torch.bfloat16)[0].parent)
    elif c["tokenizer"] is not None:
        count = llm_prompts.tokenizer_counter(c["tokenizer"])
    gen = llm_prompts.PromptGenerator(c["seed"], count, max_seq_len=c["max_seq_len"])
    n, top = c["count"], c["max_tokens"]
    prompts = {"short": lambda: gen.short(n, top), "passages": lambda: gen.passages(n, top),
               "mixed": lambda: gen.mixed(n, (min(32, top), top))}[c["set"]]()
    return llm_prompts.chat_bodies(prompts)


def body_texts(body: Any) -> list[str]:
    """The texts of one embedding request body: {"text": ..}, {"texts": ..}, {"input": ..} (a string
    or a list of strings), or a bare JSON string or list; [] for anything else."""
    value = body
    if isinstance(body, dict):
        value = next((body[k] for k in ("input", "text", "texts") if k in body), None)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(t, str) for t in value):
        return list(value)
    return []


def regroup(bodies: list[str], n: int, field: str | None = None) -> list[str]:
    """The bodies' texts, in order, as requests of exactly `n` texts each: every text once (the rest
    of a division dropped), or the texts cycled into one request when there are fewer than `n`.
    Each request keeps the first body's other keys and its text field (`input`, `text` or `texts`,
    as the first body names it; `text` for bare bodies; `field` chooses another, e.g. `input` for
    the `/v1/embeddings` route)."""
    parsed = [json.loads(b) for b in bodies]
    texts = [t for b in parsed for t in body_texts(b)]
    if not texts:
        raise SchemaError("sweep.texts_per_request: the payloads hold no texts to regroup")
    first = next((b for b in parsed if isinstance(b, dict) and body_texts(b)), None)
    template = {k: v for k, v in (first or {}).items() if k not in ("input", "text", "texts")}
    field = field or next((k for k in ("input", "text", "texts") if first is not None and k in first), "text")
    count = max(1, len(texts) // n)
    out = []
    for r in range(count):
        group = [texts[(r * n + k) % len(texts)] for k in range(n)]
        out.append(json.dumps({**template, field: group}, ensure_ascii=False))
    return out


def describe(bodies: list[str]) -> dict[str, Any]:
    """Length mix of the bodies (characters of each body), and their `max_tokens` range if they give one."""
    chars = np.array([len(b) for b in bodies])
    out: dict[str, Any] = {"count": len(bodies), "chars_p50": float(np.median(chars)),
                           "chars_p90": float(np.percentile(chars, 90)), "chars_max": int(chars.max())}
    limits = [b.get("max_tokens") for b in map(json.loads, bodies) if isinstance(b, dict)]
    limits = [m for m in limits if isinstance(m, int) and not isinstance(m, bool)]
    if limits:
        out.update(max_tokens_min=min(limits), max_tokens_max=max(limits))
    return out


def write_bodies(bodies: list[str], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(bodies) + "\n")
    return path
