"""Sentence-embedding runner: tokenizer + encoder + the model's own pooling head, built from an
optimization plan.

Load order: fp32 eager reference on the golden set -> precision -> quantization -> compile ->
warm-up of every shape bucket (CUDA-graph capture when asked) -> accuracy gate. After `__init__`
returns, no compilation or capture happens while serving (`recompiles()` counts any that do).
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field, replace
from importlib.resources import files
from pathlib import Path
from typing import Hashable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from servekit.optimizations.bucketed import BucketedForward
from servekit.optimizations.buckets import Chunk, seq_buckets
from servekit.optimizations.models.encoder import Encoder, UnsupportedModel, load_encoder
from servekit.optimizations.models.pooling import SentenceHead
from servekit.optimizations.models.sentence_model import SentenceModel, read_sentence_model
from servekit.optimizations.device import DTYPES, capability, pick_device
from servekit.optimizations.plan import Plan, PlanError, resolve_for_device
from servekit.optimizations.quantize import quantize
from servekit.optimizations.embed.segment_cache import SegmentCache

log = logging.getLogger(__name__)
# Package data (importlib.resources): found the same way in a checkout, a wheel and an archive.
GOLDEN_TEXTS = Path(str(files("servekit.optimizations"))) / "data" / "golden_texts.txt"


class SentenceEncoder(nn.Module):
    """Token ids + attention mask -> sentence embeddings: the encoder and the model's pooling head in
    one module, so that compile and CUDA graphs take the whole pipeline."""

    def __init__(self, encoder: Encoder, head: SentenceHead) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(input_ids, attention_mask), attention_mask)


def load_tokenizer(path: Path, lower_case: bool) -> Tokenizer:
    """The model's fast tokenizer, without padding or truncation (the runner pads to buckets and
    cuts itself); lower-casing added in front when sentence_bert_config.json asks for it, as
    sentence-transformers does."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (a fast tokenizer's tokenizer.json is required)")
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    if lower_case:
        from tokenizers import normalizers

        current = tokenizer.normalizer
        tokenizer.normalizer = normalizers.Sequence([normalizers.Lowercase()] + ([current] if current else []))
    return tokenizer


def special_tokens(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after a text ([CLS] / [SEP], <s> / </s>)."""
    for probe in ("hello", "a", "the", "x"):
        plain = tokenizer.encode(probe, add_special_tokens=False).ids
        full = tokenizer.encode(probe).ids
        for k in range(len(full) - len(plain) + 1):
            if plain and full[k:k + len(plain)] == plain:
                return full[:k], full[k + len(plain):]
    raise UnsupportedModel("cannot tell the tokenizer's special tokens apart from a text's own")


@dataclass(frozen=True)
class Inputs:
    """One request's inputs: texts (each behind the named prompt, or the model's default one), or
    token-id lists without special tokens (OpenAI token-array inputs) used as given."""
    texts: Sequence[str] = ()
    token_ids: Sequence[Sequence[int]] | None = None
    prompt_name: str | None = None


@dataclass(frozen=True)
class Refusal:
    """Why `encode` left a request out: an input longer than the model serves (`too_long`, with
    `reject_too_long`), or more tokens in all than `max_request_tokens` (`too_many_tokens`)."""
    reason: str
    index: int = 0    # too_long: the first input that is
    tokens: int = 0   # too_many_tokens: the request's tokens


@dataclass
class Batch:
    """A batch of requests ready for `embed`: every kept input's model ids, each request's span of
    them and token count, the forward passes that cover them, and the requests left out."""
    ids: list[list[int]] = field(default_factory=list)
    spans: dict[Hashable, tuple[int, int]] = field(default_factory=dict)
    tokens: dict[Hashable, int] = field(default_factory=dict)
    chunks: list[Chunk] = field(default_factory=list)
    refused: dict[Hashable, Refusal] = field(default_factory=dict)

    @property
    def computed_tokens(self) -> int:
        """Token positions the passes compute, padding included."""
        return sum(c.batch * c.seq for c in self.chunks)


class EmbeddingRunner:
    """Texts or token ids -> sentence embeddings as the model's own files define them, on the fast
    path the plan describes."""

    def __init__(self, model_dir: Path, plan: Plan, golden_texts: Sequence[str] | None = None) -> None:
        t0 = time.perf_counter()
        self.device = pick_device(plan.device)
        self.plan, self.downgrades = resolve_for_device(plan, self.device.type, capability(self.device))
        for msg in self.downgrades:
            log.warning("plan downgraded (fallback: eager): %s", msg)
        self.buckets = self.plan.buckets
        model_dir = Path(model_dir)
        self.spec: SentenceModel = read_sentence_model(model_dir)
        encoder_dir = model_dir / self.spec.transformer_path
        encoder = load_encoder(encoder_dir)
        self.tokenizer = load_tokenizer(encoder_dir / "tokenizer.json", self.spec.do_lower_case)
        self.prefix, self.suffix = special_tokens(self.tokenizer)
        golden = list(golden_texts) if golden_texts is not None else GOLDEN_TEXTS.read_text().splitlines()
        self.segments = SegmentCache(self.tokenizer, self.plan.tokenizer_cache, probes=golden)
        self.pad_id = encoder.cfg.pad_token_id
        self.vocab_size = encoder.cfg.vocab_size
        # What the model accepts (sentence-transformers' max_seq_length, capped by its positions) and,
        # within that, what the buckets cover: longer inputs are cut there (or refused: too_long).
        self.model_max_tokens = min(self.spec.max_seq_length or encoder.cfg.max_tokens, encoder.cfg.max_tokens)
        if not self.buckets.seq_lens:  # the plan names none: up to the model's own limit
            self.buckets = replace(self.buckets, seq_lens=tuple(seq_buckets(self.model_max_tokens)))
            self.plan = replace(self.plan, buckets=self.buckets)
        if self.buckets.max_seq > encoder.cfg.max_tokens:
            raise PlanError(f"servekit.buckets.seq_lens: {self.buckets.max_seq} exceeds the model's "
                            f"{encoder.cfg.max_tokens} positions")
        self.max_tokens = min(self.model_max_tokens, self.buckets.max_seq)
        if self.max_tokens < self.model_max_tokens:
            log.warning("buckets stop at %d tokens while the model accepts %d: longer inputs are cut at %d "
                        "(add seq_lens up to %d to cover the model)", self.max_tokens, self.model_max_tokens,
                        self.max_tokens, self.model_max_tokens)
        self._model_key = hashlib.sha256((encoder_dir / "config.json").read_bytes() + repr(self.spec).encode()).hexdigest()[:12]
        model = SentenceEncoder(encoder, SentenceHead(model_dir, self.spec)).eval().to(self.device)
        golden_ids = self.tokenize(golden)[0]
        self.forward = BucketedForward(model, self.plan, self.device, self.pad_id)
        reference = self.embed_ids(golden_ids)
        self._dim = reference.shape[1]

        model = quantize(model.to(DTYPES[self.plan.precision]), self.plan.quantization)
        self.load_s = time.perf_counter() - t0
        self.warmup_s = self.forward.optimize(model, self._model_key)
        got = self.embed_ids(golden_ids)
        self.accuracy = accuracy_report(got, reference)
        if self.accuracy["mean_cosine"] < self.plan.accuracy_threshold:
            raise PlanError(
                f"accuracy gate: plan {self.plan.label()} has mean cosine {self.accuracy['mean_cosine']:.6f} "
                f"to the fp32 eager reference, below its threshold {self.plan.accuracy_threshold} "
                f"(max abs error {self.accuracy['max_abs_err']:.3g})")
        self.forward.mark_warm()
        log.info("effective plan %s on %s: load %.1fs, warm-up %.1fs, accuracy %s",
                 self.plan.label(), self.device, self.load_s, self.warmup_s, self.accuracy)

    # -- serving path -------------------------------------------------------------------------
    def prompt(self, name: str | None) -> str:
        """The text put before each input: the named prompt, else the model's default prompt, else none."""
        name = name if name is not None else self.spec.default_prompt_name
        return self.spec.prompts[name] if name is not None else ""

    def tokenize(self, texts: Sequence[str], prompt_name: str | None = None) -> tuple[list[list[int]], list[bool]]:
        """Model input ids per text (prompt prepended, special tokens around it) cut to `max_tokens`
        as the tokenizer's own truncation cuts, and which were cut."""
        prompt = self.prompt(prompt_name)
        return self.wrap(self.encode_texts([prompt + t for t in texts]))

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's own tokens, without special tokens and uncut."""
        # Most of a bulk request's worker time was the tokenizer's (benchmarks/results/worker-overhead-cpu):
        # cached segments make it a few dictionary lookups per text where the tokenizer allows it.
        return self.segments.encode(texts)

    def wrap(self, token_lists: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[bool]]:
        """A text's tokens (no special tokens, e.g. an OpenAI token-array input) -> model input ids:
        special tokens around them, the text cut so that the whole fits `max_tokens`; and which were cut."""
        room = self.max_tokens - len(self.prefix) - len(self.suffix)
        out, cut = [], []
        for ids in token_lists:
            cut.append(len(ids) > room)
            out.append(self.prefix + list(ids[:room]) + self.suffix)
        return out, cut

    def encode(self, requests: Mapping[Hashable, Inputs], reject_too_long: bool = False,
               max_request_tokens: int | None = None) -> Batch:
        """A batch's requests -> model inputs, in one tokenizer call for all their texts: prompts
        prepended, special tokens around each input, each cut to `max_tokens` (or its request
        refused, with `reject_too_long`); requests of more than `max_request_tokens` refused; and
        the forward passes of least cost over what is kept."""
        texts = [self.prompt(r.prompt_name) + t for r in requests.values() if r.token_ids is None for t in r.texts]
        text_tokens = iter(self.encode_texts(texts))
        batch = Batch()
        for key, r in requests.items():
            own = list(r.token_ids) if r.token_ids is not None else [next(text_tokens) for _ in r.texts]
            ids, cut = self.wrap(own)
            n = sum(map(len, ids))
            if reject_too_long and any(cut):
                batch.refused[key] = Refusal("too_long", index=cut.index(True))
            elif max_request_tokens is not None and n > max_request_tokens:
                batch.refused[key] = Refusal("too_many_tokens", tokens=n)
            else:
                batch.spans[key] = (len(batch.ids), len(batch.ids) + len(ids))
                batch.tokens[key] = n
                batch.ids.extend(ids)
        batch.chunks = self.forward.chunks([len(s) for s in batch.ids])
        return batch

    def embed_batch(self, batch: Batch) -> dict[Hashable, np.ndarray]:
        """Each kept request's embeddings (n, dim), float32; one device-to-host copy for the batch.
        A device failure raises: `embed_each` then tells which request it was."""
        vectors = self.embed_ids(batch.ids, batch.chunks).numpy()
        return {key: vectors[a:b] for key, (a, b) in batch.spans.items()}

    def embed_each(self, batch: Batch) -> dict[Hashable, np.ndarray | Exception]:
        """After a failed batch: each request on its own, so only a request that fails alone fails."""
        out: dict[Hashable, np.ndarray | Exception] = {}
        for key, (a, b) in batch.spans.items():
            try:
                out[key] = self.embed_ids(batch.ids[a:b]).numpy()
            except Exception as e:
                log.exception("inference failed for request %s of the batch (%d texts)", key, b - a)
                out[key] = e
        return out

    def measure_speed(self) -> tuple[float, float]:
        """(tokens embedded, characters tokenized) per second on this worker now: full-length inputs
        (one on CPU, where time grows with the batch; a full batch bucket elsewhere) and text of words
        never seen (the segment cache does not help a hostile request either). Each the best of a
        few runs: the device's speed, not a moment of contention."""
        n = 1 if self.device.type == "cpu" else self.buckets.max_batch
        seqs, _ = self.wrap([self.encode_texts(["the"])[0] * self.max_tokens] * n)
        tokens_per_s = sum(map(len, seqs)) / _best_seconds(lambda: self.embed_ids(seqs))
        rng = np.random.default_rng(0)
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
        texts = [" ".join("".join(rng.choice(letters, 7)) for _ in range(2500)) for _ in range(3)]
        unseen = iter(texts)  # a new text each run: no run finds the previous one's words cached
        chars_per_s = len(texts[0]) / _best_seconds(lambda: self.encode_texts([next(unseen)]), reps=len(texts))
        return tokens_per_s, chars_per_s

    def chunks(self, seqs: Sequence[Sequence[int]]) -> list[Chunk]:
        """The forward passes `embed_ids` would cut `seqs` into (eager: exact length-sorted runs)."""
        return self.forward.chunks([len(s) for s in seqs])

    def embed_ids(self, seqs: Sequence[Sequence[int]], chunks: Sequence[Chunk] | None = None) -> torch.Tensor:
        """Embeddings (n, dim) as float32 on the CPU; one device-to-host copy for the whole batch."""
        out = self.forward.run(seqs, chunks=chunks)
        return torch.empty(0, 0) if out is None else out

    def recompiles(self) -> int:
        """Graphs compiled since warm-up finished; 0 while serving stays on captured buckets."""
        return self.forward.recompiles()

    def embed(self, texts: Sequence[str], prompt_name: str | None = None) -> torch.Tensor:
        return self.embed_ids(self.tokenize(texts, prompt_name)[0])

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def normalized(self) -> bool:
        """Whether embeddings are L2-normalised (the model has a Normalize module last)."""
        return self.spec.normalized

    def report(self) -> dict:
        """What was loaded and how: logged at start-up and recorded by benchmarks."""
        return {"plan": self.plan.label(), "device": str(self.device), "downgrades": self.downgrades,
                "pooling": list(self.spec.pooling), "normalized": self.normalized, "max_tokens": self.max_tokens,
                "model_max_tokens": self.model_max_tokens, "prompts": sorted(self.spec.prompts),
                "load_s": round(self.load_s, 3), "warmup_s": round(self.warmup_s, 3),
                "compile_cache_hit": self.forward.compile_cache_hit, "accuracy": self.accuracy,
                "segment_cache": "on" if self.segments.enabled else f"off: {self.segments.off_reason}",
                "buckets": self.forward.bucket_stats}


def _best_seconds(work, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return max(min(times), 1e-6)


def accuracy_report(got: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    cos = F.cosine_similarity(got.float(), reference.float(), dim=1)
    return {"mean_cosine": round(float(cos.mean()), 6), "min_cosine": round(float(cos.min()), 6),
            "max_abs_err": float((got.float() - reference.float()).abs().max())}
