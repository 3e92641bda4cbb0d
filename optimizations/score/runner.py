"""Cross-encoder and classifier runner: text pairs or texts -> logits, on the fast path an embedding
plan describes (precision, quantization, compile, CUDA graphs per (batch, seq) bucket, chunks of
least cost), with the same load order as the embedding runner: fp32 eager reference on the golden
set -> precision -> quantization -> compile -> warm-up of every bucket -> accuracy gate.

Tokenization is the model's fast tokenizer with truncation `longest_first` at the model's limit,
as sentence-transformers' CrossEncoder and transformers' pipelines tokenize: a pair longer than
the limit loses tokens from its longer text first (from both once they are equally long).
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from servekit.optimizations.buckets import Chunk, exact_chunks, plan_chunks, seq_buckets, token_cost
from servekit.optimizations.device import DTYPES, capability, pick_device
from servekit.optimizations.embed.runner import (GOLDEN_TEXTS, _cache_env, _replay_seconds, _sdpa_context, _to_host,
                                                 load_tokenizer, pad_chunk, unique_graphs)
from servekit.optimizations.models.classifier import (ClassifierSpec, SequenceClassifier, apply_activation,
                                                      load_classifier)
from servekit.optimizations.plan import Plan, PlanError, resolve_for_device
from servekit.optimizations.quantize import quantize

log = logging.getLogger(__name__)
# Tokens of one input: ids, token types, and whether truncation cut it.
Tokens = tuple[list[list[int]], list[list[int]], list[bool]]


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
        self.tokenizer = load_tokenizer(model_dir / "tokenizer.json", self.spec.do_lower_case)
        self.tokenizer.enable_truncation(self.max_tokens, strategy="longest_first")
        golden = list(golden_texts) if golden_texts is not None else GOLDEN_TEXTS.read_text().splitlines()
        golden_pairs = list(zip(golden[::2], golden[1::2]))
        golden_ids = self.tokenize(golden_pairs if self.spec.kind == "rerank" else golden)
        model = model.to(self.device)
        self._forward = self._eager_forward(model)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], torch.Tensor]] = {}
        self._replay_s: dict[tuple[int, int], float] = {}
        reference = self.scores(self.logits(golden_ids[0], golden_ids[1]))

        model = quantize(model.to(DTYPES[self.plan.precision]), self.plan.quantization)
        self._forward = self._eager_forward(model)
        if self.plan.compile != "off":
            self._forward = self._compiled_forward(self._forward)
        self.load_s = time.perf_counter() - t0
        self.bucket_stats: list[dict] = []
        t1 = time.perf_counter()
        if self.plan.warmup or self.plan.cuda_graphs or self.plan.compile != "off":
            self._warm_up()
        self.warmup_s = time.perf_counter() - t1
        err = float((self.scores(self.logits(golden_ids[0], golden_ids[1])) - reference).abs().max())
        self.accuracy = {"max_abs_err": err, "tolerance": score_tolerance(self.plan)}
        if err > score_tolerance(self.plan):
            raise PlanError(f"accuracy gate: plan {self.plan.label()} scores the golden set up to {err:.3g} away from "
                            f"the fp32 eager reference, more than its tolerance {score_tolerance(self.plan):.3g}")
        self._graphs_baseline = unique_graphs()
        log.info("effective plan %s on %s (%s, %d labels): load %.1fs, warm-up %.1fs, accuracy %s", self.plan.label(),
                 self.device, self.spec.kind, len(self.spec.labels), self.load_s, self.warmup_s, self.accuracy)

    # -- forward variants ---------------------------------------------------------------------
    def _eager_forward(self, model: SequenceClassifier) -> Callable[..., torch.Tensor]:
        attention = self.plan.attention

        def forward(ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
            with torch.no_grad(), _sdpa_context(attention):
                return model(ids, mask, types)

        return forward

    def _compiled_forward(self, forward: Callable) -> Callable:
        import torch._dynamo

        limit = len(self.buckets.shapes()) + 4
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))
        if self.plan.compile_cache:
            # Inductor's and Triton's own on-disk caches: a later worker loads kernels instead of compiling.
            _cache_env("TORCHINDUCTOR_CACHE_DIR", Path(self.plan.compile_cache) / "inductor")
            _cache_env("TRITON_CACHE_DIR", Path(self.plan.compile_cache) / "triton")
        return torch.compile(forward, mode=None if self.plan.compile == "default" else self.plan.compile,
                             dynamic=True, fullgraph=True)

    def _warm_up(self) -> None:
        pool = torch.cuda.graph_pool_handle() if self.plan.cuda_graphs else None
        for b, s in self.buckets.shapes():
            t = time.perf_counter()
            ids = torch.full((b, s), self.pad_id, dtype=torch.long, device=self.device)
            mask = torch.ones((b, s), dtype=torch.long, device=self.device)
            types = torch.zeros((b, s), dtype=torch.long, device=self.device)
            for _ in range(2 if (self.plan.cuda_graphs or self.plan.compile != "off") else 1):
                self._forward(ids, mask, types)
            if self.plan.cuda_graphs:
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(ids, mask, types)
                self._graphs[(b, s)] = (graph, (ids, mask, types), out)
                self._replay_s[(b, s)] = _replay_seconds(graph, self.device)
            self.bucket_stats.append({"batch": b, "seq": s, "capture_s": round(time.perf_counter() - t, 4),
                                      "replay_ms": round(self._replay_s[(b, s)] * 1e3, 4)
                                      if (b, s) in self._replay_s else None})

    # -- serving path -------------------------------------------------------------------------
    def _unpack(self, encodings: list) -> Tokens:
        typed = self.spec.pair_types
        return ([e.ids for e in encodings], [e.type_ids if typed else [0] * len(e.ids) for e in encodings],
                [bool(e.overflowing) for e in encodings])

    def tokenize(self, inputs: Sequence[str | tuple[str, str]]) -> Tokens:
        """Model inputs of texts and (query, document) pairs in one tokenizer call: a text cut at its
        end, a pair `longest_first`, to `max_tokens`; and which were cut."""
        return self._unpack(self.tokenizer.encode_batch(list(inputs)))

    def chunks(self, seqs: Sequence[Sequence[int]]) -> list[Chunk]:
        """Forward passes for `seqs`: eager plans pad each length-sorted run only to its longest input;
        compiled or captured ones pad to buckets, cut by least replay time (or padded positions)."""
        lengths = [len(s) for s in seqs]
        if self.plan.compile == "off" and not self.plan.cuda_graphs:
            return exact_chunks(lengths, self.buckets.max_batch)
        replay = self._replay_s
        cost = (lambda b, s: replay[(b, s)]) if replay else token_cost
        return plan_chunks(lengths, self.buckets.batch_sizes, self.buckets.seq_lens, cost)

    def logits(self, seqs: Sequence[Sequence[int]], types: Sequence[Sequence[int]],
               chunks: Sequence[Chunk] | None = None) -> torch.Tensor:
        """Logits (n, labels) as float32 on the CPU; one device-to-host copy for the whole batch."""
        chunks = self.chunks(seqs) if chunks is None else chunks
        parts, order = [], []
        for chunk in chunks:
            ids, mask = pad_chunk(seqs, chunk, self.pad_id)
            type_ids, _ = pad_chunk(types, chunk, 0)
            parts.append(self._run(chunk.batch, chunk.seq, ids, mask, type_ids)[: len(chunk.indices)])
            order.extend(chunk.indices)
        if not parts:
            return torch.empty(0, len(self.spec.labels))
        out = _to_host(torch.cat(parts).float())
        result = torch.empty_like(out)
        result[torch.as_tensor(order, dtype=torch.long)] = out
        return result

    def _run(self, b: int, s: int, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        graph = self._graphs.get((b, s))
        if graph is None:
            return self._forward(*(t.to(self.device, non_blocking=True) for t in (ids, mask, types)))
        g, static, out = graph
        for dst, src in zip(static, (ids, mask, types)):
            dst.copy_(src, non_blocking=True)
        g.replay()
        return out.clone()  # the next replay overwrites `out`

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
        return unique_graphs() - self._graphs_baseline

    def report(self) -> dict:
        return {"plan": self.plan.label(), "device": str(self.device), "downgrades": self.downgrades,
                "kind": self.spec.kind, "labels": list(self.spec.labels), "activation": self.spec.activation,
                "max_tokens": self.max_tokens, "model_max_tokens": self.model_max_tokens,
                "load_s": round(self.load_s, 3), "warmup_s": round(self.warmup_s, 3), "accuracy": self.accuracy,
                "buckets": self.bucket_stats}
