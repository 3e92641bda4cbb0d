"""`plan_bench ready` on CPU: two fresh worker processes of a compile plan, the first with empty
caches, the second with the compile cache the first left behind (real compiles, of a tiny BERT
folder given by --model-dir: inductor's CPU compile of MiniLM takes minutes on 2 cores and the
compile cache's behaviour does not depend on the model's size), over two buckets that share one
compiled graph: the cache's effect is the same with one graph as with several, and each graph
costs ~30 s of compiling on 2 cores), with the installed bytecode caches (`--pycache installed`:
a fresh bytecode folder would add ~13 s of compiling torch's modules to the cold start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ready_cold_then_with_compile_cache(tmp_path: Path) -> None:
    from tiny_encoders import hf_encoder

    folder = hf_encoder(tmp_path / "model", "bert")  # a plain folder: sentence-transformers' import costs more
    # Inductor compiles in the worker process itself: its default pool of compile processes, each
    # importing torch from the cold run's empty bytecode cache, tripled the cold start on 2 cores
    # (211 s -> 82 s for the whole command) without changing what the cache saves.
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "servekit.benchmarks.plan_bench", "ready", "--out", str(tmp_path),
                           "--plan", "fp32-compile", "--model-dir", str(folder), "--batch-sizes", "4", "--seq-lens", "16", "64",
                           "--pycache", "installed"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "ready-fp32-compile.json").read_text())
    cold, cached = result["ready"]["cold"], result["ready"]["with_compile_cache"]
    assert result["config"]["compile"] == "default" and result["environment"]["torch"]
    assert result["model_dir"] == str(folder) and result["pycache"] == "installed"
    assert (cold["compile_cache_hit"], cached["compile_cache_hit"]) == (False, True)
    assert result["config"]["buckets"] == {"batch_sizes": [4], "seq_lens": [16, 64]}
    assert cold["buckets"] == cached["buckets"] == 2 and cached["compiled_graphs"] >= 1
    assert len(cached["slowest_buckets"]) == 2 and all(b["capture_s"] >= 0 for b in cached["slowest_buckets"])
    # the compile cache is what makes the second start shorter: compiling dominates the cold one
    assert cached["warmup_s"] < 0.7 * cold["warmup_s"], (cold, cached)
    assert cached["runner_ready_s"] < cold["runner_ready_s"]
