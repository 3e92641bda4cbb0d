"""Sentence-embedding runner: tokenizer + BERT encoder built from an optimization plan.

Load order: fp32 eager reference on the golden set -> precision -> quantization -> compile ->
warm-up of every shape bucket (CUDA-graph capture when asked) -> accuracy gate. After `__init__`
returns, no compilation or capture happens while serving (`recompiles()` counts any that do).
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from contextlib import nullcontext
from importlib.resources import files
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from servekit.optimizations.bert import BertEncoder, load_bert, mean_pool_normalize
from servekit.optimizations.buckets import Chunk, plan_chunks
from servekit.optimizations.device import DTYPES, capability, pick_device
from servekit.optimizations.plan import Plan, PlanError, resolve_for_device
from servekit.optimizations.quantize import quantize

log = logging.getLogger(__name__)
# Package data (importlib.resources): found the same way in a checkout, a wheel and an archive.
GOLDEN_TEXTS = Path(str(files(__package__))) / "data" / "golden_texts.txt"


def _sdpa_context(attention: str):
    if attention == "auto":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[attention]
    return sdpa_kernel([backend])


def _cache_env(name: str, directory: Path) -> None:
    """Point a compiler cache at `directory` unless the environment chose one. Inductor writes its
    default into TORCHINDUCTOR_CACHE_DIR the first time anything asks for it (loading, quantizing),
    so that value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get(name)
    if current is None or (name == "TORCHINDUCTOR_CACHE_DIR" and current == os.path.abspath(default_cache_dir())):
        os.environ[name] = str(directory)


def unique_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a new one while serving = a recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class EmbeddingRunner:
    """Texts -> L2-normalised sentence embeddings, on the fast path the plan describes."""

    def __init__(self, model_dir: Path, plan: Plan, golden_texts: Sequence[str] | None = None) -> None:
        t0 = time.perf_counter()
        self.device = pick_device(plan.device)
        self.plan, self.downgrades = resolve_for_device(plan, self.device.type, capability(self.device))
        for msg in self.downgrades:
            log.warning("plan downgraded (fallback: eager): %s", msg)
        self.buckets = self.plan.buckets
        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.pad_id = self.tokenizer.token_to_id("[PAD]") or 0
        self.sep_id = self.tokenizer.token_to_id("[SEP]")
        model = load_bert(Path(model_dir)).to(self.device)
        if self.buckets.max_seq > model.cfg.max_position_embeddings:
            raise PlanError(f"servekit.buckets.seq_lens: {self.buckets.max_seq} exceeds the model's "
                            f"{model.cfg.max_position_embeddings} positions")
        golden = list(golden_texts) if golden_texts is not None else GOLDEN_TEXTS.read_text().splitlines()
        golden_ids = self.tokenize(golden)[0]
        self._forward = self._eager_forward(model)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        reference = self.embed_ids(golden_ids)
        self._dim = reference.shape[1]
        self.compile_cache_hit = False

        model = model.to(DTYPES[self.plan.precision])
        model = quantize(model, self.plan.quantization)
        self._forward = self._eager_forward(model)
        if self.plan.compile != "off":
            self._forward = self._compiled_forward(self._forward)
        self.load_s = time.perf_counter() - t0
        self.bucket_stats: list[dict] = []
        t1 = time.perf_counter()
        if self.plan.warmup or self.plan.cuda_graphs or self.plan.compile != "off":
            self._warm_up()
        self._save_compile_cache()
        self.warmup_s = time.perf_counter() - t1
        self._graphs_baseline = unique_graphs()
        got = self.embed_ids(golden_ids)
        self.accuracy = accuracy_report(got, reference)
        if self.accuracy["mean_cosine"] < self.plan.accuracy_threshold:
            raise PlanError(
                f"accuracy gate: plan {self.plan.label()} has mean cosine {self.accuracy['mean_cosine']:.6f} "
                f"to the fp32 eager reference, below its threshold {self.plan.accuracy_threshold} "
                f"(max abs error {self.accuracy['max_abs_err']:.3g})")
        self._graphs_baseline = unique_graphs()
        log.info("effective plan %s on %s: load %.1fs, warm-up %.1fs, accuracy %s",
                 self.plan.label(), self.device, self.load_s, self.warmup_s, self.accuracy)

    # -- forward variants ---------------------------------------------------------------------
    def _eager_forward(self, model: BertEncoder) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        attention = self.plan.attention

        def forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            with torch.no_grad(), _sdpa_context(attention):
                return mean_pool_normalize(model(ids, mask), mask)

        return forward

    def _compiled_forward(self, forward: Callable) -> Callable:
        import torch._dynamo

        # dynamic=True: one graph covers every bucket (batch 1 may get its own), so start-up does not
        # compile once per shape; CUDA graphs then remove the launch overhead per bucket. The limit
        # is raised anyway so that no bucket can silently fall back to eager.
        limit = len(self.buckets.shapes()) + 4
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))
        self._load_compile_cache()
        return torch.compile(forward, mode=None if self.plan.compile == "default" else self.plan.compile,
                             dynamic=True, fullgraph=True)

    # -- compile cache ------------------------------------------------------------------------
    def _cache_file(self) -> Path | None:
        if not self.plan.compile_cache or self.plan.compile == "off":
            return None
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        key = f"{torch.__version__}|{name}|{self.plan.label()}|{self.buckets.shapes()}"
        return Path(self.plan.compile_cache) / f"minilm-{hashlib.sha256(key.encode()).hexdigest()[:16]}.bin"

    def _load_compile_cache(self) -> None:
        if self.plan.compile_cache and self.plan.compile != "off":
            # Inductor's and Triton's own on-disk caches (FX graphs, kernels) go to the same volume,
            # so a new worker also skips kernel compilation; a directory set from outside wins.
            _cache_env("TORCHINDUCTOR_CACHE_DIR", Path(self.plan.compile_cache) / "inductor")
            _cache_env("TRITON_CACHE_DIR", Path(self.plan.compile_cache) / "triton")
        path = self._cache_file()
        self.compile_cache_hit = bool(path and path.exists())
        if self.compile_cache_hit:
            torch.compiler.load_cache_artifacts(path.read_bytes())
            log.info("compile cache loaded from %s", path)

    def _save_compile_cache(self) -> None:
        path = self._cache_file()
        if path is None or path.exists():
            return
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(artifacts[0])
            log.info("compile cache saved to %s", path)

    # -- warm-up and CUDA graphs --------------------------------------------------------------
    def _warm_up(self) -> None:
        pool = torch.cuda.graph_pool_handle() if self.plan.cuda_graphs else None
        for b, s in self.buckets.shapes():
            t = time.perf_counter()
            mem0 = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
            ids = torch.full((b, s), self.pad_id, dtype=torch.long, device=self.device)
            mask = torch.ones((b, s), dtype=torch.long, device=self.device)
            # Compiling and graph capture need a pass or two first; eager needs one to warm allocators.
            for _ in range(2 if (self.plan.cuda_graphs or self.plan.compile != "off") else 1):
                self._forward(ids, mask)
            if self.plan.cuda_graphs:
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(ids, mask)
                self._graphs[(b, s)] = (graph, ids, mask, out)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.bucket_stats.append({
                "batch": b, "seq": s, "capture_s": round(time.perf_counter() - t, 4),
                "mem_mb": round(((torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0) - mem0) / 2**20, 2),
            })

    # -- serving path -------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> tuple[list[list[int]], list[bool]]:
        """Token ids per text (with [CLS]/[SEP]) cut to the largest bucket, and which were cut."""
        max_len = self.buckets.max_seq
        out, cut = [], []
        # encode_batch_fast skips character offsets, which nothing here reads: 20-30% less CPU per text (VM).
        for enc in self.tokenizer.encode_batch_fast(list(texts)):
            ids = enc.ids
            cut.append(len(ids) > max_len)
            out.append(ids if len(ids) <= max_len else ids[: max_len - 1] + [self.sep_id])
        return out, cut

    def chunks(self, seqs: Sequence[Sequence[int]]) -> list[Chunk]:
        return plan_chunks([len(s) for s in seqs], self.buckets.batch_sizes, self.buckets.seq_lens)

    def embed_ids(self, seqs: Sequence[Sequence[int]], chunks: Sequence[Chunk] | None = None) -> torch.Tensor:
        """Embeddings (n, dim) as float32 on the CPU; one device-to-host copy for the whole batch."""
        chunks = self.chunks(seqs) if chunks is None else chunks
        parts, order = [], []
        for chunk in chunks:
            ids = torch.full((chunk.batch, chunk.seq), self.pad_id, dtype=torch.long)
            mask = torch.zeros((chunk.batch, chunk.seq), dtype=torch.long)
            for row, i in enumerate(chunk.indices):
                ids[row, : len(seqs[i])] = torch.as_tensor(seqs[i])
                mask[row, : len(seqs[i])] = 1
            # Padding rows get one attended token so their (discarded) mean is finite.
            mask[len(chunk.indices):, 0] = 1
            parts.append(self._run(chunk.batch, chunk.seq, ids, mask)[: len(chunk.indices)])
            order.extend(chunk.indices)
        out = torch.cat(parts).float().cpu() if parts else torch.empty(0, 0)
        result = torch.empty_like(out)
        result[torch.as_tensor(order, dtype=torch.long)] = out
        return result

    def _run(self, b: int, s: int, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        graph = self._graphs.get((b, s))
        if graph is None:
            return self._forward(ids.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True))
        g, static_ids, static_mask, static_out = graph
        static_ids.copy_(ids, non_blocking=True)
        static_mask.copy_(mask, non_blocking=True)
        g.replay()
        # The next replay of this graph overwrites static_out: keep a copy.
        return static_out.clone()

    def recompiles(self) -> int:
        """Graphs compiled since warm-up finished; 0 while serving stays on captured buckets."""
        return unique_graphs() - self._graphs_baseline

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        return self.embed_ids(self.tokenize(texts)[0])

    @property
    def dim(self) -> int:
        return self._dim

    def report(self) -> dict:
        """What was loaded and how: logged at start-up and recorded by benchmarks."""
        return {"plan": self.plan.label(), "device": str(self.device), "downgrades": self.downgrades,
                "load_s": round(self.load_s, 3), "warmup_s": round(self.warmup_s, 3),
                "compile_cache_hit": self.compile_cache_hit, "accuracy": self.accuracy,
                "buckets": self.bucket_stats}


def accuracy_report(got: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    cos = F.cosine_similarity(got.float(), reference.float(), dim=1)
    return {"mean_cosine": round(float(cos.mean()), 6), "min_cosine": round(float(cos.min()), 6),
            "max_abs_err": float((got.float() - reference.float()).abs().max())}
