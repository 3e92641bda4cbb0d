"""Tiny random sequence classifiers saved the way users' models are: transformers' `save_pretrained`
for `*ForSequenceClassification` checkpoints, sentence-transformers' `CrossEncoder.save()` for
cross-encoder folders; and their reference scores from those libraries."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from tiny_encoders import tokenizer

FAMILIES = ("bert", "roberta", "xlm-roberta", "distilbert", "mpnet")
QUERIES = ["what is the river", "how many people live in paris"]
DOCUMENTS = ["the river ocean mountain", "paris is a big city", "hello world", "a",
             "the big red dog ran fast on the mat " * 5, "how many people live in london berlin paris " * 4]
TEXTS = ["the cat sat on the mat", "hello world", "the big red dog ran fast on the mat " * 6, "a"]


def _typed_pairs(tok, family: str):
    """A BERT tokenizer as bert-base's own: class BertTokenizer, a pair's second text token type 1 (so
    that transformers and sentence-transformers pass token types and the cross-encoder's token type
    embeddings are exercised). Other families' tokenizers pass none."""
    from tokenizers import processors
    from transformers import BertTokenizerFast

    if family != "bert":
        return tok
    cls, sep = tok.cls_token, tok.sep_token
    backend = tok.backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, tok.cls_token_id), (sep, tok.sep_token_id)])
    specials = {k: getattr(tok, k) for k in ("pad_token", "unk_token", "cls_token", "sep_token", "mask_token")}
    return BertTokenizerFast(tokenizer_object=backend, **specials)


def hf_classifier(path: Path, family: str, labels: Sequence[str] = ("score",), problem_type: str | None = None,
                  seed: int = 0, max_positions: int = 80) -> Path:
    """A random tiny `*ForSequenceClassification` of `family` with `labels` (id2label)."""
    from transformers import (BertConfig, BertForSequenceClassification, DistilBertConfig,
                              DistilBertForSequenceClassification, MPNetConfig, MPNetForSequenceClassification,
                              RobertaConfig, RobertaForSequenceClassification, XLMRobertaConfig,
                              XLMRobertaForSequenceClassification)

    tok, vocab = tokenizer(family)
    tok = _typed_pairs(tok, family)
    heads = dict(id2label=dict(enumerate(labels)), label2id={v: k for k, v in enumerate(labels)},
                 num_labels=len(labels), problem_type=problem_type)
    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                  **heads)
    torch.manual_seed(seed)
    if family == "bert":
        model = BertForSequenceClassification(BertConfig(**common, max_position_embeddings=max_positions))
    elif family == "roberta":
        model = RobertaForSequenceClassification(RobertaConfig(**common, max_position_embeddings=max_positions + 2,
                                                               pad_token_id=1))
    elif family == "xlm-roberta":
        model = XLMRobertaForSequenceClassification(XLMRobertaConfig(**common, max_position_embeddings=max_positions + 2,
                                                                     pad_token_id=1))
    elif family == "mpnet":
        model = MPNetForSequenceClassification(MPNetConfig(**common, max_position_embeddings=max_positions + 2,
                                                           pad_token_id=1))
    elif family == "distilbert":
        model = DistilBertForSequenceClassification(DistilBertConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=4,
                                                                     hidden_dim=48, max_position_embeddings=max_positions,
                                                                     **heads))
    else:
        raise ValueError(family)
    # Random init leaves LayerNorms at 1/0 and biases at 0: perturb every tensor so that each one matters.
    # The head is redrawn larger, so that scores spread well beyond the parity tolerance.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("classifier", "pre_classifier", "bert.pooler")):
                p.copy_(torch.randn_like(p) * 0.5 if p.dim() > 1 else torch.zeros_like(p))  # no bias: no saturation
            else:
                p.add_(torch.randn_like(p) * 0.05)
    model.eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path


def cross_encoder(path: Path, family: str, max_length: int = 24, seed: int = 0) -> Path:
    """A sentence-transformers CrossEncoder folder (one label, sigmoid) around a tiny `family` model."""
    from sentence_transformers import CrossEncoder

    hf = hf_classifier(path.parent / f"{path.name}-hf", family, seed=seed)
    CrossEncoder(str(hf), max_length=max_length, device="cpu").save(str(path))
    return path


def ce_scores(path: Path, pairs: Sequence[tuple[str, str]]) -> torch.Tensor:
    """`CrossEncoder.predict` of `pairs` (fp32, CPU): the scores the reranker must reproduce."""
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(path), device="cpu")
    return torch.as_tensor(ce.predict(list(pairs), convert_to_numpy=True)).float()


def hf_logits(path: Path, texts: Sequence[str], max_length: int | None = None) -> torch.Tensor:
    """transformers' own classifier logits (n, labels) for single texts, truncated as its tokenizer does."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    enc = tok(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits.float()
