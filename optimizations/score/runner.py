"""Cross-encoder and classifier runner: text pairs or texts -> logits, on the fast path an embedding
plan describes (precision, quantization, compile, CUDA graphs per (batch, seq) bucket, chunks of
least cost), with the same load order as the embedding runner: fp32 eager reference on the golden
set -> precision -> quantization -> compile -> warm-up of every bucket -> accuracy gate.

Tokenization gives what the model's fast tokenizer gives with truncation `longest_first` at the
model's limit, as sentence-transformers' CrossEncoder and transformers' pipelines tokenize: a pair
longer than the limit loses tokens from its longer text first (from both once they are equally
long). Each distinct text of a batch is tokenized once and pairs are assembled from those tokens
(optimizations/score/tokens.py), checked at start against the tokenizer's own pair encoding.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch

from servekit.optimizations.bucketed import BucketedForward
from servekit.optimizations.buckets import Chunk, seq_buckets
from servekit.optimizations.device import DTYPES, capability, pick_device
from servekit.optimizations.embed.runner import GOLDEN_TEXTS, load_tokenizer
from servekit.optimizations.models.classifier import apply_activation, load_classifier
from servekit.optimizations.plan import Plan, PlanError, resolve_for_device
from servekit.optimizations.quantize import quantize
from servekit.optimizations.score.tokens import PairTokenizer, Tokens

log = logging.getLogger(__name__)


def score_tolerance(plan: Plan) -> float:
    """Largest error of an activated score on the golden set that the accuracy gate lets through:
    ten times the embedding gate's cosine shortfall (fp32 1e-3, fp16/bf16 1e-2, quantized 0.1)."""
    return 10 * (1.0 - plan.accuracy_threshold)


class ScoreRunner:
    """Pairs (cross-encoders) or texts (classifiers) -> logits as the model's own files define them."""

    def __init__(self, model_dir: Path, plan: Plan, golden_texts: Sequence[str] | None = None) -> None:
        t0 = time.perf_counter()
        self.device = pick_device(plan.device)
        self.plan, self.downgrades = resolve_for_device(plan, self.device.type, capability(self.device))
        for msg in self.downgrades:
            log.warning("plan downgraded (fallback: eager): %s", msg)
        model_dir = Path(model_dir)
        model, self.spec = load_classifier(model_dir)
        self.pad_id = model.encoder.cfg.pad_token_id
        self.model_max_tokens = self.spec.max_tokens
        self.buckets = self.plan.buckets
        if not self.buckets.seq_lens:
            self.buckets = replace(self.buckets, seq_lens=tuple(seq_buckets(self.model_max_tokens)))
            self.plan = replace(self.plan, buckets=self.buckets)
        if self.buckets.max_seq > model.encoder.cfg.max_tokens:
            raise PlanError(f"servekit.buckets.seq_lens: {self.buckets.max_seq} exceeds the model's "
                            f"{model.encoder.cfg.max_tokens} positions")
        self.max_tokens = min(self.model_max_tokens, self.buckets.max_seq)
        if self.max_tokens < self.model_max_tokens:
            log.warning("buckets stop at %d tokens while the model accepts %d: longer inputs are cut at %d",
                        self.max_tokens, self.model_max_tokens, self.max_tokens)
        tokenizer = load_tokenizer(model_dir / "tokenizer.json", self.spec.do_lower_case)
        golden = list(golden_texts) if golden_texts is not None else GOLDEN_TEXTS.read_text().splitlines()
        self.pairs = PairTokenizer(tokenizer, self.max_tokens, self.spec.pair_types, self.plan.tokenizer_cache,
                                   probes=golden)
        golden_pairs = list(zip(golden[::2], golden[1::2]))
        golden_ids = self.tokenize(golden_pairs if self.spec.kind == "rerank" else golden)
        model = model.to(self.device)
        self.forward = BucketedForward(model, self.plan, self.device, self.pad_id, typed=True)
        reference = self.scores(self.logits(golden_ids[0], golden_ids[1]))

        model = quantize(model.to(DTYPES[self.plan.precision]), self.plan.quantization)
        self.load_s = time.perf_counter() - t0
        self.warmup_s = self.forward.optimize(model)
        err = float((self.scores(self.logits(golden_ids[0], golden_ids[1])) - reference).abs().max())
        self.accuracy = {"max_abs_err": err, "tolerance": score_tolerance(self.plan)}
        if err > score_tolerance(self.plan):
            raise PlanError(f"accuracy gate: plan {self.plan.label()} scores the golden set up to {err:.3g} away from "
                            f"the fp32 eager reference, more than its tolerance {score_tolerance(self.plan):.3g}")
        self.forward.mark_warm()
        log.info("effective plan %s on %s (%s, %d labels): load %.1fs, warm-up %.1fs, accuracy %s", self.plan.label(),
                 self.device, self.spec.kind, len(self.spec.labels), self.load_s, self.warmup_s, self.accuracy)

    # -- serving path -------------------------------------------------------------------------
    def tokenize(self, inputs: Sequence[str | tuple[str, str]]) -> Tokens:
        """Model inputs of texts and (query, document) pairs, each distinct text tokenized once: a text
        cut at its end, a pair `longest_first`, to `max_tokens`; and which were cut."""
        return self.pairs.encode(inputs)

    def chunks(self, seqs: Sequence[Sequence[int]]) -> list[Chunk]:
        """The forward passes `logits` would cut `seqs` into (eager: exact length-sorted runs)."""
        return self.forward.chunks([len(s) for s in seqs])

    def logits(self, seqs: Sequence[Sequence[int]], type_splits: Sequence[int],
               chunks: Sequence[Chunk] | None = None) -> torch.Tensor:
        """Logits (n, labels) as float32 on the CPU; one device-to-host copy for the whole batch.
        `type_splits`: each input's first position of token type 1, as `tokenize` gives them."""
        out = self.forward.run(seqs, type_splits, chunks)
        return torch.empty(0, len(self.spec.labels)) if out is None else out

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's scores from its logits: a cross-encoder's relevance (n,), a classifier's (n, labels)."""
        scores = apply_activation(logits, self.spec.activation)
        return scores[:, 0] if self.spec.kind == "rerank" else scores

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> torch.Tensor:
        ids, types, _ = self.tokenize(pairs)
        return self.scores(self.logits(ids, types))

    def classify(self, texts: Sequence[str]) -> torch.Tensor:
        ids, types, _ = self.tokenize(texts)
        return self.scores(self.logits(ids, types))

    def recompiles(self) -> int:
        """Graphs compiled since warm-up finished; 0 while serving stays on captured buckets."""
        return self.forward.recompiles()

    def report(self) -> dict:
        return {"plan": self.plan.label(), "device": str(self.device), "downgrades": self.downgrades,
                "kind": self.spec.kind, "labels": list(self.spec.labels), "activation": self.spec.activation,
                "max_tokens": self.max_tokens, "model_max_tokens": self.model_max_tokens,
                "load_s": round(self.load_s, 3), "warmup_s": round(self.warmup_s, 3), "accuracy": self.accuracy,
                "buckets": self.forward.bucket_stats,
                "pair_encoding": "assembled" if self.pairs.assembled else f"library: {self.pairs.off_reason}",
                "segment_cache": self.pairs.segments.off_reason or "on"}
