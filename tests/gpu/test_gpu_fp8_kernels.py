"""The block-FP8 GEMM and the fused block-FP8 / bf16 MoE on the GPU (compiled Triton,
which the interpreter tests cannot cover) against the fp32 torch references, including
capture and replay in a CUDA graph. Runs where a GPU is:
python3 -m pytest -q tests/gpu/test_gpu_fp8_kernels.py"""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.gemm import fp8_block_gemm as f8
from moeserve.kernels.moe.fp8 import fused_moe_fp8, fused_moe_fp8_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _close(got: torch.Tensor, ref: torch.Tensor, rel: float = 1e-2) -> None:
    ref = ref.float()
    err = (got.float() - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), (err, ref.abs().max().item())


@pytest.mark.parametrize("m", [1, 2, 3, 8, 13, 100])
def test_fp8_gemm(m):
    torch.manual_seed(m)
    n, k = 640, 1664  # ragged against 128-wide blocks in neither; split-K on
    q, si = f8.quantize_fp8_block(torch.randn(n, k, device="cuda"))
    si = si * torch.rand_like(si)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    _close(f8.fp8_block_gemm(x, q, si), f8.fp8_block_gemm_ref(x, q, si))


@pytest.mark.parametrize("stages", [0, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7])
def test_fp8_gemv(m, stages):
    """The CUDA-core GEMV (cp.async-pipelined or not), split-K on, 1-4 rows per weight pass,
    in a CUDA graph replayed twice (the split-K workspace must come back zeroed)."""
    torch.manual_seed(m)
    n, k = 640, 1664
    q, si = f8.quantize_fp8_block(torch.randn(n, k, device="cuda"))
    si = si * torch.rand_like(si)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    cfg = dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=3, num_warps=2, num_stages=1, STAGES=stages)
    ws = f8.SplitKWorkspace.create(8 * n, 1024, "cuda")
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    f8.fp8_block_gemm(x, q, si, out=out, workspace=ws, config=cfg, kernel="gemv")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        f8.fp8_block_gemm(x, q, si, out=out, workspace=ws, config=cfg, kernel="gemv")
    for _ in range(2):
        out.fill_(float("nan"))
        g.replay()
        _close(out, f8.fp8_block_gemm_ref(x, q, si))


def _bank(e, n, k, fp8):
    w = torch.randn(e, n, k, device="cuda") * 0.05
    if not fp8:
        return w.to(torch.bfloat16), None
    parts = [f8.quantize_fp8_block(w[j]) for j in range(e)]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("kernel", ["gemv", "mma", None])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_fused_moe_paths(fp8, kernel, m):
    torch.manual_seed(200 + m)
    e, h, i, topk = 12, 512, 256, 4
    w13, s13 = _bank(e, 2 * i, h, fp8)
    w2, s2 = _bank(e, h, i, fp8)
    ids = torch.stack([torch.randperm(e, device="cuda")[:topk] for _ in range(m)]).int()
    ids[::3, 0] = e + 1  # another rank's expert (EP): skipped
    tw = torch.rand(m, topk, device="cuda")
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    got = fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, kernel=kernel)
    _close(got, fused_moe_fp8_ref(x, ids, tw, w13, s13, w2, s2), 2e-2)


def test_fused_moe_replays_in_a_cuda_graph():
    torch.manual_seed(7)
    e, h, i, topk, m = 16, 512, 256, 8, 4
    w13, s13 = _bank(e, 2 * i, h, True)
    w2, s2 = _bank(e, h, i, True)
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(m, topk, device="cuda", dtype=torch.int32)
    tw = torch.rand(m, topk, device="cuda")
    out = torch.empty(m, h, device="cuda", dtype=torch.bfloat16)
    fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, out=out)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, out=out)
    for seed in range(3):  # new routings written into the captured inputs
        gen = torch.Generator(device="cuda").manual_seed(seed)
        ids.copy_(
            torch.stack([torch.randperm(e, device="cuda", generator=gen)[:topk] for _ in range(m)])
        )
        g.replay()
        _close(out, fused_moe_fp8_ref(x, ids, tw, w13, s13, w2, s2), 2e-2)
