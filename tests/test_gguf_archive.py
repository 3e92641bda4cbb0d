"""`servekit archive FILE.gguf` for the newer families: weights dequantized to the plan's precision
(fp32 plans get the GGUF's own values), `kernels: torch` named in a generated GPU config for blocks
the Triton decode kernels do not fuse, and an unsupported architecture refused from the header."""
from __future__ import annotations

import time
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from decoder_checkpoints import write_checkpoint

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_gguf_families import write_gguf

    root = tmp_path_factory.mktemp("qwen3")
    return write_gguf(write_checkpoint("qwen3", root / "hf", seed=5), root / "tiny-qwen3.gguf", "qwen3")


def _weights(mar: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    with zipfile.ZipFile(mar) as z:
        return load(z.read("model.safetensors"))


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32), ("cuda", torch.bfloat16)])
def test_gguf_weights_take_the_generated_plans_precision(qwen3_gguf: Path, tmp_path: Path, device: str,
                                                         dtype: torch.dtype, archive_in_process) -> None:
    r = archive_in_process(qwen3_gguf, "--out", tmp_path, "--device", device, "--no-compress")
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "tiny-qwen3.yaml").read_text()
    plan = yaml.safe_load(text)["servekit"]
    assert plan["precision"] == {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    assert {t.dtype for t in _weights(tmp_path / "tiny-qwen3.mar").values()} == {dtype}
    if device == "cuda":  # the shipped GPU config asks for the fused kernels, which do not cover Qwen3's q/k norms
        assert plan["kernels"] == "torch" and "do not cover qwen3 blocks" in text


def test_gguf_weights_take_a_given_configs_precision(qwen3_gguf: Path, tmp_path: Path, archive_in_process) -> None:
    config = tmp_path / "plan.yaml"
    config.write_text(yaml.safe_dump({"servekit": {"device": "cpu", "precision": "fp32", "max_seq_len": 128,
                                                   "limits": {"max_tokens": 16}}}))
    r = archive_in_process(qwen3_gguf, "--out", tmp_path / "out", "--config", config, "--no-compress")
    assert r.returncode == 0, r.stderr
    assert {t.dtype for t in _weights(tmp_path / "out" / "tiny-qwen3.mar").values()} == {torch.float32}


def test_an_unsupported_gguf_is_refused_at_once(tmp_path: Path, archive_in_process) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(64, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    t0 = time.perf_counter()
    r = archive_in_process(tmp_path / "phi.gguf", "--out", tmp_path / "out", "--device", "cpu")
    assert r.returncode == 2 and "GGUF architecture 'phi2' is not supported" in r.stderr, r.stderr
    assert time.perf_counter() - t0 < 30 and not (tmp_path / "out").exists()
