"""Build a session artefact (an archive store, trained speculator heads) once per test run, however
many pytest-xdist workers ask for it: the first builds it under a file lock in the run's shared
temp folder, the others wait and reuse it."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import pytest
from filelock import FileLock

DONE = ".built"


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temp folder every worker of this run sees: the parent of the worker's own base temp
    under xdist (`pytest-N/popen-gw0` -> `pytest-N`), the base temp itself otherwise."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if base.name.startswith("popen-gw") else base


def build_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name` under the run's shared temp folder, filled by `build(folder)` the first
    time any worker asks. A build that raises leaves nothing behind, so the next asker retries."""
    folder = shared_root(tmp_path_factory) / "shared" / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if (folder / DONE).exists():
            return folder
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        try:
            build(folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        (folder / DONE).touch()
    return folder
