"""Token sampling on device: greedy, temperature, top-k, top-p, reproducible per-request seeds.

Every parameter is a per-row tensor, so one batch mixes greedy and sampled requests and the whole
step stays on the device (no host sync, capturable in a CUDA graph).

Randomness is a counter-based hash, not a ``torch.Generator``: the noise for row ``b`` at vocab id
``v`` is ``hash(seed[b], position[b], v)``. That makes a request's output depend only on its own
seed, prompt and position -- not on which other requests share its batch or which bucket it was
padded to -- and it needs no generator state, which a captured CUDA graph could not advance.
Sampling then is the Gumbel-max trick: ``argmax(logits / T + Gumbel)`` is a draw from
``softmax(logits / T)``.

Order of the filters follows transformers' defaults: temperature, then top-k, then top-p.
Presence and frequency penalties (OpenAI's) come first, on the raw logits, from per-row counts of
the tokens generated so far (the prompt's tokens are not counted, as in vLLM).

Log probabilities are reported from the raw logits (before penalties and temperature: vLLM's
default ``raw_logprobs``), for the sampled token and the row's top alternatives.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from servekit.optimizations.llm.noise import FMIX_C1, FMIX_C2, GUMBEL_MAX, MIN_TEMPERATURE, POSITION_MUL, VOCAB_STRIDE

_M32 = 0xFFFFFFFF


def upload(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """``values`` as a tensor on ``device`` without the host waiting for the device. On CUDA,
    ``torch.tensor(values, device=...)`` copies from pageable memory, which first waits until every
    step already launched on the stream has run: the engine would stall the host (and leave the
    device idle after) at each admission. Here the values go through pinned memory and an
    asynchronous copy queued behind that work; PyTorch's pinned-memory cache keeps the block until
    its copy has run."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class SamplingTensors(NamedTuple):
    """Per-row sampling parameters, all shape ``(B,)`` on the model's device."""

    temperature: Tensor  # float32; 0 means greedy
    top_k: Tensor  # int64; 0 means off
    top_p: Tensor  # float32; 1.0 means off
    seed: Tensor  # int64 in [0, 2**32)
    presence: Tensor  # float32; presence penalty, 0 means off
    frequency: Tensor  # float32; frequency penalty, 0 means off
    # float32 (B, V), or (B, 1) zeros where no row can have one: added to the logits before
    # anything else (logit_bias, a grammar's -inf mask, stop tokens masked before min_tokens).
    bias: Tensor

    @classmethod
    def build(cls, temperature: list[float], top_k: list[int], top_p: list[float], seed: list[int],
              device: torch.device | str = "cpu", presence: list[float] | None = None,
              frequency: list[float] | None = None, bias: Tensor | None = None,
              vocab_size: int = 1) -> "SamplingTensors":
        """``bias``: the rows' additive logit bias ``(B, V)``; without it, zeros ``(B, vocab_size)``
        (a decode state that rows with a bias may join is built with the model's vocabulary)."""
        zeros = [0.0] * len(temperature)
        if bias is None:
            bias = torch.zeros(len(temperature), vocab_size, dtype=torch.float32, device=device)
        return cls(upload(temperature, torch.float32, device), upload(top_k, torch.int64, device),
                   upload(top_p, torch.float32, device), upload([s & _M32 for s in seed], torch.int64, device),
                   upload(presence or zeros, torch.float32, device), upload(frequency or zeros, torch.float32, device),
                   bias.to(device=device, dtype=torch.float32))

    def copy_(self, other: "SamplingTensors") -> None:
        for dst, src in zip(self, other):
            dst.copy_(src)


def _mulmod32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), without int64 overflow (split x in 16-bit halves)."""
    return (((x & 0xFFFF) * c) + (((x >> 16) * (c & 0xFFFF)) << 16)) & _M32


def _fmix32(x: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finalizer: every input bit flips each output bit with p ~ 1/2."""
    x = x ^ (x >> 16)
    x = _mulmod32(x, FMIX_C1)
    x = x ^ (x >> 13)
    x = _mulmod32(x, FMIX_C2)
    return x ^ (x >> 16)


def uniform_noise(seed: Tensor, position: Tensor, vocab_size: int) -> Tensor:
    """Uniform floats in (0, 1), shape ``(B, V)``, a pure function of (seed, position, vocab id)."""
    row = _fmix32((_fmix32(seed & _M32) + _mulmod32(position & _M32, POSITION_MUL)) & _M32)
    if seed.device.type == "cpu" and not torch.compiler.is_compiling():
        return _vocab_noise_numpy(row, vocab_size)
    return _vocab_noise(row, vocab_size)


def _vocab_noise(row: Tensor, vocab_size: int) -> Tensor:
    """The ``(B, V)`` part of ``uniform_noise`` from each row's hash: one fused kernel once compiled."""
    v = torch.arange(vocab_size, device=row.device, dtype=torch.int64)
    x = _fmix32((row[:, None] + v[None, :] * VOCAB_STRIDE) & _M32)  # v < 2**32, c < 2**30: fits int64
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@functools.lru_cache(maxsize=4)
def _vocab_offsets(vocab_size: int) -> np.ndarray:
    return np.arange(vocab_size, dtype=np.uint32) * np.uint32(VOCAB_STRIDE)  # wraps mod 2**32, as & _M32 does


def _vocab_noise_numpy(row: Tensor, vocab_size: int) -> Tensor:
    """``_vocab_noise`` in uint32 numpy, whose multiplication wraps mod 2**32 by itself: the same
    values bit for bit (``_fmix32`` without the 16-bit halves eager torch's int64 needs). On the
    CPU, where nothing compiles the step, the torch ops hashed 32 rows of a 49,152-token vocabulary
    in ~50 ms a decode step on one thread; this takes ~2 ms."""
    x = row.numpy().astype(np.uint32)[:, None] + _vocab_offsets(vocab_size)[None, :]
    x ^= x >> 16
    x *= np.uint32(FMIX_C1)
    x ^= x >> 13
    x *= np.uint32(FMIX_C2)
    x ^= x >> 16
    out = (x >> 8).astype(np.float32)
    out += np.float32(0.5)
    out *= np.float32(1.0 / (1 << 24))
    return torch.from_numpy(out)


def top_k_top_p_filter(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Set logits outside each row's top-k and then top-p (nucleus) set to -inf.

    top-p keeps the smallest prefix of tokens (by probability after top-k) whose mass reaches p,
    always at least the most likely token; it is skipped for rows with ``top_p >= 1``.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    remove = ranks[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove = remove | ((mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0) & (ranks[None, :] > 0))
    return logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))


# What a batch needs, decided on the host from the requests (no device sync): greedy-only batches
# skip the noise, and batches without top-k/top-p skip the vocabulary sort. Each mode is its own
# captured graph. FULL (penalties and log probabilities on top of FILTER) is for the batches whose
# requests ask for them, so the common modes' graphs stay as lean as before. Plain decoding has
# every mode (PLAIN_MODES); speculative steps have MODES (a FULL batch does not speculate).
GREEDY, SAMPLE, FILTER, FULL = "greedy", "sample", "filter", "full"
MODES = (GREEDY, SAMPLE, FILTER)
PLAIN_MODES = MODES + (FULL,)
TOP_LOGPROBS = 20  # alternatives a FULL step reports per row (OpenAI's top_logprobs maximum)


def sampling_mode(temperature: list[float], top_k: list[int], top_p: list[float], full: bool = False) -> str:
    if full:
        return FULL
    if all(t == 0 for t in temperature):
        return GREEDY
    if any(t > 0 and (k > 0 or p < 1.0) for t, k, p in zip(temperature, top_k, top_p)):
        return FILTER
    return SAMPLE


def sample(logits: Tensor, params: SamplingTensors, position: Tensor, mode: str = FILTER,
           packed: Tensor | None = None) -> Tensor:
    """Next token ids ``(B,)`` from fp32 logits ``(B, V)``; ``position`` ``(B,)`` keys the noise.

    ``mode`` must cover every row (``sampling_mode``); rows with temperature 0 are greedy in any mode.
    The rows' ``bias`` is added first (a (B, 1) zero bias changes nothing), with ``-inf`` where
    their ``packed`` grammar masks forbid a token (``masked_bias``). On CUDA, GREEDY and SAMPLE
    run as one fused Triton pass (``kernels/triton_sample.py``: the same tokens, ~30 kernels
    fewer); FILTER's sort and every CPU step run ``sample_torch``.
    """
    if mode in (GREEDY, SAMPLE) and logits.is_cuda and not torch.compiler.is_compiling():
        fused = _fused_sampler()
        if fused is not None:
            return fused(logits, params.bias, params.temperature, params.seed, position, mode == SAMPLE, packed)
    return sample_torch(logits, params, position, mode, packed)


@functools.cache
def _fused_sampler() -> Callable[..., Tensor] | None:
    """``triton_sample.sample_rows``, imported on the first CUDA step (it imports triton, which CUDA
    builds of torch bring); None where Triton is missing: the torch ops then run."""
    try:
        from servekit.optimizations.kernels.triton_sample import sample_rows
    except ImportError:
        return None
    return sample_rows


def sample_torch(logits: Tensor, params: SamplingTensors, position: Tensor, mode: str = FILTER,
                 packed: Tensor | None = None) -> Tensor:
    """``sample`` as torch ops (any device, and inside a compiled region, where inductor fuses them)."""
    if packed is not None:
        params = params._replace(bias=masked_bias(params.bias, packed, logits))
    logits = logits + params.bias
    greedy = logits.argmax(dim=-1)
    if mode == GREEDY:
        return greedy
    scaled = logits / params.temperature.clamp(min=MIN_TEMPERATURE)[:, None]
    if mode == FILTER:
        scaled = top_k_top_p_filter(scaled, params.top_k, params.top_p)
    # float32 rounds the noise's largest values to exactly 1.0, whose Gumbel is +inf: bounded, so
    # that a token masked to -inf (a grammar, logit_bias) never becomes NaN and wins the argmax.
    gumbel = (-torch.log(-torch.log(uniform_noise(params.seed, position, logits.shape[-1])))).clamp(max=GUMBEL_MAX)
    sampled = (scaled + gumbel).argmax(dim=-1)
    return torch.where(params.temperature > 0, sampled, greedy)


def unpack_masks(packed: Tensor, vocab_size: int) -> Tensor:
    """Packed token masks ``(B, ceil(V / 32))`` int32 as bools ``(B, V)``: bit b of word w allows
    token 32 w + b (llguidance's layout; a row of -1 allows everything)."""
    bits = torch.arange(32, dtype=torch.int32, device=packed.device)
    return ((packed[:, :, None] >> bits) & 1).view(packed.shape[0], -1)[:, :vocab_size].bool()


def masked_bias(bias: Tensor, packed: Tensor, logits: Tensor) -> Tensor:
    """The rows' additive ``bias`` ``(B, V)`` with ``-inf`` where their packed masks forbid a token
    (a grammar's next-token mask, applied on the device: inside a captured sampling step). Where the
    bias leaves a row no allowed token (stop tokens held back by ``min_tokens`` while the grammar
    allows only a stop), the grammar wins: that row's bias drops its ``-inf`` entries."""
    allowed = unpack_masks(packed, logits.shape[-1])
    out = bias.masked_fill(~allowed, float("-inf"))
    dead = ~torch.isfinite(logits + out).any(dim=-1, keepdim=True)
    return torch.where(dead, torch.nan_to_num(bias, neginf=0.0).masked_fill(~allowed, float("-inf")), out)


def apply_penalties(logits: Tensor, counts: Tensor, params: SamplingTensors) -> Tensor:
    """OpenAI's presence/frequency penalties: ``logit[v] -= count[v] * frequency + (count[v] > 0) * presence``,
    with ``counts`` ``(B, V)`` the times each token was generated so far in the row."""
    return logits - counts * params.frequency[:, None] - (counts > 0).float() * params.presence[:, None]


def sample_full(logits: Tensor, params: SamplingTensors, position: Tensor, counts: Tensor | None) -> Tensor:
    """FULL mode: penalties (when ``counts`` is given), then FILTER sampling; returns one float64 row
    per batch row: ``[token, its logprob, TOP_LOGPROBS top token ids..., their logprobs...]``
    (token ids are exact in float64), logprobs from the raw logits."""
    penalized = logits if counts is None else apply_penalties(logits, counts, params)
    ids = sample(penalized, params, position, FILTER)
    logprobs = logits.log_softmax(dim=-1)
    top = logprobs.topk(min(TOP_LOGPROBS, logits.shape[-1]), dim=-1)
    return torch.cat([ids[:, None].double(), logprobs.gather(1, ids[:, None]).double(),
                      top.indices.double(), top.values.double()], dim=1)
