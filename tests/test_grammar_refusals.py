"""benchmarks/grammar_refusals.py on the tiny random SmolLM2: the masks it reads are llguidance's,
and the count it reports is the steps whose unmasked pick the grammar would have refused."""
from __future__ import annotations

import json
from pathlib import Path

import llguidance
import llguidance.hf
import pytest
import torch
from transformers import AutoTokenizer

from servekit.benchmarks import grammar_refusals
from servekit.optimizations.llm.grammar import JSON_FORMAT


def test_allowed_tokens_are_llguidances_mask(tiny_smollm2: list[Path]) -> None:
    """The packed words read back as booleans are llguidance's own one-byte-per-token mask, at the
    start of a document and inside it."""
    hf = AutoTokenizer.from_pretrained(tiny_smollm2[0].parent)
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 8}},
              "required": ["n", "s"]}
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT))
    for text in ("", '{"n": 12, "s": "ab'):
        for t in hf.encode(text, add_special_tokens=False) if text else []:
            assert matcher.consume_token(t)
        allowed, us = grammar_refusals.timed_mask(matcher, len(hf))
        assert us > 0 and torch.equal(allowed, grammar_refusals.allowed_tokens(matcher, len(hf)))
        own = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[:len(hf)] > 0
        assert torch.equal(allowed, own) and 0 < int(allowed.sum()) < len(hf), text
        matcher.reset()


def test_a_random_model_is_refused_and_every_answer_ends(tiny_smollm2: list[Path], tmp_path: Path) -> None:
    """A random model's unmasked first pick is not JSON's opening: each schema's first step is a
    refusal; the masked answers still go on for several steps."""
    out = tmp_path / "refusals.json"
    assert grammar_refusals.main([str(tiny_smollm2[0].parent), "--max-tokens", "4", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for mode in ("greedy", "sampled"):
        r = res[mode]
        assert res["schemas"] <= r["refused"] <= r["steps"] <= 4 * res["schemas"], r
        assert r["steps"] > res["schemas"] and r["share"] == pytest.approx(r["refused"] / r["steps"], abs=1e-4)
        # Every step with a choice whose pick ranks below the largest k was checked and its mask timed.
        checked = r["host_us"]["check"]["n"]
        assert checked == r["host_us"]["mask"]["n"] <= r["steps"] - r["forced"]
        assert checked == 0 or r["host_us"]["check"]["mean"] > 0
        assert r["check_took_another_token"] == 0  # the first candidate taken is the masked pick
        assert r["tokens_per_step_with_runs_after_sampled"] >= r["tokens_per_step_with_runs"] >= 1.0


def test_a_folder_without_a_model_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        grammar_refusals.main([str(tmp_path)])
    assert "no config.json" in capsys.readouterr().err


def test_the_rank_report_counts_the_rows_a_candidate_check_would_leave_to_a_mask() -> None:
    """Ranks of masked picks among the unmasked scores: refusals are ranks above 0, forced steps
    stay out of the per-k shares, and a row past k in a step of 32 is 1 - (1 - share) ** 32 likely."""
    r = grammar_refusals.rank_report([(0, False, 0), (3, False, 0), (5, True, 2), (70, False, 0)])
    assert (r["steps"], r["refused"], r["forced"], r["share"]) == (4, 3, 1, 0.75)
    assert r["past_k"]["1"] == pytest.approx(2 / 3, abs=1e-4) and r["past_k"]["4"] == pytest.approx(1 / 3, abs=1e-4)
    assert r["past_k"]["64"] == pytest.approx(1 / 3, abs=1e-4) and r["past_k"]["256"] == 0
    assert r["any_of_32_rows_past_k"]["4"] == pytest.approx(1 - (2 / 3) ** 32, abs=1e-4)
    assert r["any_of_32_rows_past_k"]["256"] == 0


def test_a_forced_run_of_two_or_more_goes_in_one_step() -> None:
    """Runs from positions 1 (3 tokens) and 4 (2): six tokens in three steps; a run of one saves nothing."""
    assert grammar_refusals.steps_with_runs([0, 3, 0, 0, 2, 0]) == 3
    assert grammar_refusals.steps_with_runs([1, 1, 0]) == 3 and grammar_refusals.steps_with_runs([]) == 0


def test_a_run_fed_beside_the_sampled_token_before_it_saves_that_step_too() -> None:
    """As the engine decodes: the token at 0 is sampled and the run after it (positions 1-2) fed in
    its forward, then 3 is sampled; a run of one after a sampled token goes with it as well."""
    assert grammar_refusals.steps_with_runs_after([0, 2, 0, 0]) == 2
    assert grammar_refusals.steps_with_runs_after([1, 1, 0]) == 2
    assert grammar_refusals.steps_with_runs_after([0, 0, 0]) == 3 and grammar_refusals.steps_with_runs_after([]) == 0
