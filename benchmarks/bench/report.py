"""Rendering of a sweep's analysis (analysis.py): results.json, report.md with plots, the
recommendation files. The run folder:

    points.jsonl                    one line per measured point (written as the run goes)
    raw/*.npz                       every request of every point: intended, start, end, status, payload
                                    (+ first, last, tokens for streamed requests)
    results.json                    per-config capacities, ranking, Pareto front, winner, baseline margin
    report.md + *.png               tables and plots
    recommended-model-config.yaml   the winner as a model-config (frontend keys + servekit plan)
    recommendation.json             values the Kubernetes overlay needs
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from servekit.benchmarks.bench.measure import PointResult
from servekit.benchmarks.bench.server_metrics import host_saturation
from servekit.benchmarks.bench.stats import Summary

from servekit.benchmarks.bench.analysis import (Analysis, ConfigResult, RunRecord, analyze, inprocess_figures,
                                                 recommendation, sla_dict, sla_text)


def _num(x: Any, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, (int, float)):
        return f"{x:.{nd}f}"
    return str(x)


# Streamed (LLM) sweeps: columns of the report tables.
LLM_COLUMNS = ("TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "tok/s", "tok/s/seq", "goodput req/s")


def llm_cells(s: Summary) -> list[str]:
    """The LLM_COLUMNS cells of one point."""
    m = s.llm
    if m is None:
        return ["-"] * len(LLM_COLUMNS)
    return [_num(m.ttft_ms["p50"]), _num(m.ttft_ms["p99"]), _num(m.itl_ms["p50"], 2), _num(m.itl_ms["p99"], 2),
            _num(m.tokens_per_s), _num(m.tokens_per_s_per_seq),
            "-" if m.goodput_rps is None else _num(m.goodput_rps, 2)]


LLM_NOTE = (" TTFT: time to the first token, from the intended send time. ITL: a request's mean time per token "
            "after the first, (last - first) / (tokens - 1); the percentiles are over requests. tok/s: completion "
            "tokens of successful requests per second, all together; tok/s/seq: 1000 / median ITL, the speed one "
            "sequence decodes at. Failed requests count as infinitely slow in the TTFT and ITL percentiles. goodput: "
            "requests per second that each met the SLA's TTFT and ITL bounds (as vLLM's --goodput).")


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def llm_text(s: Summary) -> str:
    """The streamed figures of the winner's line ("" for other sweeps)."""
    m = s.llm
    if m is None:
        return ""
    return (f", TTFT p99 {m.ttft_ms['p99']:.1f} ms, ITL p99 {m.itl_ms['p99']:.2f} ms, "
            f"{m.tokens_per_s:.1f} output tokens/s ({m.tokens_per_s_per_seq:.1f} per sequence)"
            + ("" if m.goodput_rps is None else f", goodput {m.goodput_rps:.2f} requests/s"))


@dataclass
class Answer:
    answered: bool
    lines: list[str] = field(default_factory=list)


def baseline_doubt(b: ConfigResult) -> str | None:
    """Why the stock baseline's capacity understates it, or None. Its closed-loop probe meeting the
    SLA at over twice the arrival rate its open-loop search settled on means that search ran into
    unstable windows, not the server's limit (seen on an H100: probe 160 requests/s, capacity 10),
    so "N x the stock throughput" would overstate servekit's lead."""
    probe = b.search.probe if b.search else None
    if probe is None or not probe.passed or b.capacity <= 0 or probe.throughput <= 2 * b.capacity:
        return None
    return (f"the stock baseline's closed-loop probe met the SLA at {probe.throughput:.1f} requests/s, over twice its "
            f"open-loop capacity of {b.capacity:.1f}: the margin over stock is overstated; measure again with "
            "longer windows (measurement.window_s)")


def host_note(p: PointResult) -> str | None:
    """Why a point's capacity may understate the server (its host's CPUs were saturated), or None."""
    saturated = host_saturation(p.host)
    if not saturated:
        return None
    return (f"at the winner's load {saturated}: client and server competed for them, so its capacity is a "
            "lower bound and can vary between runs; running the bench on another machine against it "
            "(target.remote) measures the server alone")


def texts_text(r: ConfigResult) -> str:
    """' = N texts/s (k texts per request)' where the configuration's requests carry texts."""
    if r.texts_capacity is None:
        return ""
    return f" = {r.texts_capacity:.1f} texts/s ({r.texts_per_request:g} texts per request)"


def answer_lines(run: RunRecord, a: Analysis) -> Answer:
    cfg = run.cfg
    sla = sla_text(cfg.sla)
    w, b = a.winner, a.baseline
    lines: list[str] = []
    answered = True
    if run.interrupted:
        lines.append("PARTIAL: the run was interrupted; figures cover the configurations measured so far.")
    if run.fatal:
        lines.append(f"FAILED: {run.fatal}")
    if w is None:
        lines.append(f"No configuration met the SLA ({sla}) at any load tried.")
        answered = False
    else:
        bp = w.best
        lines.append(f"Winner: {w.config.label()}: {w.capacity:.1f} requests/s{texts_text(w)} within the SLA "
                     f"({sla}); at that load p50 {bp.summary.p['p50']:.1f} ms, p99 {bp.summary.p['p99']:.1f} ms"
                     f"{llm_text(bp.summary)}.")
        note = host_note(bp)
        if note:
            lines.append(f"NOTE: {note}.")
    if a.base_name is None:
        lines.append("No stock baseline in this sweep (mark a variant `baseline: true`).")
    elif b is None or b.status != "measured":
        why = b.error if b is not None and b.error else "not measured"
        lines.append(f"Stock baseline {a.base_name}: {why}; the margin over stock is unknown.")
        answered = False
    elif w is b:
        lines.append(f"The winner is the baseline variant {a.base_name} itself (no other variant met the SLA).")
    elif w is not None:
        if b.capacity > 0:
            unit, stock_texts = (" in texts/s", texts_text(b)) if a.by_texts else ("", "")
            lines.append(f"{a.margin:.1f} x the stock throughput{unit} at the same SLA "
                         f"(stock {b.config.label()}: {b.capacity:.1f} requests/s{stock_texts}).")
            if a.margin is not None and a.margin < 1:
                lines.append("LOSES: the best non-stock configuration serves less than stock at this SLA.")
            doubt = baseline_doubt(b)
            if doubt:
                lines.append(f"WARNING: {doubt}.")
        else:
            lines.append(f"The stock baseline ({b.config.label()}) met the SLA at no load tried; "
                         f"the winner serves {w.capacity:.1f} requests/s within it.")
    ip = inprocess_figures(run, w)
    if ip is not None and "texts_per_s" in ip:
        lines.append(f"In-process reference: the winner's plan ran {ip['texts_per_s']:.0f} texts/s inside one process "
                     f"(full batches of {ip['batch_size']} from the same payloads: tokenize + embed, no HTTP); "
                     f"served within the SLA: {ip['served_texts_per_s']:.0f} texts/s = {ip['served_fraction']:.0%} of it.")
    elif ip is not None:
        lines.append(f"In-process reference not measured: {ip['skipped']}.")
    errs = [r for r in run.results if r.status == "error"]
    if errs:
        lines.append(f"{len(errs)} configuration(s) failed: " + "; ".join(f"{r.config.label()}: "
                     f"{(r.error or '').splitlines()[0]}" for r in errs))
    skipped = [r for r in run.results if r.status == "skipped"]
    if skipped:
        lines.append(f"{len(skipped)} configuration(s) skipped (time budget): "
                     + ", ".join(r.config.label() for r in skipped))
    unfinished = [r for r in run.results if r.status == "measured" and not r.finished]
    if unfinished:
        lines.append(f"{len(unfinished)} configuration(s) ran out of time budget mid-search (their capacity is only "
                     "a lower bound) and are not recommended: " + ", ".join(r.config.label() for r in unfinished))
    unstable = [p for p in run.points if p.status == "unstable"]
    if unstable:
        lines.append(f"{len(unstable)} point(s) were unstable (windows never agreed) and count as not passing.")
    return Answer(answered and not run.interrupted, lines)


def _plots(run: RunRecord, a: Analysis, out: Path) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sla = run.cfg.sla.p99_ms
    made: list[tuple[str, str]] = []
    by_conf: dict[Any, list[PointResult]] = {}
    for p in run.points:
        if p.summary is not None and p.load.mode == run.cfg.load.mode and p.role != "probe":
            by_conf.setdefault(p.config, []).append(p)
    if not by_conf:
        return made
    keep = [r.config for r in a.ranked[:8]]
    if a.baseline is not None and a.baseline.config not in keep:
        keep.append(a.baseline.config)
    keep += [c for c in by_conf if c not in keep][: max(0, 10 - len(keep))]
    fig, ax = plt.subplots(figsize=(8, 5))
    top = sla * 4
    for conf in keep:
        pts = sorted(by_conf.get(conf, []), key=lambda p: p.load.level)
        if not pts:
            continue
        xs = [p.throughput for p in pts]
        ys = [min(p.p99, top) for p in pts]
        style = "--" if a.baseline is not None and conf == a.baseline.config else "-"
        ax.plot(xs, ys, style, marker="o", label=conf.label())
        for p, x, y in zip(pts, xs, ys):
            if not p.passed:
                ax.plot([x], [y], "x", color="black", markersize=7)
    ax.axhline(sla, color="red", linestyle=":", label=f"SLA p99 {sla:g} ms")
    ax.set_xlabel("throughput (successful requests/s)")
    ax.set_ylabel(f"p99 latency (ms, clipped at {top:g})")
    ax.set_title("Latency vs throughput per configuration (x: point outside the SLA)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_throughput.png", dpi=110)
    plt.close(fig)
    made.append(("Latency vs throughput", "latency_throughput.png"))

    measured = [r for r in run.results if r.status == "measured"]
    series: dict[tuple[str, int], list[Any]] = {}
    for r in measured:
        series.setdefault((r.config.variant, r.config.workers), []).append(r)
    if any(len({x.config.batch_size for x in v}) > 1 for v in series.values()):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
        for (variant, workers), rs in sorted(series.items()):
            rs = sorted(rs, key=lambda r: r.config.batch_size)
            ax1.plot([r.config.batch_size for r in rs], [min(r.best.p99, top) if r.best else math.nan for r in rs],
                     marker="o", label=f"{variant} w{workers}")
            ax2.plot([r.config.batch_size for r in rs], [r.capacity for r in rs], marker="o", label=f"{variant} w{workers}")
        ax1.axhline(sla, color="red", linestyle=":")
        batches = sorted({r.config.batch_size for r in measured})
        for ax, yl in ((ax1, "p99 at the capacity point (ms)"), (ax2, "capacity within SLA (requests/s)")):
            ax.set_xticks(batches)
            ax.set_xlabel("batch size")
            ax.set_ylabel(yl)
            ax.grid(alpha=0.3)
        ax2.legend(fontsize=7)
        fig.suptitle("Batch size: p99 at capacity and capacity")
        fig.tight_layout()
        fig.savefig(out / "p99_vs_batch.png", dpi=110)
        plt.close(fig)
        made.append(("p99 and capacity vs batch size", "p99_vs_batch.png"))
    wseries: dict[tuple[str, int, int], list[Any]] = {}
    for r in measured:
        wseries.setdefault((r.config.variant, r.config.batch_size, r.config.max_batch_delay_ms), []).append(r)
    if any(len({x.config.workers for x in v}) > 1 for v in wseries.values()):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for (variant, b, d), rs in sorted(wseries.items()):
            rs = sorted(rs, key=lambda r: r.config.workers)
            ax.plot([r.config.workers for r in rs], [r.capacity for r in rs], marker="o", label=f"{variant} b{b} d{d}")
        ax.set_xlabel("workers")
        ax.set_ylabel("capacity within SLA (requests/s)")
        ax.set_title("Throughput within the SLA vs workers")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "throughput_vs_workers.png", dpi=110)
        plt.close(fig)
        made.append(("Throughput vs workers", "throughput_vs_workers.png"))
    return made


def write_report(run: RunRecord) -> Answer:
    cfg, out = run.cfg, run.dir
    a = analyze(run)
    ans = answer_lines(run, a)
    w = a.winner
    ready = None
    if w is not None:
        readies = [r.ready_s for r in run.results if r.config.variant == w.config.variant and r.ready_s]
        ready = max(readies) if readies else None
    rec = recommendation(run, a, ready)
    if rec is not None:
        model_cfg, overlay = rec
        (out / "recommended-model-config.yaml").write_text(
            f"# Recommended by `servekit bench` ({cfg.name}): {w.capacity:.1f} requests/s per server within "
            f"p99 <= {cfg.sla.p99_ms:g} ms.\n" + yaml.safe_dump(model_cfg, sort_keys=False))
        (out / "recommendation.json").write_text(json.dumps(overlay, indent=2) + "\n")
    else:
        for name in ("recommended-model-config.yaml", "recommendation.json"):
            (out / name).unlink(missing_ok=True)
    try:
        plots = _plots(run, a, out)
    except Exception as e:  # a plot must never lose the report
        plots = []
        ans.lines.append(f"(plots failed: {type(e).__name__}: {e})")
    front = a.front
    results_json = {
        "name": cfg.name, "started": run.started, "elapsed_s": round(run.elapsed(), 1),
        "partial": run.interrupted, "fatal": run.fatal, "answered": ans.answered, "answer": ans.lines,
        "sla": sla_dict(cfg.sla),
        "load_mode": cfg.load.mode,
        "configs": [{**r.config.to_dict(), "status": r.status, "error": r.error,
                     "capacity_rps": round(r.capacity, 3),
                     "mean_texts_per_request": r.texts_per_request,
                     "capacity_texts_per_s": None if r.texts_capacity is None else round(r.texts_capacity, 3),
                     "p50_ms": r.best.summary.p["p50"] if r.best else None,
                     "p99_ms": r.best.summary.p["p99"] if r.best else None,
                     **({"llm": r.best.summary.llm.to_dict()} if r.best and r.best.summary.llm else {}),
                     "load_at_capacity": r.best.load.level if r.best else None,
                     "first_failing_load": r.search.first_fail if r.search else None,
                     "search": r.search.bound if r.search else None, "ready_s": r.ready_s,
                     "repeats_rps": r.repeats, "pareto": i in front,
                     "baseline": r.config.variant == a.base_name}
                    for i, r in enumerate(run.results)],
        "winner": w.config.to_dict() if w else None,
        "baseline": a.baseline.config.to_dict() if a.baseline else None,
        "margin_over_baseline": a.margin,
        "recommendation": rec[1] if rec else None,
        "inprocess": inprocess_figures(run, w),
        "payloads": run.payload_info, "versions": run.versions,
    }
    (out / "results.json").write_text(json.dumps(results_json, indent=2, default=str) + "\n")

    L: list[str] = [f"# servekit bench: {cfg.name}", ""]
    if run.interrupted:
        L += ["> **Partial report**: the run was interrupted.", ""]
    L += ["**Question:** which configuration gives the most throughput while p99 stays within the SLA, and by how "
          "much does it beat the stock setup?", ""]
    L += [f"**Answer:** {ans.lines[0] if ans.lines else ''}", ""] + [f"- {x}" for x in ans.lines[1:]] + [""]
    v = run.versions
    L += ["## Setup", "",
          f"- SLA: {sla_text(cfg.sla)}; a failed request counts as infinitely slow in the SLA percentiles.",
          f"- Load: {cfg.load.mode} loop" + (f" ({cfg.load.arrival} arrivals; latency timed from each request's "
                                               "scheduled send time)" if cfg.load.mode == "open" else " (N users)")
          + f"; locust/gevent load processes; request timeout {cfg.load.timeout_s:g}s.",
          f"- Measurement: warm-up {cfg.measurement.warmup_s:g}s (excluded), windows of {cfg.measurement.window_s:g}s "
          f"until the last {cfg.measurement.stable_windows} agree (throughput and p50 within "
          f"{cfg.measurement.tolerance:.0%} or their sampling noise, p99 within {cfg.measurement.tail_tolerance:.0%} once "
          f"windows hold 1000+ requests, or every window's p99 on the same side of the SLA) or "
          f"{cfg.measurement.max_trials} windows; percentiles are exact (nearest rank) over every request of the "
          "agreeing windows.",
          f"- Search: highest passing load, bisected until pass and fail are within {cfg.load.search.precision:.0%}"
          + (f"; then the winner's and the baseline's brackets are refined to {cfg.load.search.refine_precision:.0%} "
             f"(at most {cfg.load.search.refine_points} more points each)" if cfg.load.search.refine_precision else "")
          + ".",
          f"- Payloads: {run.payload_info.get('count', '?')} bodies, characters p50 "
          f"{_num(run.payload_info.get('chars_p50'), 0)}, p90 {_num(run.payload_info.get('chars_p90'), 0)}, max "
          f"{run.payload_info.get('chars_max', '-')}"
          + (f"; max_tokens {run.payload_info['max_tokens_min']} to {run.payload_info['max_tokens_max']}"
             if "max_tokens_min" in run.payload_info else "") + ".",
          f"- Target: {'local TorchServe from ' + str(cfg.target.local.config) if cfg.target.local else cfg.target.remote.inference_url}.",
          f"- Machine: {v.get('machine')}, {v.get('cpu_count')} CPUs, GPU: {', '.join(v.get('gpu') or ['none'])}"
          + (f" (driver {v['nvidia_driver']})" if v.get("nvidia_driver") else "") + ".",
          f"- Versions: python {v.get('python')}, torch {v.get('torch')}, torchserve {v.get('torchserve')}, "
          f"transformers {v.get('transformers')}, locust {v.get('locust')}.",
          f"- Started {run.started}, {run.elapsed():.0f}s so far.", ""]
    L += ["## Ranking", "", "Capacity = the highest load that met the SLA with stable windows (open loop: its "
          "arrival rate; closed loop: its achieved throughput). "
          "P = on the Pareto front of (capacity, p99 at capacity)."
          + (LLM_NOTE if cfg.streamed else ""), ""]
    # A streamed (LLM) request is one generation, not a batch of texts: its columns replace texts/batch.
    extra = list(LLM_COLUMNS) if cfg.streamed else []
    per_batch = ("requests/batch", "requests_per_batch") if cfg.streamed else ("texts/batch", "texts_per_batch")
    texts = [] if cfg.streamed else ["texts/s"]  # capacity x texts per request
    L += [_row(["#", "config", "capacity rps", *texts, "p50 ms", "p99 ms", *extra, "load", per_batch[0], "queue ms",
                "backend ms", "GPU util", "host CPU", "P", "search"]),
          _row(["---"] * (13 + len(extra) + len(texts)))]
    idx = {id(r): i for i, r in enumerate(run.results)}
    for n, r in enumerate(a.ranked, 1):
        bp = r.best
        s = bp.server
        L.append(_row([str(n), f"{r.config.label()}{' (stock)' if r.config.variant == a.base_name else ''}",
                       f"{r.capacity:.1f}", *([_num(r.texts_capacity)] if texts else []),
                       _num(bp.summary.p["p50"]), _num(bp.summary.p["p99"]),
                       *(llm_cells(bp.summary) if extra else []), bp.load.label(), _num(s.get(per_batch[1]), 2),
                       _num(s.get("ts_queue_mean_ms")), _num(s.get("ts_backend_mean_ms")),
                       _num(bp.gpu.get("util_mean_pct"), 0), _num(bp.host.get("busy_pct"), 0),
                       "P" if idx[id(r)] in front else "", r.search.bound]))
    other = [r for r in run.results if r not in a.ranked]
    if other:
        L += ["", "Configurations without a passing load:", ""]
        for r in other:
            why = r.error or (r.search.bound if r.search else r.status)
            L.append(f"- {r.config.label()}: {r.status}: {(why or '').splitlines()[0] if why else ''}")
    if rec is not None:
        L += ["", "## Recommendation", "", "`recommended-model-config.yaml`:", "", "```yaml",
              (out / "recommended-model-config.yaml").read_text().rstrip(), "```", "",
              "`recommendation.json` (for the Kubernetes overlay):", "", "```json",
              json.dumps(rec[1], indent=2), "```"]
    if plots:
        L += ["", "## Plots", ""]
        for title, f in plots:
            L += [f"### {title}", "", f"![{title}]({f})", ""]
    L += ["## Every point", "",
          _row(["config", "load", "role", "status", "rps", "p50", "p90", "p99", "p99.9", *extra, "errors", "windows",
                "stable", "notes"]),
          _row(["---"] * (13 + len(extra)))]
    for p in run.points:
        s = p.summary
        L.append(_row([p.config.label(), f"{p.load.mode} {p.load.label()}", p.role, p.status, _num(s.throughput),
                       _num(s.p["p50"]), _num(s.p["p90"]), _num(s.p["p99"]), _num(s.p["p99.9"]),
                       *(llm_cells(s) if extra else []), f"{s.error_rate:.2%}", str(len(p.windows)),
                       "yes" if p.stable else "no", "; ".join(p.reasons).replace("|", "/")]))
    L += ["", "## Files", "", "- `points.jsonl`: every point (config, load, summary, percentiles, errors, windows, "
          "server metrics, GPU, versions)", "- `raw/`: every request of every point (numpy .npz: intended, start, end, "
          "status, payload index; seconds" + ("; streamed requests add first, last (token arrival times) and tokens"
                                              if cfg.streamed else "") + ")",
          "- `results.json`, `recommendation.json`, `recommended-model-config.yaml`",
          "- `bench.yaml`: the sweep file as run", ""]
    (out / "report.md").write_text("\n".join(L))
    return ans
