"""The benchmark YAML: shipped files validate, mistakes fail with the key's path."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from servekit.benchmarks.bench.schema import SchemaError, load_config, parse_config

ROOT = Path(__file__).resolve().parent.parent
SWEEPS = sorted((ROOT / "benchmarks" / "sweeps").glob("*.yaml"))

BASE = {
    "name": "t",
    "target": {"local": {}},
    "variants": [{"name": "stock", "model": "minilm-stock", "baseline": True,
                  "sweep": {"workers": [1], "batch_size": [1]}},
                 {"name": "fast", "model": "minilm", "plan": {"precision": "fp32"}}],
    "sweep": {"workers": [1, 2], "batch_size": [1, 8]},
    "payloads": {"body": {"text": "hi"}},
    "sla": {"p99_ms": 50},
}


def with_(path: str, value, base=BASE) -> dict:
    raw = copy.deepcopy(base)
    node = raw
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node.setdefault(k, {})
    node[keys[-1]] = value
    return raw


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_shipped_sweeps_validate(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A sweep of a model folder that benchmarks/shaped_models.py writes (shaped/<name>, random weights
    # in a real model's shape, 400+ MB) is checked against a tiny encoder folder at the same path.
    folders = {v["model"] for v in yaml.safe_load(path.read_text())["variants"]
               if str(v.get("model", "")).startswith("shaped/")}
    if folders:
        from tiny_encoders import st_model

        monkeypatch.chdir(tmp_path)
        for folder in folders:
            st_model(tmp_path / folder, "bert")
    cfg = load_config(path)
    assert cfg.variants and cfg.sla.p99_ms > 0
    assert cfg.baseline is not None, "every shipped sweep compares against a stock baseline"


def test_defaults_and_variant_axes() -> None:
    cfg = parse_config(BASE)
    assert cfg.load.mode == "open" and cfg.load.arrival == "poisson" and cfg.load.search.start is None
    assert cfg.measurement.tolerance == 0.10 and cfg.measurement.stable_windows == 3
    stock, fast = cfg.variants
    assert stock.axes.workers == (1,) and stock.axes.batch_size == (1,)
    assert fast.axes.workers == (1, 2) and fast.axes.batch_size == (1, 8)
    assert cfg.baseline is stock
    assert cfg.load.search.refine_precision is None and cfg.measurement.inprocess_s == 0
    refined = parse_config(with_("load.search", {"precision": 0.2, "refine": {"precision": 0.03}}))
    assert (refined.load.search.refine_precision, refined.load.search.refine_points) == (0.03, 6)


@pytest.mark.parametrize("path, value, message", [
    ("sweep.batch_size", [1, 8, 0], "sweep.batch_size[2]: expected a positive integer, got 0"),
    ("sweep.workers", [1, "two"], "sweep.workers[1]: expected a positive integer"),
    ("sweep.max_batch_delay_ms", [-1], "sweep.max_batch_delay_ms[0]: expected a non-negative integer"),
    ("sweep.batch_sizes", [1], "sweep.batch_sizes: unknown key"),
    ("sla.p99_ms", -5, "sla.p99_ms: expected a positive number"),
    ("sla.max_error_rate", 1.5, "sla.max_error_rate: expected a number in [0, 1)"),
    ("sla.p50_ms", 80, "sla.p50_ms: 80.0 is above sla.p99_ms"),
    ("load.mode", "burst", "load.mode: 'burst' is not one of open, closed"),
    ("load.levels", [10, 5], "load.levels: values must be strictly increasing"),
    ("load.search", {"growth": 1.0}, "load.search.growth: expected a number > 1"),
    ("load.search", {"precison": 0.1}, "load.search.precison: unknown key"),
    ("load.search", {"precision": 0.1, "refine": {"precision": 0.2}},
     "load.search.refine.precision: must be finer than load.search.precision (0.1)"),
    ("load.search", {"refine": {"max_points": 3}}, "load.search.refine: give `precision`"),
    ("load.search", {"refine": {"precision": 0.03, "points": 3}}, "load.search.refine.points: unknown key"),
    ("measurement.inprocess_s", -1, "measurement.inprocess_s: expected a non-negative number"),
    ("measurement.max_trials", 2, "measurement.max_trials: 2 is fewer than stable_windows"),
    ("measurement.tolerance", 0, "measurement.tolerance: expected a number in (0, 1)"),
    ("variants.1.plan", {"precision": "fp12"}, "variants[1].plan.precision: 'fp12' is not one of"),
    ("variants.1.model", "nope", "variants[1].model: 'nope' is neither a bundled model"),
    ("variants.1.name", "stock", "variants[1].name: duplicate variant name 'stock'"),
    ("variants.1.name", "bad name", "variants[1].name: 'bad name' must be"),
    ("variants.1.overrides", {"batchSize": 4}, "variants[1].overrides.batchSize: set by the sweep"),
    ("variants.1.baseline", True, "variants: at most one variant may be `baseline: true`"),
    ("variants.0.sweep", {"workers": [0]}, "variants[0].sweep.workers[0]: expected a positive integer"),
    ("target", {"local": {}, "remote": {"inference_url": "http://x:1", "management_url": "http://x:2"}},
     "target: give exactly one of"),
    ("target", {"remote": {"inference_url": "localhost:8080", "management_url": "http://x:2"}},
     "target.remote.inference_url: expected an http(s):// URL"),
    ("target", {"remote": {"inference_url": "http://x:1", "management_url": "http://x:2"}},
     "variants[0].model: a remote target needs `target.remote.model_store`"),
    ("payloads", {"body": {}, "file": "x.jsonl"}, "payloads: give exactly one of"),
    ("payloads", {"file": "no/such/file.jsonl"}, "payloads.file: "),
    ("colour", "blue", "colour: unknown key"),
])
def test_errors_name_the_key(path: str, value, message: str) -> None:
    with pytest.raises(SchemaError) as e:
        parse_config(with_(path, value))
    assert message in str(e.value)


def test_missing_required_keys() -> None:
    raw = copy.deepcopy(BASE)
    del raw["sla"]
    with pytest.raises(SchemaError, match="sla: required"):
        parse_config(raw)
    with pytest.raises(SchemaError, match=r"sla.p99_ms: required"):
        parse_config(with_("sla", {"p50_ms": 10}))


def test_closed_loop_levels_are_integers() -> None:
    with pytest.raises(SchemaError, match=r"load.levels\[1\]: expected a positive integer"):
        parse_config(with_("load", {"mode": "closed", "levels": [1, 2.5]}))
    cfg = parse_config(with_("load", {"mode": "closed", "levels": [1, 4], "search": False}))
    assert cfg.load.levels == (1, 4) and not cfg.load.search.enabled


def test_invalid_yaml_file(tmp_path: Path) -> None:
    p = tmp_path / "b.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(SchemaError, match="not valid YAML"):
        load_config(p)
    p.write_text(yaml.safe_dump(with_("sweep.batch_size", [1, 8, 0])))
    from servekit.benchmarks.bench.runner import main
    assert main([str(p), "--check"]) == 2


# -- streamed LLM sweeps ---------------------------------------------------------------------------
LLM = {
    "name": "llm",
    "target": {"local": {}},
    "variants": [{"name": "plain", "model": "smollm2", "config": "config/models/smollm2-cpu.yaml", "baseline": True},
                 {"name": "spec", "model": "smollm2", "config": "config/models/smollm2-cpu.yaml",
                  "plan": {"speculation": {"n_heads": 2}}, "speculator": "heads"}],
    "request": {"path": "/predictions/{model}/1.0/v1/chat/completions", "stream": "sse"},
    "payloads": {"file": "benchmarks/payloads/chat.jsonl", "set": {"max_tokens": 16}},
    "sla": {"p99_ms": 5000, "ttft_p99_ms": 500, "itl_p99_ms": 50},
}


def test_llm_sweep_parses() -> None:
    cfg = parse_config(LLM)
    assert cfg.streamed and cfg.request.stream == "sse"
    assert (cfg.sla.ttft_p99_ms, cfg.sla.itl_p99_ms) == (500.0, 50.0)
    plain, spec = cfg.variants
    assert plain.speculator is None and spec.speculator == ROOT / "heads"  # resolved, not required to exist yet
    assert cfg.payloads.set_keys == {"max_tokens": 16}
    assert not parse_config(BASE).streamed


@pytest.mark.parametrize("path, value, message", [
    ("request.stream", "websocket", "request.stream: 'websocket' is not one of none, sse"),
    ("sla.itl_p99_ms", -1, "sla.itl_p99_ms: expected a positive number, got -1"),
    ("sla.ttft_p99_ms", "fast", "sla.ttft_p99_ms: expected a positive number"),
    ("payloads.set", [1], "payloads.set: expected a mapping, got list"),
    ("payloads", {"chat": {"set": "poems"}}, "payloads.chat.set: 'poems' is not one of short, passages, mixed"),
    ("payloads", {"chat": {"count": 3}}, "payloads.chat.set: required"),
    ("payloads", {"chat": {"set": "mixed", "tokenizer": "no/such/tokenizer.json"}}, "payloads.chat.tokenizer: "),
    # the smollm2 plan goes through the LLM handler's own parser, merged with the model-config
    ("variants.1.plan", {"speculation": {"n_heads": 0}}, "variants[1].plan.speculation.n_heads: expected a positive"),
    ("variants.1.plan", {"quantization": "int8_weight_only", "speculation": {}},
     "variants[1].plan.quantization: unknown key"),
    ("variants.1.plan", {"limits": {"max_tokens": 4096}}, "variants[1].plan.limits.max_tokens: 4096 leaves no room"),
    ("variants.1.plan", {}, "variants[1].speculator: the variant's plan has no `speculation` section"),
    ("variants.0.plan", {"speculation": {"n_heads": 2}}, "variants[0].speculator: required"),
    ("variants", [LLM["variants"][0], {"name": "spec", "mar": "smollm2.mar", "speculator": "heads"}],
     "variants[1].speculator: only for variants built from `model`"),
    # TorchServe 0.12 stalls a continuous-batching model's running requests behind an idle second worker
    ("sweep", {"workers": [1, 2]}, "variants[0]: sweeps workers [1, 2] over a continuous-batching model; "
                                   "TorchServe 0.12's continuous batching serves one worker per model"),
    ("variants.1.sweep", {"workers": [2]}, "variants[1]: sweeps workers [2] over a continuous-batching model"),
])
def test_llm_errors_name_the_key(path: str, value, message: str) -> None:
    with pytest.raises(SchemaError) as e:
        parse_config(with_(path, value, LLM))
    assert message in str(e.value)


def test_one_worker_is_checked_only_for_continuous_batching() -> None:
    """Workers sweep freely where TorchServe batches per call (embeddings) and at one for the LLM."""
    assert parse_config(with_("sweep", {"workers": [1]}, LLM)).variants[0].axes.workers == (1,)
    assert parse_config(BASE).variants[1].axes.workers == (1, 2)


@pytest.mark.parametrize("key", ["ttft_p99_ms", "itl_p99_ms"])
def test_token_slas_need_a_streamed_sweep(key: str) -> None:
    with pytest.raises(SchemaError, match=rf"sla.{key}: only for streamed requests \(set `request.stream: sse`\)"):
        parse_config(with_(f"sla.{key}", 100, BASE))


def test_streamed_bodies_must_ask_for_a_stream(tmp_path: Path) -> None:
    from servekit.benchmarks.bench.payloads import load_bodies

    f = tmp_path / "chat.jsonl"
    f.write_text('{"messages": [], "stream": true}\n\n{"messages": []}\n')
    cfg = parse_config(with_("payloads", {"file": str(f)}, LLM))
    with pytest.raises(SchemaError, match=rf'payloads: {f}:3 lacks "stream": true'):
        load_bodies(cfg.payloads, streamed=True)
    assert len(load_bodies(cfg.payloads)) == 2  # an embedding sweep does not ask
    cfg = parse_config(with_("payloads", {"file": str(f), "set": {"stream": True, "max_tokens": 8}}, LLM))
    bodies = [json.loads(b) for b in load_bodies(cfg.payloads, streamed=True)]
    assert bodies == [{"messages": [], "stream": True, "max_tokens": 8}] * 2
    cfg = parse_config(with_("payloads", {"body": ["not", "an", "object"], "set": {"stream": True}}, LLM))
    with pytest.raises(SchemaError, match="payloads.set: payloads.body is not a JSON object"):
        load_bodies(cfg.payloads)


def test_shipped_chat_payloads() -> None:
    from servekit.benchmarks.bench.payloads import load_bodies

    cfg = parse_config(LLM)
    bodies = [json.loads(b) for b in load_bodies(cfg.payloads, streamed=True)]
    assert len(bodies) >= 40 and all(b["max_tokens"] == 16 for b in bodies)  # `set` wins over the file
    raw = [json.loads(line) for line in (ROOT / "benchmarks/payloads/chat.jsonl").read_text().splitlines()]
    assert all(b["temperature"] == 0 and b["stream_options"] == {"include_usage": True} for b in raw)
    assert min(b["max_tokens"] for b in raw) >= 32 and max(b["max_tokens"] for b in raw) <= 128
    assert len({b["messages"][-1]["content"] for b in raw}) == len(raw)


def test_generated_chat_payloads() -> None:
    from servekit.benchmarks.bench.payloads import load_bodies

    chat = {"set": "mixed", "count": 12, "seed": 1, "max_tokens": 64}
    bodies = [json.loads(b) for b in load_bodies(parse_config(with_("payloads", {"chat": chat}, LLM)).payloads,
                                                 streamed=True)]
    assert len({json.dumps(b["messages"]) for b in bodies}) == 12  # every body a different prompt
    assert all(b["stream"] and b["temperature"] == 0 and 32 <= b["max_tokens"] <= 64 for b in bodies)
    again = load_bodies(parse_config(with_("payloads", {"chat": chat, "set": {"max_tokens": 16}}, LLM)).payloads)
    assert [json.loads(b)["messages"] for b in again] == [b["messages"] for b in bodies]  # same seed, same prompts
    assert all(json.loads(b)["max_tokens"] == 16 for b in again)


def test_speculator_heads_are_checked_when_the_run_starts(tmp_path: Path) -> None:
    from servekit.benchmarks.bench.runner import check_heads

    spec = parse_config(with_("variants.1.speculator", str(tmp_path), LLM)).variants[1]
    with pytest.raises(SchemaError, match=rf"variants\[spec\].speculator: {tmp_path} lacks speculator.json, "
                                          "speculator.safetensors; train heads with `servekit train-speculator"):
        check_heads(spec)
    for name in ("speculator.json", "speculator.safetensors"):
        (tmp_path / name).write_text("")
    check_heads(spec)


def test_inprocess_reads_the_texts_of_every_body_shape(tmp_path: Path) -> None:
    from servekit.benchmarks.bench.inprocess import payload_texts

    bodies = tmp_path / "bodies.jsonl"
    bodies.write_text('{"text": "a"}\n{"input": ["b", "c", "d"]}\n["e", "f"]\n\n{"text": ["g"]}\n')
    per_body, mean = payload_texts(bodies)
    assert per_body == [["a"], ["b", "c", "d"], ["e", "f"], ["g"]] and mean == 7 / 4
    bodies.write_text('{"sleep_ms": 3}\n')
    with pytest.raises(ValueError, match="no request body holds a text"):
        payload_texts(bodies)


def test_a_variant_names_a_model_folder(tmp_path: Path) -> None:
    """`model:` takes any folder `servekit archive PATH` takes (relative to the sweep file): the
    variant's base model-config is the one generated for it, its archive ships the model's own
    files, and the in-process reference runs its plan."""
    import zipfile

    from tiny_encoders import hf_encoder, st_model

    from servekit.benchmarks.bench import archives, inprocess

    st_model(tmp_path / "models" / "enc", "bert", pooling="cls", max_seq_length=24)
    raw = with_("variants.1.model", "models/enc")
    del raw["variants"][1]["plan"]
    cfg = parse_config(raw, base=tmp_path)
    variant = cfg.variants[1]
    assert variant.model == str((tmp_path / "models" / "enc").resolve())
    vc = archives.variant_config(variant.model, None, {}, {})
    assert vc["servekit"]["buckets"]["seq_lens"] == [16, 24]  # fitted to the model's max_seq_length
    mar = archives.build_variant(variant.model, "enc", dict(vc), tmp_path / "store", tmp_path / "work")
    with zipfile.ZipFile(mar) as z:
        assert {"modules.json", "1_Pooling/config.json", "model.safetensors"} <= set(z.namelist())
    bodies = tmp_path / "bodies.jsonl"
    bodies.write_text('{"input": ["a short text", "another one"]}\n')
    vc["servekit"].update({"device": "cpu", "precision": "fp32", "compile": "off", "cuda_graphs": False})
    figures = inprocess.measure(variant.model, vc, bodies, batch_size=4, seconds=0.3)
    assert figures["texts_per_s"] > 0 and figures["texts_per_request"] == 2

    with pytest.raises(SchemaError, match=r"variants\[1\]\.model: 'models/none' is neither a bundled model"):
        parse_config(with_("variants.1.model", "models/none"), base=tmp_path)
    hf_encoder(tmp_path / "models" / "odd", "bert")
    config = json.loads((tmp_path / "models" / "odd" / "config.json").read_text())
    (tmp_path / "models" / "odd" / "config.json").write_text(json.dumps({**config, "model_type": "t5",
                                                                         "architectures": ["T5Model"]}))
    with pytest.raises(SchemaError, match=r"variants\[1\]\.model: .*t5"):
        parse_config(with_("variants.1.model", "models/odd"), base=tmp_path)


def test_texts_per_request_axis_and_regrouped_bodies() -> None:
    from servekit.benchmarks.bench.payloads import regroup

    cfg = parse_config(with_("sweep.texts_per_request", [1, 4]))
    assert cfg.variants[1].axes.texts_per_request == (1, 4)
    assert cfg.variants[0].axes.texts_per_request == (1, 4)  # a variant's own sweep keeps the run's axis
    with pytest.raises(SchemaError, match=r"sweep.texts_per_request\[1\]: expected a positive integer"):
        parse_config(with_("sweep.texts_per_request", [1, 0]))
    with pytest.raises(SchemaError, match="sweep.texts_per_request: regroups the texts of embedding requests"):
        parse_config(with_("sweep.texts_per_request", [2], LLM))

    bodies = [json.dumps(b) for b in ({"input": ["a", "b"], "model": "m"}, {"input": "c"}, {"input": ["d", "e", "f"]})]
    assert [json.loads(b) for b in regroup(bodies, 2)] == [{"model": "m", "input": ["a", "b"]},
                                                           {"model": "m", "input": ["c", "d"]},
                                                           {"model": "m", "input": ["e", "f"]}]
    assert [json.loads(b) for b in regroup(bodies, 4)] == [{"model": "m", "input": ["a", "b", "c", "d"]}]
    # fewer texts than a request holds: cycled; native bodies keep their `text` field
    assert [json.loads(b) for b in regroup(['{"text": "x"}', '"y"'], 3)] == [{"text": ["x", "y", "x"]}]
    with pytest.raises(SchemaError, match="the payloads hold no texts"):
        regroup(['{"sleep_ms": 3}'], 2)
    # the OpenAI route's field, whatever the payload file uses
    assert [json.loads(b) for b in regroup(['{"text": "x"}', '{"text": "y"}'], 2, "input")] == [{"input": ["x", "y"]}]
