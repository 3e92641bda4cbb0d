"""benchmarks/grammar_mask_costs.py end to end on the tiny random SmolLM2: it records the model's
constrained answers to every schema of the structured benchmark and times their masks under each
slice set (llguidance's, servekit's, one slice per string length) and with every maxLength in the
grammar instead of counted, with the figures written where asked; the recorded answers kept with ``--answers`` and replayed from there."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from servekit.benchmarks import grammar_mask_costs
from servekit.benchmarks.structured_bench import SCHEMAS


def test_the_benchmark_times_each_slice_set_over_the_models_answers(tiny_smollm2: list[Path], tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    out, answers = tmp_path / "costs.json", tmp_path / "answers.json"
    args = [str(tiny_smollm2[0].parent), "--temperatures", "0", "0.8", "--max-tokens", "6", "--rows", "4",
            "--answers", str(answers), "--out", str(out)]
    assert grammar_mask_costs.main([*args, "--threads", "1", "2", "--every-length"]) == 0
    res = json.loads(out.read_text())
    recorded = json.loads(answers.read_text())
    assert [a["schema"] for a in recorded] == 2 * list(range(len(SCHEMAS)))
    assert res["answers"] == 2 * len(SCHEMAS) and res["rows"] == 4
    sets = res["slice_sets"]
    assert set(sets) == {"llguidance's default", "servekit's", "every length to 30",
                         f"servekit's, {grammar_mask_costs.BOUNDED_IN_GRAMMAR}"}
    masks = {r["masks"] for r in sets.values()}
    assert len(masks) == 1 and 2 * len(SCHEMAS) <= masks.pop() <= 2 * len(SCHEMAS) * 6  # the same answers replayed
    for r in sets.values():
        assert r["mask_us"]["p50"] <= r["mask_us"]["p99"] <= r["mask_us"]["max"]
        assert r["steps"] > 0 and r["compile_ms"]["median"] > 0
        assert r["step_of_4_rows_on_1_threads_us"]["mean"] > 0 and r["step_of_4_rows_on_2_threads_us"]["mean"] > 0
    assert "servekit's slices:" in capsys.readouterr().out
    # A second run replays the same answers from the file, without recording.
    assert grammar_mask_costs.main([*args, "--threads", "2"]) == 0
    assert "answers read from" in capsys.readouterr().out
    again = json.loads(out.read_text())["slice_sets"]["servekit's"]
    assert again["masks"] == sets["servekit's"]["masks"] and again["steps"] == sets["servekit's"]["steps"]


def test_answers_that_are_not_recorded_answers_are_named(tiny_smollm2: list[Path], tmp_path: Path) -> None:
    bad = tmp_path / "answers.json"
    bad.write_text(json.dumps([{"schema": 10_000, "tokens": [1]}]))
    with pytest.raises(SystemExit, match="not a list of recorded answers"):
        grammar_mask_costs.main([str(tiny_smollm2[0].parent), "--answers", str(bad)])


def test_a_folder_that_is_no_model_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        grammar_mask_costs.main([str(tmp_path)])
    assert "is not a model folder" in capsys.readouterr().err
