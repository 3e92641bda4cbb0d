"""`servekit archive PATH` on cross-encoders and sequence classifiers: the kind read from the model's
files (rerank for one label, classify for several), a model-config from the cross-encoder template
written beside the archive, and a one-line exit-2 error with nothing written for what is not served."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import yaml

from servekit.archive import main
from servekit.model_source import infer_kind, model_source
from tiny_classifiers import cross_encoder, hf_classifier



@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"ce": cross_encoder(root / "ce", "bert", max_length=24),
            "multi": hf_classifier(root / "multi", "distilbert", ("toxic", "insult", "threat"),
                                   "multi_label_classification"),
            "single": hf_classifier(root / "single", "roberta", ("neg", "pos"))}


def test_kinds_and_files_read_from_the_models_own_files(models):
    assert infer_kind(models["ce"]) == "rerank" and infer_kind(models["multi"]) == "classify"
    assert infer_kind(models["single"]) == "classify"
    ce = model_source(models["ce"])
    names = {w.name for w in ce.files}
    assert {"config.json", "tokenizer.json", "model.safetensors", "config_sentence_transformers.json"} <= names
    assert ce.max_tokens == 24  # the CrossEncoder's own max_length (tokenizer_config.json)
    assert model_source(models["single"]).max_tokens == 80  # no limit given: the position table's


def test_archive_of_a_crossencoder_writes_the_mar_and_its_model_config(models, tmp_path, archive_in_process):
    out = tmp_path / "store"
    r = archive_in_process(models["ce"], "--out", out, "--device", "cpu", "--no-compress", "--name", "reranker")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["reranker.mar", "reranker.yaml"]
    cfg = yaml.safe_load((out / "reranker.yaml").read_text())
    assert cfg["servekit"]["buckets"]["seq_lens"] == [16, 24]
    assert cfg["servekit"]["limits"]["max_texts_per_request"] == 1000
    with zipfile.ZipFile(out / "reranker.mar") as z:
        names = set(z.namelist())
        manifest = json.loads(z.read("MAR-INF/MANIFEST.json"))
    assert manifest["model"]["handler"] == "score_handler.py"
    assert {"config_sentence_transformers.json", "servekit/optimizations/score/runner.py",
            "servekit/optimizations/models/classifier.py"} <= names


def test_the_gpu_config_keeps_the_templates_finer_length_buckets_up_to_the_models_limit(models):
    """The cross-encoder GPU template steps its sequence buckets by at most 1.5x (less padding per
    pass); a model's generated config keeps those below its limit, then doubles up to the limit."""
    from servekit.model_source import generated_config
    from servekit.optimizations.buckets import seq_buckets
    from servekit.resources import model_config

    template = yaml.safe_load(model_config("cross-encoder-gpu").read_text())["servekit"]["buckets"]["seq_lens"]
    assert all(b <= 1.5 * a for a, b in zip(template, template[1:]))
    _, cfg = generated_config(model_source(models["single"]), "cuda", "test")
    assert cfg["servekit"]["buckets"]["seq_lens"] == [s for s in template if s < 80] + [80]
    assert seq_buckets(8192, given=[16, 32, 64, 128]) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert seq_buckets(512) == [16, 32, 64, 128, 256, 512]


def _break(path: Path, **changes) -> Path:
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("breakage, kind, message", [
    ("gpt2", None, "a sequence classifier of model_type 'gpt2'"),
    ("token", None, "BertForTokenClassification is a token classifier"),
    ("activation", None, "cross-encoder activation 'torch.nn.modules.activation.ReLU' is not supported"),
    ("labels", None, "classifier.weight has 1 outputs but config.json names 2 labels"),
    ("problem", None, "problem_type 'ranking' is not one of"),
    ("kind", "rerank", "--kind rerank does not fit a model with 2 labels"),
])
def test_unservable_classifiers_fail_in_one_line_leaving_nothing(tmp_path, capsys, breakage, kind, message):
    path = hf_classifier(tmp_path / "m", "bert")
    if breakage == "gpt2":
        _break(path, model_type="gpt2", architectures=["GPT2ForSequenceClassification"])
    elif breakage == "token":
        _break(path, architectures=["BertForTokenClassification"])
    elif breakage == "activation":
        _break(path, sentence_transformers={"activation_fn": "torch.nn.modules.activation.ReLU"})
    elif breakage == "labels":
        _break(path, id2label={"0": "a", "1": "b"}, label2id={"a": 0, "b": 1})
    elif breakage == "problem":
        _break(path, problem_type="ranking")
    elif breakage == "kind":
        path = hf_classifier(tmp_path / "two", "bert", ("a", "b"))
    out = tmp_path / "store"
    capsys.readouterr()  # the model builders' progress bars
    code = main([str(path), "--out", str(out), "--device", "cpu", *(["--kind", kind] if kind else [])])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists() or not any(out.iterdir())
