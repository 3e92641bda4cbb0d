"""Bring your own decoder, end to end: a tiny Qwen2 checkpoint written by transformers (biases,
sharded safetensors, its own byte-level tokenizer, chat template and eos list) goes through
`servekit train-speculator --model-dir` (heads for it) and `servekit archive PATH --speculator`
(kind inferred, model-config generated for the CPU: continuous batching, speculation) and a live
TorchServe; the openai client's chat completions, streamed and not, carry transformers'
own greedy generation on the same files, token for token."""
from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import torch
import yaml

from decoder_checkpoints import write_checkpoint
from servekit.archive import main as archive_main
from servekit.torchserve import TorchServe

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.server

NAME = "my-qwen"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("qwen2", tmp_path_factory.mktemp("models") / "Qwen2 tiny", seed=0, shard=True)


@pytest.fixture(scope="module")
def heads(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Speculator heads trained on the model's own greedy completions (`servekit train-speculator`)."""
    from servekit.optimizations.training import train_speculator

    out = tmp_path_factory.mktemp("custom-heads")
    (out / "prompts.txt").write_text("\n".join(f"Say {w}." for w in "one two three four five six seven eight nine "
                                                                     "ten eleven twelve".split()))
    old = torch.get_num_threads()
    try:
        assert train_speculator.main(["--model-dir", str(checkpoint), "--dtype", "fp32", "--out", str(out / "heads"),
                                      "--prompts", str(out / "prompts.txt"), "--new-tokens", "24", "--samples", "0",
                                      "--steps", "60", "--heads", "2", "--topic-prompts", "0", "--draft-vocab", "0",
                                      "--threads", "1", "--quiet"]) == 0
    finally:
        torch.set_num_threads(old)
    return out / "heads"


@pytest.fixture(scope="module")
def server(checkpoint: Path, heads: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchServe]:
    store = tmp_path_factory.mktemp("custom-llm-store")
    # `servekit archive` through its main() (a fresh interpreter would cost ~5 s of CPU; what it
    # prints reaches pytest's captured output)
    assert archive_main([str(checkpoint), "--out", str(store), "--name", NAME, "--device", "cpu", "--no-compress",
                         "--speculator", str(heads)]) == 0
    config = yaml.safe_load((store / f"{NAME}.yaml").read_text())
    assert config["continuousBatching"] is True and config["servekit"]["device"] == "cpu"
    assert config["servekit"]["speculation"]["heads"] == "speculator"  # generated for the heads given
    with TorchServe(tmp_path_factory.mktemp("ts-custom-llm"), store) as ts:
        ts.register(f"{NAME}.mar", NAME, workers=1, timeout=240)
        yield ts


def _hf_greedy_bytes(checkpoint: Path, messages: list[dict], max_tokens: int) -> list[bytes]:
    """transformers' greedy tokens (up to an eos id of the model's generation config), as bytes:
    random weights write arbitrary bytes, so tokens rather than text are compared."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # the GPT-2 byte alphabet

    tok = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False)[0, ids["input_ids"].shape[1]:].tolist()
    stops = set(model.generation_config.eos_token_id)
    out = out[:next((i for i, t in enumerate(out) if t in stops), len(out))]
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    return [bytes(byte_of[c] for c in tok.convert_ids_to_tokens(t)) for t in out]


def test_an_archived_custom_decoder_serves_transformers_greedy_tokens(server: TorchServe, checkpoint: Path) -> None:
    client = openai.OpenAI(base_url=f"{server.inference_url}/predictions/{NAME}/1.0/v1", api_key="unused",
                           max_retries=0, timeout=120)
    for text in ("Hello there", "Name three colours."):
        messages = [{"role": "user", "content": text}]
        want = _hf_greedy_bytes(checkpoint, messages, 20)
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0, logprobs=True)
        assert r.model == NAME and r.usage.completion_tokens == len(want)
        assert [bytes(t.bytes) for t in r.choices[0].logprobs.content] == want
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=20, temperature=0, stream=True) if c.choices)
        assert streamed == r.choices[0].message.content
    assert [m.id for m in client.models.list().data] == [NAME]
    deadline = time.monotonic() + 15  # the acceptance counters go out once a second
    while _metric(server, "servekit_spec_proposed_total") == 0 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _metric(server, "servekit_spec_proposed_total") > 0  # the greedy requests speculated


def _metric(server: TorchServe, name: str) -> float:
    text = urllib.request.urlopen(f"{server.metrics_url}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
