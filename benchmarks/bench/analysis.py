"""What a sweep's measurements say, as typed data: per-configuration results, the ranking, the
Pareto front, the winner, the baseline and the margin, the recommendation. Rendering (report.md,
plots, the answer's wording) is report.py's; the runner and the report both read this module, and
it reads neither of them.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servekit.benchmarks.bench.measure import PointResult, ServingConfig
from servekit.benchmarks.bench.schema import SLA, BenchConfig
from servekit.benchmarks.bench.search import BUDGET_EXHAUSTED, SearchResult
from servekit.model_source import sanitize_name


@dataclass
class ConfigResult:
    config: ServingConfig
    status: str = "pending"   # measured, error, skipped
    error: str | None = None
    search: SearchResult | None = None
    ready_s: float | None = None
    repeats: list[float] = field(default_factory=list)
    texts_per_request: float | None = None  # mean texts per request of its bodies (embedding sweeps)

    @property
    def capacity(self) -> float:
        if self.search is None or self.search.best is None:
            return 0.0
        return min([self.search.capacity, *self.repeats])

    @property
    def texts_capacity(self) -> float | None:
        """Texts/s at the capacity (requests/s x texts per request), None without texts."""
        return None if self.texts_per_request is None else self.capacity * self.texts_per_request

    @property
    def best(self) -> PointResult | None:
        return self.search.best if self.search else None

    @property
    def finished(self) -> bool:
        """Its search ended on its own terms, not cut short by the sweep's time budget."""
        return self.search is not None and self.search.bound != BUDGET_EXHAUSTED


@dataclass
class RunRecord:
    """Everything a sweep has measured so far: what the report and the analysis read. The runner's
    Run adds the measuring to it."""
    cfg: BenchConfig
    dir: Path
    results: list[ConfigResult] = field(default_factory=list)
    points: list[PointResult] = field(default_factory=list)
    started: str = ""
    versions: dict[str, Any] = field(default_factory=dict)
    interrupted: bool = False
    fatal: str | None = None
    payload_info: dict[str, Any] = field(default_factory=dict)
    mars: dict[str, str] = field(default_factory=dict)
    variant_configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    inprocess: dict[str, Any] | None = None
    t0: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


@dataclass(frozen=True)
class Analysis:
    """The sweep's answer as data: `ranked` (passing configurations, most capacity first), the
    Pareto `front` (indices into the run's results), the `winner` (best non-baseline, or the
    baseline when nothing else passed), the `baseline`'s best configuration and its variant name."""
    ranked: list[ConfigResult]
    front: set[int]
    winner: ConfigResult | None
    baseline: ConfigResult | None
    base_name: str | None
    by_texts: bool = False  # ranked by texts/s: the sweep varies the texts per request

    def score(self, r: ConfigResult) -> float:
        return score(r, self.by_texts)

    @property
    def margin(self) -> float | None:
        """Winner / baseline (texts/s or requests/s, as ranked), None when either is missing or zero."""
        w, b = self.winner, self.baseline
        return self.score(w) / self.score(b) if w and b and self.score(b) > 0 else None


def sla_text(sla: SLA) -> str:
    parts = [f"p99 <= {sla.p99_ms:g} ms"]
    if sla.p50_ms is not None:
        parts.append(f"p50 <= {sla.p50_ms:g} ms")
    if sla.ttft_p99_ms is not None:
        parts.append(f"TTFT p99 <= {sla.ttft_p99_ms:g} ms")
    if sla.itl_p99_ms is not None:
        parts.append(f"ITL p99 <= {sla.itl_p99_ms:g} ms")
    return ", ".join(parts + [f"errors <= {sla.max_error_rate:.1%}"])


def sla_dict(sla: SLA) -> dict[str, Any]:
    d: dict[str, Any] = {"p99_ms": sla.p99_ms, "p50_ms": sla.p50_ms, "max_error_rate": sla.max_error_rate}
    d.update({k: getattr(sla, k) for k in ("ttft_p99_ms", "itl_p99_ms") if getattr(sla, k) is not None})
    return d


def point_json(p: PointResult, versions: dict[str, Any], cfg: BenchConfig) -> dict[str, Any]:
    llm = {"llm": p.summary.llm.to_dict()} if p.summary is not None and p.summary.llm is not None else {}
    return {
        "run": cfg.name,
        "config": p.config.to_dict(),
        "load": {"mode": p.load.mode, "level": p.load.level, "arrival": p.load.arrival if p.load.mode == "open" else None},
        "role": p.role,
        "status": p.status,
        "reasons": p.reasons,
        "stable": p.stable,
        "spreads": {k: (None if math.isinf(v) else round(v, 4)) for k, v in p.spreads.items()},
        "segment_s": list(p.segment),
        "summary": p.summary.to_dict() if p.summary else None,
        "percentiles_ms": p.summary.to_dict()["p"] if p.summary else None,
        **llm,
        "errors": {"count": p.summary.errors, "rate": p.summary.error_rate, "by_status": p.summary.status_counts}
        if p.summary else None,
        "warmup": p.warmup.to_dict() if p.warmup else None,
        "windows": [w.to_dict() for w in p.windows],
        "server": p.server,
        "gpu": p.gpu,
        "host": p.host,
        "generator": p.generator,
        "raw_file": p.raw_file,
        "elapsed_s": round(p.elapsed_s, 2),
        "sla": sla_dict(cfg.sla),
        "versions": versions,
        "gpu_name": (versions.get("gpu") or [None])[0],
    }


def pareto(results: list[ConfigResult]) -> set[int]:
    """Indices of configs not dominated in (capacity higher, p99 at capacity lower)."""
    pts = [(i, r.capacity, r.best.p99) for i, r in enumerate(results) if r.best is not None and r.capacity > 0]
    front = set()
    for i, cap, p99 in pts:
        if not any((c2 >= cap and q2 <= p99) and (c2 > cap or q2 < p99) for _, c2, q2 in pts):
            front.add(i)
    return front


def score(r: ConfigResult, by_texts: bool) -> float:
    """What the ranking compares: texts/s when the texts per request vary, else requests/s."""
    return (r.texts_capacity or 0.0) if by_texts else r.capacity


def analyze(run: RunRecord) -> Analysis:
    cfg = run.cfg
    results = run.results
    base_name = cfg.baseline.name if cfg.baseline else None
    measured = [r for r in results if r.status == "measured"]
    # Requests of 1 and of 32 texts are different work: with the texts per request as an axis,
    # configurations compare by the texts they embed per second.
    by_texts = any(r.config.texts_per_request for r in results)
    # A search the time budget cut short only has a lower bound: never ranked, never recommended.
    ranked = sorted([r for r in measured if r.capacity > 0 and r.finished],
                    key=lambda r: (-score(r, by_texts), r.config.workers, r.best.p99))
    baseline = [r for r in results if r.config.variant == base_name]
    base_best = max(baseline, key=lambda r: score(r, by_texts)) if baseline else None
    contenders = [r for r in ranked if r.config.variant != base_name] or ranked
    return Analysis(ranked, pareto(results), contenders[0] if contenders else None, base_best, base_name, by_texts)


def inprocess_figures(run: RunRecord, w: ConfigResult | None) -> dict[str, Any] | None:
    """The in-process reference (measurement.inprocess_s) with the served share of it, or None."""
    ip = run.inprocess
    if ip is None or w is None or "texts_per_s" not in ip:
        return ip  # not asked for, or skipped (it says why)
    if ip.get("config") != w.config.to_dict():
        return None  # measured for another configuration
    served = w.capacity * ip["texts_per_request"]
    return {**ip, "served_texts_per_s": served, "served_fraction": served / ip["texts_per_s"]}


def recommendation(run: RunRecord, a: Analysis, ready_s: float | None) -> tuple[dict[str, Any], dict[str, Any]] | None:
    w = a.winner
    if w is None:
        return None
    cfg = run.cfg
    c = w.config
    per_pod = w.capacity
    usable = per_pod * cfg.deploy.headroom
    target = cfg.deploy.target_rps or per_pod
    replicas = max(1, math.ceil(target / usable)) if usable > 0 else None
    warm = cfg.deploy.warmup_seconds or (math.ceil(ready_s * 1.5 + 5) if ready_s else None)
    base = dict(run.variant_configs.get(c.variant, {}))
    model_cfg = {"minWorkers": c.workers, "maxWorkers": c.workers, "batchSize": c.batch_size,
                 "maxBatchDelay": c.max_batch_delay_ms}
    model_cfg.update({k: v for k, v in base.items() if k not in model_cfg})
    variant = next(v for v in cfg.variants if v.name == c.variant)
    overlay = {
        "model": sanitize_name(Path(variant.model).name) if variant.model else Path(variant.mar or c.variant).stem,
        "variant": c.variant,
        "mar": run.mars.get(c.variant),
        "workers": c.workers,
        "batch_size": c.batch_size,
        "max_batch_delay_ms": c.max_batch_delay_ms,
        "per_pod_capacity_rps": round(per_pod, 2),
        **({"texts_per_request": c.texts_per_request,
            "per_pod_capacity_texts_per_s": round(w.texts_capacity or 0.0, 2)} if c.texts_per_request else {}),
        "headroom": cfg.deploy.headroom,
        "target_rps": round(target, 2),
        "replicas": replicas,
        "warmup_seconds": warm,
        "sla": sla_dict(cfg.sla),
        "gpu": (run.versions.get("gpu") or [None])[0],
        "plan": base.get("servekit"),
    }
    if w.best.summary.llm is not None:  # what one pod delivers at that load, for capacity planning
        overlay["llm"] = w.best.summary.llm.to_dict()
    return model_cfg, overlay
