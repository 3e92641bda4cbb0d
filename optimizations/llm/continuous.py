"""Continuous batching on ``LlamaRunner``: requests join the running batch between decode steps and
leave it the moment they finish, instead of a batch running until its last row ends.

Slots: the runner's KV cache rows ``0..max_num_seqs-1``. A request gets the lowest free slot; its
prompt goes into that cache row while the other rows keep their state, and from then on it is one
row of the decode steps. Every decode step runs the runner's step (a CUDA graph on GPU) of the
smallest batch bucket that covers the highest busy slot; free slots below it decode garbage that
nobody reads, as padding rows always did. A row's state (token, position, sampling parameters,
penalty counts) lives in the runner's one ``DecodeState`` whose bucket views share memory, so
changing bucket moves nothing.

Prefill (packed.py): each ``step()`` runs one packed forward over chunks of as many prefilling
prompts as fit the token budget (``max_num_batched_tokens``), laid end to end without padding
between requests, with the running rows' next tokens riding in it (one each, counted in the
budget), whose sampling half then runs (``_mixable`` says when they ride instead: speculation
and a suspect prefilled alone keep the packed forward and the whole decode step). With grammar
rows that sampling half waits for their masks, as a split step's does (below).
``plan_prefill`` splits the budget: first up to ``prefill_chunk`` tokens for each prompt, oldest
first, then what is left to the oldest ones again. So a decode row gets a token every step, a long
prompt holds a short one back by at most one chunk, and the oldest prompt always advances (no
starvation). A prompt's last chunk samples its first token and starts its row decoding.

Each row computes what it computes alone (its own cache row, its own positions, noise keyed by
its own seed and position), so its output does not depend on who else is running: exactly so in
fp32 (the CPU tests); in bf16 on a GPU, forwards of other shapes (another batch bucket, the packed
forward a row rides in) round differently, so a greedy answer can part where two tokens tie.

Pipelining: each ``step()`` launches decode step t+1 before it reads
step t, so the device never waits for the host's bookkeeping; a row that finished at step t has one
wasted token computed in step t+1, which is dropped. The packed prefill is queued on the same
stream after the step in flight, so it never races with it.

Speculative decoding (``runner.speculation``): while the busy slots fit its
largest batch bucket, no running request needs logprobs or penalties and one of them is greedy, a
step is a verify step over the same rows instead of a plain one; each row accepts what it accepts
and the plain and verify steps share the rows' state, so the batch moves between the two from one
step to the next. A request starts with stale drafts (the prefill makes none): its first verify
step yields one token and drafts for the next. Sampled rows and requests with ``speculate=False``
accept no drafts and get exactly their plain tokens.

Prefix caching (prefix_cache.py, on unless ``prefix_caching=False``): a free row keeps the K/V of
its last request, indexed by blocks of tokens; an admitted prompt whose leading blocks some row
holds takes that row over or gets them copied into its own, and its prefill starts past them.
"""
from __future__ import annotations

import collections
import logging
import random
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Collection, Hashable, Sequence

import torch

from servekit.optimizations.buckets import pick_bucket
from servekit.optimizations.llm.generate import (FINISH_LENGTH, FINISH_STOP, HostCopies, LlamaRunner, SampleStep,
                                                 SamplingParams, TokenLogprob, read_row, sample_mode, token_ids)
from servekit.optimizations.llm.grammar import Caps, GrammarError, MaskUpload, RowConstraint, bias_rows, row_caps
from servekit.optimizations.llm.packed import Chunk, PackedPrefill, triton_fits
from servekit.optimizations.llm.prefix_cache import PrefixCache, PrefixStats, copy_rows
from servekit.optimizations.llm.sampling import FULL, GREEDY, MODES, SamplingTensors, sampling_mode, upload
from servekit.optimizations.llm.speculative import SpecStats

if TYPE_CHECKING:
    from llguidance import LLMatcher

log = logging.getLogger(__name__)

FINISH_ERROR = "error"
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
HOST_COPIES = 6  # host buffers per output shape (``ContinuousBatcher._host``)
# Packed forwards of up to this many tokens run the fused decode kernels (kernels: triton), larger
# ones the packed layers (packed.py).
FUSED_PACKED_TOKENS = 64
# Without prompts to prefill, grammar rows' forced runs get a packed forward of their own only where
# their tokens past each run's head add up to this share of the decoding rows (1.0: they at least
# double the step's tokens); otherwise each forced token takes a decode step under a one-token mask.
# Feeding every run (0.0) took a 32-row round of SmolLM2's JSON answers in 63-71 steps instead of
# 77-84 on an H200, but each step cost more (the packed forward and its host tables), and tokens/s
# did not rise: in-process about the same, served 79% of free tokens/s against 85% and 83% on one
# machine (benchmarks/results/start-run-h200/).
RUNS_ALONE_SHARE = 1.0


def plan_prefill(remaining: list[int], budget: int, chunk: int) -> list[int]:
    """How many tokens each prefilling prompt (oldest first; ``remaining``: its tokens not yet in the
    cache) puts into this step's packed forward: up to ``chunk`` each in order, then the budget
    left over to the oldest first. The total never exceeds ``budget``; the oldest always gets
    ``min(remaining, chunk, budget)`` at least."""
    take, left = [], budget
    for r in remaining:
        n = min(r, chunk, left)
        take.append(n)
        left -= n
    for i, r in enumerate(remaining):
        if left == 0:
            break
        extra = min(r - take[i], left)
        take[i] += extra
        left -= extra
    return take


@dataclass
class SeqUpdate:
    """What one request got from one ``step()``: new tokens (the last one carries the finish
    reason, a stop token included: do not print it), their logprobs when asked for, or an
    error that ended the request (``finish_reason == "error"``)."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: Exception | None = None
    cached_tokens: int = 0  # on a request's first update: prompt tokens whose K/V the prefix cache gave

    def merge(self, later: "SeqUpdate") -> "SeqUpdate":
        """This update followed by ``later`` (in place)."""
        self.tokens += later.tokens
        self.logprobs += later.logprobs
        self.finish_reason = later.finish_reason or self.finish_reason
        self.error = later.error or self.error
        self.cached_tokens = self.cached_tokens or later.cached_tokens
        return self


@dataclass
class _Seq:
    key: Hashable
    prompt: list[int]  # with the run its grammar forces from its start, where it has one (``fed``)
    params: SamplingParams
    stops: frozenset[int]
    seed: int  # the request's seed, or one drawn for it at add()
    speculate: bool = True  # accepts drafts (greedy requests that did not opt out)
    slot: int = -1
    prefilled: int = 0  # prompt tokens in the cache so far (a long prompt goes in chunks)
    launched: int = 0  # steps asked of the device so far (the prefill included); 0: not decoding yet
    generated: int = 0  # tokens reported
    out: list[int] = field(default_factory=list)  # the tokens reported
    cached: int = 0  # prompt tokens whose K/V the prefix cache gave
    # Upper bound of the position of the token the next launched step feeds (a verify step may
    # advance a row by 1..k+1 positions: the bound assumes k+1 until its output is read).
    pos_hi: int = 0
    done: bool = False
    constraint: RowConstraint | None = None  # grammar, logit_bias, min_tokens: the row's bias per step
    # The tokens its grammar forces from its start (``{"name":``), prefilled as the prompt's tail and
    # reported as the answer's head with its first token (``ContinuousBatcher._start_run``).
    fed: list[int] = field(default_factory=list)

    @property
    def per_step_bias(self) -> bool:
        """Its bias needs its last token (a grammar, ``min_tokens``): its steps run split."""
        return self.constraint is not None and self.constraint.per_step


@dataclass
class _Pending:
    host: HostCopies | None  # None: a split step whose sampling half is not launched yet
    slot: int
    mode: str
    seqs: list[tuple[int, _Seq]]  # (row of the output, request)
    drafts: int = 0  # k for a verify step's output (k+1 base tokens and the accepted count per row)
    sample: SampleStep | None = None  # a split step's sampling half, launched by _sample()


class ContinuousBatcher:
    """The scheduler: ``add()`` / ``cancel()`` requests at any time, ``step()`` to advance.

    Not thread-safe: one thread drives it (the LLM handler's engine thread). FIFO admission up to
    ``max_num_seqs`` running requests (prefilling ones included); the rest wait in order.
    ``warmup()`` builds every packed-prefill shape before the first request.
    """

    def __init__(self, runner: LlamaRunner, max_num_seqs: int | None = None, prefill_chunk: int = 512,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, prefix_caching: bool = True,
                 jump_forced: bool = True, fused_tokens: int = FUSED_PACKED_TOKENS) -> None:
        self.r = runner
        self.max_num_seqs = max_num_seqs or runner.max_batch
        if not 1 <= self.max_num_seqs <= runner.max_batch:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be between 1 and the largest batch "
                             f"bucket {runner.max_batch}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
        if max_num_batched_tokens < prefill_chunk:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} is below prefill_chunk={prefill_chunk}")
        self.prefill_chunk, self.max_num_batched_tokens = prefill_chunk, max_num_batched_tokens
        self.slots: list[_Seq | None] = [None] * self.max_num_seqs
        self.waiting: collections.deque[_Seq] = collections.deque()
        self.prefilling: collections.deque[_Seq] = collections.deque()  # in slots, prompts not all in yet; oldest first
        self.by_key: dict[Hashable, _Seq] = {}
        # Launched outputs not read yet (a decode step's, a prefill's first tokens): each with its
        # host copy, sampling mode and (output row, request) pairs.
        self._inflight: list[_Pending] = []
        # A split step whose forward half runs and whose sampling half waits for its rows' bias.
        self._forward: _Pending | None = None
        self._hosts: dict[tuple, HostCopies] = {}
        self._masks = MaskUpload()  # the grammar rows' packed masks on their way to the sampling steps
        # Requests of a packed forward that failed: prefilled alone, one at a time, so that only the culprit fails.
        self._suspects: set[Hashable] = set()
        self._rng = random.Random()
        # Grammar rows' forced token runs for the next forward (``_forced_runs``), by request.
        self.jump_forced = jump_forced
        self._jumps: dict[Hashable, list[int]] = {}
        self.moves = 0  # requests moved to a lower row by _compact()
        # Called (with the step's updates) right before a split step admits, midway through the
        # step: requests that arrived since the step began are added then (EngineThread) and
        # admitted in this step rather than the next.
        self.intake: Callable[[dict[Hashable, SeqUpdate]], None] | None = None
        # Captured per token bucket where decode steps are (CUDA graphs) and the Triton attention serves the model.
        graphs = runner.cuda_graphs and triton_fits(runner.model) is None
        # A compiling plan compiles the packed layers too (the runner's compiled blocks, dynamic in the
        # token count): their elementwise work fuses around the kernel, built per bucket by warmup().
        blocks = runner.compiled_model.blocks if graphs and runner.compiled_model is not None else None
        # With kernels: triton on a model of small weights, the short forwards (decoding rows riding
        # beside a short prompt, a short prompt alone) run the decode steps' fused blocks, a token a
        # row: 31 decoding rows and a 1-token prompt cost an H100 0.91 ms this way against 1.34 through
        # the packed layers; from 128 tokens up the packed layers are faster (docs/llm-engine.md).
        triton = runner.triton_model
        fused = triton.blocks if triton is not None and triton.small_weights else None
        self.packed = PackedPrefill(runner.model, max_num_batched_tokens, self.max_num_seqs, graphs=graphs,
                                    pad_id=runner.pad_id, blocks=blocks, state_tokens=runner.state.tokens,
                                    fused=fused, fused_tokens=fused_tokens)
        spec = runner.speculation
        self.spec = spec
        # Draft positions proposed and accepted so far (the handler's metrics read these).
        self.spec_stats = SpecStats.empty(spec.n_heads) if spec is not None else None
        # Blocks of computed prefixes reused by later prompts (prefix_cache.py); None: every prompt is prefilled whole.
        self.prefix = PrefixCache(runner, self.max_num_seqs) if prefix_caching else None

    def warmup(self) -> dict[str, object]:
        """Build every packed-prefill shape (compiles the packed layers where the plan compiles,
        captures each token bucket on CUDA, compiles the attention kernel) and the host copies of
        every output shape a step can produce: the first request of any length then costs what
        later ones do. Returns what was built and the seconds it took."""
        built = self.packed.warmup()
        # Host copies are pinned on CUDA (slow to allocate): one ring per output shape, made here.
        # First tokens: 1..max_num_seqs rows; decode steps: each batch bucket; both in plain and FULL modes.
        dev = self.r.device
        for full in (False, True):
            sampling = SamplingTensors.build([0.0], [0], [1.0], [0], dev)
            logits = torch.zeros(1, self.r.model.config.vocab_size, device=dev)
            last = torch.zeros(1, dtype=torch.int64, device=dev)
            probe = sample_mode(logits, sampling, last, FULL if full else GREEDY)
            for rows in sorted(set(range(1, self.max_num_seqs + 1)) | set(self.r.batch_buckets)):
                key = ((rows, *probe.shape[1:]), probe.dtype)
                if key not in self._hosts:
                    self._hosts[key] = HostCopies(key[0], dev, probe.dtype, count=HOST_COPIES)
        built["host_copies"] = len(self._hosts)
        return built

    # -- requests ------------------------------------------------------------------------------
    def add(self, key: Hashable, prompt: list[int], params: SamplingParams, speculate: bool = True) -> None:
        """Queue a request; ``ValueError`` (naming the problem) if the runner cannot run it.
        ``speculate=False`` keeps it from accepting drafts (sampled requests never do)."""
        if key in self.by_key:
            raise ValueError(f"request {key!r} is already running")
        if (err := self.r.check(prompt, params)) is not None:
            raise ValueError(err)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        seq = _Seq(key, list(prompt), params, frozenset(params.stop_token_ids), seed,
                   speculate=speculate and params.temperature == 0 and not params.full and params.constraint is None,
                   constraint=params.constraint.start() if params.constraint is not None else None)
        if self.jump_forced and seq.constraint is not None:
            self._start_run(seq)
        self.by_key[key] = seq
        self.waiting.append(seq)

    def _start_run(self, s: _Seq) -> None:
        """The run of tokens ``s``'s grammar forces before its first choice (``{"name":`` for a
        schema whose first property is required): its matcher takes the run now, the prompt's
        prefill feeds it after the prompt, the first token is sampled after it, and the request gets
        the run with that token. Otherwise the first step would sample the run's first token under a
        one-token mask and only the next forward would feed the rest: a step of every constrained
        answer. Cut as the later runs are (``_forced``)."""
        run, c = self._forced(s), s.constraint
        if not all(c.accept(tok) for tok in run):  # llguidance refusing its own forced tokens: a bug
            raise ValueError(f"the grammar refused the tokens it forces from its start: {c.error() or run}")
        s.prompt += run
        s.fed = run

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
        running requests fill: prompt and generated tokens so far (a prefilling prompt: what is in)."""
        used = sum((len(s.prompt) - len(s.fed) + s.generated) if s.launched else s.prefilled
                   for s in self.slots if s is not None)
        return used / (self.max_num_seqs * self.r.max_seq_len)

    def prefix_stats(self) -> PrefixStats | None:
        """The prefix cache's counters (hit rate, blocks held), None when it is off."""
        return self.prefix.stats() if self.prefix is not None else None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.running > 0 or bool(self._inflight) or self._forward is not None

    # -- one iteration -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> dict[Hashable, SeqUpdate]:
        """Admit waiting requests into free slots, run one packed forward over the prompts' chunks with
        the decoding rows' next tokens riding in it where they can (else the next decode step is
        launched too), read the previous step. Returns the new tokens of every request that got some."""
        updates: dict[Hashable, SeqUpdate] = {}
        admitted = self._forward is None
        later: list[_Pending] = []  # read once this step's sampling half is launched
        if admitted:
            self._compact()
            self._admit()
            prefilled, launched = self._prefill(updates, self._mixable())
            if not self._per_step_bias():  # pipelined: launch step t+1, then read step t
                if launched is None:  # no decoding row rode along with the prompts
                    launched = self._launch()
                self._read_all(updates)
                if prefilled is not None:
                    self._read(prefilled, updates)
                self._inflight = [launched] if launched is not None else []
                return updates
            if launched is not None:
                # The decoding rows rode in the packed forward; the new rows start after their
                # sampling half, so their first tokens can wait a step rather than the host wait
                # for the whole forward before it fills the riders' masks.
                self._forward = launched
                later += [prefilled] if prefilled is not None else []
            else:  # the new rows' first tokens are read, then the next forward launched (below)
                self._inflight += [prefilled] if prefilled is not None else []
        # A row whose bias depends on its last token (a grammar, min_tokens not reached) needs that
        # token on the host before its next token is sampled; the model's forward does not (its
        # input tokens are on the device). So the step runs in halves: while the forward runs, the
        # host fills the bias rows; then the sampling is launched.
        self._read_all(updates)
        self._load_bias()
        sampled = None
        if self._forward is not None:
            sampled = self._sample(self._forward)
            self._inflight = [sampled]
            self._forward = None
        self._inflight += later
        if not admitted or not self.prefilling:
            # After the sampling, behind it on the device: rows move down (their masks are filled at
            # their new rows from the next step on). Then the sampled tokens are read, and the next
            # forward is the prompts' chunks with the decoding rows riding in it where they can, each
            # row's new token followed by the run of tokens its grammar forces after it. (A step
            # that admitted has run its prompts' forward: it goes on here when none is left.)
            if not admitted:
                if self.intake is not None:
                    self.intake(updates)
                self._compact()
                self._admit()
            self._read_all(updates)
            self._jumps = self._forced_runs()
            prefilled, self._forward = self._prefill(updates, self._mixable())
            self._inflight += [prefilled] if prefilled is not None else []
            if self._forward is not None and self._forward.sample is None:  # sampled at once: no bias to wait for
                self._inflight.append(self._forward)
                self._forward = None
        if self._forward is None and self._per_step_bias():
            # The next decode forward now: its input tokens are on the device. Tokens still unread
            # (a step that admitted while prompts are still being prefilled) are read while it runs.
            self._forward = self._launch(split=True)
            if self._forward is not None:
                self._read_all(updates)
        self._jumps = {}
        return updates

    def _read_all(self, updates: dict[Hashable, SeqUpdate]) -> None:
        for pending in self._inflight:
            self._read(pending, updates)
        self._inflight = []

    def _per_step_bias(self) -> bool:
        """Whether a decoding row's bias needs its last token (a grammar, ``min_tokens``): its steps
        run split."""
        return any(s is not None and not s.done and s.launched and s.per_step_bias for s in self.slots)

    def _decoding(self) -> list[_Seq]:
        """The rows a decode step advances, or none when none of them may still need a token after
        the steps already launched (each gives at least one): the last read finishes the rest."""
        active = [s for s in self.slots if s is not None and not s.done and s.launched > 0]
        return active if any(s.launched < s.params.max_tokens for s in active) else []

    def _shape(self, rows: list[_Seq]) -> tuple[int, str]:
        """The batch bucket and sampling mode of a step over ``rows``."""
        return pick_bucket(max(s.slot for s in rows) + 1, self.r.batch_buckets), _mode([s.params for s in rows])

    @staticmethod
    def _advance(rows: list[_Seq], k: int = 0) -> list[tuple[int, _Seq]]:
        """Count a step launched for ``rows`` (each writes positions pos .. pos+k); returns its
        (output row, request) pairs: a decode step's output row is the slot."""
        for s in rows:
            s.launched += 1
            s.pos_hi += k + 1
        return [(s.slot, s) for s in rows]

    def _load_bias(self) -> None:
        """Before a split step's sampling half, for each decoding row's next token: the grammar rows'
        packed masks, filled on the host (several rows at once) while the forward runs and copied
        as one block of bits that the captured sampling step unpacks and applies; the bias rows
        that change with the token (stop tokens before ``min_tokens``) of the rows that have them."""
        if self._forward is None or self._forward.sample is None:
            return
        st = self._forward.sample.state
        matchers = self._matchers(self._forward)
        if not matchers:  # masks left by grammar rows that have finished
            st.packed.fill_(-1)
        else:
            self._masks(matchers, st.packed, self._caps(self._forward))
        if self._masks.too_slow:  # an audit's verdict: those rows end when this step is read
            for _, s in self._forward.seqs:
                took = None if s.constraint is None else self._masks.too_slow.get(id(s.constraint.matcher))
                if took is not None:
                    s.constraint.refuse_slow(took, self._masks.limit_s)
            self._masks.too_slow.clear()
        dev = self.r.device
        changing = [s for _, s in self._forward.seqs if not s.done and s.constraint is not None
                    and s.constraint.bias_changes]
        if changing:
            bias = self.r.state.params.bias
            bias.index_copy_(0, upload([s.slot for s in changing], torch.int64, dev),
                             bias_rows([s.constraint for s in changing], bias.shape[1], dev, grammar=False))

    def _host(self, out: torch.Tensor) -> tuple[HostCopies, int]:
        """Start copying ``out`` to the host; returns where it lands. At most four copies are
        outstanding: a split step's sampling and its prefill's output (its prompts' first tokens,
        or its riders' sampling half once no row needs split steps), then the next step's prompts'
        first tokens and the decode step launched after them, before that step reads them all; so
        a ring of ``HOST_COPIES`` buffers per shape never overwrites one before it is read."""
        key = (tuple(out.shape), out.dtype)
        if key not in self._hosts:
            self._hosts[key] = HostCopies(tuple(out.shape), self.r.device, out.dtype, count=HOST_COPIES)
        host = self._hosts[key]
        return host, host.start_next(out)

    def _compact(self) -> None:
        """Decoding requests move down into free rows when that makes the decode batch's bucket
        smaller. Requests end at any row, so without this the last few of a busy period decode at
        the bucket of the highest busy row (3 requests left in rows 5, 17 and 29 pay for 32 rows:
        ~1.1 ms a step for SmolLM2 on an H100 instead of ~0.65 for 4). A move is queued on the
        stream behind the step in flight: the cache row as one multi-tensor copy (with the prefix
        cache, a swap that keeps the free row's cached blocks), then the row's decode state; that
        step's output is still read at the old row. Not while a request above the new bucket is
        prefilling (its chunks go into its row), nor with speculation (its per-row drafts stay put)."""
        if self.spec is not None:
            return
        busy = [i for i, s in enumerate(self.slots) if s is not None]
        if not busy:
            return
        want = pick_bucket(len(busy), self.r.batch_buckets)
        if want >= pick_bucket(busy[-1] + 1, self.r.batch_buckets):
            return
        movers = [self.slots[i] for i in busy if i >= want]
        if any(not s.launched for s in movers):
            return
        free = [i for i in range(want) if self.slots[i] is None]
        for s, dst in zip(movers, free):
            src, n = s.slot, min(s.pos_hi + 1, self.r.max_seq_len)  # every position a launched step wrote
            if self.prefix is not None:
                self.prefix.swap(src, dst, n)
            else:
                copy_rows(self.r.model, src, dst, n)
            self.r.state.move_row(src, dst)
            self._park(src)  # the row left behind is free
            self.slots[src], self.slots[dst], s.slot = None, s, dst
        self.moves += len(movers)

    def _admit(self) -> None:
        """Waiting requests into free slots, in order; their prompts go in from this step on."""
        free = [i for i, s in enumerate(self.slots) if s is None]
        while free and self.waiting:
            s = self.waiting.popleft()
            if self.prefix is None:
                s.slot = free[0]
            else:
                # Any free row below the batch bucket that the busy rows and the lowest free row need
                # costs the decode steps nothing more: the prefix cache chooses among those.
                busy = max((i for i, x in enumerate(self.slots) if x is not None), default=-1)
                limit = pick_bucket(max(busy, free[0]) + 1, self.r.batch_buckets)
                place = self.prefix.place(s.prompt, free, limit)
                s.slot, s.prefilled = place.slot, place.cached
                s.cached = place.cached
            free.remove(s.slot)
            self.slots[s.slot] = s
            self._park(s.slot)  # idle inside the decode batch until its prompt is in
            self.prefilling.append(s)

    def _park(self, slot: int) -> None:
        """Park a row that is not decoding (free, or its prompt going in) at the cache's last
        position: its garbage steps write there, which a request overwrites before it could read
        it, and past the kv bucket it attends nothing."""
        self.r.state.input_pos[slot].fill_(self.r.max_seq_len - 1)  # setitem costs more host time (indexing)

    def _mixable(self) -> list[_Seq]:
        """The decoding rows whose next token this step's packed forward can compute beside the
        prompts' chunks (one forward instead of a packed one and a decode step), or none: with
        speculation (its verify steps), a suspect prefilled alone, or nothing to prefill and no
        forced runs worth a packed forward of their own."""
        if self.spec is not None or self._suspects or not (self.prefilling or self._jumps):
            return []
        return self._decoding()

    def _prefill(self, updates: dict[Hashable, SeqUpdate], decoding: list[_Seq]
                 ) -> tuple[_Pending | None, _Pending | None]:
        """One packed forward over the next chunks of the prefilling prompts (``plan_prefill``);
        prompts whose last chunk went in get their first token and start decoding. ``decoding``
        (``_mixable``): rows whose decode step rides in the same forward, one token each (a run of
        forced tokens for those in ``_jumps``) within the token budget; then also returns that
        step, sampled by their bucket's captured sampling half (None: the rows still need their
        decode step). Where a decoding row's bias needs its last token, or a new row's will, that
        sampling half is left to ``_sample()``, after the bias is loaded, and the new rows' state
        with it. Without prompts to prefill, the forward carries the decoding rows alone."""
        while self.prefilling and self.prefilling[0].done:  # cancelled meanwhile
            self.prefilling.popleft()
        queue = [s for s in self.prefilling if not s.done]
        suspects = [s for s in queue if s.key in self._suspects]
        if suspects:
            queue = suspects[:1]
        # The budget left for prompts: a token per decoding row, and each run's tokens past its
        # first; runs are cut to fit it.
        jumps, budget = {}, self.max_num_batched_tokens - len(decoding)
        for s in decoding:
            run = self._jumps.get(s.key, [])[:budget + 1]  # its head is the row's own next token
            if len(run) >= 2:
                jumps[s.key] = run
                budget -= len(run) - 1
        if not queue and sum(len(run) - 1 for run in jumps.values()) < max(len(decoding) * RUNS_ALONE_SHARE, 1):
            # Without prompts, the runs alone pay for a packed forward only where they at least
            # double the step's tokens (RUNS_ALONE_SHARE): it costs more than the decode step's
            # forward (SmolLM2 on an H100, benchmarks/sampling_cost.py: 1.19-1.32 against 0.72-0.85 ms
            # at 32 rows, 1.03-1.07 against 0.38-0.41 at one), and its tables are built on the host.
            return None, None
        if queue and budget < min(self.prefill_chunk, len(queue[0].prompt) - queue[0].prefilled):
            # The decode tokens would cut the oldest prompt's chunk: two forwards keep it whole.
            decoding, jumps, budget = [], {}, self.max_num_batched_tokens
        take = plan_prefill([len(s.prompt) - s.prefilled for s in queue], budget, self.prefill_chunk)
        chunks, seqs = [], []
        for s, n in zip(queue, take):
            if n:
                end = s.prefilled + n
                chunks.append(Chunk(s.prompt[s.prefilled:end], s.prefilled, s.slot, end == len(s.prompt)))
                seqs.append(s)
        finishing = [s for s, c in zip(seqs, chunks) if c.last]
        split = self._per_step_bias() or any(s.per_step_bias for s in finishing)
        # A decoding row's entry: its next token (on the device) at the position it feeds (at most
        # the context's last: a request's prompt and max_tokens fit the context), or that token
        # (read) followed by the run of tokens its grammar forces after it.
        riders = [Chunk(jumps[s.key], s.pos_hi, s.slot, True) if s.key in jumps else
                  Chunk([self.r.pad_id], s.pos_hi, s.slot, True, from_state=True) for s in decoding]
        try:
            logits = self.packed.run(chunks + riders)
        except Exception as e:  # e.g. out of memory: which request? each is prefilled alone next
            if not seqs:  # decoding rows alone: like a failed decode step, not one request's
                raise
            self._prefill_failed(seqs, e, updates)
            return None, None
        def ride(logits: torch.Tensor, starting: Sequence[_Seq] = ()) -> _Pending | None:
            """The riders' decode step from their logits (after ``starting``'s), the runs they fed
            given to their requests; for a split one, tokens still unread are read while it runs."""
            mixed = self._decode_from(logits, decoding, split, jumps, starting) if decoding else None
            for s in decoding:
                if s.key in jumps:  # fed: the matcher takes the run, the request gets it now
                    self._take(s, updates.setdefault(s.key, SeqUpdate()), jumps[s.key][1:])
            if mixed is not None and mixed.sample is not None:
                self._read_all(updates)
            return mixed

        # With riders, the new rows' first tokens come from the riders' sampling half: their rows
        # of the decode state start at their prompts' last positions, their grammars' start masks
        # are filled with the riders' masks, and nothing is sampled for them alone.
        starting = finishing if decoding else []
        out = None
        try:
            if starting:
                self._start_rows(starting)
            elif finishing:
                out, mode, start = self._first_tokens(logits, finishing)
                self.r.state.load_rows(*start)
        except Exception as e:  # the riders' step goes on; the prompts are prefilled again
            for s in finishing:  # idle in the decode steps again until then
                self._park(s.slot)
            mixed = ride(logits[len(finishing):])
            self._prefill_failed(seqs, e, updates)
            return None, mixed
        mixed = ride(logits, starting)
        for s, c in zip(seqs, chunks):
            s.prefilled += len(c.tokens)
            if self.prefix is not None:
                self.prefix.extend(s.slot, s.prompt, s.prefilled)
        for s in finishing:
            self.prefilling.remove(s)
            self._suspects.discard(s.key)
            s.launched, s.pos_hi = 1, len(s.prompt)
        if not finishing:
            return None, mixed
        self._set_spec_rows(finishing)
        if out is None:  # sampled by the riders' step
            return None, mixed
        host, slot = self._host(out)
        return _Pending(host, slot, mode, list(enumerate(finishing))), mixed  # output row i: finishing request i

    def _prefill_failed(self, seqs: list[_Seq], error: Exception, updates: dict[Hashable, SeqUpdate]) -> None:
        """The prompts of a packed forward that failed (e.g. out of memory), not advanced: which
        request? Several are prefilled again one at a time; one alone ends with ``error``."""
        if len(seqs) > 1:
            self._suspects.update(s.key for s in seqs)
            return
        s = seqs[0]
        self._suspects.discard(s.key)
        self.prefilling.remove(s)
        self.by_key.pop(s.key, None)
        self._finish(s)
        updates[s.key] = SeqUpdate(finish_reason=FINISH_ERROR, error=error)

    @staticmethod
    def _matchers(step: _Pending) -> list[tuple[LLMatcher, int]]:
        """(matcher, row) of each grammar row of ``step`` still running: the masks its sampling half takes."""
        return [(s.constraint.matcher, s.slot) for _, s in step.seqs
                if not s.done and s.constraint is not None and s.constraint.matcher is not None]

    @staticmethod
    def _caps(step: _Pending) -> Caps:
        """(row, cap) of each grammar row of ``step`` still running whose open string's
        ``maxLength`` cuts its next mask (grammar.row_caps)."""
        rows = [s for _, s in step.seqs if not s.done and s.constraint is not None]
        return row_caps([s.constraint for s in rows], [s.slot for s in rows])

    def _sampling(self, seqs: Sequence[_Seq], grammar: bool) -> SamplingTensors:
        """The sampling parameters of ``seqs``' rows; their bias with their grammars' start masks as
        ``-inf`` (``grammar``) or without (a decode state's, whose sampling half applies the packed masks)."""
        ps = [s.params for s in seqs]
        bias = bias_rows([s.constraint for s in seqs], self.r.state.params.bias.shape[1], self.r.device, grammar=grammar)
        return SamplingTensors.build([float(p.temperature) for p in ps], [p.top_k for p in ps],
                                     [float(p.top_p) for p in ps], [s.seed for s in seqs], self.r.device,
                                     [float(p.presence_penalty) for p in ps], [float(p.frequency_penalty) for p in ps],
                                     bias)

    def _first_tokens(self, logits: torch.Tensor, seqs: list[_Seq]) -> tuple[torch.Tensor, str, tuple]:
        """Sample the first token of each request from its prompt's last logits, on their own (no
        decoding row rode in their forward). Returns the sampled output, its mode, and the arguments
        of ``DecodeState.load_rows`` that start the requests' decode rows (token, position, sampling
        parameters)."""
        dev = self.r.device
        sampling = self._sampling(seqs, grammar=True)
        mode = _mode([s.params for s in seqs])
        last = upload([len(s.prompt) - 1 for s in seqs], torch.int64, dev)  # the position each sample is keyed by
        out = sample_mode(logits, sampling, last, mode)
        if any(s.constraint is not None and s.constraint.matcher is not None for s in seqs):
            # The decode state keeps the bias without the grammar: its split steps apply each
            # step's packed masks themselves.
            sampling = sampling._replace(bias=bias_rows([s.constraint for s in seqs], sampling.bias.shape[1], dev,
                                                        grammar=False))
        return out, mode, (upload([s.slot for s in seqs], torch.int64, dev), token_ids(out, mode), last + 1, sampling)

    def _start_rows(self, seqs: list[_Seq]) -> None:
        """Start ``seqs``' decode rows one position early, for the riders' sampling half to sample
        their first tokens from their prompts' last logits (``_decode_from``): at each prompt's last
        position (which keys the sample; the half advances it), with their sampling parameters and
        no penalty counts. Their grammars' start masks are filled with the riders' masks. Sampling
        them on their own instead cost the engine thread a mask fill, a bias built twice and the
        sampling's launches per admitting step."""
        dev = self.r.device
        self.r.state.start_rows(upload([s.slot for s in seqs], torch.int64, dev),
                                upload([len(s.prompt) - 1 for s in seqs], torch.int64, dev),
                                self._sampling(seqs, grammar=False))

    def _decode_from(self, logits: torch.Tensor, rows: list[_Seq], split: bool = False,
                     jumps: dict[Hashable, list[int]] | None = None, starting: Sequence[_Seq] = ()) -> _Pending:
        """The decode step of ``rows`` whose forward half was the packed forward (``logits``: one
        row each, in order, after one per ``starting`` request): their logits into the decode state,
        then the captured sampling half of their batch bucket, which advances them as a decode step
        does; ``split``: that half is left to ``_sample()``, as a split step's. ``jumps``: the runs
        of tokens that rows fed instead of one (their new token and the tokens forced after it); the
        sampling half takes each such row at its run's last position. ``starting``:
        requests whose prompt ended in that forward (``_start_rows``): the same half samples their
        first tokens."""
        batch, mode = self._shape([*rows, *starting])
        dev = self.r.device
        self.r.state.logits.index_copy_(0, upload([s.slot for s in [*starting, *rows]], torch.int64, dev), logits)
        seqs = [(s.slot, s) for s in starting] + self._advance(rows)
        if jumps:
            jumped = [s for s in rows if s.key in jumps]
            for s in jumped:
                s.pos_hi += len(jumps[s.key]) - 1
            # Where the run's last token sits: the position its sample is keyed by and advances from.
            self.r.state.input_pos.index_copy_(0, upload([s.slot for s in jumped], torch.int64, dev),
                                               upload([[s.pos_hi - 1] for s in jumped], torch.int64, dev))
        sample = self.r.sample_steps[(batch, mode)]
        if split:
            return _Pending(None, -1, mode, seqs, sample=sample)
        host, slot = self._host(sample.run())
        return _Pending(host, slot, mode, seqs)

    def _forced_runs(self) -> dict[Hashable, list[int]]:
        """For the decoding rows, every step of which has been read (their matchers have taken their
        last token): that token followed by the tokens their grammars force after it, where there
        are any, leaving a token to sample before ``max_tokens``. The next forward feeds such a run
        whole, so a row writes ``"`` and then ``, "name": "`` in one step instead of one step a
        token; the matcher takes the run once it is fed (``_prefill`` may cut it or leave it out).
        Rows with logprobs or penalties (their counts and logprobs go token by token) take no runs."""
        if not self.jump_forced:
            return {}
        runs = {}
        for s in self.slots:
            if s is not None and s.launched and not s.done and (run := self._forced(s)):
                runs[s.key] = [s.out[-1], *run]
        return runs

    @staticmethod
    def _forced(s: _Seq) -> list[int]:
        """The tokens ``s``'s grammar forces from its matcher's state, as a run may take them: a
        token left to sample before ``max_tokens``, none from a stop token on; none for rows with
        logprobs or penalties (their counts and logprobs go token by token)."""
        c = s.constraint
        if c is None or c.matcher is None or s.params.full or c.matcher.is_stopped():
            return []
        run = c.forced()[:s.params.max_tokens - s.generated - 1]
        for i, tok in enumerate(run):
            if tok in s.stops:
                return run[:i]
        return run

    def _set_spec_rows(self, seqs: list[_Seq]) -> None:
        """Tell the verify steps which of these newly started rows accept drafts."""
        if self.spec is None:
            return
        inside = [s for s in seqs if s.slot < len(self.spec.spec_rows)]
        if inside:
            dev = self.r.device
            self.spec.set_rows(upload([s.slot for s in inside], torch.int64, dev),
                               upload([int(s.speculate) for s in inside], torch.int64, dev))

    def _speculates(self, active: list[_Seq], batch: int, mode: str) -> bool:
        """Whether the next step is a verify step: speculation exists, the busy slots fit its
        buckets, no row needs the plain steps' FULL mode, and some row accepts drafts."""
        spec = self.spec
        return (spec is not None and bool(spec.spec_buckets) and batch <= spec.spec_buckets[-1]
                and mode in _SPEC_MODES and any(s.speculate for s in active)
                and all(s.constraint is None for s in active))  # verify steps take no bias

    def _launch(self, split: bool = False) -> _Pending | None:
        """Launch the next decode step of the decoding rows (a verify step when they speculate);
        ``split``: only its forward half, ``_sample()`` launches the rest."""
        active = self._decoding()
        if not active:
            return None
        batch, mode = self._shape(active)
        steps, k = self.r.steps, 0  # a plain step, or a verify step proposing k drafts per row
        if not split and self._speculates(active, batch, mode):
            steps, k = self.spec.steps, self.spec.n_heads
            batch = pick_bucket(batch, self.spec.spec_buckets)
        # The step writes positions pos .. pos+k of each row: attend to one past the last.
        needed = min(max(s.pos_hi for s in active) + k + 1, self.r.max_seq_len)
        kv = pick_bucket(needed, self.r.kv_buckets)
        seqs = self._advance(active, k)
        if split:
            self.r.forward_steps[(batch, kv)].run()
            return _Pending(None, -1, mode, seqs, sample=self.r.sample_steps[(batch, mode)])
        host, slot = self._host(steps[(batch, mode, kv)].run())
        return _Pending(host, slot, mode, seqs, k)

    def _sample(self, pending: _Pending) -> _Pending:
        """Launch a split step's sampling half (its rows' bias loaded) and the copy of its output."""
        assert pending.sample is not None
        pending.host, pending.slot = self._host(pending.sample.run())
        return pending

    def _read(self, pending: _Pending, updates: dict[Hashable, SeqUpdate]) -> None:
        rows = pending.host.wait(pending.slot)
        k = pending.drafts
        for row, s in pending.seqs:
            if s.done:  # finished or cancelled since the launch: its tokens are dropped
                continue
            u = updates.setdefault(s.key, SeqUpdate())
            if s.generated == 0:
                u.cached_tokens = min(s.cached, len(s.prompt) - len(s.fed))  # the request's prompt alone
                if s.fed:  # the start run, fed with the prompt, already taken by the matcher
                    u.tokens += s.fed
                    s.out += s.fed
                    s.generated += len(s.fed)
            if k:  # a verify step: the row's first accepted+1 base tokens
                accepted = rows[row][k + 1]
                s.pos_hi -= k - accepted  # the bound assumed every draft accepted
                if s.speculate:
                    self.spec_stats.add_row(accepted)
                new, logprobs = rows[row][:accepted + 1], None
            else:
                tok, logprobs = read_row(rows[row], pending.mode, s.params.logprobs)
                new = [tok]
            if logprobs is not None:
                u.logprobs.append(logprobs)
            self._take(s, u, new)

    def _take(self, s: _Seq, u: SeqUpdate, tokens: list[int]) -> None:
        """Give request ``s`` its new ``tokens`` (its matcher takes each) until one ends it."""
        c = s.constraint
        for tok in tokens:
            if c is not None and (c.refused is not None or not c.accept(tok)):
                why = c.error()
                u.finish_reason, u.error = FINISH_ERROR, (
                    GrammarError(why) if why is not None else RuntimeError(f"the grammar rejected token {tok}"))
                break
            u.tokens.append(tok)
            s.out.append(tok)
            s.generated += 1
            if tok in s.stops:
                u.finish_reason = FINISH_STOP
            elif s.generated >= s.params.max_tokens:
                u.finish_reason = FINISH_LENGTH
            if u.finish_reason is not None:
                break
        if u.finish_reason is not None:
            self.by_key.pop(s.key, None)
            self._finish(s)

    def _finish(self, seq: _Seq) -> None:
        seq.done = True
        if seq.slot >= 0 and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None
            if self.prefix is not None:
                # In the row: what the prefill put in (the start run included), and every later
                # reported token but the last (the step that would write its K/V was never run, or
                # runs past the request's end).
                valid = seq.prompt[:seq.prefilled] + seq.out[len(seq.fed):-1]
                self.prefix.release(seq.slot, valid, len(valid))

    def fail_all(self, error: Exception) -> dict[Hashable, SeqUpdate]:
        """End every request with ``error`` (a decode step failed: it cannot be pinned on one row)."""
        out = {key: SeqUpdate(finish_reason=FINISH_ERROR, error=error) for key in self.by_key}
        for seq in list(self.by_key.values()):
            self._finish(seq)
        self.by_key.clear()
        self.waiting.clear()
        self.prefilling.clear()
        self._suspects.clear()
        self._inflight, self._forward = [], None
        if self.prefix is not None:  # what the failed step left in the cache is unknown
            self.prefix.clear()
        return out


_SPEC_MODES = frozenset(MODES)  # the verify steps' sampling modes (FULL: plain steps only)


def _mode(params: list[SamplingParams]) -> str:
    """The one sampling mode that serves every running row (the runner's modes, as for a batch)."""
    return sampling_mode([p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params],
                         any(p.full for p in params))



class UpdateBoard:
    """Updates waiting for the serving side: the engine posts each step's, the handler takes
    those of its requests (merged, when several steps came between two takes)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._updates: dict[Hashable, SeqUpdate] = {}

    def post(self, updates: dict[Hashable, SeqUpdate]) -> None:
        with self._cond:
            for key, u in updates.items():
                have = self._updates.get(key)
                self._updates[key] = u if have is None else have.merge(u)
            self._cond.notify_all()

    def discard(self, key: Hashable) -> None:
        """Drop what ``key`` has waiting (a cancelled request's last tokens)."""
        with self._cond:
            self._updates.pop(key, None)

    def take(self, keys: Collection[Hashable], timeout: float) -> dict[Hashable, SeqUpdate]:
        """The updates of ``keys`` collected so far, waiting up to ``timeout`` s for the first one."""
        with self._cond:
            self._cond.wait_for(lambda: any(k in self._updates for k in keys), timeout)
            return {k: self._updates.pop(k) for k in keys if k in self._updates}

    def wait(self, keys: Collection[Hashable], timeout: float) -> bool:
        """Wait up to ``timeout`` s until one of ``keys`` has an update (left for ``take``); whether one has."""
        with self._cond:
            return self._cond.wait_for(lambda: any(k in self._updates for k in keys), timeout)


class EngineThread:
    """A ``ContinuousBatcher`` driven by its own thread, so that decode steps run back to back while
    the serving side (the TorchServe handler) takes requests in and answers out at its own pace.

    ``submit`` / ``cancel`` from any thread; ``take`` waits for and returns the updates of given
    requests. Only the engine thread touches the batcher and the device. With an ``outlet``, each
    step's updates go to it (called on the engine thread) instead of to ``take``: the engine
    process (engine_process.py) sends them to the worker that way.
    """

    def __init__(self, batcher: ContinuousBatcher, device: torch.device | None = None,
                 outlet: Callable[[dict[Hashable, SeqUpdate]], None] | None = None) -> None:
        self.batcher = batcher
        self.board = UpdateBoard()
        self._outlet = outlet or self.board.post
        self._commands: collections.deque[tuple] = collections.deque()
        self._wake = threading.Event()
        self.running = self.waiting = 0  # as of the last step: for metrics
        self.kv_usage = 0.0
        # The serving thread formats answers (detokenizing, JSON) while this one steps the model:
        # with Python's default 5 ms GIL switch interval a busy serving thread could hold this one
        # back for more than a decode step; 0.5 ms keeps its wait well under one step.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        # A split step (grammar rows running) admits midway, after its sampling half is launched;
        # requests that arrived since its start join there instead of a step later (served at 32
        # constrained streams on an H200: from 2.4-2.5 ms between a request reaching the engine
        # process and its admission to 1.4, benchmarks/results/served-cpu-contention-h200/).
        batcher.intake = self._intake
        self._thread = threading.Thread(target=self._loop, args=(device,), name="servekit-engine", daemon=True)
        self._thread.start()

    def submit(self, key: Hashable, prompt: list[int], params: SamplingParams, speculate: bool = True) -> None:
        self._commands.append(("add", key, prompt, params, speculate))
        self._wake.set()

    def cancel(self, key: Hashable) -> None:
        self._commands.append(("cancel", key))
        self._wake.set()

    def fail(self, key: Hashable, error: Exception) -> None:
        """End request ``key`` with ``error`` before it started (it reaches ``take`` like any update)."""
        self._commands.append(("fail", key, error))
        self._wake.set()

    def settle(self, timeout: float) -> bool:
        """Wait (up to ``timeout`` s) until the engine has handled every command sent before this
        call (cancellations included) and updated ``running``/``waiting``/``kv_usage`` after them,
        so gauges read then reflect the requests that are gone. False if it took longer."""
        done = threading.Event()
        self.after_step(done.set)
        return done.wait(timeout)

    def after_step(self, call: Callable[[], None]) -> None:
        """Have the engine thread ``call()`` once every command sent before is handled and the step
        after them done, its updates out and the gauges read after it."""
        self._commands.append(("settle", call))
        self._wake.set()

    def take(self, keys: Collection[Hashable], timeout: float) -> dict[Hashable, SeqUpdate]:
        return self.board.take(keys, timeout)

    def wait(self, keys: Collection[Hashable], timeout: float) -> bool:
        return self.board.wait(keys, timeout)

    def _add(self, cmd: tuple, updates: dict[Hashable, SeqUpdate]) -> None:
        try:
            self.batcher.add(*cmd[1:])
        except ValueError as e:  # the caller validated: a bug or a race, the request's own error
            updates[cmd[1]] = SeqUpdate(finish_reason=FINISH_ERROR, error=e)

    def _intake(self, updates: dict[Hashable, SeqUpdate]) -> None:
        """The new requests at the head of the commands, added mid-step (``ContinuousBatcher.intake``).
        Stops at any other command, so that a cancellation or a settle still follows what came
        before it."""
        while self._commands and self._commands[0][0] == "add":  # this thread alone takes commands
            self._add(self._commands.popleft(), updates)

    def _loop(self, device: torch.device | None) -> None:
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
        b = self.batcher
        while True:
            if not b.has_work and not self._commands:
                self._wake.wait()
            self._wake.clear()
            updates: dict[Hashable, SeqUpdate] = {}
            settled: list[Callable[[], None]] = []
            try:
                while self._commands:
                    cmd = self._commands.popleft()
                    if cmd[0] == "settle":  # answered once the counters below include every earlier command
                        settled.append(cmd[1])
                        continue
                    if cmd[0] == "cancel":
                        b.cancel(cmd[1])
                        continue
                    if cmd[0] == "fail":
                        updates[cmd[1]] = SeqUpdate(finish_reason=FINISH_ERROR, error=cmd[2])
                        continue
                    self._add(cmd, updates)
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
                self._outlet(updates)
            for call in settled:
                call()
