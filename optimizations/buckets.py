"""Shape buckets: pad every batch up to a pre-captured (batch, seq) shape.

Compiled graphs and CUDA graphs are shape-specialised; serving arbitrary shapes would recompile
(dynamo gives up after a few shapes and silently runs eager). Padding to a small fixed set of
shapes, all captured at start-up, keeps serving on the fast path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def pick_bucket(n: int, sizes: Sequence[int]) -> int:
    """Smallest bucket size >= n. `sizes` is increasing; n must fit in the largest."""
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


def seq_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """Powers of two from `smallest` up to a model's length limit, the limit itself last."""
    out, n = [], smallest
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


def plan_chunks(lengths: Sequence[int], batch_sizes: Sequence[int], seq_lens: Sequence[int]) -> list[Chunk]:
    """Group sequences into bucketed forward passes with little padding.

    Sequences are sorted by length so that each chunk holds similar lengths, then cut into chunks
    of at most the largest batch bucket. Lengths must already fit in the largest seq bucket.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    max_b = batch_sizes[-1]
    chunks = []
    for start in range(0, len(order), max_b):
        idx = tuple(order[start:start + max_b])
        longest = max(lengths[i] for i in idx)
        chunks.append(Chunk(idx, pick_bucket(len(idx), batch_sizes), pick_bucket(longest, seq_lens)))
    return chunks


def padding_ratio(lengths: Sequence[int], chunks: Sequence[Chunk]) -> float:
    """Fraction of computed token positions that are padding."""
    computed = sum(c.batch * c.seq for c in chunks)
    return 0.0 if computed == 0 else 1.0 - sum(lengths) / computed
