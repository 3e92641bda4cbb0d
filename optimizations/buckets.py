"""Shape buckets: pad every batch up to a pre-captured (batch, seq) shape.

Compiled graphs and CUDA graphs are shape-specialised; serving arbitrary shapes would recompile
(dynamo gives up after a few shapes and silently runs eager). Padding to a small fixed set of
shapes, all captured at start-up, keeps serving on the fast path. Where nothing is captured or
compiled (eager, as on CPU), `exact_chunks` cuts length-sorted runs padded only to their own
longest text: padding there buys nothing and costs compute.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Sequence


def pick_bucket(n: int, sizes: Sequence[int]) -> int:
    """Smallest bucket size >= n. `sizes` is increasing; n must fit in the largest."""
    k = bisect_left(sizes, n)
    if k == len(sizes):
        raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")
    return sizes[k]


def seq_buckets(max_tokens: int, smallest: int = 16, given: Sequence[int] = ()) -> list[int]:
    """Sequence buckets up to a model's length limit, the limit itself last: those of `given` (a
    model-config's, which may step finer than doubling) below the limit, then powers of two from
    `smallest` (or from twice the last given one) up to it."""
    out = [s for s in sorted(set(given)) if s < max_tokens]
    n = out[-1] * 2 if out else smallest
    while n < max_tokens:
        out.append(n)
        n *= 2
    return out + [max_tokens]


@dataclass(frozen=True)
class Chunk:
    """Rows of one padded forward pass: `indices` into the caller's list, padded to (batch, seq)."""

    indices: tuple[int, ...]
    batch: int
    seq: int


# Fixed cost of one forward pass in token positions, for plans whose passes are not timed at
# start-up (eager, compile without CUDA graphs): on the 2-core VM MiniLM's eager pass costs
# ~1 ms beyond its ~4 µs per token position.
PASS_OVERHEAD_TOKENS = 256


def token_cost(batch: int, seq: int) -> float:
    """A forward pass's cost in token positions: padded positions plus the fixed cost of a pass."""
    return batch * seq + PASS_OVERHEAD_TOKENS


def plan_chunks(lengths: Sequence[int], batch_sizes: Sequence[int], seq_lens: Sequence[int],
                cost: Callable[[int, int], float] = token_cost) -> list[Chunk]:
    """Group sequences into bucketed forward passes of least total `cost(batch, seq)`.

    Sequences are sorted by length and cut into runs, each padded to a (batch, seq) bucket. Cutting
    a batch of many lengths into fixed runs of the largest batch bucket padded ~half of a bulk
    batch's positions (H100, 32-text requests: benchmarks/results/minilm-bulk-cache-h100). Here the
    cuts minimise the summed cost, by dynamic programming over the sorted lengths: a run other than
    the first is best exactly a batch bucket long (a shorter one pays for the same padded shape),
    so each cut point tries one run per batch bucket. Lengths must fit in the largest seq bucket.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if not order:
        return []
    seq_of = [pick_bucket(lengths[i], seq_lens) for i in order]
    n = len(order)
    # Each bucket's cost once: the loop below asks for it about n x len(batch_sizes) times.
    costs = {(b, s): cost(b, s) for b in batch_sizes for s in set(seq_of)}
    best = [0.0] + [math.inf] * n  # best[j]: least cost of the j shortest sequences
    cut: list[tuple[int, int]] = [(0, 0)] * (n + 1)  # cut[j]: (start, batch bucket) of its last run
    for j in range(1, n + 1):
        seq = seq_of[j - 1]
        for b in batch_sizes:
            start = j - b if j > b else 0
            c = best[start] + costs[b, seq]
            if c < best[j]:
                best[j], cut[j] = c, (start, b)
            if start == 0:  # larger buckets would only pad the same sequences more
                break
    chunks = []
    j = n
    while j > 0:
        start, b = cut[j]
        chunks.append(Chunk(tuple(order[start:j]), b, seq_of[j - 1]))
        j = start
    return chunks[::-1]


def padding_ratio(lengths: Sequence[int], chunks: Sequence[Chunk]) -> float:
    """Fraction of computed token positions that are padding."""
    computed = sum(c.batch * c.seq for c in chunks)
    return 0.0 if computed == 0 else 1.0 - sum(lengths) / computed


def exact_chunks(lengths: Sequence[int], max_batch: int,
                 cost: Callable[[int, int], float] = token_cost) -> list[Chunk]:
    """Group sequences into eager forward passes of least total `cost(batch, seq)`, each pass exactly
    as large as its run of texts and as long as the run's longest one (no bucket shapes).

    Sorted by length, every run is contiguous; the cuts minimise the summed cost by dynamic
    programming over the sorted lengths (each cut point tries every run size up to `max_batch`).
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0.0] + [math.inf] * n
    cut = [0] * (n + 1)  # cut[j]: start of the last run of the j shortest sequences
    for j in range(1, n + 1):
        seq = lengths[order[j - 1]]
        for start in range(max(0, j - max_batch), j):
            c = best[start] + cost(j - start, seq)
            if c < best[j]:
                best[j], cut[j] = c, start
    chunks = []
    j = n
    while j > 0:
        start = cut[j]
        chunks.append(Chunk(tuple(order[start:j]), j - start, lengths[order[j - 1]]))
        j = start
    return chunks[::-1]
