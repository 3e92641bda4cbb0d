"""benchmarks/score_passes.py on the CPU: a tiny cross-encoder's rerank requests timed stage by stage,
the buckets' figures and a kernel profile written, bad arguments refused before any model loads."""
from __future__ import annotations

import json

import pytest

from servekit.benchmarks.score_passes import main
from servekit.benchmarks.shaped_models import sequence_classifier


def test_requests_are_timed_and_written(tmp_path, capsys):
    model = sequence_classifier(tmp_path / "ce", width=32, layers=1, heads=2, labels=("score",))
    config = tmp_path / "cpu.yaml"
    config.write_text("servekit:\n  device: cpu\n  buckets: {batch_sizes: [1, 4, 8], seq_lens: [32, 64, 128]}\n")
    assert main(["--model-dir", str(model), "--config", str(config), "--requests", "3", "--warmup", "1",
                 "--documents", "6", "--doc-tokens", "40", "--profile", "4x64", "--label", "t",
                 "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "score-passes-t.json").read_text())
    assert result["requests"] == 3 and result["documents"] == 6
    assert 6 * 32 < result["tokens_per_request"] < 6 * 60  # documents of 32-48 tokens, the query's and specials
    assert all(result["stages"][s]["mean_ms"] > 0 for s in ("parse", "tokenize", "forward"))
    assert result["total"]["mean_ms"] >= result["stages"]["forward"]["mean_ms"]
    assert 0 <= result["padding"] < 1 and result["pairs_per_s"] > 0
    assert "aten::" in result["profile"]  # the profiled passes' operator table
    assert "one process, one request after another" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--profile", "128by128"], "give a bucket as PAIRSxTOKENS"),
    (["--requests", "0"], "--requests and --documents must be >= 1"),
])
def test_bad_arguments_are_named(tmp_path, capsys, args, message):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        main(["--model-dir", str(tmp_path), "--out", str(tmp_path / "out"), *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_folder_without_a_model_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--model-dir", str(tmp_path), "--out", str(tmp_path / "out")])
    assert "no config.json" in capsys.readouterr().err
