"""The demo's closing sentence on CPU: said only when servekit did not beat stock in its sweep."""
from __future__ import annotations

import json
from pathlib import Path

from servekit.demo import cpu_verdict


def test_the_demo_explains_a_cpu_loss_and_stays_quiet_otherwise(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"margin_over_baseline": 0.82}))
    sentence = cpu_verdict(results)
    assert sentence is not None and "0.8 x stock's capacity" in sentence and "GPU" in sentence
    results.write_text(json.dumps({"margin_over_baseline": 1.7}))
    assert cpu_verdict(results) is None
    results.write_text(json.dumps({"margin_over_baseline": None}))  # no baseline measured
    assert cpu_verdict(results) is None
    assert cpu_verdict(tmp_path / "missing.json") is None
    results.write_text("{not json")
    assert cpu_verdict(results) is None
