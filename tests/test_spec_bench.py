"""spec_bench's runs beside a constrained row (CPU): a tiny random Llama with SmolLM2's vocabulary and
tokenizer, random speculator heads, the structured benchmark's schemas compiled for that tokenizer."""
from __future__ import annotations

import pytest
import torch

from servekit.benchmarks import spec_bench
from servekit.benchmarks.structured_bench import SCHEMAS
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
from servekit.optimizations.llm.grammar import JSON, GrammarCompiler, GrammarSpec
from servekit.optimizations.llm.speculative import SpeculativeDecoding, Speculator, SpeculatorConfig
from servekit.optimizations.models.gguf_weights import smollm2_archive_files
from servekit.optimizations.models.llama import LlamaConfig, init_random

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

VOCAB = 49152  # SmolLM2's


def test_free_rows_beside_a_constrained_row_take_plain_steps_until_it_ends() -> None:
    tokenizer = ChatTokenizer(smollm2_archive_files(torch.bfloat16)[0].parent)
    stops = (tokenizer.eos_token_id,)
    model = init_random(LlamaConfig.tiny(vocab_size=VOCAB), seed=0)
    base = LlamaRunner(model, max_seq_len=256, batch_buckets=(1, 2), prefill_buckets=(16, 32, 64),
                       kv_buckets=(128, 256))
    heads = Speculator(SpeculatorConfig.for_model(model, n_heads=2)).reset_parameters(seed=1, random_out=True)
    spec = SpeculativeDecoding(base, heads, max_spec_batch=2)
    spec.warmup()
    compiler = GrammarCompiler(tokenizer, VOCAB, stops)
    constrained = [SamplingParams(max_tokens=40, stop_token_ids=stops,
                                  constraint=compiler.constraint(GrammarSpec.of(JSON, schema)))
                   for _, _, schema in SCHEMAS[:2]]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": f"Tell me about {topic}."}])
               for _, topic, _ in SCHEMAS[:3]]
    free = SamplingParams(max_tokens=40, stop_token_ids=())  # the free rows run past the constrained answers
    r = spec_bench.beside_constrained(base, spec, prompts, 2, 2, free, constrained)
    assert r["batch"] == 2 and r["free_rows"] == 2
    alone, beside = r["speculative, free rows alone"], r["speculative, beside a constrained row"]
    assert alone["verified_share"] > beside["verified_share"] >= 0.0, r
    assert r["plain, free rows alone"]["verified_share"] == r["plain, beside a constrained row"]["verified_share"] == 0
    assert 0 < beside["constrained_tokens_mean"] <= 40 and alone["constrained_tokens_mean"] is None
    assert all(v["free_tok_per_s_per_seq"] > 0 for k, v in r.items() if isinstance(v, dict))


def test_the_constrained_batches_need_a_free_row(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        spec_bench.main(["--out", str(tmp_path), "--tiny", "--constrained-batches", "1"])
    assert "each batch needs a free row" in capsys.readouterr().err
