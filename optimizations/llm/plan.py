"""An LLM's plan (the model-config's `servekit:` section) -> a warmed-up runner.

The runner is generate.py's ``LlamaRunner``, driven by the continuous engine (continuous.py); with a
``speculation`` section it also gets speculative.py's step strategy (speculator heads from the
archive), so the handler serves one runner whatever the plan.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from servekit.optimizations.device import DTYPES, capability, pick_device
from servekit.optimizations.llm.generate import KERNELS, LlamaRunner
from servekit.optimizations.models.llama import generation_stop_ids, load_config, load_llama
from servekit.optimizations.plan import (DEVICES, FALLBACKS, PRECISIONS, PlanError, check_bools, check_choice,
                                         check_keys, int_list, positive_int, resolve_for_device)
from servekit.optimizations.llm.speculative import DEFAULT_MAX_SPEC_BATCH, SPEC_CONFIG, SpeculativeDecoding, load_speculator

if TYPE_CHECKING:
    from servekit.optimizations.llm.chat_template import ChatTokenizer


@dataclass(frozen=True)
class LlmLimits:
    max_tokens: int = 1024  # the largest max_tokens a request may ask for
    default_max_tokens: int = 256  # when a request gives none (capped by the context left)


@dataclass(frozen=True)
class SpecPlan:
    """``servekit.speculation``: speculator heads packed in the archive (optimizations/llm/speculative.py)."""

    heads: str = "speculator"  # folder in the archive holding speculator.json + speculator.safetensors
    n_heads: int | None = None  # drafts per step (default: every trained head)
    max_batch: int = DEFAULT_MAX_SPEC_BATCH  # batches with more requests decode without speculation


@dataclass(frozen=True)
class LlmPlan:
    device: str = "auto"
    precision: str = "fp32"
    compile: str = "off"  # off | default | max-autotune-no-cudagraphs: prefill and decode, dynamic shapes
    cuda_graphs: bool = False  # decode steps captured per (batch, kv length, sampling mode)
    kernels: str = "torch"  # torch | triton: decode/verify steps through fused Triton kernels (optimizations/kernels/triton_decode.py)
    warmup: bool = True
    fallback: str = "error"  # error | eager: what to do when compile/graphs cannot be applied
    max_seq_len: int = 2048  # KV cache length: prompt + completion
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    prompt_lens: tuple[int, ...] | None = None  # the largest is the longest prompt accepted (default: max_seq_len - 1)
    kv_lens: tuple[int, ...] | None = None  # decode attention lengths (default: 256, 512, ... max_seq_len)
    limits: LlmLimits = field(default_factory=LlmLimits)
    cpu_threads: int | None = None  # torch intra-op threads on CPU (None: torch's default)
    speculation: SpecPlan | None = None  # None: plain decoding
    # Continuous batching: each step runs one packed forward of at most this many tokens: the
    # decoding rows' next tokens and prompt chunks (several prompts', no padding between them).
    max_num_batched_tokens: int = 2048
    prefill_chunk: int = 512  # ... of which one prompt takes at most this many while others wait for the budget
    # Reuse the K/V of prompt prefixes already computed (optimizations/llm/prefix_cache.py).
    prefix_caching: bool = True

    def label(self) -> str:
        parts = [self.precision]
        if self.compile != "off":
            parts.append(f"compile-{self.compile}")
        if self.kernels != "torch":
            parts.append(f"kernels-{self.kernels}")
        if self.cuda_graphs:
            parts.append("cudagraphs")
        if self.speculation is not None:
            parts.append(f"spec{self.speculation.n_heads or ''}")
        return "+".join(parts)


LLM_COMPILE_MODES = ("off", "default", "max-autotune-no-cudagraphs")


def parse_llm_plan(raw: object, path: str = "servekit") -> LlmPlan:
    """Validate the ``servekit:`` mapping of an LLM model-config; errors name the key."""
    raw = check_keys(path, raw, {"device", "precision", "compile", "cuda_graphs", "warmup", "fallback",
                                  "max_seq_len", "buckets", "limits", "cpu_threads", "speculation",
                                  "prefill_chunk", "max_num_batched_tokens", "kernels",
                                  "prefix_caching"})
    kw: dict[str, object] = {}
    for key, choices in (("device", DEVICES), ("precision", PRECISIONS), ("compile", LLM_COMPILE_MODES),
                         ("fallback", FALLBACKS), ("kernels", KERNELS)):
        if key in raw:
            kw[key] = check_choice(f"{path}.{key}", raw[key], choices)
    kw.update(check_bools(path, raw, ("cuda_graphs", "warmup", "prefix_caching")))
    for key in ("max_seq_len", "cpu_threads", "prefill_chunk", "max_num_batched_tokens"):
        if raw.get(key) is not None:
            kw[key] = positive_int(f"{path}.{key}", raw[key])
    budget = int(kw.get("max_num_batched_tokens", LlmPlan.max_num_batched_tokens))  # type: ignore[call-overload]
    chunk = int(kw.get("prefill_chunk", LlmPlan.prefill_chunk))  # type: ignore[call-overload]
    if budget < chunk:
        raise PlanError(f"{path}.max_num_batched_tokens: {budget} is below prefill_chunk {chunk} (the most one "
                        "prompt puts into a step)")
    max_seq = int(kw.get("max_seq_len", LlmPlan.max_seq_len))  # type: ignore[call-overload]
    buckets = check_keys(f"{path}.buckets", raw.get("buckets"), {"batch_sizes", "prompt_lens", "kv_lens"})
    for key in ("batch_sizes", "prompt_lens", "kv_lens"):
        if key in buckets:
            values = int_list(f"{path}.buckets.{key}", buckets[key])
            if key != "batch_sizes" and values[-1] > max_seq:
                raise PlanError(f"{path}.buckets.{key}: {values[-1]} exceeds max_seq_len {max_seq}")
            kw[key] = values
    lim = check_keys(f"{path}.limits", raw.get("limits"), {"max_tokens", "default_max_tokens"})
    limits = LlmLimits(**{k: positive_int(f"{path}.limits.{k}", v) for k, v in lim.items()})
    if "default_max_tokens" not in lim:
        limits = LlmLimits(limits.max_tokens, min(limits.max_tokens, LlmLimits.default_max_tokens))
    if limits.max_tokens >= max_seq:
        raise PlanError(f"{path}.limits.max_tokens: {limits.max_tokens} leaves no room for a prompt in "
                        f"max_seq_len {max_seq}")
    if limits.default_max_tokens > limits.max_tokens:
        raise PlanError(f"{path}.limits.default_max_tokens: {limits.default_max_tokens} exceeds "
                        f"limits.max_tokens {limits.max_tokens}")
    if raw.get("speculation") is not None:
        kw["speculation"] = _parse_spec_plan(raw["speculation"], f"{path}.speculation")
    return LlmPlan(**kw, limits=limits)  # type: ignore[arg-type]


def _parse_spec_plan(raw: object, path: str) -> SpecPlan:
    raw = check_keys(path, raw, {"heads", "n_heads", "max_batch"})
    kw: dict[str, object] = {}
    if "heads" in raw:
        heads = raw["heads"]
        if not isinstance(heads, str) or not heads or heads.startswith("/") or ".." in Path(heads).parts:
            raise PlanError(f"{path}.heads: expected a folder inside the archive, got {heads!r}")
        kw["heads"] = heads
    if raw.get("n_heads") is not None:
        kw["n_heads"] = positive_int(f"{path}.n_heads", raw["n_heads"])
    if "max_batch" in raw:  # 0 turns speculation off for every batch
        v = raw["max_batch"]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise PlanError(f"{path}.max_batch: expected an integer >= 0, got {v!r}")
        kw["max_batch"] = v
    return SpecPlan(**kw)  # type: ignore[arg-type]


def load_llm_runner(model_dir: str, plan: LlmPlan) -> tuple[LlamaRunner, LlmPlan, list[str]]:
    """Load the converted checkpoint in ``model_dir`` and build (and warm up) the plan's runner,
    with speculative decoding as its step strategy when the plan has a ``speculation`` section.

    Returns the runner, the effective plan and the downgrades made (only with ``fallback: eager``;
    otherwise anything the plan asks for that cannot be applied raises ``PlanError``).
    """
    device = pick_device(plan.device)
    plan, downgrades = resolve_for_device(plan, device.type, capability(device))
    if plan.cpu_threads and device.type == "cpu":
        torch.set_num_threads(plan.cpu_threads)
    try:  # before the weights: a context the model cannot serve fails at once
        load_config(model_dir).check_context(plan.max_seq_len)
    except ValueError as e:
        raise PlanError(f"servekit.max_seq_len: {e}") from None
    model = load_llama(model_dir, device, DTYPES[plan.precision])

    def build(p: LlmPlan) -> LlamaRunner:
        compiled = p.compile != "off"
        # With triton kernels, compile covers the packed prefill only: decode steps are the fused kernels.
        return LlamaRunner(model, p.max_seq_len, p.batch_sizes, p.prompt_lens, p.kv_lens,
                           compile_prefill=compiled, compile_decode=compiled and p.kernels == "torch",
                           cuda_graphs=p.cuda_graphs, compile_mode=p.compile if compiled else "default",
                           kernels=p.kernels)

    runner = build(plan)
    if plan.warmup:
        try:
            runner.warmup()
        except Exception as e:
            if plan.fallback != "eager" or (plan.compile == "off" and not plan.cuda_graphs and plan.kernels == "torch"):
                raise PlanError(f"warm-up of plan {plan.label()} failed: {type(e).__name__}: {e}") from e
            downgrades.append(f"warm-up of {plan.label()} failed ({type(e).__name__}: {e}); serving eager")
            plan = dataclasses.replace(plan, compile="off", cuda_graphs=False, kernels="torch")
            runner = build(plan)
            runner.warmup()
    if plan.speculation is not None:
        runner.speculation = _speculation(runner, Path(model_dir), plan)
        runner.plan["speculative"] = runner.speculation.plan
    if device.type == "cuda":
        # Scratch memory of loading and of every warm-up (plain and speculative) goes back to the
        # device (graphs keep their own pool): other workers on this GPU may use it, and serving
        # allocates only what it needs, so a request too large for the device fails alone.
        torch.cuda.empty_cache()
    return runner, plan, downgrades


def stop_token_ids(model_dir: str | Path, tokenizer: ChatTokenizer) -> tuple[int, ...]:
    """Every id that ends a generation: the eos ids of ``config.json`` and ``generation_config.json``
    (one id or a list each), the tokenizer's own eos token, and ``<|endoftext|>`` where the
    vocabulary has one (byte-level BPE vocabularies end documents with it; a chat model that
    emits it has nothing more to say)."""
    ids = set(generation_stop_ids(model_dir))
    ids.update(t for t in (tokenizer.eos_token_id, tokenizer.token_id("<|endoftext|>")) if t is not None)
    return tuple(sorted(ids))


def _speculation(runner: LlamaRunner, model_dir: Path, plan: LlmPlan) -> SpeculativeDecoding:
    """The archive's speculator heads as the warmed-up runner's step strategy (verify steps warmed)."""
    sp = plan.speculation
    assert sp is not None
    folder = model_dir / sp.heads
    if not (folder / SPEC_CONFIG).is_file():
        raise PlanError(f"servekit.speculation.heads: no {SPEC_CONFIG} in the archive folder {sp.heads!r} "
                        "(build the archive with --speculator DIR)")
    try:
        heads = load_speculator(folder)
        spec = SpeculativeDecoding(runner, heads, max_spec_batch=sp.max_batch, n_heads=sp.n_heads,
                                   compile_verify=plan.compile != "off")
    except ValueError as e:  # heads for another model, more heads asked for than trained, ...
        raise PlanError(f"servekit.speculation: {e}") from e
    if plan.warmup:
        spec.warmup()
    return spec
