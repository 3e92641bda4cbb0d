"""The optimization plan: the `servekit:` section of a model-config YAML, validated once at load.

Every key is checked here, so a typo fails with the key's path instead of deep inside a run.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, TypeVar

PRECISIONS = ("fp32", "fp16", "bf16")
QUANTIZATIONS = ("none", "int8_weight_only", "int8_dynamic", "int4_weight_only", "float8_dynamic")
COMPILE_MODES = ("off", "default", "max-autotune", "max-autotune-no-cudagraphs")
ATTENTION = ("auto", "math", "flash", "efficient", "cudnn")
DEVICES = ("auto", "cpu", "cuda")
FALLBACKS = ("error", "eager")
TOO_LONG = ("truncate", "reject")

# Accuracy-gate defaults: minimum mean cosine similarity to the fp32 eager reference.
DEFAULT_MIN_COSINE = {"fp32": 0.9999, "fp16": 0.999, "bf16": 0.999, "quantized": 0.99}


class PlanError(ValueError):
    """A plan that is malformed, or that cannot run on this device."""


@dataclass(frozen=True)
class Buckets:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    # Empty: powers of two up to the model's own length limit, chosen when the model loads.
    seq_lens: tuple[int, ...] = ()

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    @property
    def max_seq(self) -> int:
        return self.seq_lens[-1]

    def shapes(self) -> list[tuple[int, int]]:
        """Every (batch, seq) bucket, largest first (so smaller graphs reuse the memory pool)."""
        return [(b, s) for b in reversed(self.batch_sizes) for s in reversed(self.seq_lens)]


@dataclass(frozen=True)
class Limits:
    max_texts_per_request: int = 2048  # OpenAI's own limit for an embeddings input list
    max_chars_per_text: int = 100_000
    too_long: str = "truncate"  # inputs over the largest seq bucket: truncate, or 413 for that request


@dataclass(frozen=True)
class Plan:
    device: str = "auto"
    precision: str = "fp32"
    quantization: str = "none"
    compile: str = "off"
    cuda_graphs: bool = False
    attention: str = "auto"
    buckets: Buckets = field(default_factory=Buckets)
    warmup: bool = True
    compile_cache: str | None = None
    fallback: str = "error"
    min_cosine: float | None = None
    limits: Limits = field(default_factory=Limits)
    # Threads that tokenize a batch (the tokenizer's own parallelism). None: one per GPU worker
    # (several workers share the host's cores), the library's default (every core) on CPU.
    tokenizer_threads: int | None = None
    # torch's intra-op threads per worker. None: one per GPU worker, torch's default (every core) on
    # CPU; several CPU workers on one host each want their share of the cores, or their thread pools
    # oversubscribe them.
    threads: int | None = None
    # Whitespace-delimited segments whose token ids each worker keeps (optimizations/embed/segment_cache.py);
    # 0 sends every text through the tokenizer's whole pipeline.
    tokenizer_cache: int = 200_000

    @property
    def accuracy_threshold(self) -> float:
        if self.min_cosine is not None:
            return self.min_cosine
        if self.quantization != "none":
            return DEFAULT_MIN_COSINE["quantized"]
        return DEFAULT_MIN_COSINE[self.precision]

    def label(self) -> str:
        """Short, stable description used in logs, metric labels and reports."""
        parts = [self.precision]
        if self.quantization != "none":
            parts.append(self.quantization)
        if self.compile != "off":
            parts.append(f"compile-{self.compile}")
        if self.cuda_graphs:
            parts.append("cudagraphs")
        if self.attention != "auto":
            parts.append(f"sdpa-{self.attention}")
        return "+".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_choice(path: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise PlanError(f"{path}: {value!r} is not one of {', '.join(choices)}")
    return value


def check_keys(path: str, raw: Any, allowed: set[str]) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise PlanError(f"{path}: expected a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise PlanError(f"{path}.{unknown[0]}: unknown key (allowed: {', '.join(sorted(allowed))})")
    return raw


def int_list(path: str, raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, list) or not raw:
        raise PlanError(f"{path}: expected a non-empty list of positive integers")
    for i, v in enumerate(raw):
        positive_int(f"{path}[{i}]", v)
    if sorted(set(raw)) != list(raw):
        raise PlanError(f"{path}: values must be strictly increasing, got {raw}")
    return tuple(raw)


def _int_at_least(path: str, v: Any, low: int, expected: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise PlanError(f"{path}: expected {expected}, got {v!r}")
    return v


def positive_int(path: str, v: Any) -> int:
    return _int_at_least(path, v, 1, "a positive integer")


def parse_plan(raw: Any, path: str = "servekit") -> Plan:
    """Validate the `servekit:` mapping of a model-config YAML into a Plan."""
    fields = {f.name for f in dataclasses.fields(Plan)}
    raw = check_keys(path, raw, fields)
    kw: dict[str, Any] = {}
    for key in ("device", "precision", "quantization", "compile", "attention", "fallback"):
        if key in raw:
            choices = {"device": DEVICES, "precision": PRECISIONS, "quantization": QUANTIZATIONS,
                       "compile": COMPILE_MODES, "attention": ATTENTION, "fallback": FALLBACKS}[key]
            kw[key] = check_choice(f"{path}.{key}", raw[key], choices)
    kw.update(check_bools(path, raw, ("cuda_graphs", "warmup")))
    if raw.get("compile_cache") is not None:
        if not isinstance(raw["compile_cache"], str) or not raw["compile_cache"]:
            raise PlanError(f"{path}.compile_cache: expected a directory path")
        kw["compile_cache"] = raw["compile_cache"]
    for key in ("tokenizer_threads", "threads"):
        if raw.get(key) is not None:
            kw[key] = positive_int(f"{path}.{key}", raw[key])
    if "tokenizer_cache" in raw:
        kw["tokenizer_cache"] = _int_at_least(f"{path}.tokenizer_cache", raw["tokenizer_cache"], 0,
                                              "a number of entries >= 0 (0: off)")
    if raw.get("min_cosine") is not None:
        v = raw["min_cosine"]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 < v <= 1.0:
            raise PlanError(f"{path}.min_cosine: expected a number in (0, 1], got {v!r}")
        kw["min_cosine"] = float(v)
    if "buckets" in raw:
        b = check_keys(f"{path}.buckets", raw["buckets"], {"batch_sizes", "seq_lens"})
        defaults = Buckets()
        kw["buckets"] = Buckets(
            batch_sizes=int_list(f"{path}.buckets.batch_sizes", b["batch_sizes"]) if "batch_sizes" in b else defaults.batch_sizes,
            seq_lens=int_list(f"{path}.buckets.seq_lens", b["seq_lens"]) if "seq_lens" in b else defaults.seq_lens,
        )
    if "limits" in raw:
        lim = check_keys(f"{path}.limits", raw["limits"], {f.name for f in dataclasses.fields(Limits)})
        d = Limits()
        kw["limits"] = Limits(
            max_texts_per_request=positive_int(f"{path}.limits.max_texts_per_request",
                                                lim.get("max_texts_per_request", d.max_texts_per_request)),
            max_chars_per_text=positive_int(f"{path}.limits.max_chars_per_text",
                                             lim.get("max_chars_per_text", d.max_chars_per_text)),
            too_long=check_choice(f"{path}.limits.too_long", lim.get("too_long", d.too_long), TOO_LONG),
        )
    plan = Plan(**kw)
    if plan.cuda_graphs and plan.compile in ("max-autotune",):
        raise PlanError(f"{path}.compile: 'max-autotune' captures its own CUDA graphs; with "
                        "cuda_graphs: true use 'max-autotune-no-cudagraphs' or 'default'")
    return plan


# Any plan dataclass with device, precision, cuda_graphs and fallback keys.
PlanT = TypeVar("PlanT")


def check_bools(path: str, raw: dict[str, Any], keys: tuple[str, ...]) -> dict[str, bool]:
    """The given boolean keys of a plan mapping that are present; PlanError naming a non-boolean one."""
    out = {}
    for key in keys:
        if key in raw:
            if not isinstance(raw[key], bool):
                raise PlanError(f"{path}.{key}: expected true or false, got {raw[key]!r}")
            out[key] = raw[key]
    return out


def triton_problem(device_type: str) -> str | None:
    """Why the fused Triton decode kernels (``kernels: triton``) cannot run here, or None."""
    if importlib.util.find_spec("triton") is None:
        return "kernels: triton needs the triton package (CUDA builds of torch bring it)"
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"kernels: triton needs a CUDA device, this one is {device_type} (only the Triton interpreter, "
                "TRITON_INTERPRET=1, runs the kernels elsewhere: slowly, for tests)")
    return None


def resolve_for_device(plan: PlanT, device_type: str, capability: tuple[int, int] | None
                       ) -> tuple[PlanT, list[str]]:
    """Check a plan (an embedding `Plan` or an `LlmPlan`: the keys it has) against the device.
    Returns the effective plan and the downgrades made.

    An unsupported choice raises PlanError unless the plan says `fallback: eager`, in which case
    the choice is dropped (and reported) so the model still serves.
    """
    problems: list[tuple[str, dict[str, Any]]] = []
    if plan.cuda_graphs and device_type != "cuda":
        problems.append(("cuda_graphs needs a CUDA device", {"cuda_graphs": False}))
    if plan.precision == "fp16" and device_type == "cpu":
        problems.append(("fp16 on CPU is slow and unsupported by several kernels; use bf16 or fp32",
                         {"precision": "fp32"}))
    quantization = getattr(plan, "quantization", "none")
    if quantization == "int4_weight_only" and device_type != "cuda":
        problems.append(("int4_weight_only needs a CUDA device (torchao tinygemm kernels)",
                         {"quantization": "none"}))
    if quantization == "float8_dynamic" and (device_type != "cuda" or (capability or (0, 0)) < (8, 9)):
        problems.append((f"float8_dynamic needs compute capability >= 8.9 (device: {device_type}"
                         f"{'' if capability is None else ' %d.%d' % capability})", {"quantization": "none"}))
    if getattr(plan, "attention", "auto") in ("flash", "cudnn") and device_type != "cuda":
        problems.append((f"attention: {plan.attention} needs a CUDA device", {"attention": "auto"}))
    if getattr(plan, "kernels", "torch") == "triton" and (problem := triton_problem(device_type)) is not None:
        problems.append((problem, {"kernels": "torch"}))
    if not problems:
        return plan, []
    if plan.fallback != "eager":
        raise PlanError("; ".join(msg for msg, _ in problems) + " (set fallback: eager to serve anyway)")
    changes: dict[str, Any] = {}
    for _, change in problems:
        changes.update(change)
    return dataclasses.replace(plan, **changes), [msg for msg, _ in problems]
