"""Plan parsing, validation errors that name the key, and device rules."""
import pytest

from servekit.optimizations.buckets import padding_ratio, pick_bucket, plan_chunks
from servekit.optimizations.plan import Plan, PlanError, parse_plan, resolve_for_device


def test_defaults_and_label():
    plan = parse_plan(None)
    assert plan == Plan()
    assert plan.label() == "fp32"
    p = parse_plan({"precision": "fp16", "compile": "default", "cuda_graphs": True, "quantization": "int8_weight_only"})
    assert p.label() == "fp16+int8_weight_only+compile-default+cudagraphs"
    assert p.accuracy_threshold == 0.99
    assert parse_plan({"precision": "bf16"}).accuracy_threshold == 0.999


@pytest.mark.parametrize("raw,where", [
    ({"precison": "fp16"}, "servekit.precison: unknown key"),
    ({"precision": "fp64"}, "servekit.precision: 'fp64' is not one of"),
    ({"quantization": "int3"}, "servekit.quantization"),
    ({"compile": True}, "servekit.compile"),
    ({"cuda_graphs": "yes"}, "servekit.cuda_graphs: expected true or false"),
    ({"buckets": {"batch_sizes": [4, 2]}}, "servekit.buckets.batch_sizes: values must be strictly increasing"),
    ({"buckets": {"seq_lens": [16, -1]}}, "servekit.buckets.seq_lens[1]"),
    ({"buckets": {"sizes": [1]}}, "servekit.buckets.sizes: unknown key"),
    ({"limits": {"too_long": "drop"}}, "servekit.limits.too_long"),
    ({"limits": {"max_texts_per_request": 0}}, "servekit.limits.max_texts_per_request"),
    ({"min_cosine": 2}, "servekit.min_cosine"),
    ({"cuda_graphs": True, "compile": "max-autotune"}, "max-autotune-no-cudagraphs"),
    ([1, 2], "servekit: expected a mapping"),
])
def test_errors_name_the_key(raw, where):
    with pytest.raises(PlanError, match=where.replace("[", r"\[").replace("]", r"\]")):
        parse_plan(raw)


def test_device_rules_fail_loudly_or_fall_back():
    with pytest.raises(PlanError, match="cuda_graphs needs a CUDA device"):
        resolve_for_device(parse_plan({"cuda_graphs": True}), "cpu", None)
    with pytest.raises(PlanError, match="int4_weight_only needs a CUDA device"):
        resolve_for_device(parse_plan({"quantization": "int4_weight_only"}), "cpu", None)
    with pytest.raises(PlanError, match="float8_dynamic needs compute capability >= 8.9"):
        resolve_for_device(parse_plan({"quantization": "float8_dynamic"}), "cuda", (8, 0))
    plan, notes = resolve_for_device(parse_plan({"quantization": "float8_dynamic"}), "cuda", (9, 0))
    assert plan.quantization == "float8_dynamic" and notes == []
    plan, notes = resolve_for_device(
        parse_plan({"cuda_graphs": True, "quantization": "int4_weight_only", "fallback": "eager"}), "cpu", None)
    assert (plan.cuda_graphs, plan.quantization) == (False, "none") and len(notes) == 2


def test_bucket_selection_and_padding():
    assert pick_bucket(1, [1, 2, 4]) == 1
    assert pick_bucket(3, [1, 2, 4]) == 4
    with pytest.raises(ValueError):
        pick_bucket(5, [1, 2, 4])
    lengths = [5, 100, 7, 30, 6]
    chunks = plan_chunks(lengths, [1, 2, 4], [8, 32, 128])
    # Sorted by length: the short ones share a chunk, the long one pads alone.
    assert [c.indices for c in chunks] == [(0, 4, 2, 3), (1,)]
    assert [(c.batch, c.seq) for c in chunks] == [(4, 32), (1, 128)]
    assert sorted(i for c in chunks for i in c.indices) == list(range(5))
    assert padding_ratio(lengths, chunks) == pytest.approx(1 - 148 / (4 * 32 + 128))


def test_tokenizer_threads_key() -> None:
    from servekit.optimizations.plan import PlanError, parse_plan

    assert parse_plan({}).tokenizer_threads is None
    assert parse_plan({"tokenizer_threads": 4}).tokenizer_threads == 4
    with pytest.raises(PlanError, match=r"servekit.tokenizer_threads: expected a positive integer, got 0"):
        parse_plan({"tokenizer_threads": 0})


def test_tokenizer_cache_key() -> None:
    from servekit.optimizations.plan import PlanError, parse_plan

    assert parse_plan({}).tokenizer_cache == 200_000
    assert parse_plan({"tokenizer_cache": 0}).tokenizer_cache == 0
    for bad in (-1, True, "big", 1.5):
        with pytest.raises(PlanError, match=r"servekit.tokenizer_cache: expected a number of entries >= 0"):
            parse_plan({"tokenizer_cache": bad})


def _brute_force_cost(lengths: list[int], batch_sizes: list[int], seq_lens: list[int], cost) -> float:
    """Least total cost over every way to cut the sorted lengths into contiguous runs."""
    from functools import lru_cache

    srt = sorted(lengths)

    @lru_cache(maxsize=None)
    def best(j: int) -> float:
        if j == 0:
            return 0.0
        return min(best(i) + cost(pick_bucket(j - i, batch_sizes), pick_bucket(srt[j - 1], seq_lens))
                   for i in range(max(0, j - batch_sizes[-1]), j))

    return best(len(srt))


@pytest.mark.parametrize("seed", range(30))
def test_plan_chunks_finds_the_cheapest_cuts(seed: int) -> None:
    """Against every contiguous cut of the sorted lengths, under a random cost table that grows
    with batch and sequence (as measured replay times do)."""
    import random

    rng = random.Random(seed)
    batch_sizes, seq_lens = [1, 2, 4, 8], [8, 16, 32, 64]
    table, acc = {}, 0.0
    for b in batch_sizes:
        row = rng.uniform(0.5, 3.0)
        for s in seq_lens:
            row += rng.uniform(0.1, 2.0) * b
            table[(b, s)] = row + acc
        acc += rng.uniform(0.1, 1.0)
    lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 11))]
    cost = lambda b, s: table[(b, s)]  # noqa: E731
    chunks = plan_chunks(lengths, batch_sizes, seq_lens, cost)
    assert sorted(i for c in chunks for i in c.indices) == list(range(len(lengths)))
    for c in chunks:
        assert len(c.indices) <= c.batch and max(lengths[i] for i in c.indices) <= c.seq
    got = sum(table[(c.batch, c.seq)] for c in chunks)
    assert got == pytest.approx(_brute_force_cost(lengths, batch_sizes, seq_lens, cost))


def test_plan_chunks_pads_a_mixed_bulk_batch_less() -> None:
    """96 texts of mixed lengths: cut by cost rather than into runs of the largest batch bucket."""
    lengths = [12] * 40 + [30] * 30 + [100] * 20 + [250] * 6
    chunks = plan_chunks(lengths, [1, 2, 4, 8, 16, 32, 64], [16, 32, 64, 128, 256])
    # Runs of 64 would pad everything up to 32 and 256: 64*32 + 32*256 = 10,240 positions.
    assert sum(c.batch * c.seq for c in chunks) < 0.75 * 10_240
    assert padding_ratio(lengths, chunks) < 0.35
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        plan_chunks([300], [1], [256])
    assert plan_chunks([], [1], [16]) == []


@pytest.mark.parametrize("seed", range(20))
def test_exact_chunks_pad_nothing_past_a_run_and_find_the_cheapest_cuts(seed: int) -> None:
    """Eager passes (nothing captured): every pass holds exactly its texts, as long as its longest,
    and the cuts cost no more than any contiguous cut of the sorted lengths."""
    import itertools
    import random

    from servekit.optimizations.buckets import exact_chunks, token_cost

    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 9))]
    max_batch = rng.choice([1, 2, 3, 8])
    chunks = exact_chunks(lengths, max_batch)
    assert sorted(i for c in chunks for i in c.indices) == list(range(len(lengths)))
    for c in chunks:
        assert c.batch == len(c.indices) <= max_batch
        assert c.seq == max(lengths[i] for i in c.indices)
    srt = sorted(lengths)
    best = min(sum(token_cost(b - a, srt[b - 1]) for a, b in zip((0,) + cuts, cuts + (len(srt),)))
               for k in range(len(srt)) for cuts in itertools.combinations(range(1, len(srt)), k)
               if all(b - a <= max_batch for a, b in zip((0,) + cuts, cuts + (len(srt),))))
    assert sum(token_cost(c.batch, c.seq) for c in chunks) == pytest.approx(best)
    assert exact_chunks([], 4) == []
    with pytest.raises(ValueError, match="max_batch"):
        exact_chunks([3], 0)
