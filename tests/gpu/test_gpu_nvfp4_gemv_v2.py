"""The NVFP4 decode GEMV v2 (Gluon + inline PTX, GPU only) against the fp32 torch matmul of the
original checkpoint-layout weights: the Kimi-K2.5 shapes, odd N and K (padded by the repack),
activations from 1e-3 to 3e3 with an outlier, several x rows, every launch config family, and
CUDA-graph replays (split-K workspace left zeroed).

  python3 -m pytest -q tests/gpu/test_gpu_nvfp4_gemv_v2.py
"""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels import nvfp4_format as fmt
from moeserve.kernels import nvfp4_gemv_v2 as v2
from moeserve.kernels.splitk import SplitKWorkspace

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

KIMI_SHAPES = [(4096, 7168), (7168, 2048), (7168, 8192), (12288, 1536)]
# f16 products and 16-term f16 block sums, bf16 output: errors well under 1% of the row scale
REL_TOL = 1e-2


def _reference(x: torch.Tensor, packed, scale, gs) -> torch.Tensor:
    return x.float() @ fmt.dequantize_nvfp4(packed, scale, gs, dtype=torch.float32).t()


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Per output row: max error within REL_TOL of that row's largest |value|."""
    err = (got.float() - ref).abs().amax(dim=1)
    scale = ref.abs().amax(dim=1).clamp_min(1e-30)
    assert bool((err <= REL_TOL * scale).all()), (err / scale).max().item()


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    return fmt.quantize_nvfp4(w)


def _run(x, rep, n, config=None, workspace=None) -> torch.Tensor:
    out = torch.full((x.shape[0], n), float("nan"), device="cuda", dtype=x.dtype)
    return v2.nvfp4_gemv_v2(x, *rep, out, workspace=workspace, config=config)


@pytest.mark.parametrize("n,k", KIMI_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_kimi_shapes(n, k, m):
    w = _weights(n, k, n + k)
    rep = v2.repack_for_gemv_v2(*w)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    _close(_run(x, rep, n), _reference(x, *w))


@pytest.mark.parametrize("n,k", [(1, 16), (100, 1040), (333, 4112), (65, 2064)])
@pytest.mark.parametrize("m", [1, 3, 6])
def test_odd_shapes(n, k, m):
    w = _weights(n, k, 7 * n + k)
    rep = v2.repack_for_gemv_v2(*w)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    _close(_run(x, rep, n), _reference(x, *w))


@pytest.mark.parametrize("x_scale", [1e-3, 1.0, 3e3])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_activation_range_and_outlier(x_scale, m):
    """x from 1e-3 to 3e3, one huge outlier in row 0: no f16 overflow, and the other rows
    keep their own precision (the x scale is per 32-position vector)."""
    n, k = 512, 2048
    w = _weights(n, k, 11)
    rep = v2.repack_for_gemv_v2(*w)
    x = torch.randn(m, k, device="cuda") * x_scale
    x[0, 5] = 3e4 * x_scale
    x = x.to(torch.bfloat16)
    got = _run(x, rep, n)
    assert torch.isfinite(got).all()
    _close(got, _reference(x, *w))
    # the biggest products: every weight at its largest code next to the outlier
    big = torch.full_like(w[0], 0x77)  # code 7 (6.0) in both nibbles
    scale = torch.full_like(w[1], 448.0)
    rep_big = v2.repack_for_gemv_v2(big, scale, w[2])
    x_big = torch.full((m, k), 3e3 * x_scale, device="cuda", dtype=torch.bfloat16)
    got = _run(x_big, rep_big, n)
    assert torch.isfinite(got).all()
    _close(got, _reference(x_big, big, scale, w[2]))


@pytest.mark.parametrize(
    "cfg",
    [
        {"KC": 1, "L": 32, "RB": 16, "num_warps": 8, "PROGRAMS": 264},
        {"KC": 2, "L": 32, "RB": 16, "num_warps": 8, "PROGRAMS": 264},
        {"KC": 1, "L": 16, "RB": 32, "num_warps": 8, "PROGRAMS": 132},
        {"KC": 2, "L": 16, "RB": 8, "num_warps": 4, "PROGRAMS": 528},
        {"KC": 2, "L": 32, "RB": 32, "num_warps": 4, "PROGRAMS": 7},  # few, long programs
    ],
)
@pytest.mark.parametrize("m", [1, 2, 5])
def test_configs(cfg, m):
    n, k = 1000, 4096
    w = _weights(n, k, 3)
    rep = v2.repack_for_gemv_v2(*w)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    _close(_run(x, rep, n, cfg), _reference(x, *w))


@pytest.mark.parametrize("m", [1, 2])
def test_cuda_graph_replay(m):
    """Captured once, replayed on new x: split-K workspace and counters stay zeroed."""
    n, k = 7168, 2048
    w = _weights(n, k, 5)
    rep = v2.repack_for_gemv_v2(*w)
    cfg = {"KC": 1, "L": 32, "RB": 16, "num_warps": 8, "PROGRAMS": 264}  # splits K in two
    elems, tiles = v2.workspace_size(m, n, k, cfg)
    ws = SplitKWorkspace.create(elems, tiles, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    v2.nvfp4_gemv_v2(x, *rep, out, workspace=ws, config=cfg)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        v2.nvfp4_gemv_v2(x, *rep, out, workspace=ws, config=cfg)
    for seed in range(3):
        x.copy_(
            torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        )
        g.replay()
        torch.cuda.synchronize()
        _close(out, _reference(x, *w))
    assert not ws.partial.any() and not ws.locks.any()


def test_reference_matches_original():
    n, k = 300, 1552
    w = _weights(n, k, 9)
    rep = v2.repack_for_gemv_v2(*w)
    x = torch.randn(3, k, device="cuda", dtype=torch.bfloat16)
    ref = v2.nvfp4_gemv_v2_ref(x, *rep, n)
    _close(ref, _reference(x, *w))
