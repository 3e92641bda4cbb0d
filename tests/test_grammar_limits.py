"""benchmarks/grammar_limits.py on SmolLM2's tokenizer: the structured benchmark's schemas pass the
engine's mask limit, the grammars built to be costly are measured and the ones over it refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from servekit.benchmarks import grammar_limits


def test_the_schemas_pass_and_costly_grammars_are_measured_and_refused(tmp_path: Path) -> None:
    assert grammar_limits.main(["--steps", "3", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "grammar_limits.json").read_text())
    rows = {r["grammar"]: r for r in res["table"]}
    assert all(r["verdict"] == "accepted" for r in res["schemas"]) and len(res["schemas"]) > 20
    assert rows["regex a{300000}"]["verdict"].startswith("400: the regex makes decoding too slow")
    assert rows["regex a{300000}"]["first_ms"] > res["meta"]["mask_limit_ms"]
    assert rows["schema referring only to itself"]["llguidance_error"] == "NoExtensionBias"
    assert "admits no output" in rows["schema referring only to itself"]["verdict"]
    assert rows["regex [0-9]{20000}"]["verdict"] == "accepted"
    assert "| regex a{300000} |" in (tmp_path / "grammar_limits.md").read_text()


def test_steps_below_one_are_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        grammar_limits.main(["--steps", "0"])
    assert "--steps must be at least 1" in capsys.readouterr().err
