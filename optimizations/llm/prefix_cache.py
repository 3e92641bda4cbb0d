"""Automatic prefix caching for the continuous engine (continuous.py): the K/V of a prefix already
computed (a system prompt, a few-shot header, the earlier turns of a conversation) is reused by
later requests instead of being prefilled again.

Layout. The KV cache keeps one row per request (``KVCache`` buffers ``(rows, n_kv, positions, D)``),
the layout the fused Triton decode kernels and the captured decode steps read. Over those rows this
module keeps an index of **full blocks** of ``BLOCK`` tokens:

* a block is keyed by its parent (the block before it in the row) and its own token ids, so a key
  names a whole prefix, chained from position 0. A dict lookup hashes the key and compares the
  tokens on a hit: no hash collision can alias two prefixes;
* each row holds a chain of blocks from position 0: the full blocks of its tokens whose K/V is in
  the row (a prompt's, as its chunks go in; when the request ends, the prompt and the generated
  tokens but the last, whose K/V no step wrote). A block held by several rows is one entry with
  several holders, and it leaves the index when its last holder drops it;
* a lookup walks a prompt's blocks while some row holds them; every holder of the last block
  found holds the whole prefix. At most ``len(prompt) - 1`` tokens are reused: the last prompt
  token is always computed, since its logits give the first token.

Admission (``place``). Among the free rows the decode batch covers anyway (below the batch bucket
of the busy rows), a request takes over a row that holds its prefix (no copy), else goes into the
one that holds nothing or was used least recently, and the prefix is copied there from a holder
(one copy per cache tensor, positions ``0..n-1``, queued on the engine's stream). The prefill then
starts at position ``n``. A row beyond that bucket is never given to a request for its cache: it
would enlarge every decode step the request runs, while the copy costs one read of the prefix's
K/V (~35 MB for 1,500 tokens of SmolLM2-135M in bf16: tens of microseconds of H100 bandwidth).

Eviction. A finished or cancelled request's row is free at once; its blocks stay in the index and
go when the row is given to another request. So that the decode batch's preference for low rows
does not throw away the cache whenever the load is low (one request at a time always lands in
row 0), the blocks of the row about to be reused move (a copy) to a free row beyond the decode
batch that holds nothing or older blocks: the free rows together are one LRU cache.

Safety without reference counts on the device: a busy row is never evicted, and a running row's
prefix positions never change (its steps write past them); a free row's garbage decode steps write
at its own next position or later, never inside its blocks; a row that receives blocks while it
stays free is parked at the cache's last position first, as admitted rows are. Every copy and write
is queued on one stream in host order, so a copy reads its source before anything queued later can
write it.

Every model family's cache can be copied this way: sliding-window layers (Gemma 2/3, Phi-3,
Mistral) keep every position and apply the window in their mask, not a ring buffer.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from servekit.optimizations.llm.generate import LlamaRunner

log = logging.getLogger(__name__)

# Block size in tokens. A hit reuses whole blocks, so a prefix loses on average half a block to the
# granularity (8 tokens of a 1,500-token conversation); smaller blocks cost more host time per
# request (a 1,500-token prompt is 94 dict lookups of 16-token keys, tens of microseconds in
# Python). 16 is also the smallest packed-prefill token bucket: a finer grain buys no device time.
BLOCK = 16


@dataclass(frozen=True)
class PrefixStats:
    """Counters since the engine started, and the cache's content now."""

    requests: int  # prompts looked up
    hit_requests: int  # ... that reused at least one token
    queried_tokens: int  # prompt tokens looked up
    hit_tokens: int  # ... whose K/V came from the cache instead of a prefill
    copies: int  # hits served by a copy from another row (the others took the row over)
    moved: int  # rows of blocks moved to another free row rather than evicted
    evicted_blocks: int  # blocks that left the index
    blocks: int  # distinct blocks in the index now
    held_blocks: int  # blocks held by rows now (a block in two rows counts twice)
    capacity_blocks: int  # full blocks the rows can hold

    @property
    def hit_rate(self) -> float:
        """Share of the prompt tokens looked up that the cache served."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def usage(self) -> float:
        """Share of the KV cache's block capacity holding reusable blocks."""
        return self.held_blocks / self.capacity_blocks if self.capacity_blocks else 0.0


@dataclass(frozen=True)
class Placement:
    """Where an admitted request goes: its row, and how many prompt tokens' K/V are in that row
    before its prefill starts (``source``: the row they were copied from, None if none or the row's own)."""

    slot: int
    cached: int
    source: int | None


class _Block:
    __slots__ = ("id", "key", "rows")

    def __init__(self, id_: int, key: tuple[int, tuple[int, ...]]) -> None:
        self.id, self.key, self.rows = id_, key, set()


class PrefixCache:
    """The block index over the runner's cache rows ``0..rows-1`` and the row choice of admissions.

    One thread (the engine's) calls it; ``stats()`` only reads counters."""

    def __init__(self, runner: LlamaRunner, rows: int, block: int = BLOCK) -> None:
        if block < 1:
            raise ValueError(f"prefix cache block must be positive, got {block}")
        self.block, self.n_rows = block, rows
        self._model = runner.model
        self._input_pos, self._park = runner.state.input_pos, runner.max_seq_len - 1
        self._capacity = rows * ((runner.max_seq_len - 1) // block)
        self._blocks: dict[tuple[int, tuple[int, ...]], _Block] = {}
        self._chains: list[list[_Block]] = [[] for _ in range(rows)]
        self._used = [0] * rows  # when each row's blocks were last written or reused
        self._tick = 0
        self._ids = itertools.count(1)  # 0: the root, every chain's first parent
        self._held = 0
        self._requests = self._hit_requests = self._queried = self._hit_tokens = 0
        self._copies = self._moved = self._evicted = 0
        log.info("prefix caching: blocks of %d tokens over %d cache rows", block, rows)

    # -- the index -----------------------------------------------------------------------------
    def lookup(self, prompt: Sequence[int]) -> tuple[int, set[int]]:
        """How many leading tokens of ``prompt`` have their K/V in some row (full blocks, at most
        ``len(prompt) - 1``), and the rows holding them all (empty when none)."""
        b, parent, rows, n = self.block, 0, set(), 0
        for start in range(0, len(prompt) - b + 1, b):
            blk = self._blocks.get((parent, tuple(prompt[start:start + b])))
            if blk is None:
                break
            parent, rows, n = blk.id, blk.rows, start + b
        n = min(n, len(prompt) - 1)
        return n, set(rows) if n else set()

    def extend(self, row: int, tokens: Sequence[int], upto: int) -> None:
        """Row ``row`` holds the K/V of ``tokens[:upto]`` (whose start the row's chain already
        names): register its full blocks past the chain."""
        b, chain = self.block, self._chains[row]
        parent = chain[-1].id if chain else 0
        for start in range(len(chain) * b, upto - b + 1, b):
            key = (parent, tuple(tokens[start:start + b]))
            blk = self._blocks.get(key)
            if blk is None:
                blk = self._blocks[key] = _Block(next(self._ids), key)
            blk.rows.add(row)
            chain.append(blk)
            parent = blk.id
            self._held += 1

    def release(self, row: int, tokens: Sequence[int], upto: int) -> None:
        """A request left row ``row`` with the K/V of ``tokens[:upto]`` in it: its blocks stay
        cached (evictable) until the row is reused."""
        self.extend(row, tokens, upto)
        self._touch(row)

    def clear(self) -> None:
        """Forget every block (the cache's content is no longer known, e.g. after a failed step)."""
        for row in range(self.n_rows):
            self._truncate(row, 0)

    def _truncate(self, row: int, keep: int) -> None:
        chain = self._chains[row]
        for blk in reversed(chain[keep:]):
            blk.rows.discard(row)
            if not blk.rows:
                del self._blocks[blk.key]
                self._evicted += 1
        self._held -= max(0, len(chain) - keep)
        del chain[keep:]

    def _touch(self, row: int) -> None:
        self._tick += 1
        self._used[row] = self._tick

    # -- admission -----------------------------------------------------------------------------
    def place(self, prompt: Sequence[int], free: Sequence[int], limit: int) -> Placement:
        """Choose the row of a request among the ``free`` rows below ``limit`` (the decode batch's
        bucket: at least one free row is below it) and put its cached prefix there."""
        n, holders = self.lookup(prompt)
        near = [r for r in free if r < limit]
        self._requests += 1
        self._queried += len(prompt)
        own = [r for r in near if r in holders]
        source = None
        if own:  # take the row over: its blocks past the prefix are the only ones lost
            slot = min(own, key=lambda r: (len(self._chains[r]), r))
            self._truncate(slot, n // self.block)
        else:
            slot = min(near, key=lambda r: (bool(self._chains[r]), self._used[r], r))
            self._move_away(slot, [r for r in free if r >= limit and r not in holders])
            if n:
                source = min(holders)
                self._copy(source, slot, n)
                self._copies += 1
                self._touch(source)
                self.extend(slot, prompt, n)
        if n:
            self._hit_requests += 1
            self._hit_tokens += n
        self._touch(slot)
        return Placement(slot, n, source)

    def _move_away(self, row: int, spare: list[int]) -> None:
        """Empty ``row`` for a request: its blocks move to the spare row holding nothing or the
        oldest blocks, when that one is older than them; else they are evicted."""
        chain = self._chains[row]
        if chain:
            spare = [r for r in spare if not self._chains[r] or self._used[r] < self._used[row]]
            if spare:
                dst = min(spare, key=lambda r: (bool(self._chains[r]), self._used[r], r))
                self._truncate(dst, 0)
                self._input_pos[dst] = self._park  # a free row in the decode batch writes there only
                self._copy(row, dst, len(chain) * self.block)
                for blk in chain:
                    blk.rows.discard(row)
                    blk.rows.add(dst)
                self._chains[dst], self._chains[row] = chain, []
                self._used[dst] = self._used[row]
                self._moved += 1
                return
        self._truncate(row, 0)

    def _copy(self, src: int, dst: int, n: int) -> None:
        """Positions ``0..n-1`` of cache row ``src`` into row ``dst`` (``copy_rows``: the whole row;
        positions ``n..`` of ``dst`` get ``src``'s, which nothing reads: ``dst``'s request prefills
        from ``n`` on, a row moved away holds only its blocks)."""
        copy_rows(self._model, src, dst, n)

    def swap(self, a: int, b: int, n: int) -> None:
        """Rows ``a`` and ``b`` trade their K/V and their blocks (through the cache's spare row):
        a running request moves from ``a`` (its K/V in positions ``0..n-1``) to the free row ``b``,
        whose cached blocks stay cached in ``a``. The caller parks ``a``'s position, as for any free
        row given blocks."""
        held = len(self._chains[b]) * self.block
        if held:
            spare = self._model.spare_row
            copy_rows(self._model, b, spare, held)
            copy_rows(self._model, a, b, n)
            copy_rows(self._model, spare, a, held)
        else:
            copy_rows(self._model, a, b, n)
        chain_a, chain_b = self._chains[a], self._chains[b]
        for blk in chain_a:
            blk.rows.discard(a)
        for blk in chain_b:
            blk.rows.discard(b)
        for blk in chain_a:
            blk.rows.add(b)
        for blk in chain_b:
            blk.rows.add(a)
        self._chains[a], self._chains[b] = chain_b, chain_a
        self._used[a], self._used[b] = self._used[b], self._used[a]

    def stats(self) -> PrefixStats:
        return PrefixStats(self._requests, self._hit_requests, self._queried, self._hit_tokens, self._copies,
                           self._moved, self._evicted, len(self._blocks), self._held, self._capacity)


def copy_rows(model: torch.nn.Module, src: int, dst: int, n: int) -> None:
    """Positions ``0..n-1`` of cache row ``src`` into row ``dst``, every layer's K and V, queued on
    the current stream. On CUDA the whole rows go over as one multi-tensor copy of the model's
    per-row views (``cache_row``): a row is contiguous, so the ``2 x layers`` copies are one launch
    (a copy per tensor of the first ``n`` positions cost ~0.9 ms of host launches for SmolLM2's 60
    tensors; the whole row, ~47 MB, is tens of microseconds of an H100's bandwidth). Positions
    ``n..`` of ``dst`` then hold ``src``'s, which nothing reads: a row is written at each position
    before a step attends to it. On CPU, where bytes cost more than calls, only the ``n`` positions."""
    if next(model.parameters()).device.type == "cuda":
        torch._foreach_copy_(model.cache_row(dst), model.cache_row(src))
        return
    dsts, srcs = [], []
    for cache in (layer.attention.kv_cache for layer in model.layers):
        for t in (cache.k_cache, cache.v_cache):
            dsts.append(t[dst, :, :n])
            srcs.append(t[src, :, :n])
    torch._foreach_copy_(dsts, srcs)


__all__ = ["BLOCK", "Placement", "PrefixCache", "PrefixStats", "copy_rows"]
