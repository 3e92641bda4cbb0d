"""The fused Triton decode kernels on a GPU, in bf16, compiled (not interpreted) and captured in CUDA
graphs, against the eager bf16 model: logits of decode and verify steps (compared with an fp32
reference: the fused step may not be much further from it than eager bf16 is), and greedy
generation through the runner with ``kernels: triton`` and CUDA graphs.

    pytest -q tests/test_triton_decode_cuda.py      # on a CUDA machine, in a process of its own
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from compiled_triton import require_compiled_triton

require_compiled_triton()

from greedy_parity import check_same_or_tie  # noqa: E402
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams  # noqa: E402
from servekit.optimizations.llm.offline import generate  # noqa: E402
from servekit.optimizations.llm.packed import Chunk, PackedPrefill  # noqa: E402
from servekit.optimizations.models.llama import LlamaConfig, Transformer, init_random  # noqa: E402
from servekit.optimizations.kernels.triton_decode import TritonDecode, pdl_supported  # noqa: E402

MAX_SEQ = 256
CONFIGS = {  # SmolLM2-like (GQA 3) and Qwen2-like (GQA 7, q/k/v biases), small
    "gqa3": LlamaConfig.tiny(vocab_size=1024, dim=192, n_layers=4, n_heads=9, n_kv_heads=3, head_dim=64,
                             intermediate_size=512, tie_embeddings=False),
    "gqa7-bias": LlamaConfig.tiny(vocab_size=1024, dim=224, n_layers=4, n_heads=14, n_kv_heads=2, head_dim=64,
                                  intermediate_size=640, model_type="qwen2", qkv_bias=True, tie_embeddings=False),
}


def _models(name: str) -> tuple[Transformer, Transformer]:
    """(bf16, fp32) copies of one random model on the GPU; the lm_head scaled up so that greedy
    choices have clear margins (random weights give near-ties that bf16 noise flips)."""
    fp32 = init_random(CONFIGS[name], seed=0)
    with torch.no_grad():
        fp32.output.weight.mul_(8.0)
    fp32 = fp32.cuda()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    for m in (fp32, bf16):
        m.fuse_projections()
        m.setup_caches(max_batch_size=8, max_seq_len=MAX_SEQ)
    return bf16, fp32


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("t", [1, 3])  # a decode step; a verify step of 2 drafts
@pytest.mark.parametrize("pdl", [False, True], ids=["launch", "pdl"])  # programmatic dependent launch
@pytest.mark.parametrize("splits", [None, 16], ids=["auto-splits", "16-splits"])  # 16: many partials to merge
def test_captured_fused_step_logits_match_eager_bf16(name: str, t: int, pdl: bool, splits: int | None) -> None:
    if pdl and not pdl_supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs a Hopper GPU and Triton 3.4+")
    bf16, fp32 = _models(name)
    fused = TritonDecode(bf16, splits=splits, pdl=pdl)
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, prompt = 4, 100
    prompts = torch.randint(3, 1024, (b, prompt), device="cuda", generator=gen)
    pos0 = torch.arange(prompt, device="cuda").expand(b, prompt)
    lengths = torch.tensor([100, 37, 64, 5], device="cuda")
    with torch.no_grad():
        for m in (bf16, fp32):
            m(prompts, pos0, kv_len=prompt)
        tokens = torch.randint(3, 1024, (b, t), device="cuda", generator=gen)
        pos = lengths[:, None] + torch.arange(t, device="cuda")
        kv_len = 128
        # Static inputs; warm-up (compiles, autotunes) on a side stream, then capture and replay.
        st_tokens, st_pos = tokens.clone(), pos.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fused(st_tokens, st_pos, kv_len=kv_len)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            st_out = fused(st_tokens, st_pos, kv_len=kv_len)
        want_bf16 = bf16(tokens, pos, kv_len=kv_len)
        ref = fp32(tokens, pos, kv_len=kv_len)
        graph.replay()
        torch.cuda.synchronize()
    got = st_out.clone()
    eager_err = (want_bf16 - ref).abs().max().item()
    fused_err = (got - ref).abs().max().item()
    assert fused_err <= 2 * eager_err + 1e-2, f"fused bf16 {fused_err:.4g} vs eager bf16 {eager_err:.4g} from fp32"
    # Where the fp32 reference's best token leads by more than both bf16 paths' error, both pick it
    # (elsewhere rounding may pick either of near-tied tokens).
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * max(eager_err, fused_err)
    assert clear.any(), "no position with a clear greedy choice: the check would test nothing"
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
    assert torch.equal(want_bf16.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_generation_in_cuda_graphs_matches_eager_bf16(name: str) -> None:
    bf16, fp32 = _models(name)
    kw = dict(max_seq_len=MAX_SEQ, batch_buckets=(1, 4), prefill_buckets=(32, 128), kv_buckets=(64, 128))
    eager = LlamaRunner(bf16, **kw)
    graphed = LlamaRunner(bf16, cuda_graphs=True, kernels="triton", **kw)
    graphed.warmup()
    assert all(step.graph is not None for step in graphed.steps.values())
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1024, (n,), generator=gen).tolist() for n in (7, 30, 90)]
    params = [SamplingParams(max_tokens=16)] * 3
    want = [c.tokens for c in generate(eager, prompts, params)]
    got = [c.tokens for c in generate(graphed, prompts, params)]

    def logits_after(ids: list[int]) -> torch.Tensor:  # the fp32 model, a fresh prefill of the whole list
        with torch.no_grad():
            t = torch.tensor([ids], device="cuda")
            return fp32(t, torch.arange(len(ids), device="cuda")[None], kv_len=MAX_SEQ)[0, -1]

    problems = [p for prompt, g, w in zip(prompts, got, want)
                if (p := check_same_or_tie(prompt, g, w, logits_after, 2e-2)) is not None]
    assert not problems, problems


@pytest.mark.parametrize("name", CONFIGS)
def test_captured_packed_forward_through_the_fused_blocks_matches_the_packed_layers(name: str) -> None:
    """A captured packed forward (a prompt, a later chunk of another, two decoding rows riding; 34
    tokens padded to the 64-token bucket) through the fused blocks: its logits are about as far from
    the fp32 model's as the packed layers' bf16 forward is, the same greedy choices where clear,
    the requests' cache rows the same, and the padding writes no request's row."""
    bf16, fp32 = _models(name)
    fused = TritonDecode(bf16)
    gen = torch.Generator(device="cuda").manual_seed(3)
    contexts = {0: 40, 1: 90, 3: 30}  # rows decoding (0, 1) and a prompt's earlier chunk (3)
    with torch.no_grad():
        for m in (bf16, fp32):
            for row, n in contexts.items():
                ids = torch.randint(3, 1024, (1, n), device="cuda", generator=torch.Generator(device="cuda").manual_seed(row))
                m(ids, torch.arange(n, device="cuda")[None], kv_len=n, rows=torch.tensor([row], device="cuda"))
    state = torch.zeros(8, 1, dtype=torch.int64, device="cuda")
    state[0, 0], state[1, 0] = 17, 99
    chunks = [Chunk(torch.randint(3, 1024, (20,), device="cuda", generator=gen).tolist(), 0, 2, True),
              Chunk([0], 40, 0, True, from_state=True),
              Chunk(torch.randint(3, 1024, (12,), device="cuda", generator=gen).tolist(), 30, 3, True),
              Chunk([0], 90, 1, True, from_state=True)]
    before = [(layer.attention.kv_cache.k_cache.clone(), layer.attention.kv_cache.v_cache.clone()) for layer in bf16.layers]

    def run(**kw: object) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for layer, (k, v) in zip(bf16.layers, before):
            layer.attention.kv_cache.k_cache.copy_(k)
            layer.attention.kv_cache.v_cache.copy_(v)
        packed = PackedPrefill(bf16, max_tokens=64, max_seqs=4, graphs=True, state_tokens=state, **kw)
        packed.warmup()  # captures every bucket (its chunks go into the spare row)
        out = packed.run(chunks).float()
        torch.cuda.synchronize()
        return out.clone(), [layer.attention.kv_cache.k_cache[:4].clone() for layer in bf16.layers]

    with torch.no_grad():
        layers, layers_rows = run()
        got, got_rows = run(fused=fused.blocks, fused_tokens=64)
        ref = PackedPrefill(fp32, max_tokens=64, max_seqs=4, state_tokens=state).run(chunks)
    eager_err = (layers - ref).abs().max().item()
    fused_err = (got - ref).abs().max().item()
    assert fused_err <= 2 * eager_err + 1e-2, f"fused bf16 {fused_err:.4g} vs packed layers {eager_err:.4g} from fp32"
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * max(eager_err, fused_err)
    assert clear.any(), "no row with a clear greedy choice: the check would test nothing"
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
    written = {2: range(0, 20), 0: range(40, 41), 3: range(30, 42), 1: range(90, 91)}
    for k_got, k_layers, (k0, _) in zip(got_rows, layers_rows, before):
        for row, span in written.items():
            torch.testing.assert_close(k_got[row, :, span.start:span.stop].float(),
                                       k_layers[row, :, span.start:span.stop].float(), atol=0.05, rtol=0.05)
            untouched = [i for i in range(MAX_SEQ) if i not in span]
            assert torch.equal(k_got[row][:, untouched], k0[row][:, untouched]), f"row {row} written outside its span"


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("pdl", [False, True], ids=["launch", "pdl"])
def test_attention_by_warp_matches_the_reference_over_long_caches(monkeypatch, t: int, pdl: bool) -> None:
    """The by-warp candidates (each warp its own slots, picked by the autotuner from
    ATTN_BY_WARP_FROM slots on) and the shared-block ones, each forced, compiled: 32 rows of GQA 3
    over 1,000-2,500 cached slots in bf16, decode and verify steps, against fp32 attention."""
    from servekit.optimizations.kernels import triton_decode as td

    if pdl and not pdl_supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs a Hopper GPU and Triton 3.4+")
    b, heads, kv_heads, dim, kv_len = 32, 9, 3, 64, 4096
    gen = torch.Generator(device="cuda").manual_seed(1)
    k = torch.randn(b, kv_heads, kv_len, dim, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(b, kv_heads, kv_len, dim, device="cuda", generator=gen).to(torch.bfloat16)
    q = torch.randn(b * t, heads * dim, device="cuda", generator=gen).to(torch.bfloat16)
    last = torch.linspace(1000, 2500, b, device="cuda").long()
    pos = (last[:, None] - torch.arange(t - 1, -1, -1, device="cuda")[None, :]).reshape(-1)
    # fp32 reference: each query token over its row's slots up to its position
    visible = torch.arange(kv_len, device="cuda")[None, None, None] <= pos.view(b, 1, t, 1)  # (b, 1, t, slots)
    group = heads // kv_heads
    want = F.scaled_dot_product_attention(q.float().view(b, t, heads, dim).transpose(1, 2),
                                          k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1),
                                          attn_mask=visible)
    want = want.transpose(1, 2).reshape(b * t, heads * dim)
    scale = want.abs().max().item()  # the outputs' size, which the tolerance is a small share of
    ways = {"by warp": td._ATTN_BY_WARP, "shared blocks": [c for c in td._ATTN if c.kwargs["BLOCK_S"] == 128]}
    assert ways["by warp"] and kv_len >= td.ATTN_BY_WARP_FROM
    for way, configs in ways.items():
        for config in configs:
            monkeypatch.setattr(td._attention_kernel, "configs", [config])
            y = td.decode_attention(q, k, v, pos, kv_len, b, t, heads, kv_heads, dim, pdl=pdl)
            err = (y.float() - want).abs().max().item()
            assert err < 0.02 * scale, f"{way} {config}: max error {err} against outputs up to {scale}"
