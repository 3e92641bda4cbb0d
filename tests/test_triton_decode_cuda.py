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

from compiled_triton import require_compiled_triton

require_compiled_triton()

from greedy_parity import check_same_or_tie  # noqa: E402
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams  # noqa: E402
from servekit.optimizations.llm.offline import generate  # noqa: E402
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
