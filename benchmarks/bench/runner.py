"""`servekit bench <yaml>` / `python -m servekit bench <yaml>`: the SLA-driven auto-benchmark.

Answers: which serving configuration gives the most throughput while p99 stays within the SLA,
and by how much does it beat the stock setup? One TorchServe runs for the whole sweep; every
point is appended to points.jsonl as soon as it is measured and the report is rewritten after
every configuration, so an interrupted run (Ctrl-C) still leaves a valid partial report.

Exit status: 0 the question is answered; 1 no configuration meets the SLA, or the baseline could
not be measured; 2 the YAML is invalid; 3 the server or load generator failed before any answer;
130 interrupted (the partial report is written).
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

try:
    from rich.console import Console
except ImportError:  # a bare GPU machine: plain lines instead of rich's live progress
    Console = None  # type: ignore[assignment,misc]

from servekit.benchmarks.bench import archives, inprocess
from servekit.benchmarks.bench.analysis import ConfigResult, RunRecord, analyze, point_json, sla_text
from servekit.benchmarks.bench.loadgen import LoadGenerator, LoadGenError, LoadSpec, processes_for
from servekit.benchmarks.bench.measure import ERROR, PointResult, ServingConfig, measure_point
from servekit.benchmarks.bench.payloads import describe, load_bodies, regroup, write_bodies
from servekit.benchmarks.bench.report import Answer, write_report
from servekit.benchmarks.bench.schema import BenchConfig, SchemaError, Variant, load_config
from servekit.benchmarks.bench.search import SearchResult, refine_capacity, search_capacity
from servekit.benchmarks.bench.server_metrics import GPUSampler, scrape
from servekit.benchmarks.bench.target import Server
from servekit.torchserve import ServerError

class PlainConsole:
    """The few rich.Console methods used here, as plain prints."""

    _TAG = __import__("re").compile(r"\[/?[a-z ]*\]")

    def print(self, text: object = "", markup: bool = True) -> None:
        print(self._TAG.sub("", str(text)) if markup else text, flush=True)

    def rule(self, title: str = "") -> None:
        self.print(f"--- {title} ---")

    def status(self, text: str):
        import contextlib

        self.print(text)
        return contextlib.nullcontext()


EXIT_OK, EXIT_NO_ANSWER, EXIT_SCHEMA, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                           "machine": platform.node(), "cpu_count": __import__("os").cpu_count()}
    from importlib import metadata
    for pkg in ("torch", "torchserve", "torch-model-archiver", "transformers", "locust", "numpy", "servekit"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


class Run(RunRecord):
    """A sweep being measured: the record the report reads, plus the server, load and console."""

    def __init__(self, cfg: BenchConfig, out_dir: Path, console: Console) -> None:
        super().__init__(cfg, out_dir, started=datetime.now(timezone.utc).isoformat(timespec="seconds"))
        self.console = console
        self.gpu = GPUSampler()
        self.versions = versions()
        self.versions["gpu"] = self.gpu.names or None
        self.versions["nvidia_driver"] = self.gpu.driver
        self.point_seq = 0

    # -- bookkeeping ---------------------------------------------------------------------------
    def out_of_time(self) -> bool:
        b = self.cfg.measurement.budget_s
        return b is not None and self.elapsed() > b

    def record_point(self, p: PointResult) -> None:
        self.points.append(p)
        with open(self.dir / "points.jsonl", "a") as f:
            f.write(json.dumps(point_json(p, self.versions, self.cfg)) + "\n")
        s = p.summary
        style = {"pass": "green", "fail": "red", "unstable": "yellow"}.get(p.status, "red")
        figs = (f"{s.throughput:7.1f} rps  p50 {s.p['p50']:7.1f}  p99 {s.p['p99']:7.1f} ms  err {s.error_rate:.1%}"
                if s else "")
        if s is not None and s.llm is not None:
            figs += (f"  TTFT p99 {s.llm.ttft_ms['p99']:.1f}  ITL p99 {s.llm.itl_ms['p99']:.1f} ms  "
                     f"{s.llm.tokens_per_s:.1f} tok/s")
        extra = f"  batch {p.server['texts_per_batch']:.1f}" if p.server.get("texts_per_batch") else ""
        self.console.print(f"  [{style}]{p.status:8}[/] {p.role:6} {p.load.label():>12}  {figs}{extra}"
                           + (f"  [dim]{'; '.join(p.reasons)}[/]" if p.reasons else ""))

    # -- steps ---------------------------------------------------------------------------------
    def prepare(self) -> None:
        cfg = self.cfg
        bodies = load_bodies(cfg.payloads, streamed=cfg.streamed)
        self.payload_info = describe(bodies)
        self.bodies, self._texts_per_body = bodies, {}
        self.bodies_path = write_bodies(bodies, self.dir / "bodies.jsonl")
        for t in sorted({t for v in cfg.variants for t in v.axes.texts_per_request}):
            self.payload_info.setdefault("texts_per_request", {})[t] = describe(regroup(bodies, t, self._text_field()))
        if cfg.target.local is not None:
            self.model_store = cfg.output_dir / "model_store"
        else:
            self.model_store = cfg.target.remote.model_store
        for v in cfg.variants:
            if v.mar:
                self.mars[v.name] = v.mar
                continue
            vc = archives.variant_config(v.model, v.config, v.overrides, v.plan)  # validated at load
            self.variant_configs[v.name] = vc
            if v.speculator is not None:
                check_heads(v)
            with self.console.status(f"building archive {v.name}.mar ({v.model})"):
                t = time.monotonic()
                mar = archives.build_variant(v.model, v.name, dict(vc), self.model_store, self.dir / "configs",
                                             speculator=v.speculator)
            self.console.print(f"archive {mar.name} ready ({time.monotonic() - t:.0f}s)")
            self.mars[v.name] = mar.name

    def plan_configs(self, v: Variant) -> list[list[ServingConfig]]:
        """Groups of configs sharing one registration (same batch size and delay)."""
        a = v.axes
        return [[ServingConfig(v.name, w, b, d, t) for t in (a.texts_per_request or (None,)) for w in a.workers]
                for b, d in itertools.product(a.batch_size, a.max_batch_delay_ms)]

    def bodies_for(self, texts_per_request: int | None) -> Path:
        """The bodies file of a configuration: the payloads as given, or regrouped into requests of
        `texts_per_request` texts (written once per size)."""
        if texts_per_request is None:
            return self.bodies_path
        path = self.dir / f"bodies-t{texts_per_request}.jsonl"
        if not path.exists():
            write_bodies(regroup(self.bodies, texts_per_request, self._text_field()), path)
        return path

    def _text_field(self) -> str | None:
        """`input` for the OpenAI embeddings route (its only text field), else the bodies' own."""
        return "input" if self.cfg.request.path.rstrip("/").endswith("/v1/embeddings") else None

    def texts_per_body(self, path: Path) -> float | None:
        """Mean texts per request of a bodies file, None for streamed (LLM) sweeps."""
        if self.cfg.streamed:
            return None
        if path not in self._texts_per_body:
            try:
                self._texts_per_body[path] = inprocess.payload_texts(path)[1]
            except ValueError:  # bodies without texts (a test handler's): no texts/s to report
                self._texts_per_body[path] = None
        return self._texts_per_body[path]

    def run_config(self, server: Server, gen: LoadGenerator, c: ConfigResult, register: bool) -> None:
        cfg, console = self.cfg, self.console
        conf = c.config
        gen.path = cfg.request.path.replace("{model}", conf.variant)  # each variant is served under its name
        gen.bodies = self.bodies_for(conf.texts_per_request)
        c.texts_per_request = self.texts_per_body(gen.bodies)
        console.rule(f"[bold]{conf.label()}[/]  ({self.elapsed():.0f}s elapsed)")
        try:
            if register:
                with console.status(f"registering {conf.variant}: batch {conf.batch_size}, delay "
                                    f"{conf.max_batch_delay_ms} ms, {conf.workers} worker(s)"):
                    c.ready_s = server.register(self.mars[conf.variant], conf.variant, conf.batch_size,
                                                conf.max_batch_delay_ms, conf.workers)
                console.print(f"  ready in {c.ready_s:.1f}s")
            elif server.current is not None and server.current.workers != conf.workers:
                with console.status(f"scaling to {conf.workers} worker(s)"):
                    c.ready_s = server.scale(conf.workers)
                console.print(f"  scaled in {c.ready_s:.1f}s")
        except ServerError as e:
            c.status, c.error = ERROR, f"server not ready: {e}"
            console.print(f"  [red]ERROR[/] {c.error}")
            server.current = None if register else server.current
            return

        measure = self._measurer(server, gen, conf)

        def probe() -> PointResult:
            users = max(2, 2 * conf.workers * conf.batch_size)
            return measure(LoadSpec("closed", float(users)), "probe")

        try:
            c.search = search_capacity(cfg.load, measure, probe if cfg.load.mode == "open" else None, self.out_of_time)
        except KeyboardInterrupt:
            # Keep what this configuration measured before the interrupt in the partial report.
            mine = [p for p in self.points if p.config == conf and p.role != "probe" and p.load.mode == cfg.load.mode]
            passed = [p for p in mine if p.passed]
            c.search = SearchResult(points=mine, best=max(passed, key=lambda p: p.load.level) if passed else None,
                                    bound="interrupted")
            c.status = "measured"
            raise
        c.status = "measured"
        self._repeat(c, measure)
        cap = c.capacity
        console.print(f"  [bold]capacity within SLA: {cap:.1f} rps[/] ({c.search.bound})")

    def _measurer(self, server: Server, gen: LoadGenerator, conf: ServingConfig):
        """measure(load, role) for `conf`: one point, recorded as soon as it is measured."""
        cfg, console = self.cfg, self.console

        def measure(load: LoadSpec, role: str) -> PointResult:
            procs = processes_for(load, cfg.load.processes, cfg.load.rps_per_process, cfg.load.users_per_process)
            self.point_seq += 1
            raw = self.dir / "raw" / f"{self.point_seq:04d}-{conf.variant}-w{conf.workers}-b{conf.batch_size}" \
                                     f"-d{conf.max_batch_delay_ms}-{load.mode}-{load.level:g}.npz"
            with console.status(f"  {role} {load.label()} ..."):
                p = measure_point(gen, conf, load, procs, cfg.measurement, cfg.sla, cfg.load.timeout_s,
                                  lambda: scrape(server.metrics_url), conf.variant, self.gpu, raw,
                                  early_stop=role != "probe")
            p.role = role
            self.record_point(p)
            return p
        return measure

    def _repeat(self, c: ConfigResult, measure) -> None:
        """measurement.repeats: measure the best level again; the capacity is the lowest of them."""
        c.repeats = []
        best = c.search.best if c.search else None
        for _ in range(self.cfg.measurement.repeats - 1):
            if best is None or self.out_of_time():
                break
            p = measure(best.load, "repeat")
            c.repeats.append(p.sustained_rps if p.passed else 0.0)

    def refine(self, server: Server, gen: LoadGenerator) -> None:
        """Narrow the winner's and the baseline's SLA bracket (load.search.refine): the answer and
        its "N x stock" rest on those two capacities."""
        s = self.cfg.load.search
        if s.refine_precision is None:
            return
        a = analyze(self)  # the configurations the report will call winner and baseline
        picks = [a.winner] + ([a.baseline] if a.baseline is not a.winner else [])
        for c in picks:
            if c is None or c.status != "measured" or c.best is None or c.search.first_fail is None or \
                    (c.search.first_fail - c.capacity) / c.capacity <= s.refine_precision:
                continue
            conf = c.config
            self.console.rule(f"[bold]refining {conf.label()}[/]: {c.capacity:g} passes, "
                              f"{c.search.first_fail:g} fails  ({self.elapsed():.0f}s elapsed)")
            gen.path = self.cfg.request.path.replace("{model}", conf.variant)
            try:
                server.register(self.mars[conf.variant], conf.variant, conf.batch_size, conf.max_batch_delay_ms,
                                conf.workers)
            except ServerError as e:
                self.console.print(f"  [red]ERROR[/] not refined, server not ready: {e}")
                continue
            measure = self._measurer(server, gen, conf)
            refine_capacity(c.search, self.cfg.load.mode == "closed", s.refine_precision, s.refine_points,
                            lambda level: measure(LoadSpec(self.cfg.load.mode, level, self.cfg.load.arrival), "refine"))
            self._repeat(c, measure)
            self.console.print(f"  [bold]capacity within SLA: {c.capacity:.1f} rps[/] ({c.search.bound})")
            self.write_report()
        server.unregister()

    def measure_inprocess(self) -> None:
        """measurement.inprocess_s: the winner's plan timed inside this process, on this machine's
        device, after every model is unregistered (so a local server's workers have freed it)."""
        secs = self.cfg.measurement.inprocess_s
        w = analyze(self).winner
        if secs <= 0 or w is None:
            return
        v = next(v for v in self.cfg.variants if v.name == w.config.variant)
        if v.name not in self.variant_configs:
            self.inprocess = {"skipped": "the winner is a prebuilt archive (`mar`): its plan is not known here"}
            return
        self.console.rule(f"[bold]in-process reference[/]: {v.name} plan, batches of {w.config.batch_size}")
        try:
            with self.console.status(f"  loading the {v.name} plan and timing it for {secs:g}s ..."):
                self.inprocess = {"config": w.config.to_dict(),
                                  **inprocess.measure(v.model, self.variant_configs[v.name],
                                                      self.bodies_for(w.config.texts_per_request),
                                                      w.config.batch_size, secs)}
        except Exception as e:  # the reference is extra: never lose the sweep's report for it
            self.inprocess = {"skipped": f"failed: {type(e).__name__}: {e}"}
        if "texts_per_s" in self.inprocess:
            self.console.print(f"  {self.inprocess['texts_per_s']:.0f} texts/s in-process "
                               f"({self.inprocess['ms_per_batch']:.2f} ms per batch of {w.config.batch_size})")
        else:
            self.console.print(f"  [yellow]not measured[/]: {self.inprocess['skipped']}")

    def sweep(self, server: Server, gen: LoadGenerator) -> None:
        cfg = self.cfg
        order = sorted(cfg.variants, key=lambda v: not v.baseline)  # baseline first
        for v in order:
            groups = self.plan_configs(v)
            if cfg.strategy == "staged" and not v.baseline and len(groups) > 1:
                self._staged(server, gen, v, groups)
                continue
            for group in groups:
                for k, conf in enumerate(group):
                    self._one(server, gen, conf, register=k == 0)
            server.unregister()

    def _one(self, server: Server, gen: LoadGenerator, conf: ServingConfig, register: bool) -> ConfigResult:
        c = ConfigResult(conf)
        self.results.append(c)
        if self.out_of_time():
            c.status, c.error = "skipped", "time budget exhausted before this configuration"
            self.console.print(f"[yellow]skipped[/] {conf.label()}: {c.error}")
            return c
        self.run_config(server, gen, c, register or server.current is None)
        self.write_report()
        return c

    def _staged(self, server: Server, gen: LoadGenerator, v: Variant, groups: list[list[ServingConfig]]) -> None:
        """Batch size and delay at the first worker count, then every worker count at the best of those."""
        first = [self._one(server, gen, g[0], register=True) for g in groups]
        best = max(first, key=lambda c: c.capacity)
        rest = next(g for g in groups if g[0] == best.config)[1:]
        for k, conf in enumerate(rest):
            self._one(server, gen, conf, register=k == 0)
        server.unregister()

    def write_report(self) -> Answer:
        return write_report(self)


def check_heads(v: Variant) -> None:
    """The variant's speculator folder holds trained heads (checked when the run starts, not at
    load: heads are often trained after the sweep file is written)."""
    from servekit.optimizations.llm.speculative import SPEC_CONFIG, SPEC_WEIGHTS

    missing = [n for n in (SPEC_CONFIG, SPEC_WEIGHTS) if not (v.speculator / n).is_file()]
    if missing:
        raise SchemaError(f"variants[{v.name}].speculator: {v.speculator} lacks {', '.join(missing)}; train heads "
                          f"with `servekit train-speculator --out {v.speculator}`")


def run(cfg: BenchConfig, out_dir: Path, console: Console) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    r = Run(cfg, out_dir, console)
    console.print(f"[bold]servekit bench[/] {cfg.name}: SLA {sla_text(cfg.sla)}; output {out_dir}")
    if cfg.source:
        (out_dir / "bench.yaml").write_text(cfg.source.read_text())
    try:
        r.prepare()
        server = Server(cfg.target, out_dir, r.model_store)
        with server:
            gen = LoadGenerator(out_dir / "loadgen", server.inference_url,
                                cfg.request.path, r.bodies_path, cfg.request.content_type,
                                cfg.request.headers, cfg.load.timeout_s, cfg.load.max_inflight,
                                stream=cfg.request.stream)
            try:
                r.sweep(server, gen)
                r.refine(server, gen)
            finally:
                gen.close()
            r.measure_inprocess()
    except KeyboardInterrupt:
        r.interrupted = True
        console.print("[yellow]interrupted: writing the partial report[/]")
    except (ServerError, LoadGenError, OSError) as e:
        r.fatal = f"{type(e).__name__}: {e}"
        console.print(f"[red]FAILED[/] {r.fatal}")
    finally:
        answer = None
        try:
            answer = r.write_report()
        except KeyboardInterrupt:
            pass
    if r.interrupted:
        return EXIT_INTERRUPTED
    if answer is None:
        return EXIT_FAILED
    console.print()
    for line in answer.lines:
        console.print(line)
    rec = out_dir / "recommended-model-config.yaml"
    if rec.exists():
        console.print(f"\n[bold]recommended model-config[/] ({rec}):")
        console.print(rec.read_text().rstrip(), markup=False)
        console.print(f"[bold]Kubernetes overlay values[/] ({out_dir / 'recommendation.json'}):")
        console.print((out_dir / "recommendation.json").read_text().rstrip(), markup=False)
    console.print(f"\nreport: {out_dir / 'report.md'}")
    if r.fatal and not answer.answered:
        return EXIT_FAILED
    return EXIT_OK if answer.answered else EXIT_NO_ANSWER


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="servekit bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Exit status: 0 answered, 1 no config meets the SLA (or no baseline), "
                                       "2 invalid YAML, 3 server/load generator failure, 130 interrupted.")
    p.add_argument("sweep", type=Path, help="benchmark YAML (see benchmarks/sweeps/example.yaml)")
    p.add_argument("--out", type=Path, help="run folder (default: <output.dir>/<name>-<UTC time>)")
    p.add_argument("--check", action="store_true", help="validate the YAML and exit")
    args = p.parse_args(argv)
    console = Console(highlight=False) if Console is not None else PlainConsole()
    try:
        cfg = load_config(args.sweep)
    except (SchemaError, OSError) as e:
        console.print(f"[red]invalid benchmark file[/] {args.sweep}: {e}")
        return EXIT_SCHEMA
    if args.check:
        console.print(f"{args.sweep}: valid ({len(cfg.variants)} variants)")
        return EXIT_OK
    out = args.out or cfg.output_dir / f"{cfg.name}-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"
    try:
        return run(cfg, out.resolve(), console)
    except SchemaError as e:
        console.print(f"[red]invalid benchmark file[/] {args.sweep}: {e}")
        return EXIT_SCHEMA


if __name__ == "__main__":
    sys.exit(main())
