"""Speculative decoding with MLP-speculator heads, verified exactly by the base model.

The heads (IBM's "MLP speculator" form, arXiv 2404.19124): stage ``j`` takes a state and the
embedding of the token before the one it guesses, and returns a new state and a guess::

    s_0 = h_t                                   (the base model's final, normed hidden state)
    s_j = s_{j-1} + W_out gelu(W_in [s_{j-1} ; norm(E x_{t+j})])
    guess_{t+j+1} = argmax(lm_head(norm_j(s_j)))

``E`` and ``lm_head`` are the base model's own (frozen, not stored with the heads), so a head is
two small matrices and two norm vectors: for SmolLM2-135M (dim 576, hidden 1152) 2 M parameters
per head, 32 MiB of fp32 safetensors for 4 heads. At serving time stage 1 gets the token the base
model has just chosen, later stages the previous stage's guess.

One decoding step (``verify_step``), for every row of a batch at once:

1. feed ``[x, d_1 .. d_k]`` (the last chosen token and k drafts) at positions ``p .. p+k``: one
   forward pass of the base model over k+1 tokens, which writes k+1 KV-cache slots;
2. ``g_j = argmax`` of the base logits at each of those positions; draft ``d_j`` is accepted while
   ``d_1..d_j == g_0..g_{j-1}`` (the longest matching prefix), say ``a`` of them;
3. the row emits ``g_0 .. g_a`` (a+1 tokens): exactly the tokens plain greedy decoding would have
   produced one by one, since each ``g_j`` was computed from a prefix of accepted tokens only;
4. the heads draft the next k tokens from the hidden state at position ``p+a`` and ``g_a``.

KV cache: nothing is copied or rolled back. Slots ``p+a+1 .. p+k`` hold the rejected drafts'
keys/values, and the next step writes its k+1 tokens starting at ``p+a+1``, so it overwrites all
of them before anything reads them (a token at position q attends to slots ``0..q`` only).

Sampled requests (temperature > 0) do not speculate: they are forced to accept 0 drafts and their
token at each step is sampled from the logits of the first position with the same per-(seed,
position) noise as a plain decode step, so they get exactly the tokens they would get without
speculation; so do requests with ``speculate=False``. ``SpeculativeDecoding`` is the runner's step
strategy (``LlamaRunner.speculation``): the continuous engine (continuous.py) decides step by step
whether its running rows take a verify step or a plain one.

Static shapes: ``verify_step`` always processes k+1 tokens per row, so on CUDA it is captured as one
``torch.cuda.CUDAGraph`` per (batch bucket, sampling mode, kv bucket), like the plain decode step;
the graph advances its own state in place, the host reads ``(B, k+2)`` integers per step (the k+1
base tokens and the accepted count): one device-to-host sync per step.

Exactness holds as far as the base model computes the same logits for a token whether it is fed
alone or among k+1: always in exact arithmetic, and in practice in fp32. In bf16 the k+1-token
matmuls may round differently from the 1-token ones, which can flip an argmax between two logits
that are equal to bf16 precision; ``benchmarks/spec_bench.py`` reports how often that happens.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from servekit.optimizations.buckets import pick_bucket
from servekit.optimizations.llm.generate import (DecodeState, GraphedStep, LlamaRunner, RegionalCompiled, decode_order,
                                                 warm_steps)
from servekit.optimizations.models.llama import RMSNorm, Transformer
from servekit.optimizations.llm.sampling import FILTER, GREEDY, MODES, SamplingTensors, sample

SPEC_FORMAT = "servekit-mlp-speculator"
SPEC_WEIGHTS = "speculator.safetensors"
SPEC_CONFIG = "speculator.json"
# Above this many busy rows the engine decodes without speculation. Placeholder until the GPU
# measurement (benchmarks/spec_bench.py reports the batch size where speculation stops paying);
# the plan can set it per model.
DEFAULT_MAX_SPEC_BATCH = 8


# --- the heads ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SpeculatorConfig:
    n_heads: int = 4
    dim: int = 576  # the base model's hidden size
    hidden_dim: int = 1152
    vocab_size: int = 49152  # the base model's, checked at load
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("n_heads", "dim", "hidden_dim", "vocab_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"speculator {name} must be a positive integer, got {getattr(self, name)!r}")

    @classmethod
    def for_model(cls, model: Transformer, n_heads: int = 4, hidden_mult: float = 2.0) -> "SpeculatorConfig":
        c = model.config
        return cls(n_heads=n_heads, dim=c.dim, hidden_dim=int(round(hidden_mult * c.dim)),
                   vocab_size=c.vocab_size, norm_eps=c.norm_eps)


class SpeculatorStage(nn.Module):
    def __init__(self, config: SpeculatorConfig) -> None:
        super().__init__()
        self.emb_norm = RMSNorm(config.dim, config.norm_eps)
        self.w_in = nn.Linear(2 * config.dim, config.hidden_dim, bias=False)
        self.w_out = nn.Linear(config.hidden_dim, config.dim, bias=False)
        self.out_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, state: Tensor, emb: Tensor) -> tuple[Tensor, Tensor]:
        """state, emb ``(..., dim)`` -> (next state, normed features for the base's lm_head)."""
        z = self.w_in(torch.cat([state, self.emb_norm(emb)], dim=-1))
        state = state + self.w_out(F.gelu(z))
        return state, self.out_norm(state)


class Speculator(nn.Module):
    """k MLP-speculator stages on top of a base ``Transformer`` (whose embedding/lm_head they use)."""

    def __init__(self, config: SpeculatorConfig) -> None:
        super().__init__()
        self.config = config
        self.stages = nn.ModuleList(SpeculatorStage(config) for _ in range(config.n_heads))
        # Token ids a head may guess (sorted; empty: the whole vocabulary). Guesses come from the
        # lm_head rows of these tokens only: a 49k x 576 matmul and argmax per head is most of a
        # head's cost, and the tokens greedy decoding rarely emits are rarely right guesses.
        self.register_buffer("draft_vocab", torch.empty(0, dtype=torch.int64))
        self._draft_head: Tensor | None = None  # lm_head rows of draft_vocab (prepare_draft)
        self._draft_fn: Callable[..., Tensor] | None = None

    @property
    def n_heads(self) -> int:
        return len(self.stages)

    def reset_parameters(self, seed: int = 0, random_out: bool = False) -> "Speculator":
        """Fresh weights. ``w_out`` starts at zero for training (stage j then guesses the token
        the base just chose); ``random_out=True`` gives random guesses, for exactness tests."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for stage in self.stages:
                stage.emb_norm.weight.fill_(1.0)
                stage.out_norm.weight.fill_(1.0)
                w = stage.w_in.weight
                w.copy_(torch.randn(w.shape, generator=gen) / w.shape[1] ** 0.5)
                w = stage.w_out.weight
                w.copy_(torch.randn(w.shape, generator=gen) / w.shape[1] ** 0.5 if random_out else torch.zeros(w.shape))
        return self

    def check_base(self, model: Transformer) -> None:
        c = model.config
        if (c.dim, c.vocab_size) != (self.config.dim, self.config.vocab_size):
            raise ValueError(f"speculator heads were made for dim={self.config.dim}, vocab={self.config.vocab_size}; "
                             f"the base model has dim={c.dim}, vocab={c.vocab_size}")

    def head_subset(self, n: int) -> "Speculator":
        """The first n heads (sharing parameters): a shorter draft from the same training."""
        if not 1 <= n <= self.n_heads:
            raise ValueError(f"can use 1..{self.n_heads} heads, asked for {n}")
        if n == self.n_heads:
            return self
        sub = Speculator.__new__(Speculator)
        nn.Module.__init__(sub)
        sub.config = SpeculatorConfig(**{**asdict(self.config), "n_heads": n})
        sub.stages = nn.ModuleList(list(self.stages)[:n])
        sub.register_buffer("draft_vocab", self.draft_vocab)
        sub._draft_head, sub._draft_fn = None, None
        return sub

    def set_draft_vocab(self, ids: Tensor) -> None:
        """Restrict guesses to ``ids`` (empty: the whole vocabulary)."""
        ids = torch.unique(ids.to(torch.int64).flatten())  # sorted
        if ids.numel() and not (0 <= int(ids[0]) and int(ids[-1]) < self.config.vocab_size):
            raise ValueError(f"draft vocabulary ids must be in 0..{self.config.vocab_size - 1}")
        self.draft_vocab = ids.to(self.draft_vocab.device)
        self._draft_head, self._draft_fn = None, None

    def pick(self, logits: Tensor) -> Tensor:
        """Greedy guesses from full-vocabulary logits ``(..., V)``, within the draft vocabulary."""
        if not self.draft_vocab.numel():
            return logits.argmax(dim=-1)
        return self.draft_vocab[logits.index_select(-1, self.draft_vocab).argmax(dim=-1)]

    def prepare_draft(self, model: Transformer, compile_mode: str | None = None) -> None:
        """Serving set-up, after the heads are on the model's device and dtype: gather the draft
        vocabulary's lm_head rows once, and compile the drafting loop if asked (it fuses each
        head's norms, activation and argmax; run inside the captured verify step)."""
        w = model.output.weight
        self._draft_head = w.index_select(0, self.draft_vocab.to(w.device)).contiguous() if self.draft_vocab.numel() else None
        self._draft_fn = (torch.compile(self._draft, mode=compile_mode, fullgraph=True, dynamic=False)
                          if compile_mode else None)

    def forward(self, model: Transformer, hidden: Tensor, tokens: Tensor) -> list[Tensor]:
        """Teacher-forced logits for training: hidden ``(N, dim)`` at position t, tokens ``(N, k)``
        = x_{t+1..t+k}; returns k tensors ``(N, V)`` guessing x_{t+2..t+k+1}."""
        state, out = hidden, []
        for j, stage in enumerate(self.stages):
            state, feat = stage(state, model.tok_embeddings(tokens[:, j]))
            out.append(model.output(feat))
        return out

    def draft(self, model: Transformer, hidden: Tensor, token: Tensor) -> Tensor:
        """Greedy drafts ``(B, k)`` from hidden ``(B, dim)`` at position t and token x_{t+1} ``(B,)``."""
        head = self._draft_head
        if head is None:
            w = model.output.weight
            head = w.index_select(0, self.draft_vocab) if self.draft_vocab.numel() else w
        return (self._draft_fn or self._draft)(model.tok_embeddings.weight, head, hidden, token)

    def _draft(self, emb: Tensor, head: Tensor, hidden: Tensor, token: Tensor) -> Tensor:
        """``draft`` on plain tensors (what ``torch.compile`` sees): emb ``(V, dim)``; head: the
        lm_head rows guesses come from (all of them, or ``draft_vocab``'s)."""
        state, out = hidden, []
        for stage in self.stages:
            state, feat = stage(state, F.embedding(token, emb))
            token = F.linear(feat, head).argmax(dim=-1)
            if self.draft_vocab.numel():
                token = self.draft_vocab[token]
            out.append(token)
        return torch.stack(out, dim=1)


def save_speculator(speculator: Speculator, out_dir: str | Path, info: dict | None = None) -> Path:
    """Write ``speculator.safetensors`` (fp32) + ``speculator.json`` into ``out_dir``; returns the folder."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.float() if v.is_floating_point() else v).detach().cpu().contiguous()
               for k, v in speculator.state_dict().items()}
    save_file(tensors, str(out / SPEC_WEIGHTS), metadata={"format": SPEC_FORMAT})
    config = {"format": SPEC_FORMAT, "version": 1, **asdict(speculator.config), "training": info or {}}
    (out / SPEC_CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return out


def load_speculator(path: str | Path, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> Speculator:
    """Load heads from a folder holding ``speculator.json`` + ``speculator.safetensors``."""
    from safetensors.torch import load_file

    folder = Path(path)
    if folder.is_file():
        folder = folder.parent
    raw = json.loads((folder / SPEC_CONFIG).read_text())
    if raw.get("format") != SPEC_FORMAT:
        raise ValueError(f"{folder / SPEC_CONFIG}: format is {raw.get('format')!r}, expected {SPEC_FORMAT!r}")
    config = SpeculatorConfig(**{k: raw[k] for k in ("n_heads", "dim", "hidden_dim", "vocab_size", "norm_eps")})
    spec = Speculator(config)
    tensors = load_file(str(folder / SPEC_WEIGHTS))
    if "draft_vocab" in tensors:  # heads saved before draft vocabularies have none: all tokens
        spec.set_draft_vocab(tensors["draft_vocab"])
    else:
        tensors["draft_vocab"] = spec.draft_vocab
    spec.load_state_dict(tensors, strict=True)
    return spec.to(device=device, dtype=dtype).eval()


# --- the model calls: plain functions, compiled or captured by the runner -------------------------

def forward_hidden(model: Transformer, tokens: Tensor, input_pos: Tensor, kv_len: int | None = None,
                   last_idx: Tensor | None = None, with_logits: bool = True) -> tuple[Tensor | None, Tensor]:
    """``Transformer.forward`` that also returns the final normed hidden state.

    Returns fp32 logits and hidden states, ``(B, T, V)`` / ``(B, T, dim)``, or ``(B, V)`` /
    ``(B, dim)`` at ``last_idx`` of each row (logits None when ``with_logits`` is false).
    """
    hidden = model.hidden(tokens, input_pos, last_idx, kv_len)
    return (model.output(hidden).float() if with_logits else None), hidden


def verify_step(model: Transformer, speculator: Speculator, token: Tensor, draft: Tensor, pos: Tensor,
                spec_rows: Tensor, params: SamplingTensors, mode: str = GREEDY, kv_len: int | None = None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One speculative step. token, pos ``(B,)``: each row's last chosen token and its position;
    draft ``(B, k)``; spec_rows ``(B,)`` int, 0 for rows that must not accept drafts.

    Returns the base model's tokens ``(B, k+1)`` (a row emits the first ``accepted + 1``), the
    accepted draft counts ``(B,)``, each row's next token ``(B,)`` and its next drafts ``(B, k)``.
    """
    k = draft.shape[1]
    tokens = torch.cat([token[:, None], draft], dim=1)
    input_pos = (pos[:, None] + torch.arange(k + 1, device=pos.device)).clamp(max=model.max_seq_len - 1)
    logits, hidden = forward_hidden(model, tokens, input_pos, kv_len)
    base = logits.argmax(dim=-1)
    if mode != GREEDY:  # sampled rows take the plain runner's token for position pos, drafts ignored
        first = sample(logits[:, 0], params, input_pos[:, 0], mode)
        base = torch.cat([first[:, None], base[:, 1:]], dim=1)
    accepted = (draft == base[:, :k]).long().cumprod(dim=1).sum(dim=1) * spec_rows
    nxt = base.gather(1, accepted[:, None]).squeeze(1)
    h = hidden.gather(1, accepted[:, None, None].expand(-1, 1, hidden.shape[-1])).squeeze(1)
    return base, accepted, nxt, speculator.draft(model, h, nxt)


# --- the runner -----------------------------------------------------------------------------------

@dataclass
class SpecStats:
    """Acceptance counters summed over steps (what the handler's metrics export)."""

    proposed: list[int]
    accepted: list[int]
    tokens: int = 0  # tokens emitted by speculating rows' verify steps

    @classmethod
    def empty(cls, n_heads: int) -> "SpecStats":
        return cls([0] * n_heads, [0] * n_heads)

    def add_row(self, accepted: int) -> None:
        """One row's verify step that accepted ``accepted`` of its drafts (continuous batching)."""
        for j in range(len(self.proposed)):
            self.proposed[j] += 1
            self.accepted[j] += j < accepted
        self.tokens += accepted + 1

    @property
    def acceptance_rate(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per speculative row-step: 1 (the base's own) + accepted drafts."""
        return 1.0 + sum(self.accepted) / self.proposed[0] if self.proposed and self.proposed[0] else 1.0

    def to_dict(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted, "tokens": self.tokens,
                "acceptance_rate": [round(r, 4) for r in self.acceptance_rate],
                "mean_accepted_length": round(self.mean_accepted_length, 4)}


class SpecState:
    """Static inputs of the verify step for one batch bucket, over a plain decode state's own
    memory: its token, position and sampling rows are the decode state's, so plain and verify
    steps take turns on the same rows with nothing copied. Only the drafts and speculate flags are
    its own."""

    def __init__(self, decode: DecodeState, draft: Tensor, spec_rows: Tensor) -> None:
        self.token, self.pos, self.params = decode.tokens[:, 0], decode.input_pos[:, 0], decode.params
        self.draft, self.spec_rows = draft, spec_rows

    def load(self, token: Tensor, draft: Tensor, pos: Tensor, spec_rows: Tensor, params: SamplingTensors) -> None:
        self.token.copy_(token)
        self.draft.copy_(draft)
        self.pos.copy_(pos)
        self.spec_rows.copy_(spec_rows)
        self.params.copy_(params)


class VerifyStep(GraphedStep):
    """``verify_step`` for one (batch bucket, mode, kv length) on a shared ``SpecState``.

    ``run()`` advances the state in place (token, drafts, positions) and returns ``(B, k+2)``:
    the k+1 base tokens and the accepted count. After ``capture()`` (CUDA) it replays a graph.
    """

    def __init__(self, model: Transformer | RegionalCompiled, speculator: Speculator, state: SpecState, mode: str,
                 kv_len: int, fn: Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]) -> None:
        self.model, self.speculator, self.state, self.mode, self.kv_len, self.fn = (
            model, speculator, state, mode, kv_len, fn)

    @torch.no_grad()
    def _body(self) -> Tensor:
        st = self.state
        base, accepted, nxt, draft = self.fn(self.model, self.speculator, st.token, st.draft, st.pos, st.spec_rows,
                                             st.params, self.mode, self.kv_len)
        st.token.copy_(nxt)
        st.draft.copy_(draft)
        # Finished and dummy rows keep stepping; the clamp keeps their writes inside the cache.
        st.pos.add_(accepted + 1).clamp_(max=self.model.max_seq_len - 1)
        return torch.cat([base, accepted[:, None]], dim=1)


class SpeculativeDecoding:
    """Speculative decoding as a step strategy of a ``LlamaRunner`` (same model, KV cache, buckets,
    decode rows): set it as ``runner.speculation`` and the continuous engine takes verify steps
    while the busy rows fit ``max_spec_batch``. ``n_heads`` (default: all trained heads) is how
    many drafts a step proposes.
    """

    def __init__(self, base: LlamaRunner, speculator: Speculator, max_spec_batch: int = DEFAULT_MAX_SPEC_BATCH,
                 n_heads: int | None = None, compile_verify: bool = False) -> None:
        model = base.model
        speculator.check_base(model)
        if max_spec_batch < 0:
            raise ValueError(f"max_spec_batch must be >= 0, got {max_spec_batch}")
        w = model.tok_embeddings.weight
        self.base, self.model, self.device = base, model, base.device
        self.speculator = speculator.head_subset(n_heads or speculator.n_heads).to(device=w.device, dtype=w.dtype).eval()
        self.n_heads = self.speculator.n_heads
        self.speculator.prepare_draft(model, base.plan.get("compile_mode", "default") if compile_verify else None)
        self.max_spec_batch = min(max_spec_batch, base.max_batch)
        top = pick_bucket(self.max_spec_batch, base.batch_buckets) if self.max_spec_batch else 0
        self.spec_buckets = tuple(b for b in base.batch_buckets if b <= top)
        # The base runner's compiled blocks (regional compilation) serve verify too.
        compiled = base.compiled_model
        if compile_verify and compiled is None:
            compiled = RegionalCompiled(model, base.plan.get("compile_mode", "default"))
        verify_model = compiled if compile_verify else model
        if base.triton_model is not None:  # the fused decode kernels take k+1 tokens per row as well
            verify_model = base.triton_model
        # The verify steps run on the runner's own decode rows; a request starts with the engine's
        # prefill, which makes no drafts (its first verify step has stale ones).
        self.draft = torch.zeros(top, self.n_heads, dtype=torch.int64, device=self.device)
        self.spec_rows = torch.zeros(top, dtype=torch.int64, device=self.device)
        self.states = {b: SpecState(base.states[b], self.draft[:b], self.spec_rows[:b]) for b in self.spec_buckets}
        self.steps = {(b, m, kv): VerifyStep(verify_model, self.speculator, self.states[b], m, kv, verify_step)
                      for b in self.spec_buckets for m in MODES for kv in base.kv_buckets}
        self.plan = {"n_heads": self.n_heads, "max_spec_batch": self.max_spec_batch,
                     "spec_buckets": list(self.spec_buckets), "compile_verify": compile_verify}

    @torch.no_grad()
    def warmup(self) -> dict[str, float]:
        """Capture (CUDA) every verify step, or run one (CPU) to check its shapes; after the runner's
        own warm-up. Returns the seconds it took."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.base.cuda_graphs else None
        for b, state in self.states.items():
            zeros = torch.zeros(b, dtype=torch.int64, device=self.device)
            state.load(zeros, torch.zeros(b, self.n_heads, dtype=torch.int64, device=self.device), zeros, zeros + 1,
                       SamplingTensors.build([1.0] * b, [50] * b, [0.9] * b, [0] * b, self.device))
        warm_steps(self.steps, decode_order, pool, lambda k: k[1:] == (FILTER, self.base.kv_buckets[-1]))
        self.base.sync()
        return {"spec_verify_s": time.perf_counter() - t0}

    def set_rows(self, rows: Tensor, speculate: Tensor) -> None:
        """Whether the requests starting in ``rows`` accept drafts (1) or not (0)."""
        self.spec_rows.index_copy_(0, rows, speculate)
