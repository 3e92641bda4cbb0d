"""The continuous engine in a process of its own, beside the TorchServe worker that serves it.

Why: in one process the engine thread (scheduling, sampling bookkeeping, grammar masks) and the
handler thread (TorchServe's protocol, parsing, detokenizing, JSON) share one GIL, and a profile
of bursts found the two holding it between them through nearly all their busy time: the engine
took a burst of 32 x 600-token prompts at ~400,000 prompt tokens/s in-process, well under 300,000
served. Here each has its own interpreter.

The worker (``EngineProcess``) starts ``python -c ... main()`` with one end of a socket pair;
the two exchange pickled messages (``multiprocessing.connection.Connection``) that only these two
processes of one install read:

- worker -> engine: an ``EngineSpec`` once, then ``("add", key, prompt, params, speculate)``,
  ``("cancel", key)`` and ``("settle", n)``;
- engine -> worker: ``("ready", EngineReady)`` or ``("failed", kind, message)`` once, then
  ``("updates", {key: SeqUpdate}, Gauges | None)`` after each step that produced any, and
  ``("settled", n, Gauges)``.

The model is loaded, compiled and captured in the engine process only. A compiled grammar cannot
cross: the worker sends a request's constraint with its ``GrammarSpec`` alone (``DeferredGrammars``)
and the engine compiles it, from a cache of its own, on helper threads under the compiler's time
limit; a grammar that fails ends its request with the ``GrammarError`` (the worker's 400). If the
engine process ends, every request in flight gets an error and the worker ends too, so that
TorchServe starts a new worker (and with it a new engine).
"""
from __future__ import annotations

import concurrent.futures
import importlib
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any, Callable, Collection, Hashable

from servekit.optimizations.heap import freeze_heap
from servekit.optimizations.llm.continuous import FINISH_ERROR, SeqUpdate, UpdateBoard
from servekit.optimizations.llm.generate import RunnerShape, SamplingParams
from servekit.optimizations.llm.plan import LlmPlan
from servekit.optimizations.llm.prefix_cache import PrefixStats
from servekit.optimizations.plan import PlanError

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25  # how often updates carry the counters (speculation, prefix cache) with them
# After the engine process ends, how long the worker lives on: its handler's next call answers the
# requests in flight with their errors before the worker exits and TorchServe replaces it.
DEATH_GRACE_S = 1.0
WATCH_INTERVAL_S = 0.5  # how often the engine process checks that its worker is alive


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process builds: the model folder, the plan, the rows and the device."""

    model_dir: str
    plan: LlmPlan
    max_num_seqs: int
    gpu_id: int | None = None
    # "module:function" imported in the engine process and called with (batcher, tokenizer) before
    # it serves: how a test handler injects faults into the engine (the module is found on sys_path).
    hook: str | None = None
    sys_path: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineReady:
    """What the worker learns once the engine is built."""

    shape: RunnerShape
    plan: LlmPlan  # the effective plan (after downgrades)
    downgrades: tuple[str, ...]
    runner_plan: dict[str, Any]
    max_num_seqs: int
    max_num_batched_tokens: int
    spec_positions: int | None  # draft positions counted, None without speculation
    seconds: float
    frozen_objects: int = 0  # objects of the built engine exempted from the garbage collector (freeze_heap)


@dataclass(frozen=True)
class Gauges:
    running: int
    waiting: int
    kv_usage: float
    spec: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # drafts proposed and accepted per position
    prefix: PrefixStats | None = field(default=None)


class EngineError(RuntimeError):
    """The engine process failed to start, or ended."""


def _exit_worker() -> None:
    def later() -> None:
        time.sleep(DEATH_GRACE_S)
        log.error("exiting the worker: its engine process ended")
        os._exit(1)

    threading.Thread(target=later, name="servekit-engine-gone", daemon=True).start()


class EngineProcess:
    """The worker's side: ``EngineThread``'s interface (``submit``, ``cancel``, ``settle``, ``take``,
    ``wait``; its gauges in ``gauges``) over the socket to the engine process. Blocks in ``__init__`` until the
    engine is built; raises ``PlanError`` / ``EngineError`` with the engine's reason if it is not."""

    def __init__(self, spec: EngineSpec, on_death: Callable[[], None] = _exit_worker) -> None:
        ours, theirs = socket.socketpair()
        boot = "from servekit.optimizations.llm.engine_process import main; main()"
        # The worker names itself: an engine still importing when its worker dies would otherwise
        # take its new parent (init, or a subreaper) for the worker and outlive it.
        self._proc = subprocess.Popen([sys.executable, "-c", boot, str(theirs.fileno()), str(os.getpid())],
                                      pass_fds=(theirs.fileno(),))
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send(spec)
        self.ready = self._await_ready()
        self.shape = self.ready.shape
        self.max_num_batched_tokens = self.ready.max_num_batched_tokens
        self.board = UpdateBoard()
        self.gauges = Gauges(0, 0, 0.0)
        self._send_lock, self._open_lock = threading.Lock(), threading.Lock()
        self._open: set[Hashable] = set()  # submitted, not finished: what fails if the engine ends
        self._settling: dict[int, threading.Event] = {}
        self._settle_ids = itertools.count()
        self._dead: EngineError | None = None
        self._on_death = on_death
        # The handler thread formats answers while the receiver waits to hand the engine's updates
        # over: with Python's default 5 ms GIL switch interval a first token could wait that long.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        threading.Thread(target=self._receive, name="servekit-engine-link", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _await_ready(self) -> EngineReady:
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.wait()
            raise EngineError(f"the engine process exited with code {code} before it was ready; "
                              "its log (above) says why") from None
        if msg[0] == "failed":
            _, kind, message = msg
            self._proc.wait()
            if kind == PlanError.__name__:
                raise PlanError(message)
            raise EngineError(f"the engine failed to start: {kind}: {message}")
        return msg[1]

    def submit(self, key: Hashable, prompt: list[int], params: SamplingParams, speculate: bool = True) -> None:
        if params.constraint is not None:
            params = replace(params, constraint=params.constraint.portable())
        with self._open_lock:
            if self._dead is None:
                self._open.add(key)
        if self._dead is not None or not self._send(("add", key, prompt, params, speculate)):
            error = self._dead or EngineError("the engine process ended")
            self.board.post({key: SeqUpdate(finish_reason=FINISH_ERROR, error=error)})

    def cancel(self, key: Hashable) -> None:
        with self._open_lock:
            self._open.discard(key)
        self.board.discard(key)
        self._send(("cancel", key))

    def settle(self, timeout: float) -> bool:
        """As ``EngineThread.settle``: the gauges then include every command sent before."""
        done = threading.Event()
        n = next(self._settle_ids)
        self._settling[n] = done
        if not self._send(("settle", n)):
            return False
        ok = done.wait(timeout)
        self._settling.pop(n, None)
        return ok

    def take(self, keys: Collection[Hashable], timeout: float) -> dict[Hashable, SeqUpdate]:
        return self.board.take(keys, timeout)

    def wait(self, keys: Collection[Hashable], timeout: float) -> bool:
        return self.board.wait(keys, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """End the engine process: it exits when its end of the socket reads EOF."""
        self._on_death = lambda: None
        # shutdown, not just close: the receiver thread blocked in recv() keeps a closed descriptor's
        # socket open (no EOF for the engine); shutdown ends both directions for everyone.
        with socket.socket(fileno=os.dup(self._conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
        self._conn.close()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _send(self, msg: tuple) -> bool:
        try:
            with self._send_lock:
                self._conn.send(msg)
            return True
        except (OSError, ValueError):  # the engine is gone: the receiver reports it
            return False

    def _receive(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "updates":
                    _, updates, gauges = msg
                    if gauges.spec is None and gauges.prefix is None:  # a light one: the counters as they were
                        gauges = replace(gauges, spec=self.gauges.spec, prefix=self.gauges.prefix)
                    self.gauges = gauges
                    with self._open_lock:
                        # Steps the engine ran before it took a cancellation in still report the
                        # cancelled request: nobody would take those updates.
                        updates = {k: u for k, u in updates.items() if k in self._open}
                        self._open.difference_update([k for k, u in updates.items() if u.finish_reason is not None])
                    if updates:
                        self.board.post(updates)
                elif msg[0] == "settled":
                    _, n, self.gauges = msg
                    done = self._settling.get(n)
                    if done is not None:
                        done.set()
        except (EOFError, OSError):
            self._end()

    def _end(self) -> None:
        try:
            code = self._proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        self._dead = EngineError(f"the engine process ended (exit code {code})")
        log.error("%s; ending its requests", self._dead)
        with self._open_lock:
            gone, self._open = self._open, set()
        self.board.post({key: SeqUpdate(finish_reason=FINISH_ERROR, error=self._dead) for key in gone})
        for done in list(self._settling.values()):
            done.set()
        self._on_death()


# -- the engine process ----------------------------------------------------------------------------------------
def _portable(updates: dict[Hashable, SeqUpdate]) -> dict[Hashable, SeqUpdate]:
    """``updates`` with any error that does not pickle replaced by a RuntimeError of its message."""
    for key, u in updates.items():
        if u.error is not None:
            try:
                pickle.dumps(u.error)
            except Exception:
                updates[key] = replace(u, error=RuntimeError(f"{type(u.error).__name__}: {u.error}"))
    return updates


def _build(spec: EngineSpec) -> tuple[Any, Any, Any, EngineReady]:
    """Load the model, build and warm up the engine: (batcher, grammar compiler, device, ready)."""
    import torch

    from servekit.optimizations.llm.chat_template import ChatTokenizer
    from servekit.optimizations.llm.continuous import ContinuousBatcher
    from servekit.optimizations.llm.grammar import GrammarCompiler
    from servekit.optimizations.llm.plan import load_llm_runner, stop_token_ids

    t0 = time.perf_counter()
    if spec.gpu_id is not None and torch.cuda.is_available() and spec.plan.device != "cpu":
        torch.cuda.set_device(spec.gpu_id)
    runner, plan, downgrades = load_llm_runner(spec.model_dir, spec.plan)
    for msg in downgrades:
        log.warning("plan downgraded (fallback: eager): %s", msg)
    if spec.max_num_seqs > runner.max_batch:
        raise PlanError(f"batchSize {spec.max_num_seqs} exceeds servekit.buckets.batch_sizes' largest "
                        f"bucket {runner.max_batch}")
    batcher = ContinuousBatcher(runner, spec.max_num_seqs, plan.prefill_chunk, plan.max_num_batched_tokens,
                                prefix_caching=plan.prefix_caching)
    built = batcher.warmup()
    fused = f", forwards of up to {built['fused_up_to']} tokens through the fused decode kernels" \
        if built["fused_up_to"] else ""
    log.info("continuous batching: packed prefill (%s attention, %s layers, %s) over token buckets %s built in "
             "%.1f s%s; prefix caching %s", built["attention"], "compiled" if built["compiled"] else "eager",
             "CUDA graphs" if built["graphs"] else "no graphs", built["token_buckets"], built["seconds"], fused,
             "on" if plan.prefix_caching else "off")
    tokenizer = ChatTokenizer(spec.model_dir)
    compiler = GrammarCompiler(tokenizer, runner.model.config.vocab_size, stop_token_ids(spec.model_dir, tokenizer))
    if spec.hook:
        module, _, name = spec.hook.partition(":")
        getattr(importlib.import_module(module), name)(batcher, tokenizer)
    stats = batcher.spec_stats
    ready = EngineReady(runner.shape, plan, tuple(downgrades), runner.plan, batcher.max_num_seqs,
                        batcher.max_num_batched_tokens,
                        len(stats.proposed) if stats is not None else None, time.perf_counter() - t0)
    return batcher, compiler, runner.device, ready


def _exit_with_worker(worker: int) -> None:
    """Exit once the worker that started this process is gone. Serving, a closed socket says so
    (EOF); but building the engine (minutes for a large model) reads no socket, and a worker that
    TorchServe killed for its startup timeout would leave an engine holding the GPU behind."""
    while os.getppid() == worker:
        time.sleep(WATCH_INTERVAL_S)
    log.error("the worker (pid %d) is gone; exiting", worker)
    os._exit(1)


def main() -> None:
    """The engine process: build the engine from the ``EngineSpec`` sent first, then serve commands
    until the worker's end of the socket closes."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s [engine %(process)d] %(levelname)s %(name)s - %(message)s")
    conn = Connection(int(sys.argv[1]))
    threading.Thread(target=_exit_with_worker, args=(int(sys.argv[2]),), name="servekit-engine-watch", daemon=True).start()
    spec: EngineSpec = conn.recv()
    sys.path[:0] = [p for p in spec.sys_path if p not in sys.path]
    try:
        batcher, compiler, device, ready = _build(spec)
    except BaseException as e:
        log.exception("the engine failed to start")
        conn.send(("failed", type(e).__name__, str(e)))
        sys.exit(1)
    from servekit.optimizations.llm.continuous import EngineThread
    from servekit.optimizations.llm.grammar import GrammarError

    stats_at = [0.0]

    def gauges(full: bool) -> Gauges:
        stats = batcher.spec_stats
        spec_counts = (tuple(stats.proposed), tuple(stats.accepted)) if full and stats is not None else None
        return Gauges(batcher.running, len(batcher.waiting), batcher.kv_usage, spec_counts,
                      batcher.prefix_stats() if full else None)

    def send_updates(updates: dict[Hashable, SeqUpdate]) -> None:
        # On the engine thread, the only sender after "ready": no lock. The counters ride along
        # a few times a second; running/waiting/kv_usage with every message.
        now = time.perf_counter()
        full = now - stats_at[0] >= STATS_INTERVAL_S
        if full:
            stats_at[0] = now
        conn.send(("updates", _portable(updates), gauges(full)))

    # The built engine (model, compiled layers, graphs, tokenizer, grammar compiler) lives as long as
    # this process: out of the collector's reach, a full collection never walks it mid-step.
    conn.send(("ready", replace(ready, frozen_objects=freeze_heap())))
    engine = EngineThread(batcher, device, outlet=send_updates)
    # Grammars not in the cache compile on helper threads (up to the compiler's time limit), so
    # that this thread goes on taking other requests and cancellations in meanwhile; a request
    # cancelled while its grammar compiles is dropped when the compilation ends.
    compiling: dict[Hashable, bool] = {}  # key -> cancelled while compiling
    lock = threading.Lock()
    helpers = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="servekit-engine-compile")

    def add(key: Hashable, prompt: list[int], params: SamplingParams, speculate: bool) -> None:
        error = None
        try:
            params = replace(params, constraint=compiler.restore(params.constraint))
        except GrammarError as e:
            error = e
        except Exception as e:  # anything else still ends this request, never leaves it unanswered
            log.exception("compiling a request's grammar failed")
            error = e
        with lock:
            if compiling.pop(key, False):
                return
        if error is not None:
            engine.fail(key, error)
        else:
            engine.submit(key, prompt, params, speculate)

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the worker is gone (it exited or closed the socket)
            os._exit(0)
        if msg[0] == "add":
            c = msg[3].constraint
            if c is not None and c.grammar is None and c.spec is not None and not compiler.cached(c.spec):
                with lock:
                    compiling[msg[1]] = False
                helpers.submit(add, *msg[1:])
            else:
                add(*msg[1:])
        elif msg[0] == "cancel":
            with lock:
                if msg[1] in compiling:
                    compiling[msg[1]] = True
                    continue
            engine.cancel(msg[1])
        elif msg[0] == "settle":
            engine.after_step(lambda n=msg[1]: conn.send(("settled", n, gauges(True))))
