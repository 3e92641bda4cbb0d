"""benchmarks/engine_first_burst.py on the CPU SmolLM2 plan: bursts of real prompts through the
engine, every request answered; CUDA graph launches are logged only where graphs exist (GPU)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from servekit.benchmarks.engine_first_burst import main
from servekit.optimizations.llm.generate import GraphedStep
from servekit.resources import model_config


def test_bursts_through_the_cpu_engine(tmp_path: Path) -> None:
    real_run = GraphedStep.run
    assert main(["--out", str(tmp_path), "--config", str(model_config("smollm2-cpu")), "--bursts", "2",
                 "--streams", "3", "--max-tokens", "2"]) == 0
    assert GraphedStep.run is real_run  # the launch log put the real method back
    res = json.loads((tmp_path / "engine_first_burst.json").read_text())
    assert res["graphs"] == 0 and res["frozen_objects"] > 0
    assert len(res["bursts"]) == 2
    for b in res["bursts"]:
        assert b["requests"] == b["answered"] == 3
        assert 3 <= b["tokens"] <= 6 and b["steps"] >= 2  # prompts, then a decode step (or a stop token)
        assert 0 < b["ttft_ms_p50"] <= b["ttft_ms_p99"] <= b["ttft_ms_max"]
        assert b["launches"] == 0  # no graph on the CPU
    assert res["environment"]["command"].startswith("python -m servekit.benchmarks.engine_first_burst")


def test_bad_arguments_are_named(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--streams", "0"])
    assert "--streams must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="captures no CUDA graphs"):
        main(["--out", str(tmp_path), "--config", str(model_config("smollm2-cpu")), "--replay-first"])
