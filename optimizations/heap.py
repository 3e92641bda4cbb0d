"""The cyclic garbage collector in a long-lived serving process."""
from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Exempt every object alive now from the cyclic garbage collector; returns how many.

    Called once a long-lived process is set up: a worker once warm, an LLM engine process once its
    engine is built, a load-generator process once imported. A loaded plan is ~0.5 M objects
    (dynamo/inductor state, graphs, tokenizer), and each full collection walks them all: ~250 ms
    on a 2-core VM (the CPU SmolLM2 engine process: ~100 ms), and on an H100 host under load p99
    stalls of 70-100 ms that came and went between measurement windows. Frozen objects are never
    collected, which is right for what lives as long as the process.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
