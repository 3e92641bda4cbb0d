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
