"""`servekit archive` refuses speculator heads that the model-config cannot use, and a model-config
that asks for heads it was not given, before building anything."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def archive(capsys: pytest.CaptureFixture, *args: str, out: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """`servekit archive smollm2 ...` in this process (its main(), as the console script calls it; a
    subprocess would spend seconds importing torch before each refusal): (exit code, stderr)."""
    from servekit.archive import main

    monkeypatch.chdir(ROOT)  # the paths below are the checkout's
    code = main(["smollm2", "--out", str(out), *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--config", "config/models/smollm2-spec.yaml"], "asks for speculator heads (servekit.speculation): give "
                                                      "--speculator DIR"),
    (["--config", "config/models/smollm2-cpu.yaml", "--speculator", "optimizations"],
     "--speculator given but config/models/smollm2-cpu.yaml has no servekit.speculation section"),
    (["--config", "config/models/smollm2-spec.yaml", "--speculator", "no/such/heads"],
     "speculator heads not found: no/such/heads/speculator.json"),
    (["--config", "no/such.yaml"], "model-config not found: no/such.yaml"),
])
def test_archive_refuses_mismatched_speculator(tmp_path: Path, args: list[str], message: str, capsys,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    code, err = archive(capsys, *args, out=tmp_path, monkeypatch=monkeypatch)
    assert code == 2, err
    assert err.strip() == f"servekit archive: error: {message}" or message in err, err
    assert "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing written


def test_no_compress_builds_a_stored_mar(tmp_path: Path) -> None:
    import zipfile

    r = subprocess.run([sys.executable, "-m", "servekit.archive", "minilm", "--out", str(tmp_path), "--no-compress"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    with zipfile.ZipFile(tmp_path / "minilm.mar") as z:
        infos = z.infolist()
        names = {i.filename for i in infos}
    assert {"MAR-INF/MANIFEST.json", "model.safetensors", "minilm.yaml", "embedding_handler.py",
            "servekit/__init__.py", "servekit/handlers/embedding_handler.py", "servekit/optimizations/plan.py"} <= names
    assert not any(n.startswith(("handlers/", "optimizations/")) for n in names)  # one namespace only
    assert {i.compress_type for i in infos} == {zipfile.ZIP_STORED}
