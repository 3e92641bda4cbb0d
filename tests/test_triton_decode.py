"""The fused Triton decode kernels (optimizations/kernels/triton_decode.py) under the Triton interpreter on
CPU, in fp32, against the eager layers of optimizations/models/llama.py: each kernel, a whole block, a
decode step after a prefill, greedy generation through the runner (plain, speculative verify
steps, continuous batching), the plan key, and the GPU benchmark's CPU smoke mode.

The interpreter is chosen by ``TRITON_INTERPRET=1`` when the kernels are defined (the module's
import), for the whole process: on a CUDA machine this module is skipped and
test_triton_decode_cuda.py runs the compiled kernels instead."""
from __future__ import annotations

import json
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA machine: test_triton_decode_cuda.py tests the compiled kernels", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined (first import of triton_decode)
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from servekit.optimizations.kernels import triton_decode as td  # noqa: E402
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams  # noqa: E402
from servekit.optimizations.llm.offline import generate  # noqa: E402
from servekit.optimizations.models.llama import LlamaConfig, Transformer, apply_rope, init_random  # noqa: E402
from servekit.optimizations.llm.plan import LlmPlan, parse_llm_plan  # noqa: E402
from servekit.optimizations.plan import PlanError, resolve_for_device  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

MAX_SEQ = 64
TOL = dict(rtol=1e-4, atol=1e-4)

# GQA ratio 2 (tiny), 1 and 3; biases everywhere (Qwen2-style q/k/v, plus o and mlp); a head_dim
# that is not dim / n_heads and not a power of two (Mistral-style).
CONFIGS = {
    "tiny": LlamaConfig.tiny(),
    "mha": LlamaConfig.tiny(n_heads=4, n_kv_heads=4),
    "gqa3-bias": LlamaConfig.tiny(n_heads=6, n_kv_heads=2, head_dim=16, qkv_bias=True, o_bias=True, mlp_bias=True),
    "head24": LlamaConfig.tiny(n_heads=4, n_kv_heads=2, head_dim=24, intermediate_size=96),
}


def _model(config: LlamaConfig, seed: int = 0) -> Transformer:
    model = init_random(config, seed=seed)
    model.fuse_projections()
    model.setup_caches(max_batch_size=4, max_seq_len=MAX_SEQ)
    for layer in model.layers:  # random cache contents: attention must read only what it may
        cache = layer.attention.kv_cache
        gen = torch.Generator().manual_seed(seed + 1)
        cache.k_cache.copy_(torch.randn(cache.k_cache.shape, generator=gen))
        cache.v_cache.copy_(torch.randn(cache.v_cache.shape, generator=gen))
    return model


def _batch(model: Transformer, positions: list[list[int]], seed: int = 0):
    """x (B, T, dim), cos/sin as Transformer.hidden gathers them, input_pos (B, T)."""
    gen = torch.Generator().manual_seed(seed)
    input_pos = torch.tensor(positions)
    x = torch.randn(*input_pos.shape, model.config.dim, generator=gen)
    return x, model.rope_cos[input_pos].unsqueeze(1), model.rope_sin[input_pos].unsqueeze(1), input_pos


@pytest.fixture(params=["K looped", "K looped, rms loop not unrolled", "K in one block"])
def k_blocks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The matmul kernels with their interpreter configuration (K in 32-wide blocks: the loop; the
    rms loop unrolled, as for SmolLM2-sized rows, or not, as for Llama-3.1-8B-sized ones) or
    with K in one block (the tiny models' K <= 128: the path SmolLM2-sized layers take on a GPU,
    where the rms comes from the multiplied tile itself)."""
    if request.param == "K looped, rms loop not unrolled":
        import triton.language as tl

        monkeypatch.setattr(td, "_RSTD_UNROLLED", tl.constexpr(1))
    if request.param == "K in one block":
        import triton

        one = dict(BLOCK_N=16, BLOCK_K=128)
        monkeypatch.setattr(td._linear_residual_kernel, "configs", [triton.Config(one, num_warps=4)])
        monkeypatch.setattr(td._norm_gate_up_kernel, "configs", [triton.Config(one, num_warps=4)])
        monkeypatch.setattr(td._norm_qkv_rope_kernel, "configs",
                            [triton.Config(dict(BLOCK_J=16, BLOCK_K=128), num_warps=4)])
    return request.param


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("rows_in", ["rows", "one row", "3 rows"])  # up to GEMV_ROWS: the GEMV path
def test_norm_qkv_rope_matches_eager_and_writes_the_cache_rows(name: str, k_blocks: str, rows_in: str) -> None:
    model = _model(CONFIGS[name])
    block, att = model.layers[0], model.layers[0].attention
    positions, rows = [[5, 6], [17, 18], [0, 1]], torch.tensor([2, 0, 4])  # T = 2, cache rows mapped
    if rows_in == "one row":
        positions, rows = [[23]], torch.tensor([3])
    elif rows_in == "3 rows":  # a verify step of 2 drafts at batch 1: GEMV rows with a masked 4th
        positions, rows = [[23, 24, 25]], torch.tensor([3])
    x, cos, sin, input_pos = _batch(model, positions)
    b, t, _ = x.shape
    with torch.no_grad():
        q, k, v = att.project_qkv(block.attention_norm(x))
        q = apply_rope(q.reshape(b, t, att.n_heads, -1).transpose(1, 2), cos, sin)
        k = apply_rope(k.reshape(b, t, att.n_kv_heads, -1).transpose(1, 2), cos, sin)
        v = v.reshape(b, t, att.n_kv_heads, -1).transpose(1, 2)
        cache = att.kv_cache
        out = td.norm_qkv_rope(x.reshape(b * t, -1), block.attention_norm, att.wqkv, cos.reshape(b * t, -1),
                               sin.reshape(b * t, -1), input_pos.reshape(-1), cache.k_cache, cache.v_cache,
                               att.n_heads, att.n_kv_heads, att.head_dim, t, rows)
    torch.testing.assert_close(out, q.transpose(1, 2).reshape(b * t, -1), **TOL)
    for i, row in enumerate(rows.tolist()):
        torch.testing.assert_close(cache.k_cache[row][:, input_pos[i]], k[i], **TOL)
        torch.testing.assert_close(cache.v_cache[row][:, input_pos[i]], v[i], **TOL)


def _reference_attention(q: torch.Tensor, model: Transformer, input_pos: torch.Tensor, rows: torch.Tensor,
                         kv_len: int) -> torch.Tensor:
    """Eager attention of q (B, T, n_heads * D) over the cache rows, slot s visible iff s <= position."""
    att = model.layers[0].attention
    b, t, _ = q.shape
    k = att.kv_cache.k_cache[rows, :, :kv_len].repeat_interleave(att.n_heads // att.n_kv_heads, dim=1)
    v = att.kv_cache.v_cache[rows, :, :kv_len].repeat_interleave(att.n_heads // att.n_kv_heads, dim=1)
    mask = torch.arange(kv_len)[None, None, None] <= input_pos[:, None, :, None]
    y = F.scaled_dot_product_attention(q.reshape(b, t, att.n_heads, -1).transpose(1, 2), k, v, attn_mask=mask)
    return y.transpose(1, 2).reshape(b * t, -1)


@pytest.fixture(params=["shared blocks", "by warp"])
def attention_mode(request, monkeypatch) -> str:
    """The attention kernel's two ways of walking a row's cache: its warps side by side over each
    block, or each warp over its own slots of a block (the by-warp candidates, which the GPU's
    autotuner may pick from ATTN_BY_WARP_FROM slots on). Under the interpreter the kernel has one
    candidate; here it is one of each way, with several blocks in the tests' contexts."""
    if request.param == "by warp":
        monkeypatch.setattr(td._attention_kernel, "configs", [triton.Config(dict(BLOCK_S=4, WARPS=2), num_warps=2)])
    return request.param


@pytest.mark.parametrize("name,t,splits", [("tiny", 1, 1), ("tiny", 1, 3), ("mha", 2, 1), ("gqa3-bias", 3, 2),
                                           ("head24", 1, 4), ("tiny", 1, 40)])
def test_decode_attention_reads_only_slots_up_to_each_position(attention_mode: str, name: str, t: int,
                                                               splits: int) -> None:
    model = _model(CONFIGS[name])
    att = model.layers[0].attention
    starts, rows, kv_len = [40, 3, 22], torch.tensor([1, 3, 0]), 48
    input_pos = torch.tensor([[p + i for i in range(t)] for p in starts])
    q = torch.randn(3, t, att.n_heads * att.head_dim, generator=torch.Generator().manual_seed(3))
    cache = att.kv_cache
    y = td.decode_attention(q.reshape(3 * t, -1), cache.k_cache, cache.v_cache, input_pos.reshape(-1), kv_len, 3, t,
                            att.n_heads, att.n_kv_heads, att.head_dim, rows, splits)
    torch.testing.assert_close(y, _reference_attention(q, model, input_pos, rows, kv_len), **TOL)


def test_by_warp_candidates_only_from_their_bucket_on_over_unsplit_caches() -> None:
    """The autotuner's by-warp candidates (compiles and timings at warm-up) join only where they were
    measured faster: from ATTN_BY_WARP_FROM slots on, the cache not split (full batches); elsewhere
    the shared-block candidates alone."""
    by_warp = triton.Config(dict(BLOCK_S=16, WARPS=4), num_warps=4, num_stages=4)
    shared = [triton.Config(dict(BLOCK_S=b, WARPS=0), num_warps=4) for b in (32, 64, 128)]
    at, below = {"kv_len": td.ATTN_BY_WARP_FROM}, {"kv_len": td.ATTN_BY_WARP_FROM // 2}
    assert td._attn_prune(shared + [by_warp], below, SPLITS=1) == shared
    assert td._attn_prune(shared + [by_warp], at, SPLITS=1) == shared + [by_warp]
    assert td._attn_prune(shared + [by_warp], at, SPLITS=4) == shared


@pytest.mark.parametrize("splits", [1, 3])
def test_rows_past_the_bucket_are_idle_and_the_others_unchanged(attention_mode: str, splits: int) -> None:
    """A row parked at the cache's last slot (a prompt going in, a free row) sits past the kv
    bucket the live rows chose: it reads nothing and gives zeros, never NaN; the live rows'
    attention is the reference's."""
    model = _model(CONFIGS["tiny"])
    att = model.layers[0].attention
    cache, kv_len = att.kv_cache, 48
    input_pos = torch.tensor([40, model.max_seq_len - 1, 22, kv_len])
    rows = torch.tensor([1, 3, 0, 2])
    q = torch.randn(4, att.n_heads * att.head_dim, generator=torch.Generator().manual_seed(5))
    y = td.decode_attention(q, cache.k_cache, cache.v_cache, input_pos, kv_len, 4, 1, att.n_heads, att.n_kv_heads,
                            att.head_dim, rows, splits)
    live = torch.tensor([0, 2])
    want = _reference_attention(q[live][:, None], model, input_pos[live][:, None], rows[live], kv_len)
    torch.testing.assert_close(y[live], want, **TOL)
    assert torch.equal(y[torch.tensor([1, 3])], torch.zeros(2, y.shape[1]))


def test_tuning_positions_fill_the_upper_half_of_the_bucket() -> None:
    """The contexts attention is tuned on: each row's tokens consecutive, the rows' last positions
    spread from the bucket's middle to its last slot, none past it."""
    pos = td.tuning_positions(512, 32, 1, "cpu")
    assert pos.shape == (32,) and int(pos[0]) == 256 and 496 <= int(pos[-1]) <= 511
    assert bool((pos[1:] > pos[:-1]).all())
    verify = td.tuning_positions(1024, 4, 3, "cpu").view(4, 3)
    assert bool((verify[:, 1:] - verify[:, :-1] == 1).all()) and int(verify.max()) <= 1023
    assert verify[:, -1].tolist() == [512, 639, 767, 895]
    assert td.tuning_positions(1, 2, 2, "cpu").tolist() == [0, 0, 0, 0]  # clamped: no negative position


@pytest.mark.parametrize("table", [False, True])
def test_attention_is_tuned_once_per_shape_on_bucket_contexts_without_touching_the_call(
        monkeypatch: pytest.MonkeyPatch, table: bool) -> None:
    """Off the interpreter, a shape's first decode_attention call first runs the kernel on
    tuning_positions (autotuning there, not on the caller's rows, which the runner's warm-up
    keeps at position 0), once per autotune key; the caller's output and the cache are what they
    are without it. Here the kernels run under the interpreter with the flag turned off."""
    model = _model(CONFIGS["gqa3-bias"])
    att = model.layers[0].attention
    cache = att.kv_cache
    before = (cache.k_cache.clone(), cache.v_cache.clone())
    monkeypatch.setattr(td, "INTERPRET", False)
    monkeypatch.setattr(td, "_TUNED_ON_CONTEXT", set())
    tuned = []
    real = td._tune_on_context
    monkeypatch.setattr(td, "_tune_on_context", lambda *a: tuned.append(a[3:6]) or real(*a))
    kv_len, rows = 48, torch.tensor([2, 0, 3, 1, 2, 0]) if table else None  # more tokens than cache rows
    n = 6 if table else 4
    input_pos = torch.tensor([0, 5, 31, 47, 12, 20][:n])
    q = torch.randn(n, att.n_heads * att.head_dim, generator=torch.Generator().manual_seed(7))
    for _ in range(2):
        y = td.decode_attention(q, cache.k_cache, cache.v_cache, input_pos, kv_len, n, 1, att.n_heads,
                                att.n_kv_heads, att.head_dim, rows, 2)
        want = _reference_attention(q[:, None], model, input_pos[:, None],
                                    rows if rows is not None else torch.arange(n), kv_len)
        torch.testing.assert_close(y, want, **TOL)
    assert tuned == [(kv_len, n, 1)]  # once: the second call found its key tuned
    assert torch.equal(cache.k_cache, before[0]) and torch.equal(cache.v_cache, before[1])
    td.decode_attention(q, cache.k_cache, cache.v_cache, input_pos, 32, n, 1, att.n_heads, att.n_kv_heads,
                        att.head_dim, rows, 2)
    assert tuned[-1] == (32, n, 1)  # another bucket: another key


def test_rows_per_program_choose_the_gemv_path_for_few_rows_of_small_weights() -> None:
    """Up to GEMV_ROWS rows go through the GEMV path (BLOCK_M below 16, a power of two); 3-4 rows
    only for weights up to 4 M elements (Qwen2.5-0.5B's gate/up is larger); the rest through tl.dot,
    16 rows per program for weights up to SMALL_WEIGHTS (they stay in L2), else all rows up to 64
    (Llama-3.1-8B's: each weight read once). Shapes only: meta tensors hold no memory."""
    def weight(n: int, k: int):
        return torch.empty(n, k, dtype=torch.bfloat16, device="meta")

    smol_gate_up, qwen_gate_up = weight(2 * 1536, 576), weight(2 * 4864, 896)
    assert [td._block_m(m, 576, 2, smol_gate_up) for m in (1, 2, 3, 4, 5, 8, 40, 100)] == [1, 2, 4, 4, 16, 16, 16, 16]
    assert [td._block_m(m, 896, 2, qwen_gate_up) for m in (1, 2, 3, 4)] == [1, 2, 16, 16]
    # K too long for a GEMV program's registers (Qwen2.5-0.5B's down projection): 2 rows fit, 4 do not.
    qwen_down = weight(896, 4864)
    assert [td._block_m(m, 4864, 1, qwen_down) for m in (1, 2, 3)] == [1, 2, 16]
    assert td._block_m(1, 32768, 1, weight(64, 32768)) == 16  # not even one row's weight tile fits
    assert [td._block_m(m, 896, 2, qwen_gate_up) for m in (8, 32)] == [16, 16]  # 8.7 M elements: small
    llama8b_gate_up = weight(2 * 14336, 4096)
    assert [td._block_m(m, 4096, 2, llama8b_gate_up) for m in (5, 32, 100)] == [16, 32, 64]


def test_tl_dot_blocks_fit_shared_memory_and_attention_splits_stop_at_whole_batches() -> None:
    """tl.dot projections keep their one configuration where its three pipeline stages fit shared
    memory, else halve BLOCK_K (fp32 weights, a GPU with less shared memory); attention splits the cache only while the rows and
    kv heads make fewer than 96 programs."""
    assert td.dot_config((32, 256, 4), 16, 2, 2) == (32, 256, 4)  # SmolLM2's gate/up in bf16: 123 KB
    assert td.dot_config((32, 256, 4), 16, 2, 4) == (32, 128, 4)  # the same in fp32: 246 KB at 256
    assert td.dot_config((32, 256, 4), 16, 1, 4) == (32, 256, 4)  # the output / down projections in fp32: 147 KB
    l40s = int(101376 * 0.86)  # 99 KiB a block: gate/up's 123 KB at 256 would not load there
    assert td.dot_config((32, 256, 4), 16, 2, 2, l40s) == (32, 128, 4)
    assert td._budget_for(torch.empty(0)) == td._SMEM_BUDGET  # no GPU: the H100's
    assert td.attention_splits(32, 3, 512) == 1  # SmolLM2 at batch 32: 96 programs, no reduce kernel
    assert td.attention_splits(16, 3, 512) == 5
    assert td.attention_splits(1, 3, 512) == 8  # at least 64 slots a split
    assert td.attention_splits(12, 8, 4096) == 1  # Llama-3.1-8B's 8 kv heads at batch 12


@pytest.mark.parametrize("name", ["tiny", "gqa3-bias"])
@pytest.mark.parametrize("m", [5, 1, 3])  # up to GEMV_ROWS: the GEMV path
def test_projection_kernels_match_eager(name: str, k_blocks: str, m: int) -> None:
    model = _model(CONFIGS[name])
    block = model.layers[1]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(m, model.config.dim, generator=gen)
    with torch.no_grad():
        gate, up = block.feed_forward.w13(block.ffn_norm(x)).chunk(2, dim=-1)
        torch.testing.assert_close(td.norm_gate_up(x, block.ffn_norm, block.feed_forward.w13), F.silu(gate) * up, **TOL)
        y = torch.randn(m, block.attention.wo.weight.shape[1], generator=gen)
        torch.testing.assert_close(td.linear_residual(y, block.attention.wo, x), x + block.attention.wo(y), **TOL)


@pytest.mark.parametrize("name,t", [("tiny", 1), ("gqa3-bias", 2), ("head24", 1)])
def test_fused_block_equals_the_eager_block(name: str, t: int, k_blocks: str) -> None:
    fused_model, eager_model = _model(CONFIGS[name]), _model(CONFIGS[name])
    positions = [[9 + i for i in range(t)], [30 + i for i in range(t)], [2 + i for i in range(t)]]
    x, cos, sin, input_pos = _batch(fused_model, positions)
    mask = torch.arange(40)[None, None] <= input_pos[:, :, None]
    rows = torch.tensor([3, 1, 0])
    with torch.no_grad():
        want = eager_model.layers[0](x, cos, sin, mask, input_pos, rows)
        got = td.FusedDecodeBlock(fused_model.layers[0], splits=2)(x, cos, sin, mask, input_pos, rows)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(fused_model.layers[0].attention.kv_cache.k_cache,
                               eager_model.layers[0].attention.kv_cache.k_cache, **TOL)


def test_decode_steps_after_a_prefill_give_the_eager_logits() -> None:
    model = _model(LlamaConfig.tiny())
    fused = td.TritonDecode(model)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, 256, (3, 12), generator=gen)
    lengths = torch.tensor([12, 5, 9])  # right-padded prompts: rows decode from their own positions
    with torch.no_grad():
        model(tokens, torch.arange(12).expand(3, 12), kv_len=12)
        nxt, pos = tokens.gather(1, (lengths - 1)[:, None]), lengths[:, None].clone()
        for _ in range(3):
            state = [layer.attention.kv_cache.k_cache.clone() for layer in model.layers]
            want = model(nxt, pos, kv_len=32)
            for layer, k in zip(model.layers, state):  # the fused step writes the same slots again
                layer.attention.kv_cache.k_cache.copy_(k)
            got = fused(nxt, pos, kv_len=32)
            torch.testing.assert_close(got, want, **TOL)
            nxt, pos = got[:, -1].argmax(-1, keepdim=True), pos + 1


@pytest.mark.parametrize("name", ["tiny", "gqa3-bias"])
def test_a_packed_forward_through_the_fused_blocks_equals_the_packed_layers(name: str) -> None:
    """A packed forward of a fresh prompt, a later chunk of another (its earlier positions already
    in the row) and two decoding rows riding (their tokens from the decode state), run by the fused
    blocks a token a row: the same logits and cache rows as the packed layers' forward; padded to a
    larger token bucket (as a captured graph runs it), the same again, and the padding touches no
    request's row."""
    from servekit.optimizations.llm.packed import Chunk, PackedPrefill, _PackedStep

    model = _model(CONFIGS[name])  # random cache contents: the chunk's earlier positions, the riders' contexts
    fused = td.TritonDecode(model).blocks
    before = [(layer.attention.kv_cache.k_cache.clone(), layer.attention.kv_cache.v_cache.clone())
              for layer in model.layers]
    state = torch.zeros(model.max_batch_size, 1, dtype=torch.int64)
    state[0, 0], state[1, 0] = 17, 99
    gen = torch.Generator().manual_seed(7)
    chunks = [Chunk(torch.randint(3, 256, (7,), generator=gen).tolist(), 0, 2, True),
              Chunk([0], 20, 0, True, from_state=True),
              Chunk(torch.randint(3, 256, (5,), generator=gen).tolist(), 10, 3, True),
              Chunk([0], 33, 1, True, from_state=True)]
    written = {2: range(0, 7), 0: range(20, 21), 3: range(10, 15), 1: range(33, 34)}

    def restore() -> None:
        for layer, (k, v) in zip(model.layers, before):
            layer.attention.kv_cache.k_cache.copy_(k)
            layer.attention.kv_cache.v_cache.copy_(v)

    def rows_of_requests() -> list[torch.Tensor]:
        return [torch.stack([layer.attention.kv_cache.k_cache[:4], layer.attention.kv_cache.v_cache[:4]])
                for layer in model.layers]

    with torch.no_grad():
        want = PackedPrefill(model, max_tokens=32, max_seqs=4, state_tokens=state).run(chunks)
        want_rows = rows_of_requests()
        restore()
        packed = PackedPrefill(model, max_tokens=32, max_seqs=4, state_tokens=state, fused=fused, fused_tokens=32)
        got = packed.run(chunks)
        got_rows = rows_of_requests()
        restore()
        packed._load(chunks)  # 14 tokens as the 32-token bucket's graph body runs them
        padded = _PackedStep(packed, 32).run()[:4].clone()
        padded_rows = rows_of_requests()
    assert packed.layers(32) is packed.fused and packed.layers(33) is None
    assert td.TritonDecode(model).small_weights  # the engine's condition for this path
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(padded, want, **TOL)
    for layer_got, layer_padded, layer_want, (k0, _) in zip(got_rows, padded_rows, want_rows, before):
        torch.testing.assert_close(layer_got, layer_want, **TOL)
        torch.testing.assert_close(layer_padded, layer_want, **TOL)
        for row, span in written.items():  # the rest of each request's row is as it was
            untouched = [i for i in range(MAX_SEQ) if i not in span]
            torch.testing.assert_close(layer_padded[0, row][:, untouched], k0[row][:, untouched])


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(6)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 13, 9)]


@pytest.fixture(scope="module")
def runners() -> dict[str, LlamaRunner]:
    model = init_random(LlamaConfig.tiny(), seed=0)
    kw = dict(max_seq_len=MAX_SEQ, batch_buckets=(1, 4), prefill_buckets=(16,), kv_buckets=(16, 32))
    return {k: LlamaRunner(model, kernels=k, **kw) for k in ("torch", "triton")}  # one model, one cache


def test_greedy_generation_with_triton_kernels_equals_torch(runners: dict[str, LlamaRunner]) -> None:
    params = [SamplingParams(max_tokens=6)] * 3
    want = generate(runners["torch"], _prompts(), params)
    got = generate(runners["triton"], _prompts(), params)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert runners["triton"].plan["kernels"] == "triton"


def test_continuous_batching_decodes_through_the_fused_kernels(runners: dict[str, LlamaRunner]) -> None:
    from servekit.optimizations.llm.continuous import ContinuousBatcher

    batcher = ContinuousBatcher(runners["triton"])
    # The prompts' forwards (the second's with the first's row riding) go through the fused blocks too.
    assert batcher.packed.fused is not None and batcher.packed.layers(13 + 1) is batcher.packed.fused
    prompts, got = _prompts(), {}
    batcher.add(0, prompts[0], SamplingParams(max_tokens=5))
    for i in range(8):
        if i == 2:  # joins while the first request decodes: another row, another position
            batcher.add(1, prompts[1], SamplingParams(max_tokens=4))
        for key, update in batcher.step().items():
            got.setdefault(key, []).extend(update.tokens)
    want = [generate(runners["torch"], [p], [SamplingParams(max_tokens=n)])[0].tokens for p, n in zip(prompts, (5, 4))]
    assert [got[0], got[1]] == want and not batcher.has_work


def test_speculative_verify_steps_run_the_fused_kernels(runners: dict[str, LlamaRunner]) -> None:
    from servekit.optimizations.llm.continuous import ContinuousBatcher
    from servekit.optimizations.llm.speculative import Speculator, SpeculatorConfig, SpeculativeDecoding

    base = runners["triton"]
    heads = Speculator(SpeculatorConfig.for_model(base.model, 2)).reset_parameters(seed=1, random_out=True)
    base.speculation = SpeculativeDecoding(base, heads, max_spec_batch=4)
    try:
        assert all(step.model is base.triton_model for step in base.speculation.steps.values())
        params = [SamplingParams(max_tokens=5)] * 3
        batcher = ContinuousBatcher(base)
        got = generate(base, _prompts(), params, batcher=batcher)
        assert batcher.spec_stats.proposed[0] > 0
    finally:
        base.speculation = None
    assert [c.tokens for c in got] == [c.tokens for c in generate(runners["torch"], _prompts(), params)]


def test_plan_key_is_validated_and_checked_against_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_llm_plan({}).kernels == "torch"
    plan = parse_llm_plan({"kernels": "triton", "precision": "bf16"})
    assert plan.kernels == "triton" and "kernels-triton" in plan.label()
    with pytest.raises(PlanError, match=r"servekit\.kernels: 'cuda' is not one of torch, triton"):
        parse_llm_plan({"kernels": "cuda"})
    assert resolve_for_device(plan, "cpu", None) == (plan, [])  # the interpreter runs them (this module)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(PlanError, match="kernels: triton needs a CUDA device"):
        resolve_for_device(plan, "cpu", None)
    eager, downgrades = resolve_for_device(LlmPlan(kernels="triton", fallback="eager"), "cpu", None)
    assert eager.kernels == "torch" and "needs a CUDA device" in downgrades[0]
    with pytest.raises(ValueError, match="compile_decode=False"):
        LlamaRunner(init_random(LlamaConfig.tiny()), 32, (1,), kernels="triton", compile_decode=True)


@pytest.mark.parametrize("warm_up", ["steps", "engine"])
def test_benchmark_smoke_run_on_cpu(tmp_path, warm_up: str) -> None:
    """Both warm-ups: each measured step's own, and the runner's (as the engine starts) first."""
    from servekit.benchmarks import decode_kernels

    assert decode_kernels.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--warm-up", warm_up]) == 0
    result = json.loads((tmp_path / "decode_kernels.json").read_text())
    assert result["warm_up"] == warm_up and {r["kernels"] for r in result["rows"]} == {"torch", "triton"}
    assert f"warm-up {warm_up}" in (tmp_path / "decode_kernels.md").read_text()


def test_greedy_parity_benchmark_finds_and_judges_partings(tmp_path) -> None:
    """The parity benchmark's CPU smoke run (tiny model, 2 prompts of 3 tokens at batches 1 and 2: both
    paths agree; an interpreted step costs about a second, and the generation tests above compare
    the two paths on more tokens), and its verdict on a completion that parts from the reference: at
    the fp32 model's second-best token it is a near-tie only when the fp32 gap is below --tie-gap; a
    token outside the top two never is."""
    import json

    from servekit.benchmarks import greedy_parity

    assert greedy_parity.main(["--device", "cpu", "--tiny", "--prompts", "2", "--max-tokens", "3", "--batches", "1",
                               "2", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "greedy_parity.json").read_text())
    assert [(r["batch"], r["identical"], r["differences"]) for r in res["batches"]] == [(1, 2, []), (2, 2, [])]
    model = init_random(LlamaConfig.tiny(), seed=0)
    model.setup_caches(max_batch_size=1, max_seq_len=MAX_SEQ)
    prompt, want = [5, 9, 11], [7, 8, 9, 10]
    gap, best, second = greedy_parity.top2_gap(model, prompt + want[:2], MAX_SEQ)
    other = next(t for t in range(3, 256) if t not in (best, second))
    for got_token, tie_gap, tie in ((second, gap + 1.0, True), (second, gap / 2, False), (other, 1e9, False)):
        got = want[:2] + [got_token, 1]
        [row] = greedy_parity.compare([prompt], [want[:2] + [best, 1]], [got], model, MAX_SEQ, tie_gap)
        assert (row["parted_at"], row["triton"], row["fp32_gap"], row["near_tie"]) == (2, got_token, round(gap, 4), tie)
    [longer] = greedy_parity.compare([prompt], [want], [want + [3]], model, MAX_SEQ, 0.1)
    assert longer["parted_at"] == 4 and not longer["near_tie"]
    assert greedy_parity.compare([prompt], [want], [list(want)], model, MAX_SEQ, 0.1) == []


def test_kernels_compile_for_an_h100() -> None:
    """What the interpreter never runs (Triton's compiler down to sm_90 machine code), in a process of
    its own without the interpreter."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_compile_check.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled 40 kernels for sm_90" in done.stdout


def test_programmatic_dependent_launch_stays_off_without_a_hopper_gpu() -> None:
    """PDL needs compute capability 9.0+ and a CUDA device: on CPU (and under the interpreter) the
    kernels launch as usual, and TritonDecode says so."""
    assert not td.pdl_supported(torch.device("cpu"))
    model = _model(CONFIGS["tiny"])
    assert td.TritonDecode(model).pdl is False
