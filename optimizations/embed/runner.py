"""Sentence-embedding runner: tokenizer + encoder + the model's own pooling head, built from an
optimization plan.

Load order: fp32 eager reference on the golden set -> precision -> quantization -> compile ->
warm-up of every shape bucket (CUDA-graph capture when asked) -> accuracy gate. After `__init__`
returns, no compilation or capture happens while serving (`recompiles()` counts any that do).
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time
from contextlib import nullcontext
from dataclasses import replace
from importlib.resources import files
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from servekit.optimizations.buckets import Chunk, exact_chunks, plan_chunks, seq_buckets, token_cost
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


def pad_chunk(seqs: Sequence[Sequence[int]], chunk: Chunk, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's ids and attention mask ``(batch, seq)``, right-padded. Built in numpy from one
    flat array of all the chunk's tokens: a torch slice assignment per text cost ~16 µs each,
    more than the rest of a 32-text request's padding and answer together (VM,
    benchmarks/results/worker-overhead-cpu)."""
    rows = [seqs[i] for i in chunk.indices]
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    filled = np.arange(chunk.seq) < lengths[:, None]  # each text's own cells
    mask = np.zeros((chunk.batch, chunk.seq), dtype=np.int64)
    mask[: len(rows)] = filled
    mask[len(rows):, 0] = 1  # padding rows get one attended token so their (discarded) mean is finite
    ids = np.full((chunk.batch, chunk.seq), pad_id, dtype=np.int64)
    # Row-major order of the filled cells is the concatenation order of the rows' tokens.
    ids[: len(rows)][filled] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64,
                                           count=int(lengths.sum()))
    return torch.from_numpy(ids), torch.from_numpy(mask)


def _replay_seconds(graph: torch.cuda.CUDAGraph, device: torch.device, reps: int = 5) -> float:
    """The fastest of `reps` replays of a captured graph, each waited for: other workers starting on
    the same GPU at the same time only ever slow a replay down."""
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU. From a GPU, the worker thread sleeps until the device is done (a blocking
    event) rather than spinning in `.cpu()`'s wait, which holds a host core for the whole device
    time of the batch; up to 16 workers share one GPU host's cores."""
    if t.device.type != "cuda":
        return t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event(blocking=True)
    done.record()
    done.synchronize()
    return host


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
        self._forward = self._eager_forward(model)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._replay_s: dict[tuple[int, int], float] = {}  # seconds per replay of each captured bucket
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
    def _eager_forward(self, model: SentenceEncoder) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        attention = self.plan.attention

        def forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            with torch.no_grad(), _sdpa_context(attention):
                return model(ids, mask)

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
        return Path(self.plan.compile_cache) / f"encoder-{self._model_key}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.bin"

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
                self._replay_s[(b, s)] = _replay_seconds(graph, self.device)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.bucket_stats.append({
                "batch": b, "seq": s, "capture_s": round(time.perf_counter() - t, 4),
                "replay_ms": round(self._replay_s[(b, s)] * 1e3, 4) if (b, s) in self._replay_s else None,
                "mem_mb": round(((torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0) - mem0) / 2**20, 2),
            })

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

    def chunks(self, seqs: Sequence[Sequence[int]]) -> list[Chunk]:
        lengths = [len(s) for s in seqs]
        if self.plan.compile == "off" and not self.plan.cuda_graphs:
            # Eager (CPU): no shape is captured, so a pass is exactly its texts, none padded past the
            # longest of its length-sorted run.
            return exact_chunks(lengths, self.buckets.max_batch)
        # With every bucket's replay timed at warm-up, the chunks minimise measured device time;
        # otherwise padded token positions plus a fixed cost per pass.
        replay = self._replay_s
        cost = (lambda b, s: replay[(b, s)]) if replay else token_cost
        return plan_chunks(lengths, self.buckets.batch_sizes, self.buckets.seq_lens, cost)

    def embed_ids(self, seqs: Sequence[Sequence[int]], chunks: Sequence[Chunk] | None = None) -> torch.Tensor:
        """Embeddings (n, dim) as float32 on the CPU; one device-to-host copy for the whole batch."""
        chunks = self.chunks(seqs) if chunks is None else chunks
        parts, order = [], []
        for chunk in chunks:
            ids, mask = pad_chunk(seqs, chunk, self.pad_id)
            parts.append(self._run(chunk.batch, chunk.seq, ids, mask)[: len(chunk.indices)])
            order.extend(chunk.indices)
        out = _to_host(torch.cat(parts).float()) if parts else torch.empty(0, 0)
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
                "compile_cache_hit": self.compile_cache_hit, "accuracy": self.accuracy,
                "segment_cache": "on" if self.segments.enabled else f"off: {self.segments.off_reason}",
                "buckets": self.bucket_stats}


def accuracy_report(got: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    cos = F.cosine_similarity(got.float(), reference.float(), dim=1)
    return {"mean_cosine": round(float(cos.mean()), 6), "min_cosine": round(float(cos.min()), 6),
            "max_abs_err": float((got.float() - reference.float()).abs().max())}
