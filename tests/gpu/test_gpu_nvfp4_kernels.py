"""Every NVFP4 GEMM / MoE kernel path on the GPU against the fp32 torch references, including
the register-fed mma.sync paths (inline PTX, which the CPU interpreter cannot run). Runs where
a GPU is: python3 -m pytest -q tests/gpu/test_gpu_nvfp4_kernels.py"""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.gemm import nvfp4_format as fmt
from moeserve.kernels.gemm import nvfp4_gemm as nv
from moeserve.kernels.moe import nvfp4 as moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    ref = ref.float()
    err = (got.float() - ref).abs().max().item()
    assert err <= 1e-2 * ref.abs().max().item(), (err, ref.abs().max().item())


def test_probes_pass():
    dev = torch.device("cuda")
    assert nv.probe_decode(dev) == nv.DECODE_ASM
    assert nv.probe_gemv_mma(dev)


@pytest.mark.parametrize("kernel", ["gemv", "gemv_mma", "mma", "dequant"])
@pytest.mark.parametrize("m", [1, 3, 8, 13])
def test_gemm_paths(kernel, m):
    torch.manual_seed(m)
    n, k = 384, 1536  # N a multiple of every tile, K of the MMA GEMV's 256-wide steps
    packed, scale, gs = fmt.quantize_nvfp4(torch.randn(n, k, device="cuda") * 0.02)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = nv.nvfp4_gemm(x, packed, scale, gs, kernel=kernel)
    _close(y, nv.nvfp4_gemm_ref(x, packed, scale, gs))


def _moe_case(m: int) -> tuple:
    """m tokens routed to 4 of 12 small quantized experts: (x, ids, weights, expert tensors)."""
    e, h, i, topk = 12, 512, 256, 4
    parts13 = [fmt.quantize_nvfp4(torch.randn(2 * i, h, device="cuda") * 0.05) for _ in range(e)]
    parts2 = [fmt.quantize_nvfp4(torch.randn(h, i, device="cuda") * 0.05) for _ in range(e)]
    w13, s13, g13 = (torch.stack([p[j] for p in parts13]) for j in range(3))
    w2, s2, g2 = (torch.stack([p[j] for p in parts2]) for j in range(3))
    ids = torch.stack([torch.randperm(e, device="cuda")[:topk] for _ in range(m)]).int()
    tw = torch.rand(m, topk, device="cuda")
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    return x, ids, tw, (w13, s13, g13, w2, s2, g2)


@pytest.mark.parametrize("kernel", ["gemv", "gemv_mma", "mma"])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_moe_paths(kernel, m):
    torch.manual_seed(100 + m)
    x, ids, tw, (w13, s13, g13, w2, s2, g2) = _moe_case(m)
    y = moe.fused_moe_nvfp4(x, ids, tw, w13, s13, g13, w2, s2, g2, kernel=kernel)
    _close(y, moe.fused_moe_nvfp4_ref(x, ids, tw, w13, s13, g13, w2, s2, g2))


@pytest.mark.parametrize("split_k", [1, 3])
def test_gemv_with_programmatic_dependent_launch_in_a_graph(split_k):
    """PDL: each GEMV reads the previous one's output (a chain in one CUDA graph, so a wait
    placed too late would read a stale x); bit-equal to the same chain without PDL."""
    from moeserve.kernels.configs import tile_config

    torch.manual_seed(7)
    n = k = 1024
    ws = [fmt.quantize_nvfp4(torch.randn(n, k, device="cuda") * 0.03) for _ in range(4)]
    base = dict(tile_config("nvfp4_gemv", 1, f"{n}x{k}"), SPLIT_K=split_k)
    x0 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def chain(cfg: dict) -> list[torch.Tensor]:
        outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            x = x0
            for w, o in zip(ws, outs, strict=True):
                x = nv.nvfp4_gemm(x, *w, out=o, config=cfg, kernel="gemv")
        g.replay()
        torch.cuda.synchronize()
        return outs

    plain, pdl = chain(dict(base, PDL=0)), chain(dict(base, PDL=1))
    for a, b in zip(plain, pdl, strict=True):
        assert torch.equal(a, b)
    x = x0
    for w, got in zip(ws, plain, strict=True):  # and the chain itself against the reference
        ref = nv.nvfp4_gemm_ref(x, *w)
        _close(got, ref)
        x = got


@pytest.mark.parametrize("stages", [0, 3])
@pytest.mark.parametrize("x_scale", [1e-3, 1.0, 3e3])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_gemv_f16_products(m, x_scale, stages):
    """F16: the f16x2 inline-PTX products on x scaled per row by a power of two, against the
    fp32 reference, for activations from 1e-3 to 3e3 (f16 alone would lose the small ones and
    overflow the large ones' block sums); one row has a single huge outlier."""
    torch.manual_seed(m)
    n, k = 384, 1536
    packed, scale, gs = fmt.quantize_nvfp4(torch.randn(n, k, device="cuda") * 0.02)
    x = torch.randn(m, k, device="cuda") * x_scale
    x[0, 5] = 3e4 * x_scale  # the scale follows the row's max
    x = x.to(torch.bfloat16)
    cfg = dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=2, num_warps=4, num_stages=1, STAGES=stages)
    y = nv.nvfp4_gemm(x, packed, scale, gs, config=dict(cfg, F16=1), kernel="gemv")
    _close(y, nv.nvfp4_gemm_ref(x, packed, scale, gs))
    rest = nv.nvfp4_gemm_ref(x[1:], packed, scale, gs) if m > 1 else None
    if rest is not None:  # rows without the outlier keep their own precision
        _close(y[1:], rest)


@pytest.mark.parametrize("m", [1, 5])
def test_moe_gemv_f16_products(m):
    torch.manual_seed(200 + m)
    x, ids, tw, (w13, s13, g13, w2, s2, g2) = _moe_case(m)
    cfg = dict(MP=1 if m == 1 else 2, BLOCK_N=16, BLOCK_K=256, num_warps=2, num_stages=1)
    y = moe.fused_moe_nvfp4(
        x, ids, tw, w13, s13, g13, w2, s2, g2, kernel="gemv", gate_up_config=dict(cfg, F16=1)
    )
    _close(y, moe.fused_moe_nvfp4_ref(x, ids, tw, w13, s13, g13, w2, s2, g2))
