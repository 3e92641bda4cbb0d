"""How often a JSON schema's grammar refuses the token a model picks without the grammar's mask:
the share of steps at which sampling first and masking only on a refusal would have to go back.

Each schema of the structured benchmark (benchmarks/structured_bench.py) with its prompt, as the
served benchmark sends them (the prompt names a topic, not the schema), decoded under llguidance's
mask on the model's own tokenizer; at every step the token picked from the unmasked logits is
compared with the one picked under the mask, with the same Gumbel noise (so "allowed" means "the
same token"). Greedy and sampled (temperature 0.8, the served benchmark's).

    python -m servekit.benchmarks.grammar_refusals ~/.cache/servekit/smollm2-135m-instruct-bfloat16
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from servekit.benchmarks.structured_bench import PROMPTS, SCHEMAS
from servekit.optimizations.llm.grammar import JSON_FORMAT


def allowed_tokens(matcher: llguidance.LLMatcher, vocab: int) -> torch.Tensor:
    """The matcher's next-token mask as booleans ``(vocab,)``."""
    words = torch.empty(1, (vocab + 31) // 32, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.shape[1] * 4)
    bits = (words[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].bool()


def decode(model: Any, hf: Any, tokenizer: llguidance.LLTokenizer, schema: dict, prompt: str,
           temperature: float, max_tokens: int, gen: torch.Generator) -> tuple[int, int]:
    """One constrained answer; returns (steps, steps whose unmasked pick the grammar refused)."""
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT))
    ids = hf.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                 return_tensors="pt", return_dict=True)["input_ids"]
    vocab = model.config.vocab_size
    past, steps, refused = None, 0, 0
    for _ in range(max_tokens):
        with torch.no_grad():
            out = model(input_ids=ids, cache=past, use_cache=True)
        past, logits = out.cache, out.logits[0, -1].float()
        if temperature > 0:
            u = torch.rand(logits.shape, generator=gen).clamp_(1e-10, 1.0)
            logits = logits / temperature - torch.log(-torch.log(u))
        masked = logits.masked_fill(~allowed_tokens(matcher, vocab), float("-inf"))
        token = int(masked.argmax())
        steps += 1
        refused += int(logits.argmax()) != token
        if not matcher.consume_token(token) or matcher.is_stopped():
            break
        ids = torch.tensor([[token]])
    return steps, refused


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
    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=model.config.vocab_size)
    res: dict[str, Any] = {"model_dir": str(args.model_dir), "schemas": len(SCHEMAS)}
    for name, temperature in (("greedy", 0.0), ("sampled", 0.8)):
        gen = torch.Generator().manual_seed(args.seed)
        steps = refused = 0
        for i, (schema_name, topic, schema) in enumerate(SCHEMAS):
            s, r = decode(model, hf, tokenizer, schema, PROMPTS[i % len(PROMPTS)].format(topic=topic), temperature,
                          args.max_tokens, gen)
            steps, refused = steps + s, refused + r
            print(f"  {name} {schema_name}: {r} of {s} steps refused", flush=True)
        res[name] = {"steps": steps, "refused": refused, "share": round(refused / steps, 4)}
        print(f"{name}: the grammar refused the unmasked pick at {refused} of {steps} steps "
              f"({100 * refused / steps:.1f}%)", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
