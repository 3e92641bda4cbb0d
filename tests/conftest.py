"""Shared fixtures. Server tests share one TorchServe per session (start-up costs ~20 s on 2 cores)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch

from benchmarks.server import TorchServe
from handlers.archive import build_archive

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model store holding minilm.mar built from the working tree."""
    store = tmp_path_factory.mktemp("model_store")
    build_archive("minilm", store)
    return store


@pytest.fixture(scope="session")
def minilm_server(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchServe]:
    """A live TorchServe on free ports with `minilm` registered (batch 8, delay 50 ms, 1 worker)."""
    with TorchServe(tmp_path_factory.mktemp("ts-run"), model_store) as ts:
        ts.register("minilm.mar", "minilm", batch_size=8, max_batch_delay_ms=50, workers=1)
        yield ts


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch CPU thread for a module of small-matrix tests: on 2 shared cores, two OpenMP
    threads run small matmuls many times slower as soon as another process holds a core."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
