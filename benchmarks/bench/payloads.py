"""Request bodies for a run: a JSONL file (one body per line), one fixed body, or synthetic texts."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench.schema import Payloads, SchemaError

# A neutral vocabulary for synthetic texts (the shipped file benchmarks/payloads/texts.jsonl is
# more realistic; this is for quick sweeps with a controlled length mix).
WORDS = ("the model serves requests from many clients while the queue grows and shrinks with traffic "
         "every batch pads its texts to the nearest bucket so compiled graphs are reused a worker answers "
         "each request with a vector that captures the meaning of the text users search documents "
         "support tickets product reviews and short questions in several languages").split()


def load_bodies(p: Payloads) -> list[str]:
    """Each body serialised once, as it will be sent."""
    if p.file is not None:
        bodies = []
        for n, line in enumerate(p.file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except ValueError as e:
                raise SchemaError(f"payloads.file: {p.file}:{n}: not a JSON value ({e})") from None
            bodies.append(line.strip())
        if not bodies:
            raise SchemaError(f"payloads.file: {p.file} holds no request bodies")
        return bodies
    if p.generate is None:
        return [json.dumps(p.body)]
    g = p.generate
    rng = np.random.default_rng(g["seed"])
    w = np.asarray(g["weights"], dtype=float)
    lengths = rng.choice(g["words"], size=g["count"], p=w / w.sum())
    return [json.dumps({g["field"]: " ".join(rng.choice(WORDS, size=int(n)))}) for n in lengths]


def describe(bodies: list[str]) -> dict[str, Any]:
    """Length mix of the bodies (characters of each body's text fields)."""
    chars = np.array([len(b) for b in bodies])
    return {"count": len(bodies), "chars_p50": float(np.median(chars)), "chars_p90": float(np.percentile(chars, 90)),
            "chars_max": int(chars.max())}


def write_bodies(bodies: list[str], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(bodies) + "\n")
    return path
