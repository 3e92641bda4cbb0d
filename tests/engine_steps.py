"""A ``ContinuousBatcher`` whose packed forwards and decode-step launches are counted per step: the
engine tests check with it which steps ran one forward and which ran two."""
from __future__ import annotations

import torch

from servekit.optimizations.llm.continuous import ContinuousBatcher
from servekit.optimizations.llm.packed import Chunk


class Counted:
    """The batcher's packed forward, recording for each call the step it ran in, its prompt tokens,
    its prompt chunks' sizes and the decoding rows that rode along (one token each, or a run of
    tokens their grammar forces), and in ``tokens`` each call's tokens in all; and the steps that
    launched a decode step of their own."""

    def __init__(self, batcher: ContinuousBatcher) -> None:
        self.b, self.calls, self.steps, self.launches, self.riders, self.tokens = batcher, [], 0, [], [], []
        real, launch = batcher.packed.run, batcher._launch

        def run(chunks: list[Chunk]) -> torch.Tensor:
            self.riders += [c for c in chunks if c.from_state]
            # A forced run is fed from the host as a prompt's chunk is: told apart by its row.
            forced = {self.b.by_key[k].slot for k in self.b._jumps if k in self.b.by_key}
            ride = [c.from_state or c.row in forced for c in chunks]
            prompts = [len(c.tokens) for c, r in zip(chunks, ride) if not r]
            self.calls.append((self.steps, sum(prompts), prompts, sum(ride)))
            self.tokens.append(sum(len(c.tokens) for c in chunks))
            return real(chunks)

        def launched(*args, **kwargs):
            out = launch(*args, **kwargs)
            if out is not None:
                self.launches.append(self.steps)
            return out

        batcher.packed.run, batcher._launch = run, launched

    def step(self) -> dict:
        self.steps += 1
        return self.b.step()
