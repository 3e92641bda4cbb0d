"""Sequence classifiers on the servekit encoders: cross-encoders (one label, a relevance score) and
multi-class / multi-label classifiers, from a Hugging Face `*ForSequenceClassification` checkpoint
or a sentence-transformers `CrossEncoder` folder.

The encoder is `optimizations/models/encoder.py`'s; the head on its first token is what each
family's transformers class computes:

- BERT: the pooler (dense + tanh), then `classifier`.
- RoBERTa / XLM-RoBERTa / MPNet: `classifier.dense` + tanh, then `classifier.out_proj`.
- DistilBERT: `pre_classifier` + ReLU, then `classifier`.

What the scores mean is read from the model's own files: `id2label`, `problem_type` and, for a
cross-encoder, the activation sentence-transformers applies (`activation_fn` in
`config_sentence_transformers.json` or `config.json`; sigmoid for one label when none is given).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from servekit.optimizations.models.encoder import (FAMILIES, Encoder, EncoderConfig, UnsupportedModel,
                                                   check_checkpoint, load_encoder)
from servekit.optimizations.models.weights import INDEX, safetensors_files

RERANK, CLASSIFY = "rerank", "classify"
PROBLEM_TYPES = ("single_label_classification", "multi_label_classification", "regression")
# sentence-transformers' activation names (a CrossEncoder's `activation_fn`) -> what servekit applies.
SCORE_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity",
                     "torch.nn.modules.activation.Tanh": "tanh"}
# Family -> (first dense layer, output layer) tensor prefixes and the activation between them.
HEADS = {"bert": ("bert.pooler.dense", "classifier", "tanh"),
         "roberta": ("classifier.dense", "classifier.out_proj", "tanh"),
         "mpnet": ("classifier.dense", "classifier.out_proj", "tanh"),
         "distilbert": ("pre_classifier", "classifier", "relu")}
_NO_LIMIT = 1_000_000  # a tokenizer's model_max_length above this is transformers' "no limit"


@dataclass(frozen=True)
class ClassifierSpec:
    """What a sequence classifier computes and how its scores read."""
    kind: str                     # RERANK (one label: a relevance score) or CLASSIFY (several labels)
    family: str
    labels: tuple[str, ...]       # id2label, in id order
    activation: str               # on the logits: sigmoid, identity, tanh (RERANK); softmax, sigmoid, identity
    max_tokens: int               # the longest input (both texts of a pair and special tokens together)
    do_lower_case: bool = False
    pair_types: bool = False      # a pair's second text is token type 1 (BERT: its tokenizer passes token types)

    @property
    def multi_label(self) -> bool:
        return self.kind == CLASSIFY and self.activation == "sigmoid"


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise UnsupportedModel(f"{path}: not valid JSON ({e})") from None


def st_cross_encoder(model_dir: Path) -> dict[str, Any] | None:
    """sentence-transformers' `config_sentence_transformers.json` of a CrossEncoder folder, else None."""
    path = Path(model_dir) / "config_sentence_transformers.json"
    if not path.is_file():
        return None
    raw = _json(path)
    return raw if isinstance(raw, dict) and raw.get("model_type") == "CrossEncoder" else None


def is_sequence_classifier(raw: dict[str, Any], model_dir: Path) -> bool:
    """Whether a config.json mapping (of `model_dir`) describes a sequence classifier: a
    `*ForSequenceClassification` architecture, or a sentence-transformers CrossEncoder folder."""
    archs = raw.get("architectures") or []
    return any(str(a).endswith("ForSequenceClassification") for a in archs) or st_cross_encoder(model_dir) is not None


def _labels(raw: dict[str, Any], where: Path) -> tuple[str, ...]:
    id2label = raw.get("id2label")
    if id2label is None:
        n = raw.get("num_labels", 2)
        if not isinstance(n, int) or n < 1:
            raise UnsupportedModel(f"{where}: num_labels must be a positive integer, got {n!r}")
        return tuple(f"LABEL_{i}" for i in range(n))
    if not isinstance(id2label, dict) or not id2label:
        raise UnsupportedModel(f"{where}: id2label must be a non-empty mapping of label ids to names")
    try:
        ids = sorted(int(k) for k in id2label)
    except ValueError:
        raise UnsupportedModel(f"{where}: id2label keys must be label ids 0..n-1, got {sorted(id2label)[:3]}") from None
    if ids != list(range(len(ids))):
        raise UnsupportedModel(f"{where}: id2label keys must be label ids 0..{len(ids) - 1}, got {ids[:5]}")
    return tuple(str(id2label[str(i)] if str(i) in id2label else id2label[i]) for i in ids)


def _declared_activation(raw: dict[str, Any], model_dir: Path) -> str | None:
    """The activation sentence-transformers stored for a CrossEncoder (any of its versions' places)."""
    st = st_cross_encoder(model_dir) or {}
    nested = raw.get("sentence_transformers")
    for value in (st.get("activation_fn"), nested.get("activation_fn") if isinstance(nested, dict) else None,
                  raw.get("sbert_ce_default_activation_function")):
        if value is not None:
            return str(value)
    return None


def _max_tokens(model_dir: Path, cfg: EncoderConfig) -> tuple[int, bool]:
    """The input limit sentence-transformers applies (sentence_bert_config.json's max_seq_length, else
    the tokenizer's model_max_length), capped by the position table; and its do_lower_case."""
    sbert = model_dir / "sentence_bert_config.json"
    st = _json(sbert) if sbert.is_file() else {}
    st = st if isinstance(st, dict) else {}
    limit = st.get("max_seq_length")
    if not isinstance(limit, int):
        tok = model_dir / "tokenizer_config.json"
        limit = (_json(tok) if tok.is_file() else {}).get("model_max_length")
    if isinstance(limit, (int, float)) and 0 < limit < _NO_LIMIT:
        return min(int(limit), cfg.max_tokens), bool(st.get("do_lower_case", False))
    return cfg.max_tokens, bool(st.get("do_lower_case", False))


def _passes_token_types(model_dir: Path) -> bool:
    """Whether the model's tokenizer, loaded by transformers, passes token types to the model (what
    sentence-transformers and transformers then feed): its `model_input_names`, else BERT's own
    tokenizer classes do and a generic one does not."""
    path = model_dir / "tokenizer_config.json"
    raw = _json(path) if path.is_file() else {}
    raw = raw if isinstance(raw, dict) else {}
    if isinstance(raw.get("model_input_names"), list):
        return "token_type_ids" in raw["model_input_names"]
    return str(raw.get("tokenizer_class", "")).startswith("BertTokenizer")


def read_classifier(model_dir: Path, cfg: EncoderConfig | None = None) -> ClassifierSpec:
    """The classifier in `model_dir`: kind, labels, activation and length limit from its own files.
    UnsupportedModel names what is not served and why."""
    model_dir = Path(model_dir)
    where = model_dir / "config.json"
    if not where.is_file():
        raise FileNotFoundError(f"{where}: missing (a Hugging Face model folder has config.json)")
    raw = _json(where)
    if not isinstance(raw, dict):
        raise UnsupportedModel(f"{where}: expected a JSON object")
    if raw.get("model_type") not in FAMILIES:
        arch = ", ".join(raw.get("architectures") or []) or "none given"
        raise UnsupportedModel(f"{where}: a sequence classifier of model_type {raw.get('model_type')!r} (architectures: "
                               f"{arch}) is not supported; sequence classifiers: {', '.join(sorted(FAMILIES))}")
    modules = model_dir / "modules.json"
    if modules.is_file():
        listed = _json(modules)
        if not isinstance(listed, list) or len(listed) != 1 or str(listed[0].get("path", "")) not in ("", "."):
            raise UnsupportedModel(f"{modules}: a CrossEncoder folder is one Transformer module at the folder's top; "
                                   f"got {len(listed) if isinstance(listed, list) else 'no'} modules")
    cfg = cfg or EncoderConfig.from_json(where)
    labels = _labels(raw, where)
    problem = raw.get("problem_type")
    if problem is not None and problem not in PROBLEM_TYPES:
        raise UnsupportedModel(f"{where}: problem_type {problem!r} is not one of {', '.join(PROBLEM_TYPES)}")
    if len(labels) == 1:
        declared = _declared_activation(raw, model_dir)
        if declared is not None and declared not in SCORE_ACTIVATIONS:
            raise UnsupportedModel(f"{where}: cross-encoder activation {declared!r} is not supported; supported: "
                                   f"{', '.join(a.rsplit('.', 1)[1] for a in SCORE_ACTIVATIONS)}")
        kind, activation = RERANK, SCORE_ACTIVATIONS[declared] if declared else "sigmoid"
    else:
        kind = CLASSIFY
        activation = {"multi_label_classification": "sigmoid", "regression": "identity"}.get(problem, "softmax")
    max_tokens, lower = _max_tokens(model_dir, cfg)
    return ClassifierSpec(kind, cfg.family, labels, activation, max_tokens, lower,
                          pair_types=cfg.family == "bert" and _passes_token_types(model_dir))


def apply_activation(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """Scores from logits (n, labels) as the model's activation defines them."""
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    if activation == "tanh":
        return torch.tanh(logits)
    return logits


class ClassifierHead(nn.Module):
    """The first token's hidden state -> dense -> activation -> logits, as each family's head is built."""

    def __init__(self, hidden: int, n_labels: int, activation: str) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, n_labels)
        self.act = torch.tanh if activation == "tanh" else F.relu

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.dense(hidden[:, 0])))


class SequenceClassifier(nn.Module):
    """Token ids, attention mask and token types (batch, seq) -> logits (batch, labels)."""

    def __init__(self, encoder: Encoder, head: ClassifierHead) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(input_ids, attention_mask, token_type_ids, first_only=True))


def _head_names(family: str) -> dict[str, str]:
    """Checkpoint tensor name -> ClassifierHead parameter name."""
    dense, out, _ = HEADS[family]
    return {f"{src}.{p}": f"{dst}.{p}" for src, dst in ((dense, "dense"), (out, "out")) for p in ("weight", "bias")}


def _head_tensors(model_dir: Path, family: str) -> dict[str, torch.Tensor]:
    """The head's tensors, read by name from the checkpoint's files (only those bytes)."""
    from safetensors import safe_open

    names = _head_names(family)
    found: dict[str, torch.Tensor] = {}
    for f in safetensors_files(model_dir):
        if f.name == INDEX:
            continue
        with safe_open(str(f), framework="pt") as st:
            for key in set(st.keys()) & set(names):
                found[names[key]] = st.get_tensor(key).float()
    missing = sorted(k for k, v in names.items() if v not in found)
    if missing:
        raise UnsupportedModel(f"{model_dir}: checkpoint lacks the {family} classification head's tensor {missing[0]!r}")
    return found


def check_classifier(model_dir: Path) -> ClassifierSpec:
    """Check, without loading tensor data, that `model_dir` holds a classifier servekit serves."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    spec = read_classifier(model_dir, check_checkpoint(model_dir))
    names: dict[str, tuple[int, ...]] = {}
    for f in safetensors_files(model_dir):
        if f.name != INDEX:
            with safe_open(str(f), framework="pt") as st:
                names.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    for key in _head_names(spec.family):
        if key not in names:
            raise UnsupportedModel(f"{model_dir}: checkpoint lacks the {spec.family} classification head's tensor {key!r}")
    out = HEADS[spec.family][1] + ".weight"
    if names[out][0] != len(spec.labels):
        raise UnsupportedModel(f"{model_dir}: {out} has {names[out][0]} outputs but config.json names "
                               f"{len(spec.labels)} labels")
    return spec


def load_classifier(model_dir: Path) -> tuple[SequenceClassifier, ClassifierSpec]:
    """The classifier of `model_dir` in fp32 on the CPU, and what its scores mean."""
    model_dir = Path(model_dir)
    encoder = load_encoder(model_dir)
    spec = read_classifier(model_dir, encoder.cfg)
    head = ClassifierHead(encoder.cfg.hidden_size, len(spec.labels), HEADS[spec.family][2])
    state = _head_tensors(model_dir, spec.family)
    if state["out.weight"].shape[0] != len(spec.labels):
        raise UnsupportedModel(f"{model_dir}: the head has {state['out.weight'].shape[0]} outputs but config.json "
                               f"names {len(spec.labels)} labels")
    head.load_state_dict(state, strict=True)
    return SequenceClassifier(encoder, head).eval(), spec
