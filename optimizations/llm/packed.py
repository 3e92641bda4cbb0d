"""Packed prefill: chunks of several prompts in one forward, as one flat batch of tokens.

The continuous engine (continuous.py) puts the prompts it is prefilling into the KV cache through
this one call per step: each chunk (a prompt's next tokens, the positions they take, the cache row
of its request) is laid end to end after the others, with no padding between requests. The model
runs its layers unchanged over that one row of ``N`` tokens (``Transformer.hidden`` with batch 1);
only attention differs: each layer's ``Attention.packed`` hook writes every token's k/v at its own
(cache row, position) and makes each token attend over its own row up to its own position, which
covers a later chunk of a long prompt (its earlier chunks are in the row already) as well as a
whole short prompt, and a decoding row's next token, which rides in the same forward as a chunk of
one token taken on the device from the decode state (``Chunk.from_state``).

Two attention paths compute the same thing:

* ``triton``: one kernel over the packed queries and the cache (optimizations/kernels/triton_prefill.py),
  driven by small tables on the device, so a whole packed forward is captured as one CUDA graph
  per token bucket and replays for any mix of requests that fits it (CUDA);
* ``torch``: per request, scores against its cache row, masked and soft-maxed in fp32 (CPU, and
  the reference the kernel is tested against). Its loop runs on the host, so it is never captured.

With ``kernels: triton`` and small weights, a forward of up to a few dozen tokens runs the decode
steps' fused blocks instead of the layers (``triton_decode.PackedBlock``: each token a row of its own),
which cost a short forward less than the layers' floor; the attention hook is then not called.

With graphs, the packed batch is padded to the smallest token bucket that holds it (powers of two
from 16 up to the token budget, with a bucket halfway between two of them from 128 up): no block
of the kernel covers a padding token, so it is neither stored in the cache nor attended for. Every
bucket is captured by ``warmup()``, so no request compiles anything.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from servekit.optimizations.buckets import pick_bucket
from servekit.optimizations.llm.generate import GraphedStep
from servekit.optimizations.models.llama import Attention, Transformer

if TYPE_CHECKING:
    from servekit.optimizations.kernels.triton_decode import FusedDecodeBlock

ATTENTIONS = ("triton", "torch")
BLOCK_M = 64  # query block of the Triton kernel: the block table's unit
SMALLEST_BUCKET = 16


class Chunk(NamedTuple):
    """A prompt's next tokens for one packed forward: ``tokens`` at positions ``start ..`` of cache
    row ``row``; ``last``: the prompt's final chunk, whose last token's logits are wanted.

    ``from_state``: a decoding row's next token instead (one token, ``last`` set), taken on the
    device from the decode state's ``tokens[row]``, where the step before it left it: the host has
    not read it yet (the engine reads a step's tokens after launching the next).

    A named tuple: the engine builds one per riding row every step, and building frozen dataclasses
    took ~0.03 ms of a 32-row constrained step on an H200 host (py-spy), named tuples ~0."""

    tokens: list[int]
    start: int
    row: int
    last: bool
    from_state: bool = False


# From this many tokens up, a bucket also sits halfway between two powers of two.
HALF_STEPS_FROM = 128


def token_buckets(max_tokens: int, smallest: int = SMALLEST_BUCKET) -> tuple[int, ...]:
    """Powers of two from ``smallest`` below ``max_tokens`` and, from HALF_STEPS_FROM up, 1.5 times
    each (192, 384, 768, 1536: multiples of the kernel's 64-query block), then ``max_tokens``
    itself. A packed forward costs about its padded token count, and a lone prompt is padded to
    its bucket: with doubling alone a 600-token prompt ran as 1,024 tokens, now as 768 (padding at
    most a third of the bucket instead of half, for a few more graphs captured at start)."""
    out, n = [], smallest
    while n < max_tokens:
        out.append(n)
        if n >= HALF_STEPS_FROM and n * 3 // 2 < max_tokens:
            out.append(n * 3 // 2)
        n *= 2
    return tuple(out) + (max_tokens,)


def triton_fits(model: Transformer) -> str | None:
    """Why the Triton kernel cannot serve this model, or None."""
    if model.tok_embeddings.weight.device.type != "cuda":
        return "not a CUDA model"
    d = model.config.head_dim
    if d < 16 or d & (d - 1):
        return f"head_dim {d} is not a power of two >= 16"
    if getattr(model.layers[0].attention, "softcap", None):
        return "attention soft-capping"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def _sliding(model: Transformer) -> tuple[bool, ...]:
    return tuple(getattr(model.config, "sliding_layers", ())) or (False,) * len(model.layers)


def _write_kv(attn: Attention, k: Tensor, v: Tensor, rows: Tensor, positions: Tensor) -> None:
    """This step's k/v ``(1, n_kv, N, D)`` into the cache at each token's (row, position)."""
    cache = attn.kv_cache
    if cache is None:
        raise RuntimeError("call Transformer.setup_caches() before a packed prefill")
    cache.k_cache[rows, :, positions] = k[0].transpose(0, 1)
    cache.v_cache[rows, :, positions] = v[0].transpose(0, 1)


def _scale(attn: Attention) -> float:
    scale = getattr(attn, "scale", None)
    return attn.head_dim ** -0.5 if scale is None else scale


class TorchAttention:
    """Packed attention by a loop over the requests on the host (segments known as Python ints)."""

    def __init__(self, segments: list[tuple[int, int, int, int]], rows: Tensor, positions: Tensor) -> None:
        self.segments, self.rows, self.positions = segments, rows, positions  # (start, length, pos0, row)

    def __call__(self, attn: Attention, q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
        _write_kv(attn, k, v, self.rows, self.positions)
        _, n_heads, n, d = q.shape
        n_kv = k.shape[1]
        out = q.new_zeros(n, n_heads, d)
        cache, scale, softcap = attn.kv_cache, _scale(attn), getattr(attn, "softcap", None)
        for start, length, pos0, row in self.segments:
            span = pos0 + length
            keys, values = cache.k_cache[row, :, :span], cache.v_cache[row, :, :span]  # (n_kv, S, D)
            slots = torch.arange(span, device=q.device)
            qpos = pos0 + torch.arange(length, device=q.device)[:, None]
            seen = slots[None] <= qpos  # (T, S)
            if window:
                seen = seen & (slots[None] > qpos - window)
            # GQA as the model's own attention does it: each kv head's query group folded into the
            # query axis, (n_kv, group*T, D), the mask repeated to match.
            group = n_heads // n_kv
            qs = q[0, :, start:start + length].reshape(n_kv, group * length, d)
            mask = seen.repeat(group, 1)
            if softcap:  # Gemma 2's capped scores, which SDPA has no option for: softmax in fp32
                scores = torch.tanh(torch.matmul(qs, keys.transpose(-1, -2)) * scale / softcap) * softcap
                probs = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
                y = torch.matmul(probs, values)
            else:
                y = F.scaled_dot_product_attention(qs[None], keys[None], values[None], attn_mask=mask, scale=scale)[0]
            out[start:start + length] = y.reshape(n_heads, length, d).transpose(0, 1)
        return out[None]


@torch.library.custom_op("servekit::packed_prefill_attention", mutates_args=("k_cache", "v_cache"))
def _triton_attention_op(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, seq: Tensor,
                         block_seq: Tensor, block_off: Tensor, scale: float, window: int) -> Tensor:
    """The Triton kernel over q ``(N, n_heads, D)``, k / v ``(N, n_kv, D)``: stores k / v at each
    token's (row, position) and attends. An opaque op to ``torch.compile``: a compiled packed layer
    fuses the elementwise work around it and calls the kernel as it is."""
    from servekit.optimizations.kernels.triton_prefill import packed_attention

    return packed_attention(q, k, v, k_cache, v_cache, seq, block_seq, block_off, scale, window or None)


@_triton_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, seq: Tensor, block_seq: Tensor,
      block_off: Tensor, scale: float, window: int) -> Tensor:
    return q.new_empty(q.shape)


class TritonAttention:
    """Packed attention by the Triton kernel, from tables on the device (capturable, compilable).

    Holds the whole tables and takes the first entries a forward of ``N`` tokens needs, so one
    object serves every token bucket: a compiled layer sees the same hook whatever the bucket.
    The kernel itself stores this step's k/v in the cache (padding tokens: nowhere)."""

    def __init__(self, seq: Tensor, block_seq: Tensor, block_off: Tensor, max_seqs: int) -> None:
        self.seq, self.block_seq, self.block_off, self.max_seqs = seq, block_seq, block_off, max_seqs

    def __call__(self, attn: Attention, q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
        cache = attn.kv_cache
        if cache is None:
            raise RuntimeError("call Transformer.setup_caches() before a packed prefill")
        n = q.shape[2]
        blocks = n // BLOCK_M + self.max_seqs  # each request adds at most one partial block
        y = torch.ops.servekit.packed_prefill_attention(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cache.k_cache, cache.v_cache,
            self.seq, self.block_seq[:blocks], self.block_off[:blocks], _scale(attn), window or 0)
        return y[None]


@contextmanager
def packed_attention(model: Transformer, attend: TorchAttention | TritonAttention) -> Iterator[None]:
    """Every layer's attention goes through ``attend`` inside the block (sliding layers with their window)."""
    window = getattr(model.config, "sliding_window", None)
    try:
        for layer, local in zip(model.layers, _sliding(model)):
            layer.attention.packed = partial(attend, window=window) if local else attend
        yield
    finally:
        for layer in model.layers:
            layer.attention.packed = None


def packed_logits(model: Transformer, tokens: Tensor, positions: Tensor, last_idx: Tensor,
                  attend: TorchAttention | TritonAttention, blocks: Sequence[Callable[..., Tensor]] | None = None
                  ) -> Tensor:
    """fp32 logits ``(S, V)`` at packed indices ``last_idx`` of tokens ``(N,)`` at ``positions``.
    ``blocks``: callables run instead of the model's layers (compiled copies of them)."""
    with packed_attention(model, attend):
        # Batch 1: hidden()'s own mask is unused (the hook attends), kv_len=1 keeps it tiny.
        h = model.hidden(tokens[None], positions[None], kv_len=1, blocks=blocks)
    return model.output(h[0, last_idx]).float()


class _PackedStep(GraphedStep):
    """The packed forward of one token bucket on the static tables (a CUDA graph after ``capture``)."""

    def __init__(self, owner: "PackedPrefill", n: int) -> None:
        self.owner, self.n = owner, n

    @torch.no_grad()
    def _body(self) -> Tensor:
        o, n = self.owner, self.n
        return packed_logits(o.model, o.inputs(n), o.positions[:n], o.last_idx, o.triton, o.layers(n))


class PackedPrefill:
    """One packed forward per call over up to ``max_tokens`` tokens of up to ``max_seqs`` requests.

    ``graphs`` (CUDA with the Triton path): each token bucket is a captured graph; ``run`` pads to
    the bucket. Otherwise the forward runs eagerly on exactly the tokens given.
    """

    def __init__(self, model: Transformer, max_tokens: int, max_seqs: int, graphs: bool = False,
                 attention: str | None = None, pad_id: int = 0,
                 blocks: Sequence[Callable[..., Tensor]] | None = None, state_tokens: Tensor | None = None,
                 fused: Sequence[FusedDecodeBlock] | None = None, fused_tokens: int = 0) -> None:
        """``state_tokens``: the decode state's ``tokens`` ``(rows, 1)``, where ``from_state``
        chunks take their token (a forward without them needs none). ``fused``: the decode
        steps' fused Triton blocks (``kernels: triton``), which run the forwards of up to
        ``fused_tokens`` tokens (``PackedBlock``) instead of ``blocks`` or the model's layers."""
        if max_tokens < 1 or max_seqs < 1:
            raise ValueError(f"max_tokens ({max_tokens}) and max_seqs ({max_seqs}) must be positive")
        self.model, self.max_tokens, self.max_seqs, self.pad_id = model, max_tokens, max_seqs, pad_id
        self.device = model.tok_embeddings.weight.device
        why_not = triton_fits(model)
        if attention is None:
            attention = "torch" if why_not else "triton"
        if attention not in ATTENTIONS:
            raise ValueError(f"attention {attention!r}: use one of {', '.join(ATTENTIONS)}")
        if attention == "triton" and why_not:
            raise ValueError(f"the Triton packed attention cannot serve this model: {why_not}")
        if graphs and (attention != "triton" or self.device.type != "cuda"):
            raise ValueError("packed prefill graphs need a CUDA model and the triton attention")
        if blocks is not None and attention != "triton":
            # The torch path loops over requests on the host: nothing a compiler could keep.
            raise ValueError("compiled packed layers need the triton attention")
        self.attention, self.graphs, self.blocks = attention, graphs, blocks
        self.buckets = token_buckets(max_tokens) if graphs else ()
        # The static tables, one int64 buffer (one host-to-device copy per step): tokens, positions,
        # cache rows, from_state (max_tokens each), last_idx (max_seqs), seq (4 per request), block
        # table (2 x blocks).
        n, s = max_tokens, max_seqs
        self._blocks = max_tokens // BLOCK_M + max_seqs
        sizes = [n, n, n, n, s, 4 * s, self._blocks, self._blocks]
        self._dev = torch.zeros(sum(sizes), dtype=torch.int64, device=self.device)
        views = torch.split(self._dev, sizes)
        self.tokens, self.positions, self.rows, self.from_state, self.last_idx, seq, self.block_seq, self.block_off = views
        self.state_tokens = state_tokens[:, 0] if state_tokens is not None else None
        self.seq = seq.view(s, 4)
        blank = torch.zeros(sum(sizes), dtype=torch.int64)
        b = torch.split(blank, sizes)
        b[0].fill_(pad_id)
        b[6].fill_(-1)  # no request: the program exits
        self._blank = blank
        ends = np.cumsum(sizes).tolist()
        self._bounds = list(zip([0, *ends[:-1]], ends))  # each table's slice of the buffer
        self._steps: dict[int, _PackedStep] = {}
        # One hook object for every bucket (compiled layers see the same one each time).
        self.triton = (TritonAttention(self.seq, self.block_seq, self.block_off, s)
                       if attention == "triton" else None)
        self.fused_tokens = fused_tokens if fused is not None else 0
        self.fused = None
        if fused is not None:
            from servekit.optimizations.kernels.triton_decode import PackedBlock  # imports triton: only when asked for

            self.fused = [PackedBlock(f, self.rows, model.max_seq_len) for f in fused]

    def layers(self, n: int) -> Sequence[Callable[..., Tensor]] | None:
        """What runs the layers of a forward of ``n`` tokens (None: the model's own)."""
        return self.fused if n <= self.fused_tokens else self.blocks

    def inputs(self, n: int) -> Tensor:
        """The first ``n`` input tokens: the table's, or the decode state's for ``from_state`` entries."""
        if self.state_tokens is None:
            return self.tokens[:n]
        pick = self.from_state[:n]
        # Other entries index row 0: their rows (the spare row of padding) may lie past the state's.
        return torch.where(pick.bool(), self.state_tokens[self.rows[:n] * pick], self.tokens[:n])

    def _load(self, chunks: list[Chunk]) -> tuple[int, list[tuple[int, int, int, int]]]:
        """Fill the tables for ``chunks``; returns the token count and the segments."""
        n = len(chunks)
        if not chunks or n > self.max_seqs:
            raise ValueError(f"a packed prefill takes 1..{self.max_seqs} chunks, got {n}")
        # One pass over the chunks in Python, the rest in numpy: the engine thread runs this for
        # every packed forward, on a decode step's critical path when decoding rows ride in it
        # (2-core VM, a prompt and 32 riders: 92 us against 132 with a numpy call per chunk and
        # field; four 512-token prompts: 112 against 125).
        flat: list[int] = []
        lengths, starts, cache_rows, lasts, states = [], [], [], [], []
        for c in chunks:
            flat += c.tokens
            lengths.append(len(c.tokens))
            starts.append(c.start)
            cache_rows.append(c.row)
            lasts.append(c.last)
            states.append(c.from_state)
        total = len(flat)
        if total > self.max_tokens or 0 in lengths:
            raise ValueError(f"chunks of {total} tokens (empty ones refused) exceed the budget of {self.max_tokens}")
        lengths_, starts_, cache_rows_ = np.array([lengths, starts, cache_rows], dtype=np.int64)
        lasts_, states_ = np.array([lasts, states], dtype=bool)
        decoding = bool(states_.any())
        if decoding and (self.state_tokens is None or (states_ & ((lengths_ != 1) | ~lasts_)).any()):
            raise ValueError("a from_state chunk is one token whose logits are wanted, on a forward given the decode state")
        # A fresh host copy of the blank tables per forward, pinned on CUDA: the copy to the device
        # is queued behind the step in flight instead of waiting for it (a pageable source would
        # wait), and PyTorch's pinned-memory cache keeps each buffer until its copy has run, so the
        # next forward's tables never overwrite one still being read.
        host = self._blank.pin_memory() if self.device.type == "cuda" else self._blank.clone()
        h = host.numpy()
        tokens, positions, rows, from_state, last_idx, seq, block_seq, block_off = (h[a:b] for a, b in self._bounds)
        offsets = np.cumsum(lengths_) - lengths_  # where each chunk starts in the packed batch
        tokens[:total] = flat
        positions[:total] = np.arange(total) - np.repeat(offsets - starts_, lengths_)  # chunk i's token j: start_i + j
        rows[:total] = np.repeat(cache_rows_, lengths_)
        # Padding tokens in the cache's garbage row, at position 0: the fused blocks store their
        # k/v and attend one slot there (the kernel's block table leaves them out altogether).
        rows[total:] = self.model.spare_row
        if decoding:  # one token each
            from_state[offsets[states_]] = 1
        last = (offsets + lengths_ - 1)[lasts_]
        last_idx[:len(last)] = last
        seq[:4 * n] = np.stack([offsets, lengths_, starts_, cache_rows_], axis=1).ravel()
        # The kernel's query blocks: (chunk, offset in it) for every BLOCK_M tokens of each chunk.
        per_chunk = -(-lengths_ // BLOCK_M)
        blocks = int(per_chunk.sum())
        block_seq[:blocks] = np.repeat(np.arange(n), per_chunk)
        block_off[:blocks] = (np.arange(blocks) - np.repeat(np.cumsum(per_chunk) - per_chunk, per_chunk)) * BLOCK_M
        segments = list(zip(offsets.tolist(), lengths, starts, cache_rows))
        self._dev.copy_(host, non_blocking=True)
        return total, segments

    @torch.no_grad()
    def run(self, chunks: list[Chunk]) -> Tensor:
        """Prefill ``chunks`` (each request at most once); returns fp32 logits ``(L, V)`` of the
        last token of each chunk with ``last`` set, in order. With graphs the result is the graph's
        output: read it before the next ``run``."""
        total, segments = self._load(chunks)
        n_last = sum(c.last for c in chunks)
        if self.graphs:
            return self._steps[pick_bucket(total, self.buckets)].run()[:n_last]
        n = total
        attend = self.triton or TorchAttention(segments, self.rows[:n], self.positions[:n])
        return packed_logits(self.model, self.inputs(n), self.positions[:n], self.last_idx[:n_last], attend,
                             self.layers(n))

    def pad_chunks(self, n: int) -> list[Chunk]:
        """Padding chunks of ``n`` tokens in all, what ``warmup()`` runs a bucket on: one request each
        into the spare row (the cache's garbage row), each at most a context long."""
        span = self.model.max_seq_len
        lengths = [span] * (n // span) + ([n % span] if n % span else [])
        return [Chunk([self.pad_id] * m, 0, self.model.spare_row, True) for m in lengths[:self.max_seqs]]

    @torch.no_grad()
    def warmup(self) -> dict[str, object]:
        """Capture (graphs) or run once every token bucket: the Triton kernel compiles here, and no
        request shape is new at serving time. Returns what was built and how long it took."""
        t0 = time.perf_counter()
        spare, span = self.model.spare_row, self.model.max_seq_len
        # Uncaptured, shapes do not matter: one small forward initialises the path (and compiles the kernel).
        sizes = self.buckets or (min(SMALLEST_BUCKET, self.max_tokens, span),)
        pool = torch.cuda.graph_pool_handle() if self.graphs else None
        if self.blocks is not None and self.graphs:
            # Compile first on an odd token count that no other size shares: traced at the full budget,
            # dynamo would take the tables' length and the token count for one size (duck sizing), or
            # a model dimension of 16 for the token count, and compile again for the next bucket.
            m = max(2, min(SMALLEST_BUCKET + 1, span, self.max_tokens // 2))
            self._load([Chunk([self.pad_id] * m, 0, spare, True)])
            packed_logits(self.model, self.tokens[:m], self.positions[:m], self.last_idx[:1], self.triton, self.blocks)
        for n in sorted(sizes, reverse=True):  # largest first: the smaller graphs fit in its pool
            chunks = self.pad_chunks(n)
            if self.graphs:
                self._load(chunks)
                self._steps[n] = _PackedStep(self, n)
                self._steps[n].capture(pool)
            else:
                self.run(chunks)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"attention": self.attention, "compiled": self.blocks is not None, "graphs": self.graphs,
                "token_buckets": list(sizes), "fused_up_to": self.fused_tokens,
                "max_seqs": self.max_seqs, "seconds": round(time.perf_counter() - t0, 2)}


__all__ = ["ATTENTIONS", "Chunk", "PackedPrefill", "TorchAttention", "TritonAttention", "packed_logits",
           "token_buckets", "triton_fits"]
