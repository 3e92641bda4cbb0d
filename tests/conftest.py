"""Shared fixtures. Server tests share one TorchServe per session and worker (start-up costs ~20 s
on 2 cores); archives and trained heads are built once per run, whatever the number of workers."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

# Set before torch loads OpenMP, and inherited by every process the tests start (TorchServe's Java
# frontend and its Python workers, CLI subprocesses), so on 2 shared cores:
# - OpenMP threads that wait for a barrier sleep instead of spinning. A MiniLM worker with 2 threads,
#   while another process kept one core busy, spent 70-80 s of CPU on 600 requests with the default
#   spin-wait and 8-12 s with PASSIVE (and reached READY in 10 s instead of 13-16 s).
# - The JVM compiles with C1 only and collects with the serial collector: a frontend reached ready
#   with ~0.8 s less CPU and served 600 requests with ~2 s less (C2's compiles and G1's threads cost
#   more than they give back in a server that lives for seconds to minutes).
# - Each server's inference warm-up is one request, not 500 (servekit.torchserve.warm_up_requests):
#   the JVM's compiles serve servers that live for hours, and 500 requests per server, on cores
#   that three test workers share, moved the timing of the live tests running beside them.
# An explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
os.environ.setdefault("SERVEKIT_WARM_UP_REQUESTS", "1")

import torch  # noqa: E402  (after OMP_WAIT_POLICY)

# Without a GPU, Triton kernels run only in its interpreter, which TRITON_INTERPRET=1 selects when
# triton itself is first imported. test_triton_decode.py and test_triton_prefill.py set it at their
# import, but any module collected before them that imports torch's compiler stack (torch._dynamo
# imports triton) would set triton up first: that happened once through llguidance.torch, and every
# interpreted kernel then failed ("Cannot call @triton.jit'd outside of the scope of a kernel").
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from servekit.torchserve import TorchServe
from servekit.archive import build_archive
from session_cache import build_once

ROOT = Path(__file__).resolve().parent.parent


def pytest_sessionstart(session: pytest.Session) -> None:
    # A run needs ~1.2 GB under the temp folder at its peak (fresh clone, 2-core VM) and ~0.8 GB of
    # converted SmolLM2 weights in ~/.cache/servekit: a disk that fills mid-run fails tests at random
    # with ENOSPC, so a nearly full one is named before the first test (even under -q).
    import shutil
    import tempfile

    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    free = shutil.disk_usage(tempfile.gettempdir()).free / 2**30
    if free < 5:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"WARNING: only {free:.1f} GiB free under {tempfile.gettempdir()}; "
                                "the suite needs ~4 GiB", yellow=True, bold=True)


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist every worker is a process of its own: one torch thread each keeps the
    # workers from oversubscribing the cores (two OpenMP threads per worker on 2 cores run small
    # matmuls many times slower). Fixtures that want more threads set them and restore this.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model store holding minilm.mar built from the working tree (once per run), uncompressed (half
    the build time, and each registration unpacks it with ~1 s less of the frontend's CPU). Tests may
    add archives of their own names to it."""
    return build_once(tmp_path_factory, "model_store", lambda store: build_archive("minilm", store, compress=False))


@pytest.fixture(scope="session")
def minilm_server(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchServe]:
    """A live TorchServe on free ports with `minilm` registered (batch 8, delay 50 ms, 1 worker)."""
    with TorchServe(tmp_path_factory.mktemp("ts-run"), model_store) as ts:
        ts.register("minilm.mar", "minilm", batch_size=8, max_batch_delay_ms=50, workers=1)
        yield ts


def worker_budget(server: TorchServe, model: str = "minilm") -> dict:
    """The per-request limits `model`'s latest worker derived at start from its measured speeds (its
    ready line in the model log, which every model of the server shares): they depend on how busy
    the machine was then."""
    import json

    lines = [line for line in server.log_text("model_log.log").splitlines()
             if f"-{model}_" in line and "servekit plan" in line and '"budget"' in line]
    assert lines, "the worker logged no budget"
    return json.loads(lines[-1].split(" ready: ", 1)[1])["budget"]


@pytest.fixture
def archive_in_process(capsys: pytest.CaptureFixture):
    """`servekit archive ARGS` through its main() in this process, as a CompletedProcess (rc, out,
    err): for tests of what it writes, without the ~5 s of CPU a fresh interpreter spends importing
    torch (test_archive_path.py runs the command itself)."""
    from test_archive_path import archive_here

    return lambda *args: archive_here(capsys, *args)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch CPU thread for a module of small-matrix tests: on 2 shared cores, two OpenMP
    threads run small matmuls many times slower as soon as another process holds a core."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# Prompts of the live LLM tests (the first line is held out by the recipe's every-10th split).
SPEC_PROMPTS = ["Give a synonym for happy.", "What is the capital of France?", "Write a short poem about the sea.",
                "Say hello.", "Name a colour.", "Count to three.", "What is two plus two?", "Say hi.", "Name two planets.",
                "What color is the sky?"]


@pytest.fixture(scope="session")
def tiny_smollm2(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """SmolLM2's archive files with a tiny random model (2 layers, width 64) in place of its weights
    (tests/tiny_smollm2.py): the live tests of protocol and engine behaviour serve it, a step taking
    a fraction of SmolLM2's."""
    from tiny_smollm2 import tiny_smollm2_files, write_tiny_smollm2

    return tiny_smollm2_files(build_once(tmp_path_factory, "tiny-smollm2", write_tiny_smollm2))


@pytest.fixture(scope="session")
def tiny_smollm2_heads(tiny_smollm2: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 speculator heads for `tiny_smollm2` trained by `servekit train-speculator` on the live
    tests' own prompts (seconds): the random model's greedy texts repeat tokens, which the heads
    learn, so drafts are accepted and several tokens per step reach the handler."""
    from servekit.optimizations.training import train_speculator

    def train(tmp: Path) -> None:
        (tmp / "prompts.txt").write_text("\n".join(SPEC_PROMPTS) + "\n")
        old = torch.get_num_threads()
        try:
            assert train_speculator.main(["--model-dir", str(tiny_smollm2[0].parent), "--dtype", "fp32",
                                          "--out", str(tmp / "heads"), "--prompts", str(tmp / "prompts.txt"),
                                          "--new-tokens", "32", "--samples", "0", "--steps", "100",
                                          "--batch-size", "32", "--heads", "3", "--hidden-mult", "1",
                                          "--draft-vocab", "256", "--lr", "1e-2", "--threads", "1", "--quiet"]) == 0
        finally:
            torch.set_num_threads(old)

    return build_once(tmp_path_factory, "tiny-smollm2-heads", train) / "heads"


@pytest.fixture(scope="session")
def tiny_smollm2_spec_store(tiny_smollm2: list[Path], tiny_smollm2_heads: Path,
                            tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model store holding smollm2.mar of `tiny_smollm2`: SmolLM2's CPU plan plus speculation with
    `tiny_smollm2_heads`."""
    import yaml

    def build(tmp: Path) -> None:
        config = yaml.safe_load((ROOT / "config/models/smollm2-cpu.yaml").read_text())
        config["servekit"]["speculation"] = {"heads": "speculator", "n_heads": 3, "max_batch": 4}
        (tmp / "smollm2-cpu-spec.yaml").write_text(yaml.safe_dump(config))
        build_archive("smollm2", tmp / "store", config=tmp / "smollm2-cpu-spec.yaml", weights=tiny_smollm2,
                      speculator=tiny_smollm2_heads, compress=False)

    return build_once(tmp_path_factory, "tiny-smollm2-spec", build) / "store"


@pytest.fixture(scope="module")
def tiny_llama():
    """A tiny random-init Llama (servekit.optimizations.models.llama), the same weights every time."""
    from servekit.optimizations.models.llama import LlamaConfig, init_random

    return init_random(LlamaConfig.tiny(), seed=0)


@pytest.fixture(scope="session")
def tiny_trained_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Speculator heads (4) trained by the CLI recipe on the tiny model of ``tiny_llama`` (seconds)."""
    from servekit.optimizations.training import train_speculator

    def train(out: Path) -> None:
        old = torch.get_num_threads()
        try:
            assert train_speculator.main(["--tiny", "--out", str(out), "--prompts-limit", "30", "--new-tokens",
                                          "24", "--steps", "40", "--batch-size", "128", "--device", "cpu", "--quiet",
                                          "--topic-prompts", "12", "--draft-vocab", "192"]) == 0
        finally:
            torch.set_num_threads(old)

    return build_once(tmp_path_factory, "spec-tiny", train)


# Modules that take minutes (live LLM servers, end-to-end sweeps, compiles), longest first as
# measured with --durations on 2 cores: the longest start first, so that no worker picks one up at
# the end while the other sits idle. Only a scheduling hint for pytest-xdist (`make test` passes
# --no-loadscope-reorder so that this order holds): a module missing here still runs, just later.
# The second is one that needs no session artefact: the first builds the tiny SmolLM2, its heads
# and its archive (~25 s), and a second LLM module would wait for them with its core idle.
SLOW_MODULES = (
    "test_llm_server.py", "test_triton_decode.py", "test_llm_continuous_server.py", "test_bench_e2e.py",
    "test_reliability_llm.py", "test_archive_path.py", "test_reliability_faults.py", "test_embedding_runner.py",
    "test_handlers_unit.py", "test_llama_weights.py", "test_bench_llm_e2e.py", "test_embedding_architectures.py",
    "test_k8s_pod_live.py", "test_rotary_encoders.py", "test_package.py", "test_server_embedding.py",
    "test_plan_bench_ready.py", "test_bench_known_answer.py", "test_structured_server.py",
    "test_prometheus_llm_dashboard.py", "test_generate_logic.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order otherwise


# Modules whose minutes are mostly waiting, their core nearly idle meanwhile (a `ps` sampler beside
# a run counted 0.2-0.57 CPU seconds per second of theirs): a handler that sleeps 20 ms per request
# behind fixed measurement windows, Prometheus scraping every second, a pod's probes and hooks, a
# soak at a fixed 10 requests/s. With 3 or more workers the last one runs only these, while the
# others run everything else. Not the known-answer benchmark, which waits as much: beside two busy
# lanes its requests' p99 at 5 requests/s reached 100 ms (20 ms of sleep), and its SLA boundary
# came out at 0.29-0.54x the prediction; beside one, as on a main lane, it holds.
WAITING_MODULES = ("test_k8s_pod_live.py", "test_bench_refine.py", "test_prometheus_llm_dashboard.py",
                   "test_reliability_soak.py")


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN201 (xdist's Scheduling)
    workers = config.getoption("numprocesses", 0)
    if config.getoption("dist", None) != "loadscope" or not isinstance(workers, int) or workers < 3:
        return None  # xdist's own scheduling
    from xdist.scheduler import LoadScopeScheduling

    class WaitingLaneScheduling(LoadScopeScheduling):
        """loadscope with one lane for WAITING_MODULES: worker gw{N-1} takes only those (and stops
        when none is left); the other workers take them only once nothing else is queued."""

        def _assign_work_unit(self, node) -> None:  # noqa: ANN001 (xdist's WorkerController)
            waiting_lane = node.gateway.id == f"gw{workers - 1}"
            scopes = [s for s in self.workqueue if (Path(s.split("::")[0]).name in WAITING_MODULES) == waiting_lane]
            if not scopes and waiting_lane:
                node.shutdown()
                return
            scope = (scopes or list(self.workqueue))[0]
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

    return WaitingLaneScheduling(config, log)
