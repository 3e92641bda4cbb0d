"""The benchmark YAML, validated once into small frozen dataclasses.

Every key is checked before anything starts: an unknown key or a bad value fails with the key's
path (`sweep.batch_size[2]: expected a positive integer, got 0`), never deep inside a run.
The commented reference is benchmarks/sweeps/example.yaml; docs/benchmark.md explains each key.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from servekit.resources import resolve

# Words of `payloads.generate` texts: a small fixed vocabulary, or runs of English prose (the
# stdlib's docstrings) whose vocabulary is as varied as users' texts, so per-word caches and
# tokenizers meet new words as they do in service.
GENERATED_TEXT = ("vocabulary", "prose")


class SchemaError(ValueError):
    """A malformed benchmark YAML; the message starts with the key's path."""


# -- small checkers ----------------------------------------------------------------------------
def _keys(path: str, raw: Any, allowed: set[str], required: tuple[str, ...] = ()) -> dict[str, Any]:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SchemaError(f"{path or '<top>'}: expected a mapping, got {type(raw).__name__}")
    for k in raw:
        if not isinstance(k, str):
            raise SchemaError(f"{path or '<top>'}: keys must be strings, got {k!r}")
    unknown = sorted(set(raw) - allowed)
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise SchemaError(f"{where}: unknown key (allowed: {', '.join(sorted(allowed))})")
    for k in required:
        if k not in raw:
            raise SchemaError(f"{path}.{k}: required" if path else f"{k}: required")
    return raw


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _pos_int(path: str, v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise SchemaError(f"{path}: expected a positive integer, got {v!r}")
    return v


def _nonneg_int(path: str, v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise SchemaError(f"{path}: expected a non-negative integer, got {v!r}")
    return v


def _pos_num(path: str, v: Any) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or v != v or v == float("inf"):
        raise SchemaError(f"{path}: expected a positive number, got {v!r}")
    return float(v)


def _nonneg_num(path: str, v: Any) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0 or v == float("inf"):
        raise SchemaError(f"{path}: expected a non-negative number, got {v!r}")
    return float(v)


def _fraction(path: str, v: Any, open_zero: bool = False) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (0 < v < 1 if open_zero else 0 <= v < 1):
        raise SchemaError(f"{path}: expected a number in {'(0, 1)' if open_zero else '[0, 1)'}, got {v!r}")
    return float(v)


def _choice(path: str, v: Any, choices: tuple[str, ...]) -> str:
    if v not in choices:
        raise SchemaError(f"{path}: {v!r} is not one of {', '.join(choices)}")
    return v


def _str(path: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise SchemaError(f"{path}: expected a non-empty string, got {v!r}")
    return v


def _bool(path: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise SchemaError(f"{path}: expected true or false, got {v!r}")
    return v


def _list(path: str, v: Any, item, nonempty: bool = True) -> tuple:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        v = [v]
    if not isinstance(v, list) or (nonempty and not v):
        raise SchemaError(f"{path}: expected a non-empty list, got {v!r}")
    return tuple(item(f"{path}[{i}]", x) for i, x in enumerate(v))


def _url(path: str, v: Any) -> str:
    v = _str(path, v)
    if not re.match(r"^https?://[^/\s]+", v):
        raise SchemaError(f"{path}: expected an http(s):// URL, got {v!r}")
    return v.rstrip("/")


def _path(path: str, v: Any, base: Path, must_exist: bool = True) -> Path:
    """A path from the file: relative to `base`, or else the packaged file of that project-relative
    name (`config/config.properties`, `benchmarks/payloads/texts.jsonl`) for the ones read."""
    p = Path(_str(path, v)).expanduser()
    p = resolve(p, base).resolve() if must_exist else (p if p.is_absolute() else (base / p).resolve())
    if must_exist and not p.exists():
        raise SchemaError(f"{path}: {p} does not exist")
    return p


NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


# -- dataclasses -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LocalTarget:
    config: Path
    extra_props: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RemoteTarget:
    inference_url: str
    management_url: str
    metrics_url: str | None = None
    model_store: Path | None = None  # a folder the remote server reads, when archives must be built


@dataclass(frozen=True)
class Target:
    local: LocalTarget | None
    remote: RemoteTarget | None
    ready_timeout_s: float = 600.0
    keep_models: bool = False  # leave the last registered model on the server (remote use)


@dataclass(frozen=True)
class Axes:
    workers: tuple[int, ...] = (1,)
    batch_size: tuple[int, ...] = (1,)
    max_batch_delay_ms: tuple[int, ...] = (5,)
    # Texts per request: the payloads' texts regrouped into requests of each size (embedding
    # sweeps); empty: the bodies as given.
    texts_per_request: tuple[int, ...] = ()


@dataclass(frozen=True)
class Variant:
    name: str
    model: str | None  # bundled model name (bench.archives.BENCH_SPECS) or a model folder's path, to build from
    mar: str | None    # or an archive already in the server's model store
    config: Path | None
    overrides: dict[str, Any]
    plan: dict[str, Any]
    baseline: bool
    axes: Axes  # the sweep axes for this variant (the global sweep unless the variant fixes its own)
    description: str = ""
    speculator: Path | None = None  # trained speculator heads packed into the archive (servekit.speculation)


STREAMS = ("none", "sse")


@dataclass(frozen=True)
class Request:
    path: str = "/predictions/{model}"
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    stream: str = "none"  # sse: answers are server-sent events (LLM streaming): TTFT, ITL, tokens/s


@dataclass(frozen=True)
class Payloads:
    file: Path | None = None
    body: Any = None
    generate: dict[str, Any] | None = None  # {words: [..], weights: [..], count, seed, field, text}
    # Streamed chat bodies from benchmarks/llm_prompts.py: {set, count, seed, max_tokens, max_seq_len,
    # tokenizer (None: lengths estimated from words; "smollm2": the bundled model's; else a path)}
    chat: dict[str, Any] | None = None
    set_keys: dict[str, Any] = field(default_factory=dict)  # top-level keys set in every body


@dataclass(frozen=True)
class Search:
    enabled: bool = True
    start: float | None = None  # None: from a closed-loop saturation probe
    growth: float = 2.0
    precision: float = 0.1
    max_points: int = 8
    max_level: float = 1e6
    # After the sweep, the winner's and the baseline's bracket is bisected again to this precision
    # (None: no refinement), with at most `refine_points` more points each.
    refine_precision: float | None = None
    refine_points: int = 6


@dataclass(frozen=True)
class Load:
    mode: str = "open"        # open: arrival rate (requests/s); closed: concurrent users
    arrival: str = "poisson"  # open loop only: poisson or constant
    levels: tuple[float, ...] = ()
    search: Search = field(default_factory=Search)
    processes: int | None = None  # None: auto
    rps_per_process: float = 800.0
    users_per_process: int = 256
    timeout_s: float = 30.0
    max_inflight: int = 4096


@dataclass(frozen=True)
class SLA:
    p99_ms: float
    p50_ms: float | None = None
    max_error_rate: float = 0.01
    ttft_p99_ms: float | None = None  # streamed requests: time to first token
    itl_p99_ms: float | None = None   # streamed requests: per-request mean inter-token latency


@dataclass(frozen=True)
class Measurement:
    warmup_s: float = 3.0
    window_s: float = 5.0
    tolerance: float = 0.10
    tail_tolerance: float = 0.25
    stable_windows: int = 3
    max_trials: int = 6
    repeats: int = 1
    budget_s: float | None = None
    settle_s: float = 0.5
    min_window_requests: int = 20  # windows are lengthened (up to 4x) to hold at least this many
    inprocess_s: float = 0.0  # > 0: time the winner's plan in-process (on this machine) for this long


@dataclass(frozen=True)
class Deploy:
    target_rps: float | None = None
    headroom: float = 0.8
    warmup_seconds: float | None = None


@dataclass(frozen=True)
class BenchConfig:
    name: str
    target: Target
    variants: tuple[Variant, ...]
    strategy: str
    request: Request
    payloads: Payloads
    load: Load
    sla: SLA
    measurement: Measurement
    deploy: Deploy
    output_dir: Path
    source: Path | None = None

    @property
    def baseline(self) -> Variant | None:
        return next((v for v in self.variants if v.baseline), None)

    @property
    def streamed(self) -> bool:
        return self.request.stream == "sse"


# -- parsing -----------------------------------------------------------------------------------
def _axes(path: str, raw: Any, default: Axes) -> Axes:
    raw = _keys(path, raw, {"workers", "batch_size", "max_batch_delay_ms", "texts_per_request"})
    def axis(key: str, item) -> tuple[int, ...]:
        if key not in raw:
            return getattr(default, key)
        values = _list(_join(path, key), raw[key], item)
        if len(set(values)) != len(values):
            raise SchemaError(f"{_join(path, key)}: duplicate values in {list(values)}")
        return values
    return Axes(workers=axis("workers", _pos_int), batch_size=axis("batch_size", _pos_int),
                max_batch_delay_ms=axis("max_batch_delay_ms", _nonneg_int),
                texts_per_request=axis("texts_per_request", _pos_int))


def _target(raw: Any, base: Path) -> Target:
    raw = _keys("target", raw, {"local", "remote", "ready_timeout_s", "keep_models"})
    if ("local" in raw) == ("remote" in raw):
        raise SchemaError("target: give exactly one of `local` (start TorchServe from config/) or `remote` (URLs)")
    local = remote = None
    if "local" in raw:
        lr = _keys("target.local", raw["local"], {"config", "extra_props"})
        props = _keys("target.local.extra_props", lr.get("extra_props"), set(lr.get("extra_props") or {}))
        local = LocalTarget(_path("target.local.config", lr.get("config", "config/config.properties"), base),
                            {str(k): str(v) for k, v in props.items()})
    else:
        rr = _keys("target.remote", raw["remote"], {"inference_url", "management_url", "metrics_url", "model_store"},
                   ("inference_url", "management_url"))
        remote = RemoteTarget(_url("target.remote.inference_url", rr["inference_url"]),
                              _url("target.remote.management_url", rr["management_url"]),
                              _url("target.remote.metrics_url", rr["metrics_url"]) if rr.get("metrics_url") else None,
                              _path("target.remote.model_store", rr["model_store"], base) if rr.get("model_store") else None)
    return Target(local, remote,
                  _pos_num("target.ready_timeout_s", raw.get("ready_timeout_s", 600)),
                  _bool("target.keep_models", raw.get("keep_models", False)))


def _variants(raw: Any, axes: Axes, base: Path, remote_without_store: bool) -> tuple[Variant, ...]:
    if not isinstance(raw, list) or not raw:
        raise SchemaError("variants: expected a non-empty list of variants")
    out: list[Variant] = []
    for i, rv in enumerate(raw):
        p = f"variants[{i}]"
        rv = _keys(p, rv, {"name", "model", "mar", "config", "overrides", "plan", "baseline", "sweep", "description",
                           "speculator"}, ("name",))
        name = _str(f"{p}.name", rv["name"])
        if not NAME_RE.match(name):
            raise SchemaError(f"{p}.name: {name!r} must be letters, digits, '.', '_' or '-' (it becomes a model name)")
        if name in {v.name for v in out}:
            raise SchemaError(f"{p}.name: duplicate variant name {name!r}")
        if ("model" in rv) == ("mar" in rv):
            raise SchemaError(f"{p}: give exactly one of `model` (an archive spec to build) or `mar` (an archive "
                              "already in the model store)")
        model = mar = None
        if "model" in rv:
            from servekit.benchmarks.bench.archives import BENCH_SPECS, model_spec
            model = _str(f"{p}.model", rv["model"])
            if model not in BENCH_SPECS:  # a model folder, as `servekit archive PATH` takes
                folder = (base / model).resolve()
                if not folder.is_dir():
                    raise SchemaError(f"{p}.model: {model!r} is neither a bundled model ({', '.join(sorted(BENCH_SPECS))}) "
                                      f"nor a model folder ({folder} does not exist; archive a .gguf file with "
                                      "`servekit archive` and name the .mar with `mar`)")
                model = str(folder)
                try:
                    model_spec(model)
                except (ValueError, FileNotFoundError) as e:
                    raise SchemaError(f"{p}.model: {e}") from None
            if remote_without_store:
                raise SchemaError(f"{p}.model: a remote target needs `target.remote.model_store` to build archives "
                                  "into; or name an existing archive with `mar`")
        else:
            mar = _str(f"{p}.mar", rv["mar"])
            for key in ("config", "overrides", "plan", "speculator"):
                if key in rv:
                    raise SchemaError(f"{p}.{key}: only for variants built from `model`")
        overrides = _keys(f"{p}.overrides", rv.get("overrides"), set(rv.get("overrides") or {}))
        from servekit.benchmarks.bench.archives import FRONTEND_SWEPT
        for k in overrides:
            if k in FRONTEND_SWEPT:
                raise SchemaError(f"{p}.overrides.{k}: set by the sweep (workers, batch_size, max_batch_delay_ms), "
                                  "not in the archive")
            if k == "servekit":
                raise SchemaError(f"{p}.overrides.servekit: put plan keys under `{p}.plan`")
        plan = _keys(f"{p}.plan", rv.get("plan"), set(rv.get("plan") or {}))
        config = _path(f"{p}.config", rv["config"], base) if rv.get("config") else None
        # Not checked for existence here: heads are often trained after the sweep file is written.
        speculator = _path(f"{p}.speculator", rv["speculator"], base, must_exist=False) if "speculator" in rv else None
        variant_axes = _axes(f"{p}.sweep", rv.get("sweep"), axes)
        if model is not None:
            merged = _check_plan(p, model, config, dict(overrides), dict(plan), speculator)
            if merged.get("continuousBatching") is True and max(variant_axes.workers) > 1:
                from servekit.handlers.common import CONTINUOUS_ONE_WORKER
                raise SchemaError(f"{p}: sweeps workers {list(variant_axes.workers)} over a continuous-batching model; "
                                  f"{CONTINUOUS_ONE_WORKER}: give it `sweep: {{workers: [1]}}`")
        out.append(Variant(
            name=name, model=model, mar=mar, config=config,
            overrides=dict(overrides), plan=dict(plan),
            baseline=_bool(f"{p}.baseline", rv.get("baseline", False)),
            axes=variant_axes,
            description=str(rv.get("description", "")),
            speculator=speculator,
        ))
    if sum(v.baseline for v in out) > 1:
        raise SchemaError("variants: at most one variant may be `baseline: true`")
    return tuple(out)


def _check_plan(p: str, model: str, config: Path | None, overrides: dict[str, Any], plan: dict[str, Any],
                speculator: Path | None) -> dict[str, Any]:
    """The variant's merged `servekit:` section, validated by the parser its handler uses; and
    speculator heads given exactly when that section asks for speculation. Returns the merged
    model-config."""
    from servekit.benchmarks.bench.archives import model_plan_parser, variant_config
    from servekit.optimizations.plan import PlanError
    try:
        merged = variant_config(model, config, overrides, plan)
    except (OSError, yaml.YAMLError) as e:
        raise SchemaError(f"{p}.config: cannot read the model-config: {e}") from None
    section = merged.get("servekit")
    parser = model_plan_parser(model)
    if section is not None and parser is not None:
        try:
            parser(section, f"{p}.plan")
        except PlanError as e:
            raise SchemaError(str(e)) from None
    asks = isinstance(section, dict) and section.get("speculation") is not None
    if speculator is not None and not asks:
        raise SchemaError(f"{p}.speculator: the variant's plan has no `speculation` section to use the heads "
                          f"(add e.g. `plan: {{speculation: {{n_heads: 2}}}}`)")
    if asks and speculator is None:
        raise SchemaError(f"{p}.speculator: required: the variant's plan has a `speculation` section; give the "
                          "folder written by `servekit train-speculator --out DIR`")
    return merged


def _load(raw: Any) -> Load:
    raw = _keys("load", raw, {"mode", "arrival", "levels", "search", "processes", "rps_per_process",
                              "users_per_process", "timeout_s", "max_inflight"})
    mode = _choice("load.mode", raw.get("mode", "open"), ("open", "closed"))
    item = _pos_num if mode == "open" else _pos_int
    levels = _list("load.levels", raw["levels"], item, nonempty=False) if raw.get("levels") is not None else ()
    if list(levels) != sorted(set(levels)):
        raise SchemaError(f"load.levels: values must be strictly increasing, got {list(levels)}")
    s = raw.get("search", True)
    if isinstance(s, bool):
        search = Search(enabled=s)
    else:
        s = _keys("load.search", s, {"start", "growth", "precision", "max_points", "max_level", "refine"})
        refine = _keys("load.search.refine", s.get("refine") or {}, {"precision", "max_points"})
        start = s.get("start", "auto")
        search = Search(
            enabled=True,
            start=None if start == "auto" else (_pos_num("load.search.start", start) if mode == "open"
                                                 else float(_pos_int("load.search.start", start))),
            growth=_pos_num("load.search.growth", s.get("growth", 2.0)),
            precision=_fraction("load.search.precision", s.get("precision", 0.1), open_zero=True),
            max_points=_pos_int("load.search.max_points", s.get("max_points", 8)),
            max_level=_pos_num("load.search.max_level", s.get("max_level", 1e6)),
            refine_precision=(_fraction("load.search.refine.precision", refine["precision"], open_zero=True)
                              if "precision" in refine else None),
            refine_points=_pos_int("load.search.refine.max_points", refine.get("max_points", 6)),
        )
        if refine and search.refine_precision is None:
            raise SchemaError("load.search.refine: give `precision` (e.g. 0.03)")
        if search.refine_precision is not None and search.refine_precision >= search.precision:
            raise SchemaError(f"load.search.refine.precision: must be finer than load.search.precision "
                              f"({search.precision}), got {search.refine_precision}")
        if search.growth <= 1:
            raise SchemaError(f"load.search.growth: expected a number > 1, got {search.growth}")
    if not search.enabled and not levels:
        raise SchemaError("load: with `search: false` give `levels` to measure")
    processes = raw.get("processes", "auto")
    return Load(
        mode=mode,
        arrival=_choice("load.arrival", raw.get("arrival", "poisson"), ("poisson", "constant")),
        levels=levels, search=search,
        processes=None if processes == "auto" else _pos_int("load.processes", processes),
        rps_per_process=_pos_num("load.rps_per_process", raw.get("rps_per_process", 800)),
        users_per_process=_pos_int("load.users_per_process", raw.get("users_per_process", 256)),
        timeout_s=_pos_num("load.timeout_s", raw.get("timeout_s", 30)),
        max_inflight=_pos_int("load.max_inflight", raw.get("max_inflight", 4096)),
    )


def _payloads(raw: Any, base: Path) -> Payloads:
    from servekit.benchmarks.llm_prompts import SETS

    raw = _keys("payloads", raw, {"file", "body", "generate", "chat", "set"})
    given = [k for k in ("file", "body", "generate", "chat") if k in raw]
    if len(given) != 1:
        raise SchemaError("payloads: give exactly one of `file` (JSONL, one request body per line), `body` "
                          "(one fixed body), `generate` (synthetic texts) or `chat` (generated chat prompts)")
    set_keys = dict(_keys("payloads.set", raw.get("set"), set(raw.get("set") or {})))
    if "file" in raw:
        return Payloads(file=_path("payloads.file", raw["file"], base), set_keys=set_keys)
    if "body" in raw:
        return Payloads(body=raw["body"], set_keys=set_keys)
    if "chat" in raw:
        c = _keys("payloads.chat", raw["chat"], {"set", "count", "seed", "max_tokens", "max_seq_len", "tokenizer"},
                  ("set",))
        tok = c.get("tokenizer")
        if tok is not None and tok != "smollm2":
            tok = _path("payloads.chat.tokenizer", tok, base)
        return Payloads(chat={"set": _choice("payloads.chat.set", c["set"], tuple(s for s in SETS if s != "conversation")),
                              "count": _pos_int("payloads.chat.count", c.get("count", 1000)),
                              "seed": _nonneg_int("payloads.chat.seed", c.get("seed", 0)),
                              "max_tokens": _pos_int("payloads.chat.max_tokens", c.get("max_tokens", 256)),
                              "max_seq_len": _pos_int("payloads.chat.max_seq_len", c.get("max_seq_len", 2048)),
                              "tokenizer": tok}, set_keys=set_keys)
    g = _keys("payloads.generate", raw["generate"], {"words", "weights", "count", "seed", "field", "text"}, ("words",))
    words = _list("payloads.generate.words", g["words"], _pos_int)
    weights = _list("payloads.generate.weights", g["weights"], _pos_num) if "weights" in g else (1.0,) * len(words)
    if len(weights) != len(words):
        raise SchemaError(f"payloads.generate.weights: {len(weights)} weights for {len(words)} lengths")
    return Payloads(generate={"words": list(words), "weights": list(weights),
                              "count": _pos_int("payloads.generate.count", g.get("count", 200)),
                              "seed": _nonneg_int("payloads.generate.seed", g.get("seed", 0)),
                              "field": _str("payloads.generate.field", g.get("field", "text")),
                              "text": _choice("payloads.generate.text", g.get("text", "vocabulary"), GENERATED_TEXT)},
                    set_keys=set_keys)


def _measurement(raw: Any) -> Measurement:
    raw = _keys("measurement", raw, {"warmup_s", "window_s", "tolerance", "tail_tolerance", "stable_windows",
                                     "max_trials", "repeats", "budget_s", "settle_s",
                                     "min_window_requests", "inprocess_s"})
    m = Measurement(
        warmup_s=_nonneg_num("measurement.warmup_s", raw.get("warmup_s", 3.0)),
        window_s=_pos_num("measurement.window_s", raw.get("window_s", 5.0)),
        tolerance=_fraction("measurement.tolerance", raw.get("tolerance", 0.10), open_zero=True),
        tail_tolerance=_fraction("measurement.tail_tolerance", raw.get("tail_tolerance", 0.25), open_zero=True),
        stable_windows=_pos_int("measurement.stable_windows", raw.get("stable_windows", 3)),
        max_trials=_pos_int("measurement.max_trials", raw.get("max_trials", 6)),
        repeats=_pos_int("measurement.repeats", raw.get("repeats", 1)),
        budget_s=_pos_num("measurement.budget_s", raw["budget_s"]) if raw.get("budget_s") is not None else None,
        settle_s=_nonneg_num("measurement.settle_s", raw.get("settle_s", 0.5)),
        min_window_requests=_pos_int("measurement.min_window_requests", raw.get("min_window_requests", 20)),
        inprocess_s=_nonneg_num("measurement.inprocess_s", raw.get("inprocess_s", 0.0)),
    )
    if m.max_trials < m.stable_windows:
        raise SchemaError(f"measurement.max_trials: {m.max_trials} is fewer than stable_windows ({m.stable_windows})")
    return m


def _sla(raw: Any, streamed: bool) -> SLA:
    raw = _keys("sla", raw, {"p99_ms", "p50_ms", "max_error_rate", "ttft_p99_ms", "itl_p99_ms"}, ("p99_ms",))
    def optional(key: str) -> float | None:
        return _pos_num(f"sla.{key}", raw[key]) if raw.get(key) is not None else None
    for key in ("ttft_p99_ms", "itl_p99_ms"):
        if raw.get(key) is not None and not streamed:
            raise SchemaError(f"sla.{key}: only for streamed requests (set `request.stream: sse`)")
    sla = SLA(_pos_num("sla.p99_ms", raw["p99_ms"]), optional("p50_ms"),
              _fraction("sla.max_error_rate", raw.get("max_error_rate", 0.01)),
              optional("ttft_p99_ms"), optional("itl_p99_ms"))
    if sla.p50_ms is not None and sla.p50_ms > sla.p99_ms:
        raise SchemaError(f"sla.p50_ms: {sla.p50_ms} is above sla.p99_ms ({sla.p99_ms})")
    return sla


def parse_config(raw: Any, base: Path | None = None, source: Path | None = None) -> BenchConfig:
    """Validate a parsed benchmark YAML. Relative paths are resolved against `base` (default: the
    current directory), files read falling back to servekit's packaged ones."""
    base = Path.cwd() if base is None else base
    raw = _keys("", raw, {"name", "target", "variants", "sweep", "strategy", "request", "payloads", "load", "sla",
                          "measurement", "deploy", "output"}, ("name", "target", "variants", "payloads", "sla"))
    name = _str("name", raw["name"])
    if not NAME_RE.match(name):
        raise SchemaError(f"name: {name!r} must be letters, digits, '.', '_' or '-'")
    target = _target(raw["target"], base)
    axes = _axes("sweep", raw.get("sweep"), Axes())
    variants = _variants(raw["variants"], axes, base,
                         remote_without_store=target.remote is not None and target.remote.model_store is None)
    req = _keys("request", raw.get("request"), {"path", "content_type", "headers", "stream"})
    path = _str("request.path", req.get("path", "/predictions/{model}"))
    if not path.startswith("/"):
        raise SchemaError(f"request.path: must start with '/', got {path!r}")
    headers = _keys("request.headers", req.get("headers"), set(req.get("headers") or {}))
    request = Request(path, _str("request.content_type", req.get("content_type", "application/json")),
                      {str(k): str(v) for k, v in headers.items()},
                      _choice("request.stream", req.get("stream", "none"), STREAMS))
    sla = _sla(raw["sla"], streamed=request.stream == "sse")
    if request.stream == "sse" and any(v.axes.texts_per_request for v in variants):
        raise SchemaError("sweep.texts_per_request: regroups the texts of embedding requests; a streamed (LLM) "
                          "sweep has none")
    dep = _keys("deploy", raw.get("deploy"), {"target_rps", "headroom", "warmup_seconds"})
    headroom = dep.get("headroom", 0.8)
    if not isinstance(headroom, (int, float)) or isinstance(headroom, bool) or not 0 < headroom <= 1:
        raise SchemaError(f"deploy.headroom: expected a number in (0, 1], got {headroom!r}")
    deploy = Deploy(_pos_num("deploy.target_rps", dep["target_rps"]) if dep.get("target_rps") is not None else None,
                    float(headroom),
                    _pos_num("deploy.warmup_seconds", dep["warmup_seconds"]) if dep.get("warmup_seconds") is not None
                    else None)
    out = _keys("output", raw.get("output"), {"dir"})
    return BenchConfig(
        name=name, target=target, variants=variants,
        strategy=_choice("strategy", raw.get("strategy", "grid"), ("grid", "staged")),
        request=request, payloads=_payloads(raw["payloads"], base), load=_load(raw.get("load")), sla=sla,
        measurement=_measurement(raw.get("measurement")), deploy=deploy,
        output_dir=_path("output.dir", out.get("dir", "bench-runs"), base, must_exist=False),
        source=source,
    )


def load_config(path: Path) -> BenchConfig:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise SchemaError(f"{path}: not valid YAML: {e}") from None
    return parse_config(raw, Path.cwd(), path.resolve())
