"""An encoder-style model's forward over padded (batch, seq) token tensors, run the way its plan
says: eager, compiled, or replayed from one CUDA graph per (batch, seq) bucket captured at start-up.

Shared by the embedding runner and the score runner (cross-encoders, classifiers): both cut their
inputs into chunks (`chunks`), pad each chunk (`pad_chunk`) and gather the outputs back into the
caller's order with one device-to-host copy (`run`). Everything that compiles or captures happens
in `optimize()`; `recompiles()` counts what happened after it.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from servekit.optimizations.buckets import Chunk, exact_chunks, plan_chunks, token_cost
from servekit.optimizations.plan import Plan

log = logging.getLogger(__name__)


def unique_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a new one while serving = a recompile)."""
    # A process that never imported dynamo compiled nothing. Importing it only to read a zero costs
    # every eager worker ~2 s of CPU at start (dynamo pulls in inductor).
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    return 0 if dynamo_utils is None else int(dynamo_utils.counters["stats"]["unique_graphs"])


def pad_chunk(seqs: Sequence[Sequence[int]], chunk: Chunk, pad_id: int,
              type_splits: Sequence[int] | None = None) -> tuple[torch.Tensor, ...]:
    """A chunk's ids and attention mask ``(batch, seq)``, right-padded; with `type_splits` (each
    input's first position of token type 1, as PairTokenizer gives them) also its token types: 1
    from that position to the input's end, 0 elsewhere. Built in numpy from one flat array of all
    the chunk's tokens: a torch slice assignment per text cost ~16 µs each, more than the rest of a
    32-text request's padding and answer together (VM, benchmarks/results/worker-overhead-cpu)."""
    rows = [seqs[i] for i in chunk.indices]
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    positions = np.arange(chunk.seq)
    filled = positions < lengths[:, None]  # each text's own cells
    mask = np.zeros((chunk.batch, chunk.seq), dtype=np.int64)
    mask[: len(rows)] = filled
    mask[len(rows):, 0] = 1  # padding rows get one attended token so their (discarded) mean is finite
    ids = np.full((chunk.batch, chunk.seq), pad_id, dtype=np.int64)
    # Row-major order of the filled cells is the concatenation order of the rows' tokens.
    ids[: len(rows)][filled] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64,
                                           count=int(lengths.sum()))
    if type_splits is None:
        return torch.from_numpy(ids), torch.from_numpy(mask)
    # Types from one position per row: going through every token's type as a Python int cost as
    # much as the ids (H100 host, rerank of 100 pairs: 1.3 ms of padding per request, py-spy).
    at = np.fromiter((type_splits[i] for i in chunk.indices), dtype=np.int64, count=len(rows))
    types = np.zeros((chunk.batch, chunk.seq), dtype=np.int64)
    types[: len(rows)] = filled & (positions >= at[:, None])
    return torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(types)


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


class BucketedForward:
    """`model(ids, mask)` over chunks of token lists, on the plan's path; `typed`: `model(ids, mask,
    token_types)`, the types given per input as the position where type 1 starts (a BERT pair's
    second text). Built eager (the fp32 reference runs through it first); `optimize()` then swaps
    in the served model and compiles, warms and captures every bucket of the plan.
    """

    def __init__(self, model: nn.Module, plan: Plan, device: torch.device, pad_id: int, typed: bool = False) -> None:
        self.plan, self.device, self.pad_id, self.typed = plan, device, pad_id, typed
        self.buckets = plan.buckets
        self._forward = self._eager(model)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], torch.Tensor]] = {}
        self._replay_s: dict[tuple[int, int], float] = {}  # seconds per replay of each captured bucket
        self.bucket_stats: list[dict] = []
        self.compile_cache_hit = False
        self._graphs_baseline = unique_graphs()

    @property
    def eager(self) -> bool:
        """Nothing compiled or captured: passes take exact shapes."""
        return self.plan.compile == "off" and not self.plan.cuda_graphs

    @property
    def captured(self) -> set[tuple[int, int]]:
        """The (batch, seq) buckets replayed from CUDA graphs."""
        return set(self._graphs)

    def optimize(self, model: nn.Module, cache_key: str | None = None) -> float:
        """Serve `model` (already in the plan's precision and quantization): compile it if the plan
        says so (with its compile cache, keyed by `cache_key`), then warm up and capture every bucket.
        Returns the warm-up seconds."""
        self._forward = self._eager(model)
        cache = self._cache_file(cache_key)
        if self.plan.compile != "off":
            self._forward = self._compiled(self._forward, cache)
        t = time.perf_counter()
        if self.plan.warmup or not self.eager:
            self._warm_up()
        if cache is not None and not cache.exists():
            artifacts = torch.compiler.save_cache_artifacts()
            if artifacts is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_bytes(artifacts[0])
                log.info("compile cache saved to %s", cache)
        self.mark_warm()
        return time.perf_counter() - t

    def mark_warm(self) -> None:
        """From now on, any graph dynamo compiles counts as a recompile."""
        self._graphs_baseline = unique_graphs()

    def _eager(self, model: nn.Module) -> Callable[..., torch.Tensor]:
        attention = self.plan.attention

        def forward(*inputs: torch.Tensor) -> torch.Tensor:
            with torch.no_grad(), _sdpa_context(attention):
                return model(*inputs)

        return forward

    def _cache_file(self, key: str | None) -> Path | None:
        if key is None or not self.plan.compile_cache or self.plan.compile == "off":
            return None
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        full = f"{torch.__version__}|{name}|{self.plan.label()}|{self.buckets.shapes()}"
        return Path(self.plan.compile_cache) / f"encoder-{key}-{hashlib.sha256(full.encode()).hexdigest()[:16]}.bin"

    def _compiled(self, forward: Callable, cache: Path | None) -> Callable:
        import torch._dynamo

        # dynamic=True: one graph covers every bucket (batch 1 may get its own), so start-up does not
        # compile once per shape; CUDA graphs then remove the launch overhead per bucket. The limit
        # is raised anyway so that no bucket can silently fall back to eager.
        limit = len(self.buckets.shapes()) + 4
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))
        if self.plan.compile_cache:
            # Inductor's and Triton's own on-disk caches (FX graphs, kernels) go to the same volume,
            # so a new worker also skips kernel compilation; a directory set from outside wins.
            _cache_env("TORCHINDUCTOR_CACHE_DIR", Path(self.plan.compile_cache) / "inductor")
            _cache_env("TRITON_CACHE_DIR", Path(self.plan.compile_cache) / "triton")
        self.compile_cache_hit = bool(cache and cache.exists())
        if self.compile_cache_hit:
            torch.compiler.load_cache_artifacts(cache.read_bytes())
            log.info("compile cache loaded from %s", cache)
        return torch.compile(forward, mode=None if self.plan.compile == "default" else self.plan.compile,
                             dynamic=True, fullgraph=True)

    def _warm_up(self) -> None:
        pool = torch.cuda.graph_pool_handle() if self.plan.cuda_graphs else None
        cuda = self.device.type == "cuda"
        shapes = self.buckets.shapes()
        if self.eager:
            # Eager passes take the batch's exact shape, not a bucket's: warming every bucket bought
            # nothing a request reuses and cost a CPU worker ~5 s of each start. One pass at the
            # largest shape warms the allocator and the kernels' lazy set-up.
            shapes = [max(shapes, key=lambda bs: bs[0] * bs[1])]
        for b, s in shapes:
            t = time.perf_counter()
            mem0 = torch.cuda.memory_reserved(self.device) if cuda else 0
            static = (torch.full((b, s), self.pad_id, dtype=torch.long, device=self.device),
                      torch.ones((b, s), dtype=torch.long, device=self.device),
                      *([torch.zeros((b, s), dtype=torch.long, device=self.device)] if self.typed else []))
            # Compiling and graph capture need a pass or two first; eager needs one to warm allocators.
            for _ in range(1 if self.eager else 2):
                self._forward(*static)
            if self.plan.cuda_graphs:
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(*static)
                self._graphs[(b, s)] = (graph, static, out)
                self._replay_s[(b, s)] = _replay_seconds(graph, self.device)
            if cuda:
                torch.cuda.synchronize(self.device)
            self.bucket_stats.append({
                "batch": b, "seq": s, "capture_s": round(time.perf_counter() - t, 4),
                "replay_ms": round(self._replay_s[(b, s)] * 1e3, 4) if (b, s) in self._replay_s else None,
                "mem_mb": round(((torch.cuda.memory_reserved(self.device) if cuda else 0) - mem0) / 2**20, 2),
            })

    def chunks(self, lengths: Sequence[int]) -> list[Chunk]:
        """Forward passes for inputs of these lengths. Eager: each length-sorted run exactly, padded to
        its longest input; captured or compiled: bucket shapes, cut by least measured replay time (or
        padded positions plus a fixed cost per pass when not timed)."""
        if self.eager:
            return exact_chunks(lengths, self.buckets.max_batch)
        replay = self._replay_s
        cost = (lambda b, s: replay[(b, s)]) if replay else token_cost
        return plan_chunks(lengths, self.buckets.batch_sizes, self.buckets.seq_lens, cost)

    def run(self, seqs: Sequence[Sequence[int]], type_splits: Sequence[int] | None = None,
            chunks: Sequence[Chunk] | None = None) -> torch.Tensor | None:
        """Outputs for `seqs` in their order as float32 on the CPU (one device-to-host copy for the
        whole call), or None for no input. `type_splits`: each input's first position of token
        type 1 (a typed forward's; its length for none)."""
        if self.typed != (type_splits is not None):
            raise ValueError("type_splits go with a typed forward, and only there")
        chunks = self.chunks([len(s) for s in seqs]) if chunks is None else chunks
        parts, order = [], []
        for chunk in chunks:
            inputs = pad_chunk(seqs, chunk, self.pad_id, type_splits)
            parts.append(self.run_shape(chunk.batch, chunk.seq, *inputs)[: len(chunk.indices)])
            order.extend(chunk.indices)
        if not parts:
            return None
        out = _to_host(torch.cat(parts).float())
        result = torch.empty_like(out)
        result[torch.as_tensor(order, dtype=torch.long)] = out
        return result

    def run_shape(self, b: int, s: int, *inputs: torch.Tensor) -> torch.Tensor:
        """One pass over host tensors of shape (b, s): the captured graph of that bucket if there is one."""
        graph = self._graphs.get((b, s))
        if graph is None:
            return self._forward(*(t.to(self.device, non_blocking=True) for t in inputs))
        g, static, out = graph
        for dst, src in zip(static, inputs):
            dst.copy_(src, non_blocking=True)
        g.replay()
        return out.clone()  # the next replay of this graph overwrites `out`

    def recompiles(self) -> int:
        """Graphs compiled since warm-up finished; 0 while serving stays on captured buckets."""
        return unique_graphs() - self._graphs_baseline
