"""Continuous batching on ``LlamaRunner``: requests join the running batch between decode steps and
leave it the moment they finish, instead of a batch running until its last row ends.

Slots: the runner's KV cache rows ``0..max_num_seqs-1``. A request gets the lowest free slot; its
prompt is prefilled straight into that cache row (``Transformer.forward(rows=...)``) while the
other rows keep their state, and from then on it is one row of the decode steps. Every decode step
runs the runner's step (a CUDA graph on GPU) of the smallest batch bucket that covers the highest
busy slot; free slots below it decode garbage that nobody reads, as padding rows always did. A
row's state (token, position, sampling parameters, penalty counts) lives in the runner's one
``DecodeState`` whose bucket views share memory, so changing bucket moves nothing.

Each row computes exactly what it computes alone (its own cache row, its own positions, noise
keyed by its own seed and position), so greedy output does not depend on who else is running.

Pipelining as in ``LlamaRunner.stream``: each ``step()`` launches decode step t+1 before it reads
step t, so the device never waits for the host's bookkeeping; a row that finished at step t has one
wasted token computed in step t+1, which is dropped. Admission (prefill) is queued on the same
stream after the step in flight, so it never races with it.

Speculative decoding (``runner.speculation`` built ``in_slots``): while the busy slots fit its
largest batch bucket, no running request needs logprobs or penalties and one of them is greedy, a
step is a verify step over the same rows instead of a plain one; each row accepts what it accepts
and the plain and verify steps share the rows' state, so the batch moves between the two from one
step to the next. A request starts with stale drafts (the slot prefill makes none): its first
verify step yields one token and drafts for the next. Sampled rows and requests with
``speculate=False`` accept no drafts and get exactly their plain tokens.
"""
from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from functools import partial
from dataclasses import dataclass, field
from typing import Collection, Hashable

import torch

from servekit.optimizations.buckets import pick_bucket
from servekit.optimizations.llm.generate import (FINISH_LENGTH, FINISH_STOP, HostCopies, LlamaRunner, SamplingParams,
                                             TokenLogprob, prefill, read_row, token_ids)
from servekit.optimizations.llm.sampling import MODES, SamplingTensors, sampling_mode
from servekit.optimizations.llm.speculative import SpecStats

log = logging.getLogger(__name__)

FINISH_ERROR = "error"


@dataclass
class SeqUpdate:
    """What one request got from one ``step()``: new tokens (the last one carries the finish
    reason, a stop token included as in ``StepOutput``), their logprobs when asked for, or an
    error that ended the request (``finish_reason == "error"``)."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: Exception | None = None

    def merge(self, later: "SeqUpdate") -> "SeqUpdate":
        """This update followed by ``later`` (in place)."""
        self.tokens += later.tokens
        self.logprobs += later.logprobs
        self.finish_reason = later.finish_reason or self.finish_reason
        self.error = later.error or self.error
        return self


@dataclass
class _Seq:
    key: Hashable
    prompt: list[int]
    params: SamplingParams
    stops: frozenset[int]
    speculate: bool = True  # accepts drafts (greedy requests that did not opt out)
    slot: int = -1
    prefilled: int = 0  # prompt tokens in the cache so far (a long prompt goes in chunks)
    launched: int = 0  # steps asked of the device so far (the prefill included); 0: not decoding yet
    generated: int = 0  # tokens reported
    # Upper bound of the position of the token the next launched step feeds (a verify step may
    # advance a row by 1..k+1 positions: the bound assumes k+1 until its output is read).
    pos_hi: int = 0
    done: bool = False


@dataclass
class _Pending:
    host: HostCopies
    slot: int
    mode: str
    seqs: list[tuple[int, _Seq]]  # (row of the output, request)
    drafts: int = 0  # k for a verify step's output (k+1 base tokens and the accepted count per row)


class ContinuousBatcher:
    """The scheduler: ``add()`` / ``cancel()`` requests at any time, ``step()`` to advance.

    Not thread-safe: one thread drives it (the LLM handler's engine thread). FIFO admission up to
    ``max_num_seqs`` running requests; the rest wait in order.
    """

    def __init__(self, runner: LlamaRunner, max_num_seqs: int | None = None, prefill_chunk: int = 512) -> None:
        if runner.prefill_steps and not runner.slot_prefill:
            raise ValueError("the runner's captured prefill fills rows 0..B-1: build it with slot_prefill=True")
        self.r = runner
        self.max_num_seqs = max_num_seqs or runner.max_batch
        if not 1 <= self.max_num_seqs <= runner.max_batch:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be between 1 and the largest batch "
                             f"bucket {runner.max_batch}")
        self.slots: list[_Seq | None] = [None] * self.max_num_seqs
        self.waiting: collections.deque[_Seq] = collections.deque()
        self.by_key: dict[Hashable, _Seq] = {}
        # A launched output not read yet: its host copy, the sampling mode, and (output row, request) pairs.
        self._inflight: _Pending | None = None
        self._hosts: dict[tuple, HostCopies] = {}
        self._alone = 0  # admissions left to prefill one request at a time (after a failed batch prefill)
        # Prompts longer than this go into the cache one chunk per step, so that a long prompt holds
        # the running rows back by one chunk's prefill per step, not by its whole prefill.
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.chunking: collections.deque[_Seq] = collections.deque()
        spec = runner.speculation
        if spec is not None and not getattr(spec, "in_slots", False):
            raise ValueError("the runner's speculation runs static batches: build it with in_slots=True")
        self.spec = spec
        # Draft positions proposed and accepted so far (the handler's metrics read these).
        self.spec_stats = SpecStats.empty(spec.n_heads) if spec is not None else None

    def warmup(self) -> float:
        """Run a few prompts longer than ``prefill_chunk`` through (compiled runners only): the
        chunks' shapes (any length, any offset) compile here, not in the first long request
        (measured on an H100: ~1 s per new shape). Returns the seconds it took."""
        longest = self.r.max_prompt_len
        if not self.r.compile_prefill or longest <= self.prefill_chunk:
            return 0.0
        t0 = time.perf_counter()
        for n in sorted({longest, longest - self.prefill_chunk // 3, self.prefill_chunk + 1,
                         (longest + self.prefill_chunk) // 2}):
            self.add(("warmup", n), [self.r.pad_id] * n, SamplingParams(max_tokens=1))
            while self.has_work:
                self.step()
        return time.perf_counter() - t0

    # -- requests ------------------------------------------------------------------------------
    def add(self, key: Hashable, prompt: list[int], params: SamplingParams, speculate: bool = True) -> None:
        """Queue a request; ``ValueError`` (naming the problem) if the runner cannot run it.
        ``speculate=False`` keeps it from accepting drafts (sampled requests never do)."""
        if key in self.by_key:
            raise ValueError(f"request {key!r} is already running")
        if (err := self.r.check(prompt, params)) is not None:
            raise ValueError(err)
        seq = _Seq(key, list(prompt), params, frozenset(params.stop_token_ids),
                   speculate=speculate and params.temperature == 0 and not params.full)
        self.by_key[key] = seq
        self.waiting.append(seq)

    def cancel(self, key: Hashable) -> None:
        """End a request now (client gone, stop string matched): its slot is free at once."""
        seq = self.by_key.pop(key, None)
        if seq is None:
            return
        if seq.slot < 0:
            self.waiting.remove(seq)
        self._finish(seq)

    @property
    def running(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def kv_usage(self) -> float:
        """The share of the KV cache's positions (``max_num_seqs`` rows x ``max_seq_len``) that
        running requests fill: prompt and generated tokens so far (a chunked prompt: what is in)."""
        used = sum((len(s.prompt) + s.generated) if s.launched else s.prefilled
                   for s in self.slots if s is not None)
        return used / (self.max_num_seqs * self.r.max_seq_len)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.running > 0 or self._inflight is not None

    # -- one iteration -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> dict[Hashable, SeqUpdate]:
        """Admit waiting requests into free slots (prefill), launch the next decode step, read the
        previous one. Returns the new tokens of every request that got some."""
        updates: dict[Hashable, SeqUpdate] = {}
        admitted = self._admit(updates)
        chunked = self._prefill_chunk(updates)
        launched = self._launch()
        if self._inflight is not None:
            self._read(self._inflight, updates)
        for pending in (admitted, chunked):
            if pending is not None:
                self._read(pending, updates)
        self._inflight = launched
        return updates

    def _host(self, out: torch.Tensor) -> tuple[HostCopies, int]:
        """Start copying ``out`` to the host; returns where it lands. At most three copies are
        outstanding (the step in flight, an admission's first tokens, the step just launched), so
        a ring of four buffers per shape never overwrites one before it is read."""
        key = (tuple(out.shape), out.dtype)
        if key not in self._hosts:
            self._hosts[key] = HostCopies(tuple(out.shape), self.r.device, out.dtype, count=4)
        host = self._hosts[key]
        return host, host.start_next(out)

    def _admit(self, updates: dict[Hashable, SeqUpdate]) -> _Pending | None:
        free = [i for i, s in enumerate(self.slots) if s is None]
        n = min(len(free), len(self.waiting), 1 if self._alone else len(free))
        if n == 0:
            return None
        self._alone = max(0, self._alone - 1)
        seqs = [self.waiting.popleft() for _ in range(n)]
        for s in [s for s in seqs if len(s.prompt) > self.prefill_chunk]:  # in chunks, from the next step on
            seqs.remove(s)
            s.slot = free.pop(0)
            self.slots[s.slot] = s
            # Until its prompt is in, the row is idle inside the decode batch: park its position at
            # the cache's last slot, whose garbage the request overwrites before it could read it.
            self.r.state.input_pos[s.slot] = self.r.max_seq_len - 1
            self.chunking.append(s)
        n = len(seqs)
        if n == 0:
            return None
        rows_list = free[:n]
        try:
            b = self.r.prepare([s.prompt for s in seqs], [s.params for s in seqs], self.r.batch_buckets)
            rows = torch.tensor(rows_list + [self.r.model.spare_row] * (b.batch - n), device=self.r.device)
            out = self.r.run_prefill(self.r.prefill_steps, b, partial(prefill, self.r._prefill_model), rows)
            live = rows[:n]
            self.r.state.load_rows(live, token_ids(out, b.mode)[:n], b.positions[:n],
                                   SamplingTensors(*(t[:n] for t in b.sampling)))
        except Exception as e:  # e.g. out of memory on a long prompt: that request fails, the others run on
            if n > 1:  # which one? each of them is prefilled alone next, so only the culprit fails
                self.waiting.extendleft(reversed(seqs))
                self._alone = n
                return None
            for s in seqs:
                self.by_key.pop(s.key, None)
                s.done = True
                updates[s.key] = SeqUpdate(finish_reason=FINISH_ERROR, error=e)
            return None
        for s, row in zip(seqs, rows_list):
            s.slot, s.launched, s.pos_hi = row, 1, len(s.prompt)
            self.slots[row] = s
        self._set_spec_rows(seqs)
        host, slot = self._host(out)
        return _Pending(host, slot, b.mode, list(enumerate(seqs)))  # prefill output row i: admitted request i

    def _prefill_chunk(self, updates: dict[Hashable, SeqUpdate]) -> _Pending | None:
        """The next chunk of the oldest long prompt; its last chunk samples the first token and
        starts the request decoding, like an admission."""
        while self.chunking and self.chunking[0].done:  # cancelled meanwhile
            self.chunking.popleft()
        if not self.chunking:
            return None
        s = self.chunking[0]
        start, end = s.prefilled, min(s.prefilled + self.prefill_chunk, len(s.prompt))
        dev = self.r.device
        try:
            b = self.r.prepare([s.prompt[start:end]], [s.params], (1,))  # the chunk's sampling tensors and mode
            out = prefill(self.r._prefill_model, torch.tensor([s.prompt[start:end]], device=dev),
                          torch.arange(start, end, device=dev)[None], torch.tensor([end - start - 1], device=dev),
                          b.sampling, b.mode, torch.tensor([s.slot], device=dev), kv_len=end)
            if end == len(s.prompt):
                self.r.state.load_rows(torch.tensor([s.slot], device=dev), token_ids(out, b.mode)[:1],
                                       torch.tensor([end], device=dev), b.sampling)
        except Exception as e:  # this request fails, the others run on
            self.chunking.popleft()
            self.by_key.pop(s.key, None)
            self._finish(s)
            updates[s.key] = SeqUpdate(finish_reason=FINISH_ERROR, error=e)
            return None
        s.prefilled = end
        if end < len(s.prompt):
            return None
        self.chunking.popleft()
        s.launched, s.pos_hi = 1, len(s.prompt)
        self._set_spec_rows([s])
        host, slot = self._host(out)
        return _Pending(host, slot, b.mode, [(0, s)])

    def _set_spec_rows(self, seqs: list[_Seq]) -> None:
        """Tell the verify steps which of these newly started rows accept drafts."""
        if self.spec is None:
            return
        inside = [s for s in seqs if s.slot < len(self.spec.spec_rows)]
        if inside:
            dev = self.r.device
            self.spec.set_rows(torch.tensor([s.slot for s in inside], device=dev),
                               torch.tensor([int(s.speculate) for s in inside], device=dev))

    def _speculates(self, active: list[_Seq], batch: int, mode: str) -> bool:
        """Whether the next step is a verify step: speculation exists, the busy slots fit its
        buckets, no row needs the plain steps' FULL mode, and some row accepts drafts."""
        spec = self.spec
        return (spec is not None and bool(spec.spec_buckets) and batch <= spec.spec_buckets[-1]
                and mode in _SPEC_MODES and any(s.speculate for s in active))

    def _launch(self) -> _Pending | None:
        active = [s for s in self.slots if s is not None and not s.done and s.launched > 0]
        # Only rows that may still need a token after the launched steps (each gives at least one):
        # the last read finishes the rest.
        if not any(s.launched < s.params.max_tokens for s in active):
            return None
        batch = pick_bucket(max(s.slot for s in active) + 1, self.r.batch_buckets)
        mode = _mode([s.params for s in active])
        steps, k = self.r.steps, 0  # a plain step, or a verify step proposing k drafts per row
        if self._speculates(active, batch, mode):
            steps, k = self.spec.steps, self.spec.n_heads
            batch = pick_bucket(batch, self.spec.spec_buckets)
        # The step writes positions pos .. pos+k of each row: attend to one past the last.
        needed = min(max(s.pos_hi for s in active) + k + 1, self.r.max_seq_len)
        out = steps[(batch, mode, pick_bucket(needed, self.r.kv_buckets))].run()
        for s in active:
            s.launched += 1
            s.pos_hi += k + 1
        host, slot = self._host(out)
        return _Pending(host, slot, mode, [(s.slot, s) for s in active], k)  # decode output row = slot

    def _read(self, pending: _Pending, updates: dict[Hashable, SeqUpdate]) -> None:
        rows = pending.host.wait(pending.slot)
        k = pending.drafts
        for row, s in pending.seqs:
            if s.done:  # finished or cancelled since the launch: its tokens are dropped
                continue
            u = updates.setdefault(s.key, SeqUpdate())
            if k:  # a verify step: the row's first accepted+1 base tokens
                accepted = rows[row][k + 1]
                s.pos_hi -= k - accepted  # the bound assumed every draft accepted
                if s.speculate:
                    self.spec_stats.add_row(accepted)
                new, logprobs = rows[row][:accepted + 1], None
            else:
                tok, logprob = read_row(rows[row], pending.mode, s.params.logprobs)
                new, logprobs = [tok], logprob
            for tok in new:
                u.tokens.append(tok)
                s.generated += 1
                if tok in s.stops:
                    u.finish_reason = FINISH_STOP
                elif s.generated >= s.params.max_tokens:
                    u.finish_reason = FINISH_LENGTH
                if u.finish_reason is not None:
                    break
            if logprobs is not None:
                u.logprobs.append(logprobs)
            if u.finish_reason is not None:
                self.by_key.pop(s.key, None)
                self._finish(s)

    def _finish(self, seq: _Seq) -> None:
        seq.done = True
        if seq.slot >= 0 and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None

    def fail_all(self, error: Exception) -> dict[Hashable, SeqUpdate]:
        """End every request with ``error`` (a decode step failed: it cannot be pinned on one row)."""
        out = {key: SeqUpdate(finish_reason=FINISH_ERROR, error=error) for key in self.by_key}
        for seq in list(self.by_key.values()):
            self._finish(seq)
        self.by_key.clear()
        self.waiting.clear()
        self._inflight = None
        return out


_SPEC_MODES = frozenset(MODES)  # the verify steps' sampling modes (FULL: plain steps only)


def _mode(params: list[SamplingParams]) -> str:
    """The one sampling mode that serves every running row (the runner's modes, as for a batch)."""
    return sampling_mode([p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params],
                         any(p.full for p in params))



class EngineThread:
    """A ``ContinuousBatcher`` driven by its own thread, so that decode steps run back to back while
    the serving side (the TorchServe handler) takes requests in and answers out at its own pace.

    ``submit`` / ``cancel`` from any thread; ``take`` waits for and returns the updates of given
    requests. Only the engine thread touches the batcher and the device.
    """

    def __init__(self, batcher: ContinuousBatcher, device: torch.device | None = None) -> None:
        self.batcher = batcher
        self._commands: collections.deque[tuple] = collections.deque()
        self._cond = threading.Condition()
        self._updates: dict[Hashable, SeqUpdate] = {}
        self._wake = threading.Event()
        self.running = self.waiting = 0  # as of the last step: for metrics
        self.kv_usage = 0.0
        # The serving thread formats answers (detokenizing, JSON) while this one steps the model:
        # with Python's default 5 ms GIL switch interval a busy serving thread could hold this one
        # back for more than a decode step; 0.5 ms keeps its wait well under one step.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        self._thread = threading.Thread(target=self._loop, args=(device,), name="servekit-engine", daemon=True)
        self._thread.start()

    def submit(self, key: Hashable, prompt: list[int], params: SamplingParams, speculate: bool = True) -> None:
        self._commands.append(("add", key, prompt, params, speculate))
        self._wake.set()

    def cancel(self, key: Hashable) -> None:
        self._commands.append(("cancel", key))
        self._wake.set()

    def take(self, keys: Collection[Hashable], timeout: float) -> dict[Hashable, SeqUpdate]:
        """The updates of ``keys`` collected so far, waiting up to ``timeout`` s for the first one."""
        with self._cond:
            self._cond.wait_for(lambda: any(k in self._updates for k in keys), timeout)
            return {k: self._updates.pop(k) for k in keys if k in self._updates}

    def _loop(self, device: torch.device | None) -> None:
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
        b = self.batcher
        while True:
            if not b.has_work and not self._commands:
                self._wake.wait()
            self._wake.clear()
            updates: dict[Hashable, SeqUpdate] = {}
            try:
                while self._commands:
                    cmd = self._commands.popleft()
                    if cmd[0] == "cancel":
                        b.cancel(cmd[1])
                        continue
                    try:
                        b.add(*cmd[1:])
                    except ValueError as e:  # the caller validated: a bug or a race, the request's own error
                        updates[cmd[1]] = SeqUpdate(finish_reason=FINISH_ERROR, error=e)
                if b.has_work:
                    updates.update(b.step())
            except Exception as e:  # a decode step failed (e.g. out of memory): it cannot be pinned on one row;
                # the thread lives on, so that no request waits for an engine that is gone
                log.exception("decode step failed; ending the %d running requests", b.running)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                updates.update(b.fail_all(e))
            self.running, self.waiting, self.kv_usage = b.running, len(b.waiting), b.kv_usage
            if updates:
                with self._cond:
                    for key, u in updates.items():
                        have = self._updates.get(key)
                        self._updates[key] = u if have is None else have.merge(u)
                    self._cond.notify_all()
