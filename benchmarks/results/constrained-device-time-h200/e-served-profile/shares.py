"""Share of the served engine thread's samples in each part of the step, from py-spy's raw stacks
with every thread and idle samples (``served_profile.sh``). From this folder:

    python3 shares.py constrained-engine.txt.gz matched-engine.txt.gz
"""
import collections
import gzip
import re
import sys

PARTS = ["ContinuousBatcher.step", "ContinuousBatcher._prefill", "PackedPrefill.run", "ContinuousBatcher._start_rows",
         "ContinuousBatcher._admit", "ContinuousBatcher._load_bias", "fill_masks", "ContinuousBatcher._read_all",
         "HostCopies.wait", "RowConstraint.accept", "ContinuousBatcher._forced_runs", "main.<locals>.send_updates"]

for path in sys.argv[1:]:
    inside, total = collections.Counter(), 0
    with gzip.open(path, "rt") as f:
        for line in f:
            stack, n = line.rstrip().rsplit(" ", 1)
            thread, *frames = stack.split(";")
            if not re.search(r"servekit-engine'?\)?$", thread.strip()):  # the engine thread alone
                continue
            total += int(n)
            names = {re.sub(r" \(.*", "", fr) for fr in frames}
            for part in PARTS:
                inside[part] += int(n) * (part in names)
    print(f"{path}: {total} samples of the engine thread")
    for part in PARTS:
        print(f"  {inside[part] / total:6.1%}  {part}")
