"""A user's model for `servekit archive PATH`: what it is, which of its files an archive needs, and a
model-config to start from.

PATH is a Hugging Face model folder (config.json + safetensors, sharded or not), a
sentence-transformers folder (SentenceTransformer or CrossEncoder), or a `.gguf` file. The kind is
read from the model's own config (`model_type`, `architectures`, `id2label`), never from a name:
an encoder is an embedding model, a `*ForSequenceClassification` (or CrossEncoder) with one label
a reranker, with several labels a classifier. Every problem raises UnsupportedModel or
FileNotFoundError with one line naming what and why, before anything is written.
"""
from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import yaml

from servekit.optimizations.buckets import seq_buckets
from servekit.optimizations.models.classifier import CLASSIFY, RERANK, check_classifier, is_sequence_classifier
from servekit.optimizations.models.encoder import FAMILIES, ROTARY_FAMILIES, UnsupportedModel, check_checkpoint
from servekit.optimizations.models.families import DECODER_FAMILIES
from servekit.optimizations.models.weights import safetensors_files
from servekit.resources import model_config

EMBEDDING, LLM = "embedding", "llm"
# Causal LMs the Llama-family runtime loads (model_type in config.json).
LLM_MODEL_TYPES = tuple(DECODER_FAMILIES)  # optimizations/models/families.py
LLM_TEMPLATES = {"cuda": "smollm2", "cpu": "smollm2-cpu"}  # the shipped model-config an LLM's generated one starts from
# The KV cache a generated LLM config may take: it serves its template's context (8,192 tokens on
# GPUs) or the model's, halved while batchSize rows of it would take more than this (a
# Llama-3.1-8B's 32 rows of 8,192 tokens are 32 GiB in bf16: it gets 4,096), down to
# MIN_GENERATED_CONTEXT. 16 GiB beside an 8B model's weights fits a 40 GB GPU.
GENERATED_KV_CACHE_BYTES = 16 * 2**30
MIN_GENERATED_CONTEXT = 2048
HEADER_LINES = 3  # a generated model-config's header: what it was made from and how to rebuild; then its notes
LLM_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
             "special_tokens_map.json", "chat_template.jinja")
ENCODER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "sentence_bert_config.json")
ST_ROOT_FILES = ("modules.json", "config_sentence_transformers.json")
# Encoders with a task head servekit does not serve: refused rather than served as embeddings.
OTHER_HEADS = {"ForTokenClassification": "a token classifier", "ForQuestionAnswering": "a question-answering model",
               "ForMultipleChoice": "a multiple-choice model"}

# A file for the archive: a Path goes to the archive's top by its name; (Path, "dir/name") keeps a folder.
Weight = Union[Path, tuple[Path, str]]


@dataclass(frozen=True)
class ModelSource:
    kind: str
    files: list[Weight]
    max_tokens: int   # the longest sequence the model takes (positions, or sentence-transformers' limit)
    model_type: str | None = None  # an LLM's decoder family (config.json model_type)
    kv_values: int = 0  # an LLM's keys and values per token, every layer's (its KV cache is this x rows x context)


def sanitize_name(name: str) -> str:
    """A TorchServe model name (letters, digits, '_', '-', '.', starting with a letter or digit)."""
    clean = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-._")
    if not clean:
        raise UnsupportedModel(f"cannot make a model name from {name!r}: give --name")
    return clean


def _config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (a Hugging Face model folder has config.json)")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise UnsupportedModel(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise UnsupportedModel(f"{path}: expected a JSON object")
    return raw


def infer_kind(model_dir: Path) -> str:
    """embedding for the encoders servekit serves, rerank / classify for their sequence classifiers
    (one label / several), llm for Llama-family causal LMs."""
    from servekit.optimizations.models.classifier import read_classifier

    raw = _config(Path(model_dir))
    if is_sequence_classifier(raw, Path(model_dir)):
        return read_classifier(Path(model_dir)).kind
    for arch in raw.get("architectures") or []:
        for suffix, what in OTHER_HEADS.items():
            if str(arch).endswith(suffix):
                raise UnsupportedModel(f"{Path(model_dir) / 'config.json'}: {arch} is {what}; servekit serves "
                                       "sentence embeddings, cross-encoders and sequence classifiers of these encoders")
    if raw.get("model_type") in FAMILIES or raw.get("model_type") in ROTARY_FAMILIES:
        return EMBEDDING
    if raw.get("model_type") in LLM_MODEL_TYPES:
        return LLM
    arch = ", ".join(raw.get("architectures") or []) or "none given"
    raise UnsupportedModel(f"{Path(model_dir) / 'config.json'}: model_type {raw.get('model_type')!r} (architectures: "
                           f"{arch}) is not supported; encoders: {', '.join(sorted({**FAMILIES, **ROTARY_FAMILIES}))}; causal LMs: "
                           f"{', '.join(LLM_MODEL_TYPES)}")


def _here(model_dir: Path, rel: str) -> Weight:
    path = model_dir / rel
    return path if "/" not in rel else (path, rel)


def embedding_source(model_dir: Path) -> ModelSource:
    """The files of a sentence-transformers or plain encoder folder, checked as the runner will read them."""
    from servekit.optimizations.models.sentence_model import read_sentence_model

    model_dir = Path(model_dir)
    spec = read_sentence_model(model_dir)
    base = spec.transformer_path.strip("/")
    prefix = f"{base}/" if base else ""
    enc_dir = model_dir / base
    cfg = check_checkpoint(enc_dir)
    if not (enc_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{enc_dir / 'tokenizer.json'}: missing (a fast tokenizer's tokenizer.json is required)")
    rels = [prefix + name for name in ENCODER_FILES if (enc_dir / name).is_file()]
    rels += [prefix + f.relative_to(enc_dir).as_posix() for f in safetensors_files(enc_dir)]
    rels += [name for name in ST_ROOT_FILES if (model_dir / name).is_file()]
    if spec.described:
        modules = json.loads((model_dir / "modules.json").read_text())
        for m in modules[1:]:
            folder = model_dir / str(m.get("path", ""))
            if str(m.get("path", "")) and folder.is_dir():
                rels += [f.relative_to(model_dir).as_posix() for f in sorted(folder.iterdir())
                         if f.name in ("config.json", "model.safetensors")]
    max_tokens = min(spec.max_seq_length or cfg.max_tokens, cfg.max_tokens)
    return ModelSource(EMBEDDING, [_here(model_dir, r) for r in dict.fromkeys(rels)], max_tokens)


def classifier_source(model_dir: Path, kind: str | None = None) -> ModelSource:
    """The files of a cross-encoder or sequence classifier (Hugging Face or sentence-transformers
    CrossEncoder folder), checked as the runner will read them; `kind` must match what it is."""
    model_dir = Path(model_dir)
    spec = check_classifier(model_dir)
    if kind is not None and kind != spec.kind:
        raise UnsupportedModel(f"{model_dir}: --kind {kind} does not fit a model with {len(spec.labels)} labels "
                               f"(a {spec.kind} model: rerank takes one label used as a score, classify several)")
    if not (model_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{model_dir / 'tokenizer.json'}: missing (a fast tokenizer's tokenizer.json is required)")
    files: list[Weight] = [model_dir / n for n in ENCODER_FILES + ST_ROOT_FILES if (model_dir / n).is_file()]
    files += safetensors_files(model_dir)
    return ModelSource(spec.kind, files, spec.max_tokens)


def llm_source(model_dir: Path) -> ModelSource:
    """The files of a Llama-family causal LM folder (weights, tokenizer, generation and chat settings),
    with the longest context its attention computes (``LlamaConfig.max_context``)."""
    from servekit.optimizations.models.llama import LlamaConfig  # imports torch: only for an LLM

    model_dir = Path(model_dir)
    raw = _config(model_dir)
    if raw.get("model_type") not in LLM_MODEL_TYPES:
        raise UnsupportedModel(f"{model_dir / 'config.json'}: model_type {raw.get('model_type')!r} is not a causal LM "
                               f"servekit serves ({', '.join(LLM_MODEL_TYPES)})")
    if not (model_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{model_dir / 'tokenizer.json'}: missing (a fast tokenizer's tokenizer.json is required)")
    files: list[Weight] = [model_dir / n for n in LLM_FILES if (model_dir / n).is_file()]
    files += safetensors_files(model_dir)
    try:
        config = LlamaConfig.from_hf(raw)
    except (ValueError, KeyError, TypeError):  # the plan's check names what cannot be served, at load
        return ModelSource(LLM, files, int(raw.get("max_position_embeddings") or 2048), raw["model_type"])
    return ModelSource(LLM, files, config.max_context, raw["model_type"],
                       2 * config.n_layers * config.n_kv_heads * config.head_dim)


def model_source(model_dir: Path, kind: str | None = None) -> ModelSource:
    """What `model_dir` is and what its archive ships; `kind` overrides the inferred kind."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: not a model folder or a .gguf file")
    kind = kind or infer_kind(model_dir)
    if kind in (RERANK, CLASSIFY):
        return classifier_source(model_dir, kind)
    return embedding_source(model_dir) if kind == EMBEDDING else llm_source(model_dir)


def fitted_context(n: int, bytes_per_position: int, budget: int = GENERATED_KV_CACHE_BYTES) -> int:
    """``n`` halved while a KV cache of ``bytes_per_position`` per position (every row's) would take
    more than ``budget``, but not below ``MIN_GENERATED_CONTEXT`` (nor raised to it)."""
    while n > MIN_GENERATED_CONTEXT and n * bytes_per_position > budget:
        n = max(n // 2, MIN_GENERATED_CONTEXT)
    return n


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def header_notes(text: str) -> list[str]:
    """What a generated model-config's header says was changed or cut for its model: the comment
    lines after the three every such header opens with."""
    header = [line[2:] for line in itertools.takewhile(lambda line: line.startswith("#"), text.splitlines())]
    return header[HEADER_LINES:]


def generated_config(source: ModelSource, device: str, origin: str, speculation: bool = False
                     ) -> tuple[str, dict[str, Any]]:
    """A model-config for `source` on `device` (cpu or cuda), from the shipped one of its kind, with
    buckets and lengths fitted to the model; `speculation`: with a `speculation` section for the
    heads the archive packs (LLMs). Returns (YAML text with a header, the mapping)."""
    note = ""  # what the plan turns off for this model, said in the header
    if source.kind in (EMBEDDING, RERANK, CLASSIFY):
        if source.kind == EMBEDDING:
            template = "minilm-gpu-fp16-graphs" if device == "cuda" else "minilm"
        else:
            template = "cross-encoder-gpu" if device == "cuda" else "cross-encoder"
        cfg = yaml.safe_load(model_config(template).read_text())
        plan = cfg["servekit"]
        plan["device"] = device
        buckets = plan.setdefault("buckets", {})
        buckets["seq_lens"] = seq_buckets(source.max_tokens, given=buckets.get("seq_lens", ()))
    else:
        template = LLM_TEMPLATES[device]
        cfg = yaml.safe_load(model_config(template).read_text())
        plan = cfg["servekit"]
        n = min(int(plan.get("max_seq_len", 2048)), source.max_tokens)
        rows = int(cfg.get("batchSize", 1))
        per_position = rows * source.kv_values * (4 if plan.get("precision") == "fp32" else 2)  # KV cache bytes
        wanted, n = n, fitted_context(n, per_position)
        plan["max_seq_len"] = n
        if n < source.max_tokens:
            note += (f"# max_seq_len {n} of the model's {source.max_tokens} tokens: raise it here to serve longer prompts\n"
                     "# (the KV cache grows with it: batchSize rows of max_seq_len tokens).\n")
        if n < wanted:
            note += (f"# {rows} rows of {wanted} tokens would take {_gib(wanted * per_position)} of KV cache; "
                     f"{n} tokens take {_gib(n * per_position)}.\n")
        buckets = plan.setdefault("buckets", {})
        for key in ("prompt_lens", "kv_lens"):
            if key in buckets:
                buckets[key] = [v for v in buckets[key] if v < n] + [n]
        if isinstance(plan.get("prefill_chunk"), int) and plan["prefill_chunk"] > n:
            plan["prefill_chunk"] = n
        limits = plan.setdefault("limits", {})
        for key in ("max_tokens", "default_max_tokens"):
            if isinstance(limits.get(key), int):
                limits[key] = min(limits[key], n - 1)
        if speculation:
            plan["speculation"] = {"heads": "speculator", "max_batch": 8}
        family = DECODER_FAMILIES.get(source.model_type or "")
        if family is not None and not family.triton_decode and plan.get("kernels") == "triton":
            plan["kernels"] = "torch"
            note += (f"# kernels: torch, since the fused Triton decode kernels do not cover {source.model_type} blocks\n"
                     "# (optimizations/models/families.py).\n")
    header = (f"# Generated by `servekit archive` for {origin} ({source.kind}, {device}), from the shipped\n"
              f"# config/models/{template}.yaml with buckets fitted to the model's {source.max_tokens} tokens.\n"
              f"# Edit it and rebuild with `servekit archive {origin} --config <this file>`.\n") + note
    return header + yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None), cfg
