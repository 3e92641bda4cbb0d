"""benchmarks/grammar_mask_costs.py end to end on the tiny random SmolLM2: it records the model's
constrained answers to every schema of the structured benchmark and times their masks under each
slice set (llguidance's, servekit's, one slice per string length), with the figures written where
asked."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from servekit.benchmarks import grammar_mask_costs
from servekit.benchmarks.structured_bench import SCHEMAS


def test_the_benchmark_times_each_slice_set_over_the_models_answers(tiny_smollm2: list[Path], tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "costs.json"
    assert grammar_mask_costs.main([str(tiny_smollm2[0].parent), "--temperatures", "0", "0.8", "--max-tokens", "6",
                                    "--rows", "4", "--threads", "2", "--every-length", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["answers"] == 2 * len(SCHEMAS) and res["rows"] == 4
    sets = res["slice_sets"]
    assert set(sets) == {"llguidance's default", "servekit's", "every length to 30"}
    masks = {r["masks"] for r in sets.values()}
    assert len(masks) == 1 and 2 * len(SCHEMAS) <= masks.pop() <= 2 * len(SCHEMAS) * 6  # the same answers replayed
    for r in sets.values():
        assert r["mask_us"]["p50"] <= r["mask_us"]["p99"] <= r["mask_us"]["max"]
        assert r["steps"] > 0 and r["step_of_4_rows_us"]["mean"] > 0 and r["compile_ms"]["median"] > 0
    assert "servekit's slices:" in capsys.readouterr().out


def test_a_folder_that_is_no_model_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        grammar_mask_costs.main([str(tmp_path)])
    assert "is not a model folder" in capsys.readouterr().err
