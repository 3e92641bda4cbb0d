"""The LLM runner for ``servekit.optimizations.models.llama``: KV cache, shape buckets, CUDA-graph decode steps.

Requests run through the continuous engine (continuous.py), which prefills prompts with its packed
forward (packed.py) into cache rows and then decodes them here, one row per request: every row's
tokens sit at positions ``0..len-1`` of its own KV cache row, so a row computes exactly what it
would compute alone (RoPE positions, attention span).

Shapes are bucketed: the decode batch is padded to a batch bucket (rows nobody reads decode
garbage), and each decode step attends over a kv bucket (the cache prefix the live rows have
reached, rounded up) rather than the whole cache.

On CUDA, ``LlamaRunner.warmup()`` captures one ``torch.cuda.CUDAGraph`` per (batch bucket, kv
bucket, sampling mode: greedy / sample / top-k-top-p / full (penalties and logprobs), chosen on the
host from the requests) for the decode step, sampling included, through the compiled transformer
block when the plan compiles (``RegionalCompiled``: one block compiled with dynamic shapes and
reused by every layer, shared with the packed prefill). The default GPU plan (batch 1..8, kv
256..2048) makes 64 graphs in one pool.
We capture graphs ourselves rather than through ``mode="reduce-overhead"``: the graph's input and
output tensors are ours, each step copies its output to the host before the next replay, and
nothing outside holds a graph output that a replay could overwrite (the failure seen with
transformers' static cache + compile). On CPU the same static-buffer code runs eagerly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor

from servekit.optimizations.models.llama import Transformer, WithBlocks
from servekit.optimizations.llm.sampling import (FILTER, FULL, PLAIN_MODES, TOP_LOGPROBS, SamplingTensors, masked_bias,
                                                 sample, sample_full)

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
class RunnerShape:
    """What the serving side needs to know of a runner, as plain values: they cross from the engine
    process (engine_process.py) to the worker that parses requests."""

    vocab_size: int
    max_batch: int  # rows decoding at once, the choices of all requests together
    max_prompt_len: int
    max_seq_len: int

    def context_error(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why a prompt of ``prompt_len`` tokens with ``max_tokens`` to generate does not fit, or
        None: the one check of the prompt limit and the context (the handler answers its message
        as a 400, the engine refuses such a request with it)."""
        if prompt_len > self.max_prompt_len:
            return f"the prompt has {prompt_len} tokens, more than the {self.max_prompt_len} this server accepts"
        if prompt_len + max_tokens > self.max_seq_len:
            return (f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the "
                    f"context of {self.max_seq_len} tokens")
        return None

    def check(self, prompt: list[int], params: "SamplingParams") -> str | None:
        """Why this request cannot run, or None."""
        if len(prompt) == 0:
            return "the prompt is empty"
        return params.error() or self.context_error(len(prompt), params.max_tokens)


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
    # Grammar, logit_bias and min_tokens (optimizations/llm/grammar.py).
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


def decode_one_token(model: Transformer, tokens: Tensor, input_pos: Tensor, params: SamplingTensors,
                     mode: str = FILTER, kv_len: int | None = None, counts: Tensor | None = None) -> Tensor:
    """One token per row: tokens, input_pos ``(B, 1)`` -> next tokens ``(B,)`` (FULL mode:
    ``sample_full``'s rows, penalised by ``counts``).

    Every live row's position must be below ``kv_len`` (default: the whole cache).
    """
    return sample_mode(model(tokens, input_pos, kv_len=kv_len)[:, -1], params, input_pos[:, -1], mode, counts)


def sample_mode(logits: Tensor, params: SamplingTensors, position: Tensor, mode: str,
                counts: Tensor | None = None, packed: Tensor | None = None) -> Tensor:
    """A decode step's output from its rows' last logits: ``sample_full``'s rows (penalised by
    ``counts``) in FULL mode, else the sampled ids; ``packed``: the rows' grammar masks."""
    if mode == FULL:
        if packed is not None:
            params = params._replace(bias=masked_bias(params.bias, packed, logits))
        return sample_full(logits, params, position, counts)
    return sample(logits, params, position, mode, packed)


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


# --- the runner: buckets, warm-up / capture ----------------------------------------------------

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
        # The last logits of a split step (ForwardStep -> SampleStep; the model's logits are fp32).
        self.logits = torch.zeros(batch, vocab_size, dtype=torch.float32, device=device)
        # A split step's grammar masks, packed (32 tokens per int32 word; -1: no grammar), applied
        # by SampleStep: the host copies only these bits, no unpacking launched from it.
        self.packed = torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=device)

    def view(self, batch: int) -> "DecodeState":
        """The first ``batch`` rows, sharing memory with this state."""
        out = object.__new__(DecodeState)
        out.tokens, out.input_pos, out.counts = self.tokens[:batch], self.input_pos[:batch], self.counts[:batch]
        out.logits, out.packed = self.logits[:batch], self.packed[:batch]
        out.params = SamplingTensors(*(t[:batch] for t in self.params))
        return out

    def load_rows(self, rows: Tensor, first_tokens: Tensor, positions: Tensor, params: SamplingTensors) -> None:
        """Start requests in the given rows (continuous batching): their first token, position and
        sampling parameters; their penalty counts restart from the first token."""
        self.start_rows(rows, positions, params)
        self.tokens.index_copy_(0, rows, first_tokens[:, None])
        self.counts.index_put_((rows, first_tokens), torch.ones_like(first_tokens, dtype=self.counts.dtype))

    def start_rows(self, rows: Tensor, positions: Tensor, params: SamplingTensors) -> None:
        """Rows whose first token the next sampling half samples from the logits put into their rows
        of ``logits`` (continuous batching): at ``positions`` (the prompts' last, which key the
        sample; the half advances them), their sampling parameters, no penalty counts."""
        self.input_pos.index_copy_(0, rows, positions[:, None])
        for dst, src in zip(self.params, params):
            dst.index_copy_(0, rows, src)
        self.counts.index_fill_(0, rows, 0.0)
        # No mask left by the row's last request (a grammar row that moved down leaves its last mask
        # behind): a free row's sampling half applies its packed row too. A grammar row's own mask
        # is filled before its sampling half.
        self.packed.index_fill_(0, rows, -1)

    def move_row(self, src: int, dst: int) -> None:
        """Row ``src``'s state (token, position, sampling parameters, penalty counts, grammar mask)
        into row ``dst``. The mask too: ``dst``'s is its last request's, and a sampling half that
        rides a prompt's forward applies it before any split step has refilled the masks."""
        rows = [self.tokens, self.input_pos, *self.params, self.counts, self.packed]
        torch._foreach_copy_([t[dst] for t in rows], [t[src] for t in rows])

    def load(self, first_tokens: Tensor, positions: Tensor, params: SamplingTensors) -> None:
        """Every row at once (warm-up)."""
        self.tokens.copy_(first_tokens[:, None])
        self.input_pos.copy_(positions[:, None])
        self.params.copy_(params)


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
        # Replayed once now: PyTorch does not upload a graph when it instantiates one, so the first
        # launch pays the upload (~0.3 ms of host time on an H100 host), which must not fall on a
        # request. A replay does what the warm-up runs above did (the same state advanced the same way).
        self.graph.replay()

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
        advance(st, out, self.mode, self.model.max_seq_len)
        return out


def advance(st: DecodeState, out: Tensor, mode: str, max_seq_len: int) -> None:
    """After a step sampled ``out``: each row's next input token, position and penalty counts."""
    nxt = token_ids(out, mode)
    if mode == FULL:
        st.counts.scatter_add_(1, nxt[:, None], torch.ones_like(st.counts[:, :1]))
    st.tokens.copy_(nxt[:, None])
    # Finished and dummy rows keep stepping; the clamp keeps their writes inside the cache.
    st.input_pos.add_(1).clamp_(max=max_seq_len - 1)


class ForwardStep(GraphedStep):
    """The model half of a decode step, for one (batch bucket, kv length): each row's last logits
    into the state's ``logits``. With its ``SampleStep`` it is a ``DecodeStep`` in two launches, so
    that bias rows that need each row's previous token (a grammar's mask) are filled on the host
    while this half runs on the device, and loaded before the sampling half."""

    def __init__(self, model: Transformer, state: DecodeState, kv_len: int,
                 forward: Callable[..., Tensor] | None = None) -> None:
        self.state, self.kv_len = state, kv_len
        self.forward = forward if forward is not None else model

    @torch.no_grad()
    def _body(self) -> Tensor:
        st = self.state
        st.logits.copy_(self.forward(st.tokens, st.input_pos, kv_len=self.kv_len)[:, -1])
        return st.logits


class SampleStep(GraphedStep):
    """The sampling half of a decode step, for one (batch bucket, sampling mode): samples the
    state's ``logits`` with its rows' parameters, bias and packed grammar masks, and advances the
    rows as ``DecodeStep`` does."""

    def __init__(self, state: DecodeState, mode: str, max_seq_len: int) -> None:
        self.state, self.mode, self.max_seq_len = state, mode, max_seq_len

    @torch.no_grad()
    def _body(self) -> Tensor:
        st = self.state
        out = sample_mode(st.logits, st.params, st.input_pos[:, -1], self.mode, st.counts, st.packed)
        advance(st, out, self.mode, self.max_seq_len)
        return out


# Capture order, largest shapes first: the smaller graphs fit into the memory pool they leave.
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


class LlamaRunner:
    """Owns the model's KV cache, shape buckets and compiled/captured decode steps; the continuous
    engine (continuous.py) prefills its rows and drives its steps.

    Decode graphs exist per (batch bucket, sampling mode, kv bucket): a step attends only over the
    cache prefix its rows have reached (rounded up to a kv bucket), instead of the whole cache.
    """

    def __init__(self, model: Transformer, max_seq_len: int, batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16),
                 prefill_buckets: tuple[int, ...] | None = None, kv_buckets: tuple[int, ...] | None = None,
                 compile_prefill: bool = False, compile_decode: bool = False, cuda_graphs: bool = False,
                 compile_mode: str = "default", pad_id: int = 0, kernels: str = "torch") -> None:
        """``prefill_buckets``: prompt lengths; the largest is the longest prompt accepted.
        ``compile_prefill``: the engine's packed prefill runs through the compiled blocks
        (``compiled_model``), which the decode steps use too with ``compile_decode``."""
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
        self.compile_prefill = compile_prefill
        model.setup_caches(self.batch_buckets[-1], max_seq_len)
        if compile_mode not in ("default", "max-autotune-no-cudagraphs"):
            # Other modes capture CUDA graphs of their own, which would nest inside ours.
            raise ValueError(f"compile mode {compile_mode!r}: use 'default' or 'max-autotune-no-cudagraphs'")
        # Only the transformer block is compiled, with dynamic shapes; sampling stays eager (inside
        # the decode graphs it costs no launches). Dynamo then keeps a graph for batch 1 (always
        # specialized) and one for batch > 1, whatever the buckets and modes.
        compiled = RegionalCompiled(model, compile_mode) if compile_prefill or compile_decode else None
        self.compiled_model = compiled
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
        # The same steps in two halves, for batches with rows whose bias needs their last token.
        self.forward_steps = {(b, kv): ForwardStep(model, self.states[b], kv, decode_model)
                              for b in self.batch_buckets for kv in self.kv_buckets}
        self.sample_steps = {(b, m): SampleStep(self.states[b], m, max_seq_len)
                             for b in self.batch_buckets for m in PLAIN_MODES}
        # A speculative.SpeculativeDecoding, set by llm.load_llm_runner for a speculative plan (typed
        # loosely: speculative.py builds on this module, which must not import it back).
        self.speculation: Any = None
        self.plan = {"compile_prefill": compile_prefill, "compile_decode": compile_decode,
                     "compile_mode": compile_mode, "cuda_graphs": cuda_graphs, "kernels": kernels,
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

    @property
    def shape(self) -> "RunnerShape":
        return RunnerShape(self.model.config.vocab_size, self.max_batch, self.max_prompt_len, self.max_seq_len)

    def check(self, prompt: list[int], params: SamplingParams) -> str | None:
        """Why this request cannot run, or None. ``RuntimeError`` if another runner has reallocated
        the model's KV cache since (the model holds one)."""
        if self.model.max_seq_len != self.max_seq_len or self.model.max_batch_size < self.max_batch:
            raise RuntimeError("the model's KV cache was reallocated by another runner; use one runner per model")
        return self.shape.check(prompt, params)

    @torch.no_grad()
    def warmup(self) -> dict[str, float]:
        """Capture (CUDA) every decode step, or run one of each sampling mode (CPU) to check its shapes.

        Returns the seconds it took. Leaves the KV cache holding garbage, which is harmless.
        """
        t0 = time.perf_counter()
        for b, state in self.states.items():
            state.load(torch.zeros(b, dtype=torch.int64, device=self.device),
                       torch.zeros(b, dtype=torch.int64, device=self.device),
                       SamplingTensors.build([1.0] * b, [50] * b, [0.9] * b, [0] * b, self.device))
        pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        warm_steps(self.steps, decode_order, pool, lambda k: k[1] in (FILTER, FULL) and k[2] == self.kv_buckets[-1])
        # The halves run the same code as the whole steps probed above: captured, not probed.
        warm_steps(self.forward_steps, lambda k: (-k[0], -k[1]), pool, lambda k: False)
        warm_steps(self.sample_steps, lambda k: (-k[0],), pool, lambda k: False)
        self.sync()
        return {"decode_s": time.perf_counter() - t0}

    def sync(self) -> None:
        """Wait for the device's queued work (CUDA; nothing to wait for on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
