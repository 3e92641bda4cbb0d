"""Greedy outputs of two numerically different paths (compiled vs eager, bf16 vs bf16 with other
kernels) on random test weights: equal, or they part at a near-tie of the reference's logits, where
rounding legitimately picks the other token; then the rest cannot be compared."""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def check_same_or_tie(prompt: Sequence[int], got: Sequence[int], want: Sequence[int],
                      logits_after: Callable[[list[int]], torch.Tensor], rel_tol: float) -> str | None:
    """None when `got` equals `want`, or first differs from it where the reference's logits for the two
    tokens lie within `rel_tol` of its logit range; else what went wrong. `logits_after(ids)` returns
    the reference's next-token logits ``(V,)`` after the token list `ids`."""
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        return None if len(got) == len(want) else f"lengths differ: {len(got)} vs {len(want)} tokens"
    logits = logits_after(list(prompt) + list(want[:i])).float()
    gap = (logits[want[i]] - logits[got[i]]).abs().item()
    span = (logits.max() - logits.min()).item()
    if gap <= rel_tol * span:
        return None
    return (f"token {i}: {got[i]} instead of {want[i]}, reference logits {gap:.4g} apart "
            f"(> {rel_tol} of their range {span:.4g}): not a near-tie")
