"""Speculator heads trained on a bf16 base model on the CPU: the heads keep fp32 weights while they
meet the base's bf16 embedding and lm_head (a GPU machine's `--device cpu` run used to get a bf16
base and failed with "expected m1 and m2 to have the same dtype")."""
from __future__ import annotations

import torch

from servekit.optimizations.llm.speculative import Speculator, SpeculatorConfig
from servekit.optimizations.models.llama import LlamaConfig, init_random
from servekit.optimizations.training.train_speculator import Examples, base_dtype, build_parser, evaluate, train_heads


def test_heads_train_and_evaluate_on_a_bf16_base_on_the_cpu() -> None:
    model = init_random(LlamaConfig.tiny(), seed=0, dtype=torch.bfloat16)
    heads = Speculator(SpeculatorConfig.for_model(model, n_heads=2)).reset_parameters(0)
    gen = torch.Generator().manual_seed(0)
    n, vocab = 64, model.config.vocab_size
    ex = Examples(torch.randn(n, model.config.dim, generator=gen).to(torch.bfloat16),
                  torch.randint(3, vocab, (n, 2), generator=gen), torch.randint(3, vocab, (n, 2), generator=gen))
    before = [p.detach().clone() for p in heads.parameters()]
    summary = train_heads(model, heads, ex, steps=3, batch_size=32)
    assert summary["steps"] == 3 and summary["final_loss"] == summary["final_loss"]  # not NaN
    assert all(p.dtype == torch.float32 for p in heads.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, heads.parameters()))
    assert len(evaluate(model, heads, ex)["accuracy"]) == 2


def test_the_default_base_dtype_follows_the_device_not_the_machine() -> None:
    parse = build_parser().parse_args
    assert base_dtype(parse(["--out", "x", "--device", "cpu"])) == torch.float32
    assert base_dtype(parse(["--out", "x", "--device", "cuda"])) == torch.bfloat16
    assert base_dtype(parse(["--out", "x", "--device", "cpu", "--dtype", "bf16"])) == torch.bfloat16
