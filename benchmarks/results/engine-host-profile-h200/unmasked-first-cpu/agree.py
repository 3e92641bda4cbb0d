"""How often a grammar row's sample without its mask is the sample with it, under the same noise
(the engine's Gumbel-max sampling: where the unmasked winner is allowed, it also wins masked), for
SmolLM2-135M-Instruct (fp32, CPU) answering the structured benchmark's 24 schemas in one engine.
A decoder that sampled without masks and masked only the rows whose token the grammar refuses would
give the same tokens, but a step of 32 rows needs every row to agree to skip the second sampling.
From the checkout's root:

    python benchmarks/results/engine-host-profile-h200/unmasked-first-cpu/agree.py 0.8
"""
import sys
from pathlib import Path

import yaml

from servekit.benchmarks.llm_inprocess import plan_runner
from servekit.benchmarks.structured_bench import SCHEMAS
from servekit.optimizations.llm import grammar, sampling
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.continuous import ContinuousBatcher
from servekit.optimizations.llm.generate import SamplingParams
from servekit.optimizations.llm.plan import stop_token_ids

temperature = float(sys.argv[1])
runner, plan, model_dir = plan_runner(yaml.safe_load(Path("config/models/smollm2-cpu.yaml").read_text())["servekit"])
tok = ChatTokenizer(model_dir)
stops = tuple(stop_token_ids(model_dir, tok))
compiler = grammar.GrammarCompiler(tok, runner.model.config.vocab_size, stops)
stat = {"rows": 0, "agree": 0, "steps": 0, "steps_all_agree": 0}
masked_sample = sampling.sample_torch


def both(logits, params, position, mode="filter", packed=None):
    """The engine's sample (with the packed masks), and the same rows' sample without them, compared."""
    out = masked_sample(logits, params, position, mode, packed)
    if packed is not None:
        unmasked = masked_sample(logits, params, position, mode, None)
        grammar_rows = (packed != -1).any(dim=1)
        n = int(grammar_rows.sum())
        if n:
            same = int(((out == unmasked) & grammar_rows).sum())
            stat["rows"] += n
            stat["agree"] += same
            stat["steps"] += 1
            stat["steps_all_agree"] += same == n
    return out


sampling.sample_torch = both
engine = ContinuousBatcher(runner, min(32, runner.max_batch))
for i, (_, topic, schema) in enumerate(SCHEMAS):
    prompt = tok.encode_chat([{"role": "user", "content": f"Describe {topic} as JSON."}])
    engine.add(i, prompt, SamplingParams(max_tokens=128, temperature=temperature, seed=i, stop_token_ids=stops,
                                         constraint=compiler.constraint(grammar.GrammarSpec.of(grammar.JSON, schema))))
tokens = 0
while engine.has_work:
    tokens += sum(len(u.tokens) for u in engine.step().values())
print(f"temperature {temperature}: {tokens} tokens; {stat}; a masked sample equals the unmasked one for "
      f"{stat['agree'] / max(1, stat['rows']):.3f} of grammar rows' samples; "
      f"{stat['rows'] / max(1, stat['steps']):.1f} grammar rows a step")
