"""One GPU, one TorchServe: SmolLM2 as one registration of 32 rows ("one") against two one-worker
registrations of 16 rows each ("two": two engine processes sharing the GPU, the client sending even
requests to one and odd to the other). Each model keeps one worker, so TorchServe's one-worker rule
for continuous batching (docs/serve.md) holds; the question is whether two engines' host work in
parallel beats one engine's batch. The structured benchmark's rounds of 32 streamed requests at once
(``structured_bench.mixed``): all free, all constrained (a JSON schema each), free at the
constrained answers' lengths; runs in the order of ``ORDER``.

Run from a checkout (after ``source benchmarks/gpu_env.sh`` on the GPU machine):

    python3 benchmarks/results/two-engines-h200/two_engines.py
    CFG=config/models/smollm2-cpu.yaml CONC=4 ROUNDS=1 ORDER="one two" python benchmarks/results/two-engines-h200/two_engines.py

``CFG``: the model-config (default: the shipped smollm2.yaml); ``CONC``: streams at once (32);
``ROUNDS``: rounds per mix (20); ``MIXES``: of structured_bench's mixes (constrained matched free).
"""
import json
import os
import tempfile
import time
from pathlib import Path

import yaml

from servekit.archive import build_archive
from servekit.benchmarks import structured_bench as sb
from servekit.benchmarks.llm_serve_bench import variant_config
from servekit.resources import model_config
from servekit.torchserve import TorchServe

ROUNDS = int(os.environ.get("ROUNDS", 20))
CONC = int(os.environ.get("CONC", 32))
CFG = Path(os.environ.get("CFG") or model_config("smollm2"))
ORDER = os.environ.get("ORDER", "one two one two")
MIXES = tuple(os.environ.get("MIXES", "constrained matched free").split())
work = Path(tempfile.mkdtemp(prefix="two-"))
store = work / "store"
for mar, rows in (("full", CONC), ("half", CONC // 2)):  # the same archive at two batch sizes
    (work / f"{mar}.yaml").write_text(yaml.safe_dump(variant_config(CFG, [1, rows], 5, None), sort_keys=False))
    build_archive("smollm2", store, config=work / f"{mar}.yaml", compress=False)
    os.rename(store / "smollm2.mar", store / f"{mar}.mar")
real_chat = sb.chat
urls = {}


def routed(url, *a, seed=None, **kw):
    """structured_bench's chat, with "two" as the URL: even requests (by seed) to a, odd to b."""
    if url == "two":
        url = urls["a"] if (seed or 0) % 2 == 0 else urls["b"]
    return real_chat(url, *a, seed=seed, **kw)


sb.chat = routed
res = []
with TorchServe(work / "run", store) as ts:
    t0 = time.perf_counter()
    for name, mar in (("full", "full.mar"), ("a", "half.mar"), ("b", "half.mar")):
        ts.register(mar, name, timeout=1200)
        urls[name] = f"{ts.inference_url}/predictions/{name}/1.0/v1/chat/completions"
    print(f"ready after {time.perf_counter() - t0:.0f} s", flush=True)
    for u in urls.values():
        real_chat(u, sb.FREE_PROMPT, 4, False)
        sb.warm_schemas(u)
    for run, kind in enumerate(ORDER.split()):
        rows = sb.mixed(urls["full"] if kind == "one" else "two", CONC, ROUNDS, 128, None, MIXES)
        by = {m["mix"]: m["tok_per_s_total"] for m in rows}
        print(f"== run {run} {kind}: {json.dumps(by)}", flush=True)
        res.append((kind, by))
for kind, by in res:
    print(kind, by)
