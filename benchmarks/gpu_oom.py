"""A real CUDA out-of-memory error in the LLM handler, on a GPU: it must fail alone.

The SmolLM2 GPU plan captures prefill (short prompts) and decode as CUDA graphs, whose memory is
reserved at start; a long prompt's prefill runs eagerly and allocates its activations per request.
So the script:

1. serves SmolLM2 with the GPU plan (own TorchServe) and records the solo answers of three short
   greedy requests;
2. takes most of the free GPU memory with a ballast tensor in this process, leaving
   ``--leave-free-mib``;
3. sends a ~1,900-token prompt at the same instant as the three short ones: the long one must get
   ``507 out_of_memory`` (the handler retries the batch request by request), the short ones 200
   with their solo text, and the worker must be the same process;
4. frees the ballast and sends the long prompt again: it must be answered (the worker recovered).

    python3 -m servekit.benchmarks.gpu_oom --out benchmarks/results/gpu-oom-<gpu>

Exit status 0 when every check passed, 1 otherwise (also when no out-of-memory error happened:
then lower ``--leave-free-mib``).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from servekit.benchmarks.faults import Answer, send_together, worker_identity
from servekit.resources import model_config
from servekit.torchserve import TorchServe

MODEL = "smollm2"
SHORT = ["What is the capital of France?", "Name three colors.", "Say hello in Spanish."]
LONG = "Summarize this text. " + "The quick brown fox jumps over the lazy dog near the river bank. " * 130


def _call(ts: TorchServe, content: str, max_tokens: int = 16) -> tuple[str, str, bytes, str]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}
    return ("POST", f"{ts.inference_url}/predictions/{MODEL}/1.0/v1/chat/completions", json.dumps(body).encode(),
            "application/json")


def _text(a: Answer) -> str | None:
    body = a.json()
    return body["choices"][0]["message"]["content"] if a.status == 200 and isinstance(body, dict) else None


def run(ts: TorchServe, leave_free_mib: int) -> dict[str, Any]:
    import torch

    alone = [_text(send_together([_call(ts, c)])[0]) for c in SHORT]
    worker = worker_identity(ts, MODEL)
    free, total = torch.cuda.mem_get_info()
    ballast_bytes = max(0, free - leave_free_mib * 2**20)
    ballast = torch.empty(ballast_bytes, dtype=torch.uint8, device="cuda")
    try:
        answers = send_together([_call(ts, LONG)] + [_call(ts, c) for c in SHORT])
    finally:
        del ballast
        torch.cuda.empty_cache()
    long_answer, shorts = answers[0], answers[1:]
    err = (long_answer.json() or {}).get("error", {}) if isinstance(long_answer.json(), dict) else {}
    after = send_together([_call(ts, LONG)])[0]
    res = {"gpu": torch.cuda.get_device_name(), "total_mib": total // 2**20, "free_before_mib": free // 2**20,
           "ballast_mib": ballast_bytes // 2**20, "long_status": long_answer.status, "long_error": err,
           "short_statuses": [a.status for a in shorts], "short_same_as_alone": [_text(a) for a in shorts] == alone,
           "worker_same": worker_identity(ts, MODEL) == worker, "after_ballast_freed_status": after.status}
    res["passed"] = (long_answer.status == 507 and err.get("code") == "out_of_memory"
                     and res["short_statuses"] == [200, 200, 200] and res["short_same_as_alone"]
                     and res["worker_same"] and after.status == 200)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.gpu_oom", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_oom.json")
    p.add_argument("--config", type=Path, default=model_config("smollm2"), help="GPU model-config")
    p.add_argument("--leave-free-mib", type=int, default=8, help="GPU memory the ballast leaves free")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the CPU suite simulates the error: tests/test_reliability_llm.py)")
    from servekit.benchmarks.soak import machine_info
    from servekit.archive import build_archive

    with tempfile.TemporaryDirectory(prefix="servekit-gpu-oom-") as tmp:
        store = Path(tmp) / "store"
        build_archive(MODEL, store, config=args.config, compress=False)
        with TorchServe(Path(tmp) / "run", store) as ts:
            ts.register(f"{MODEL}.mar", MODEL, timeout=1800)
            res = run(ts, args.leave_free_mib)
    res["machine"] = machine_info()
    res["command"] = "python -m servekit.benchmarks.gpu_oom " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_oom.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
