"""Batched generation for ``servekit.optimizations.models.llama``: prefill, CUDA-graph decode, streaming.

Batching choice: **per-row positions, right padding** (no left padding). Prompts of a batch are
right-padded to a length bucket; every row's tokens sit at positions ``0..len-1`` of its own KV
cache row, so a row computes exactly what it would compute alone (RoPE positions, attention
span), and its decode steps write at ``len, len+1, ...``, overwriting whatever the padding left
in the cache before anything reads it. Rows advance independently, which also leaves the door
open to inserting new requests into free rows later (continuous batching).

Shapes are bucketed: the batch is padded to a batch bucket (dummy rows decode garbage that is
never read), the prompt to a length bucket, and each decode step attends over a kv bucket (the
cache prefix the live rows have reached, rounded up) rather than the whole cache.

On CUDA, ``LlamaRunner.warmup()`` runs every prefill shape through the compiled model (when the
plan compiles: ``RegionalCompiled``, the transformer block compiled once with dynamic shapes and
reused by every layer, shared by prefill and decode; dynamo keeps 4 graphs whatever the buckets:
prefill and decode, each for batch 1 and batch > 1) and captures one ``torch.cuda.CUDAGraph`` per
(batch bucket, kv bucket, sampling mode:
greedy / sample / top-k-top-p / full (penalties and logprobs), chosen on the host from the
requests) for the decode step, sampling included. The default GPU plan (batch 1..8, kv 256..2048)
makes 64 graphs in one pool.
We capture graphs ourselves rather than through ``mode="reduce-overhead"``: the graph's input and
output tensors are ours, each step copies its output to the host before the next replay, and
nothing outside holds a graph output that a replay could overwrite (the failure seen with
transformers' static cache + compile). On CPU the same static-buffer code runs eagerly.

Host syncs: one per decode step, to stream tokens. The next step is launched before the host
waits for the current one, so the GPU never idles on the host's bookkeeping; the price is at most
one wasted step when the last row finishes.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Protocol

import torch
from torch import Tensor

from servekit.optimizations.buckets import pick_bucket
from servekit.optimizations.models.llama import Transformer, WithBlocks
from servekit.optimizations.llm.sampling import (FILTER, FULL, PLAIN_MODES, TOP_LOGPROBS, SamplingTensors, sample,
                                             sample_full, sampling_mode)

if TYPE_CHECKING:
    from servekit.optimizations.llm.grammar import DecodeConstraint

KERNELS = ("torch", "triton")  # what runs a decode step's layers: torch ops (eager or compiled), or triton_decode
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
# The sampling ranges a request may ask for (OpenAI's), checked once where requests are parsed
# (handlers/llm_handler.py) and asserted by SamplingParams.error for every other caller.
TEMPERATURE_RANGE = (0.0, 2.0)
PENALTY_RANGE = (-2.0, 2.0)


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding settings (OpenAI semantics: temperature 0 = greedy)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # report each token's logprob and this many top alternatives (None: off)
    # Grammar, logit_bias and min_tokens (optimizations/llm/grammar.py): continuous batching only.
    constraint: "DecodeConstraint | None" = None

    @property
    def full(self) -> bool:
        """Needs the FULL sampling mode (penalties or logprobs): uncaptured steps, no speculation."""
        return self.logprobs is not None or self.presence_penalty != 0 or self.frequency_penalty != 0

    def error(self) -> str | None:
        """Why these settings are invalid, or None."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            return f"max_tokens must be a positive integer, got {self.max_tokens!r}"
        lo, hi = TEMPERATURE_RANGE
        if not lo <= self.temperature <= hi:
            return f"temperature must be in [{lo:g}, {hi:g}], got {self.temperature!r}"
        if not isinstance(self.top_k, int) or self.top_k < 0:
            return f"top_k must be a non-negative integer, got {self.top_k!r}"
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p!r}"
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            return f"seed must be a non-negative integer, got {self.seed!r}"
        lo, hi = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            if not lo <= getattr(self, name) <= hi:
                return f"{name} must be in [{lo:g}, {hi:g}], got {getattr(self, name)!r}"
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= TOP_LOGPROBS):
            return f"logprobs must be an integer in [0, {TOP_LOGPROBS}], got {self.logprobs!r}"
        return None


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability and the row's top alternatives (token id, logprob), most
    likely first, as many as the request asked for."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class StepOutput:
    """New tokens of one generation step, one entry per row of the batch: the one output type of
    every step strategy.

    ``tokens[i]`` lists the tokens row i emits in this step (one for a plain decode step, 1..k+1
    for a speculative one), None once row i has finished. A row's last token carries its finish
    reason: ``"stop"`` when that token is one of its stop tokens (the stop token itself is
    reported, do not print it), ``"length"`` when it reached ``max_tokens``.

    ``proposed[j]`` / ``accepted[j]``: how many live rows proposed / had accepted a draft token at
    position j (0 = first draft) in this step; a draft at j counts as accepted only if the drafts
    before it were too. Empty for a plain step.

    ``logprobs[i]``: one ``TokenLogprob`` per token of ``tokens[i]`` when row i asked for logprobs.
    """

    tokens: list[list[int] | None]
    finish_reasons: list[str | None]
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)


@dataclass
class Completion:
    tokens: list[int]  # every sampled token, a final stop token included
    finish_reason: str
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, when asked for


# --- the model calls: plain functions, compiled or captured by the runner -------------------------

class RegionalCompiled(WithBlocks):
    """The model with its transformer block compiled once and reused by every layer.

    ``torch.compile`` of the whole model traces and compiles all 30 layers of SmolLM2 as one graph
    (it did not finish within 5 minutes on an H100); the layers share one code object and their
    weights are graph inputs, so compiling the block gives one graph that every layer reuses:
    compile time of one block, most of the fusion. Embedding, final norm and lm_head stay eager.
    """

    def __init__(self, model: Transformer, mode: str = "default") -> None:
        super().__init__(model, [torch.compile(layer, dynamic=True, mode=mode) for layer in model.layers])


def prefill(model: Transformer, tokens: Tensor, input_pos: Tensor, last_idx: Tensor,
            params: SamplingTensors, mode: str = FILTER, rows: Tensor | None = None,
            kv_len: int | None = None) -> Tensor:
    """Run right-padded prompts ``(B, T)`` at positions ``0..T-1``; sample each row's first new token
    (FULL mode: ``sample_full``'s rows; nothing is generated yet, so no penalty applies). ``rows``:
    the cache rows to fill (default ``0..B-1``). ``kv_len``: for a later chunk of a prompt (its
    positions start past 0), the cache slots attention reads, one past its last position."""
    # Positions start at 0, so attention needs cache slots :T only.
    logits = model(tokens, input_pos, last_idx, kv_len=kv_len or tokens.shape[1], rows=rows)
    position = input_pos.gather(1, last_idx[:, None]).squeeze(1)
    if mode == FULL:
        return sample_full(logits, params, position, None)
    return sample(logits, params, position, mode)


def decode_one_token(model: Transformer, tokens: Tensor, input_pos: Tensor, params: SamplingTensors,
                     mode: str = FILTER, kv_len: int | None = None, counts: Tensor | None = None) -> Tensor:
    """One token per row: tokens, input_pos ``(B, 1)`` -> next tokens ``(B,)`` (FULL mode:
    ``sample_full``'s rows, penalised by ``counts``).

    Every live row's position must be below ``kv_len`` (default: the whole cache).
    """
    logits = model(tokens, input_pos, kv_len=kv_len)[:, -1]
    if mode == FULL:
        return sample_full(logits, params, input_pos[:, -1], counts)
    return sample(logits, params, input_pos[:, -1], mode)


def token_ids(out: Tensor, mode: str) -> Tensor:
    """The sampled ids ``(B,)`` of a prefill or decode output of ``mode``."""
    return out[:, 0].long() if mode == FULL else out


def read_row(row: list, mode: str, logprobs: int | None) -> tuple[int, TokenLogprob | None]:
    """One row of a step's host copy: its token and, when the request asked, its logprobs."""
    if mode != FULL:
        return row, None
    token = int(row[0])
    if logprobs is None:
        return token, None
    ids, values = row[2:2 + TOP_LOGPROBS], row[2 + TOP_LOGPROBS:]
    return token, TokenLogprob(row[1], tuple((int(t), v) for t, v in zip(ids[:logprobs], values[:logprobs])))


def pad_prompts(prompts: list[list[int]], batch: int, length: int, pad_id: int = 0
                ) -> tuple[Tensor, Tensor, Tensor]:
    """Right-pad prompts into ``(batch, length)`` tokens and positions; ``last_idx`` per row.

    Dummy rows (beyond ``len(prompts)``) hold one pad token at position 0.
    """
    tokens = torch.full((batch, length), pad_id, dtype=torch.int64)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p, dtype=torch.int64)
    input_pos = torch.arange(length, dtype=torch.int64).expand(batch, length).contiguous()
    last_idx = torch.zeros(batch, dtype=torch.int64)
    last_idx[:len(prompts)] = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.int64)
    return tokens, input_pos, last_idx


def generate(runner: "LlamaRunner", prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
    """Generate to completion for a batch of token-id prompts (collects ``runner.stream``)."""
    return collect(runner.stream(prompts, params), len(prompts))


def collect(steps: Iterable[StepOutput], rows: int) -> list[Completion]:
    """Every row's tokens and finish reason from a whole stream of steps (any step strategy)."""
    out = [Completion([], "") for _ in range(rows)]
    for step in steps:
        for i, (toks, reason) in enumerate(zip(step.tokens, step.finish_reasons)):
            if toks is not None:
                out[i].tokens += toks
            if step.logprobs and step.logprobs[i] is not None:
                out[i].logprobs += step.logprobs[i]
            if reason is not None:
                out[i].finish_reason = reason
    return out


# --- the runner: buckets, warm-up / capture, the streaming loop ----------------------------------

class DecodeState:
    """Static decode inputs, one row per cache row, shared by the decode graphs (every mode and kv
    length). Each batch bucket's graphs use ``view(b)``: its first b rows, the same memory, so a
    row keeps its state when the running batch moves to another bucket (continuous batching)."""

    def __init__(self, batch: int, device: torch.device, vocab_size: int) -> None:
        self.tokens = torch.zeros(batch, 1, dtype=torch.int64, device=device)
        self.input_pos = torch.zeros(batch, 1, dtype=torch.int64, device=device)
        # A bias row per cache row (continuous batching loads logit_bias and grammar masks there).
        self.params = SamplingTensors.build([0.0] * batch, [0] * batch, [1.0] * batch, [0] * batch, device,
                                            vocab_size=vocab_size)
        # Times each token was generated so far, per row: the penalties' input (FULL mode only).
        self.counts = torch.zeros(batch, vocab_size, dtype=torch.float32, device=device)

    def view(self, batch: int) -> "DecodeState":
        """The first ``batch`` rows, sharing memory with this state."""
        out = object.__new__(DecodeState)
        out.tokens, out.input_pos, out.counts = self.tokens[:batch], self.input_pos[:batch], self.counts[:batch]
        out.params = SamplingTensors(*(t[:batch] for t in self.params))
        return out

    def load_rows(self, rows: Tensor, first_tokens: Tensor, positions: Tensor, params: SamplingTensors) -> None:
        """Start requests in the given rows (continuous batching): their first token, position and
        sampling parameters; their penalty counts restart from the first token."""
        self.tokens.index_copy_(0, rows, first_tokens[:, None])
        self.input_pos.index_copy_(0, rows, positions[:, None])
        for dst, src in zip(self.params, params):
            dst.index_copy_(0, rows, src)
        counts = torch.zeros(len(rows), self.counts.shape[1], dtype=self.counts.dtype, device=self.counts.device)
        counts.scatter_add_(1, first_tokens[:, None], torch.ones_like(counts[:, :1]))
        self.counts.index_copy_(0, rows, counts)

    def load(self, first_tokens: Tensor, positions: Tensor, params: SamplingTensors, count: bool = False) -> None:
        self.tokens.copy_(first_tokens[:, None])
        self.input_pos.copy_(positions[:, None])
        self.params.copy_(params)
        if count:
            self.counts.zero_().scatter_add_(1, first_tokens[:, None], torch.ones_like(self.counts[:, :1]))


class GraphedStep:
    """A step that runs eagerly, or replays a CUDA graph of itself after ``capture()`` (CUDA only).

    Subclasses write ``_body()``: one step that reads and advances state kept in static tensors.
    """

    graph: torch.cuda.CUDAGraph | None = None
    out: Tensor | None = None

    def _body(self) -> Tensor:
        raise NotImplementedError

    def capture(self, pool: object | None = None, warmup_iters: int = 2) -> None:
        # Run a few times on a side stream first: compilation, autotuning and cuBLAS workspace
        # allocation must not happen during capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup_iters):
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = self._body()

    def run(self) -> Tensor:
        if self.graph is None:
            return self._body()
        self.graph.replay()
        assert self.out is not None
        return self.out  # overwritten by the next replay: callers copy it out first


class DecodeStep(GraphedStep):
    """The decode step for one (batch bucket, sampling mode, kv length), on a shared ``DecodeState``.

    ``run()`` decodes one token per row and advances the state's ``tokens``/``input_pos`` in place,
    so consecutive calls need no host work. After ``capture()`` (CUDA only) it replays a CUDA graph.
    """

    def __init__(self, model: Transformer, state: DecodeState, mode: str, kv_len: int,
                 forward: Callable[..., Tensor] | None = None) -> None:
        self.model, self.state, self.mode, self.kv_len = model, state, mode, kv_len
        self.forward = forward if forward is not None else model  # compiled, when the plan compiles decode

    @torch.no_grad()
    def _body(self) -> Tensor:
        st = self.state
        out = decode_one_token(self.forward, st.tokens, st.input_pos, st.params, self.mode, self.kv_len, st.counts)
        nxt = token_ids(out, self.mode)
        if self.mode == FULL:
            st.counts.scatter_add_(1, nxt[:, None], torch.ones_like(st.counts[:, :1]))
        st.tokens.copy_(nxt[:, None])
        # Finished and dummy rows keep stepping; the clamp keeps their writes inside the cache.
        st.input_pos.add_(1).clamp_(max=self.model.max_seq_len - 1)
        return out


@dataclass
class PreparedBatch:
    """A validated batch padded to its (batch, prompt) buckets, with its sampling tensors."""

    batch: int
    length: int
    tokens: Tensor
    input_pos: Tensor
    last_idx: Tensor
    sampling: SamplingTensors
    mode: str
    positions: Tensor  # each row's prompt length (its first decode position); 0 for dummy rows


class PrefillState:
    """Static prefill inputs of one (batch bucket, prompt bucket), shared by its graphs (every mode)."""

    def __init__(self, batch: int, length: int, device: torch.device, slots: bool = False) -> None:
        self.tokens = torch.zeros(batch, length, dtype=torch.int64, device=device)
        self.input_pos = torch.zeros(batch, length, dtype=torch.int64, device=device)
        self.last_idx = torch.zeros(batch, dtype=torch.int64, device=device)
        self.params = SamplingTensors.build([0.0] * batch, [0] * batch, [1.0] * batch, [0] * batch, device)
        # The cache rows to fill, for a prefill into free slots of a running batch (continuous batching).
        self.rows = torch.arange(batch, device=device) if slots else None

    def load(self, tokens: Tensor, input_pos: Tensor, last_idx: Tensor, params: SamplingTensors,
             rows: Tensor | None = None) -> None:
        self.tokens.copy_(tokens)
        self.input_pos.copy_(input_pos)
        self.last_idx.copy_(last_idx)
        self.params.copy_(params)
        if rows is not None:
            assert self.rows is not None, "this prefill state fills rows 0..B-1"
            self.rows.copy_(rows)


class PrefillStep(GraphedStep):
    """Prefill of one (batch bucket, prompt bucket, sampling mode) on static inputs: on CUDA a graph
    replay instead of a few hundred kernel launches, which is most of a short prompt's TTFT.

    ``fn(tokens, input_pos, last_idx, params, mode)``: the plain runner's prefill, or the
    speculative runner's (first tokens and drafts)."""

    def __init__(self, fn: Callable[..., Tensor], state: PrefillState, mode: str) -> None:
        self.fn, self.state, self.mode = fn, state, mode

    @torch.no_grad()
    def _body(self) -> Tensor:
        st = self.state
        if st.rows is not None:
            return self.fn(st.tokens, st.input_pos, st.last_idx, st.params, self.mode, rows=st.rows)
        return self.fn(st.tokens, st.input_pos, st.last_idx, st.params, self.mode)


# Capture orders, largest shapes first: the smaller graphs fit into the memory pool they leave.
def prefill_order(key: tuple[int, int, str]) -> tuple:  # (batch, prompt length, mode)
    return -key[0] * key[1], key[2]


def decode_order(key: tuple[int, str, int]) -> tuple:  # (batch, mode, kv length)
    return -key[0], -key[2]


def warm_steps(steps: dict[tuple, GraphedStep], order: Callable[[tuple], tuple], pool: object | None,
               eager_probe: Callable[[tuple], bool]) -> None:
    """Capture every step as a CUDA graph in one memory pool (``pool``: a graph pool handle), or,
    without graphs, run the steps ``eager_probe`` picks once each to check their shapes."""
    for key in sorted(steps, key=order):
        if pool is not None:
            steps[key].capture(pool)
        elif eager_probe(key):
            steps[key].run()


class HostCopies:
    """``count`` (pinned, on CUDA) host buffers for step outputs of one shape: copy step t+1 while
    the host reads step t."""

    def __init__(self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.int64,
                 count: int = 2) -> None:
        self.cuda = device.type == "cuda"
        self.bufs = [torch.zeros(shape, dtype=dtype, pin_memory=self.cuda) for _ in range(count)]
        self.events = [torch.cuda.Event() for _ in range(count)] if self.cuda else []
        self.next = 0  # the buffer the next ``start_next`` fills

    def start_next(self, t: Tensor) -> int:
        """Start copying into the next buffer of the ring; returns its index for ``wait``."""
        slot, self.next = self.next, (self.next + 1) % len(self.bufs)
        self.start(slot, t)
        return slot

    def start(self, slot: int, t: Tensor) -> None:
        self.bufs[slot].copy_(t, non_blocking=self.cuda)
        if self.cuda:
            self.events[slot].record()

    def wait(self, slot: int) -> list:
        if self.cuda:
            self.events[slot].synchronize()
        return self.bufs[slot].tolist()


def default_prefill_buckets(max_seq_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from ``smallest``, then ``max_seq_len`` itself."""
    buckets, n = [], smallest
    while n < max_seq_len:
        buckets.append(n)
        n *= 2
    return tuple(buckets) + (max_seq_len,)


def default_kv_buckets(max_seq_len: int) -> tuple[int, ...]:
    """Cache lengths decode attends over: 256, 512, ... up to the whole cache."""
    return default_prefill_buckets(max_seq_len, smallest=min(256, max_seq_len))


class GenerationStream:
    """Iterator of ``StepOutput`` for one batch, from ``LlamaRunner.stream``.

    ``cancel(i)`` ends row i early (a stop string matched on the text side, a client went away):
    it reports no more tokens and stops counting towards the number of steps still needed.
    """

    def __init__(self, steps: Iterator[StepOutput], done: list[bool]) -> None:
        self._steps, self._done = steps, done

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self) -> StepOutput:
        return next(self._steps)

    def cancel(self, row: int) -> None:
        self._done[row] = True


class StepStrategy(Protocol):
    """Another way to decode a batch than one token per step (speculative.py's
    ``SpeculativeDecoding``), set as ``LlamaRunner.speculation``. It shares the runner's model,
    KV cache, buckets and prefill, and yields the same ``StepOutput``."""

    n_heads: int  # draft positions per step (the length of StepOutput.proposed)

    def applies(self, params: list[SamplingParams], speculate: list[bool] | None) -> bool:
        """Whether this batch decodes with the strategy (else the runner's plain steps)."""
        ...

    def stream(self, prompts: list[list[int]], params: list[SamplingParams],
               speculate: list[bool] | None) -> GenerationStream:
        ...


class LlamaRunner:
    """Owns the model's KV cache, shape buckets and compiled/captured steps; streams generations.

    Decode graphs exist per (batch bucket, sampling mode, kv bucket): a step attends only over the
    cache prefix its rows have reached (rounded up to a kv bucket), instead of the whole cache.
    """

    def __init__(self, model: Transformer, max_seq_len: int, batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16),
                 prefill_buckets: tuple[int, ...] | None = None, kv_buckets: tuple[int, ...] | None = None,
                 compile_prefill: bool = False, compile_decode: bool = False, cuda_graphs: bool = False,
                 compile_mode: str = "default", pad_id: int = 0, prefill_graphs: int = 0,
                 slot_prefill: bool = False, kernels: str = "torch", static_prefill: bool = True) -> None:
        """``static_prefill=False``: prompts go in another way (the continuous engine's packed
        prefill), so no prefill graphs are captured nor prefill shapes compiled by ``warmup()``,
        and ``stream()`` is refused; the compiled blocks (``compiled_model``) are still made."""
        self.model = model.eval()
        model.fuse_projections()  # fewer, larger matmuls: decode steps are bound by kernel launches
        self.device = model.tok_embeddings.weight.device
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA model, this one is on {self.device}")
        self.batch_buckets = tuple(sorted(set(batch_buckets)))
        self.prefill_buckets = tuple(sorted(set(prefill_buckets or default_prefill_buckets(max_seq_len))))
        self.kv_buckets = tuple(sorted(set(kv_buckets or default_kv_buckets(max_seq_len))))
        for name, buckets in (("prefill", self.prefill_buckets), ("kv", self.kv_buckets)):
            if buckets[-1] > max_seq_len:
                raise ValueError(f"{name} bucket {buckets[-1]} exceeds max_seq_len={max_seq_len}")
        if self.kv_buckets[-1] != max_seq_len:
            self.kv_buckets += (max_seq_len,)  # the last decode steps may need the whole cache
        self.max_seq_len, self.cuda_graphs, self.pad_id = max_seq_len, cuda_graphs, pad_id
        self.compile_prefill, self.static_prefill = compile_prefill, static_prefill
        model.setup_caches(self.batch_buckets[-1], max_seq_len)
        if compile_mode not in ("default", "max-autotune-no-cudagraphs"):
            # Other modes capture CUDA graphs of their own, which would nest inside ours.
            raise ValueError(f"compile mode {compile_mode!r}: use 'default' or 'max-autotune-no-cudagraphs'")
        # Only the transformer block is compiled, with dynamic shapes; sampling stays eager (inside
        # the decode graphs it costs no launches). Dynamo then keeps 4 graphs: prefill and decode,
        # each for batch 1 (always specialized) and batch > 1, whatever the buckets and modes.
        compiled = RegionalCompiled(model, compile_mode) if compile_prefill or compile_decode else None
        self.compiled_model = compiled
        self._prefill_model = compiled if compile_prefill else model
        # kernels="triton": decode (and speculative verify) steps run each layer as a few fused
        # Triton kernels instead of compiled blocks; prefill keeps its own path.
        if kernels not in KERNELS:
            raise ValueError(f"kernels {kernels!r}: use one of {', '.join(KERNELS)}")
        if kernels == "triton" and compile_decode:
            raise ValueError("kernels='triton' runs decode steps through its own fused kernels: "
                             "build the runner with compile_decode=False")
        self.kernels = kernels
        self.triton_model = None
        if kernels == "triton":
            from servekit.optimizations.kernels.triton_decode import TritonDecode  # imports triton: only when asked for

            self.triton_model = TritonDecode(model)
        decode_model = self.triton_model or (compiled if compile_decode else None)
        self.state = DecodeState(self.batch_buckets[-1], self.device, model.config.vocab_size)
        self.states = {b: self.state.view(b) for b in self.batch_buckets}
        self.steps = {(b, m, kv): DecodeStep(model, self.states[b], m, kv, decode_model)
                      for b in self.batch_buckets for m in PLAIN_MODES for kv in self.kv_buckets}
        # Prompt buckets up to `prefill_graphs` tokens prefill from static inputs (captured on CUDA);
        # longer prompts are compute-bound and run as plain calls.
        short = [t for t in self.prefill_buckets if t <= prefill_graphs] if static_prefill else []
        # slot_prefill: the static prefill inputs carry the cache rows to fill (continuous batching).
        self.slot_prefill = slot_prefill
        prefill_states = {(b, t): PrefillState(b, t, self.device, slot_prefill)
                          for b in self.batch_buckets for t in short}
        self.prefill_steps = {(b, t, m): PrefillStep(partial(prefill, self._prefill_model), st, m)
                              for (b, t), st in prefill_states.items() for m in PLAIN_MODES}
        self._rng = random.Random()
        self.speculation: StepStrategy | None = None  # set by llm.load_llm_runner for a speculative plan
        self.plan = {"compile_prefill": compile_prefill, "compile_decode": compile_decode,
                     "compile_mode": compile_mode, "cuda_graphs": cuda_graphs,
                     "prefill_graphs": prefill_graphs if static_prefill else 0, "static_prefill": static_prefill,
                     "kernels": kernels,
                     "batch_buckets": list(self.batch_buckets),
                     "prefill_buckets": list(self.prefill_buckets), "kv_buckets": list(self.kv_buckets),
                     "max_seq_len": max_seq_len}

    @property
    def max_batch(self) -> int:
        return self.batch_buckets[-1]

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt this runner takes: its largest prompt bucket, leaving one token to generate."""
        return min(self.prefill_buckets[-1], self.max_seq_len - 1)

    def check(self, prompt: list[int], params: SamplingParams) -> str | None:
        """Why this request cannot run, or None. The handler validates requests before they get
        here (with these same limits); this guards every other caller."""
        if len(prompt) == 0:
            return "the prompt is empty"
        if (err := params.error()) is not None:
            return err
        if len(prompt) > self.max_prompt_len:
            return f"the prompt has {len(prompt)} tokens, more than the {self.max_prompt_len} this server accepts"
        if len(prompt) + params.max_tokens > self.max_seq_len:
            return (f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                    f"context of {self.max_seq_len} tokens")
        return None

    @torch.no_grad()
    def warmup(self) -> dict[str, float]:
        """Compile prefill for every bucket (when compiled) and capture (CUDA) every decode step.

        Returns seconds spent per phase. Leaves the KV cache holding garbage, which is harmless.
        """
        t0 = time.perf_counter()
        shapes = [(b, t) for b in self.batch_buckets for t in self.prefill_buckets]
        # Eager prefill has nothing to compile: one small call initialises the kernels. Compiled,
        # every shape runs once, so that any guard that would recompile fails here, not in serving.
        if not self.static_prefill:
            shapes = []
        for b, t in shapes if self.compile_prefill else shapes[:1]:
            params = SamplingTensors.build([1.0] * b, [50] * b, [0.9] * b, [0] * b, self.device)
            tokens, input_pos, last_idx = (x.to(self.device) for x in pad_prompts([[self.pad_id] * t], b, t))
            rows = torch.arange(b, device=self.device) if self.slot_prefill else None
            prefill(self._prefill_model, tokens, input_pos, last_idx, params, FILTER, rows)
        self._sync()
        t1 = time.perf_counter()
        for b, state in self.states.items():
            state.load(torch.zeros(b, dtype=torch.int64, device=self.device),
                       torch.zeros(b, dtype=torch.int64, device=self.device),
                       SamplingTensors.build([1.0] * b, [50] * b, [0.9] * b, [0] * b, self.device))
        pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        warm_steps(self.prefill_steps, prefill_order, pool, lambda k: k[2] in (FILTER, FULL))
        self._sync()
        t2 = time.perf_counter()
        warm_steps(self.steps, decode_order, pool, lambda k: k[1] in (FILTER, FULL) and k[2] == self.kv_buckets[-1])
        self._sync()
        return {"prefill_s": t1 - t0, "prefill_graphs_s": t2 - t1, "decode_s": time.perf_counter() - t2}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def stream(self, prompts: list[list[int]], params: list[SamplingParams],
               speculate: list[bool] | None = None) -> GenerationStream:
        """Validate, run prefill now, and return an iterator of one ``StepOutput`` per step.

        Decodes with the ``speculation`` strategy when there is one and it applies to the batch
        (``speculate[i] = False`` keeps request i from speculating), else one token per step.
        Not a generator itself, so a bad request raises ``ValueError`` at the call, not at the
        first ``next()``. Iterate to the end (or drop the iterator) before the next call: the
        runner has one KV cache.
        """
        if self.speculation is not None and self.speculation.applies(params, speculate):
            return self.speculation.stream(prompts, params, speculate)
        return self.stream_plain(prompts, params)

    def stream_plain(self, prompts: list[list[int]], params: list[SamplingParams]) -> GenerationStream:
        """``stream`` with one token per step, whatever the strategy."""
        b = self.prepare(prompts, params, self.batch_buckets)
        with torch.no_grad():
            first = self.run_prefill(self.prefill_steps, b, partial(prefill, self._prefill_model))
            self.states[b.batch].load(token_ids(first, b.mode), b.positions, b.sampling, count=b.mode == FULL)
        host = HostCopies(tuple(first.shape), self.device, first.dtype)
        host.start(0, first)
        done = [False] * len(prompts)
        return GenerationStream(self._decode_loop(b.batch, b.mode, host, [len(p) for p in prompts], params, done),
                                done)

    def prepare(self, prompts: list[list[int]], params: list[SamplingParams],
                batch_buckets: tuple[int, ...]) -> "PreparedBatch":
        """Validate a batch (``ValueError`` naming the request) and pad it to its buckets, on the device."""
        if not self.static_prefill:
            raise RuntimeError("this runner was built without static prefill (static_prefill=False): "
                               "its prompts go through the continuous engine")
        if self.model.max_seq_len != self.max_seq_len or self.model.max_batch_size < self.max_batch:
            raise RuntimeError("the model's KV cache was reallocated by another runner; use one runner per model")
        n = len(prompts)
        if n == 0 or n != len(params):
            raise ValueError(f"need one SamplingParams per prompt, got {n} prompts and {len(params)}")
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if (err := self.check(p, sp)) is not None:
                raise ValueError(f"request {i}: {err}")
        batch = pick_bucket(n, batch_buckets)
        length = pick_bucket(max(len(p) for p in prompts), self.prefill_buckets)
        tokens, input_pos, last_idx = (x.to(self.device) for x in pad_prompts(prompts, batch, length, self.pad_id))
        pad_rows = batch - n  # dummy rows decode greedily
        temperature = [float(sp.temperature) for sp in params] + [0.0] * pad_rows
        top_k = [sp.top_k for sp in params] + [0] * pad_rows
        top_p = [float(sp.top_p) for sp in params] + [1.0] * pad_rows
        seeds = [sp.seed if sp.seed is not None else self._rng.getrandbits(32) for sp in params] + [0] * pad_rows
        presence = [float(sp.presence_penalty) for sp in params] + [0.0] * pad_rows
        frequency = [float(sp.frequency_penalty) for sp in params] + [0.0] * pad_rows
        positions = torch.tensor([len(p) for p in prompts] + [0] * pad_rows, device=self.device)
        return PreparedBatch(batch, length, tokens, input_pos, last_idx,
                             SamplingTensors.build(temperature, top_k, top_p, seeds, self.device, presence, frequency),
                             sampling_mode(temperature, top_k, top_p, any(sp.full for sp in params)), positions)

    @staticmethod
    def run_prefill(steps: dict[tuple[int, int, str], GraphedStep], b: "PreparedBatch",
                    plain: Callable[..., Tensor], rows: Tensor | None = None) -> Tensor:
        """Prefill from the static-input step of the batch's shape when there is one (a graph's
        output: the caller copies it before any replay), else ``plain(tokens, input_pos, last_idx,
        sampling, mode)``. ``rows``: the cache rows to fill (a runner built with ``slot_prefill``)."""
        step = steps.get((b.batch, b.length, b.mode))
        if step is None:
            if rows is not None:
                return plain(b.tokens, b.input_pos, b.last_idx, b.sampling, b.mode, rows=rows)
            return plain(b.tokens, b.input_pos, b.last_idx, b.sampling, b.mode)
        step.state.load(b.tokens, b.input_pos, b.last_idx, b.sampling, rows)
        return step.run()

    def _decode_loop(self, batch: int, mode: str, host: HostCopies, lengths: list[int],
                     params: list[SamplingParams], done: list[bool]) -> Iterator[StepOutput]:
        n = len(params)
        generated = [0] * n
        stops = [set(sp.stop_token_ids) for sp in params]
        launched, slot = 1, 0  # tokens per row requested from the device so far (prefill's first)
        while True:
            live = [i for i in range(n) if not done[i]]  # done[] may also be set by GenerationStream.cancel
            if not live:
                return
            if launched < max(params[i].max_tokens for i in live):  # launch step t+1 before reading step t
                # This step writes position lengths[i] + launched - 1 for row i: attend to one past it.
                needed = min(max(lengths[i] for i in live) + launched, self.max_seq_len)
                step = self.steps[(batch, mode, pick_bucket(needed, self.kv_buckets))]
                host.start(1 - slot, step.run())
                launched += 1
            rows = host.wait(slot)
            out = StepOutput([None] * n, [None] * n, logprobs=[None] * n)
            for i in live:
                tok, logprob = read_row(rows[i], mode, params[i].logprobs)
                out.tokens[i] = [tok]
                if logprob is not None:
                    out.logprobs[i] = [logprob]
                generated[i] += 1
                if tok in stops[i]:
                    out.finish_reasons[i], done[i] = FINISH_STOP, True
                elif generated[i] >= params[i].max_tokens:
                    out.finish_reasons[i], done[i] = FINISH_LENGTH, True
            yield out
            if all(done):
                return
            slot = 1 - slot
