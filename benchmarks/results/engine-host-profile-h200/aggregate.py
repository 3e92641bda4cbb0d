"""Milliseconds per engine step by function, from py-spy's raw stacks (``profile_step.py``): each
function's inclusive time (every sample with it on the stack), sampled at RATE Hz over STEPS steps
(the ``spied steps`` line of the run's log). With a second file and its steps, both side by side.

    python3 aggregate.py base/spy-json.txt.gz 11661 [micro-cuts/v2-profile/spy-json.txt.gz 13156] [--rate 100]
"""
import argparse
import collections
import gzip
import re


def per_step(path: str, steps: int, rate: float) -> tuple[dict[str, float], float]:
    """(function -> inclusive ms per step, all samples in ms per step)."""
    inclusive, total = collections.Counter(), 0
    with gzip.open(path, "rt") as f:
        for line in f:
            stack, n = line.rstrip().rsplit(" ", 1)
            total += int(n)
            # "name (file:line)" -> "name (file)"; a function counts once per sample however deep it recurses
            for frame in {re.sub(r":\d+\)$", ")", fr) for fr in stack.split(";")}:
                inclusive[frame] += int(n)
    scale = 1e3 / rate / steps
    return {k: v * scale for k, v in inclusive.items()}, total * scale


ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("runs", nargs="+", help="FILE STEPS [FILE STEPS]")
ap.add_argument("--rate", type=float, default=100.0)
ap.add_argument("--top", type=int, default=45)
args = ap.parse_args()
if len(args.runs) not in (2, 4):
    ap.error("give one or two pairs of FILE STEPS")
tables = [per_step(args.runs[i], int(args.runs[i + 1]), args.rate) for i in range(0, len(args.runs), 2)]
print("samples, ms per step: " + " | ".join(f"{t:.3f}" for _, t in tables))
first = tables[0][0]
for name in sorted(first, key=first.get, reverse=True)[:args.top]:
    print(" | ".join(f"{t.get(name, 0.0):7.3f}" for t, _ in tables) + f"  {name}")
