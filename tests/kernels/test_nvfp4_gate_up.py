"""The fused NVFP4 gate/up + SiLU GEMV (CPU interpreter) against torch on the dequantized
weights: silu(x @ gate^T) * (x @ up^T), each weight with its own global scale."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from moeserve.kernels.gemm import nvfp4_gate_up as gu  # noqa: E402
from moeserve.kernels.gemm.nvfp4_format import dequantize_nvfp4, quantize_nvfp4  # noqa: E402
from moeserve.kernels.gemm.nvfp4_gemm import DECODE_ARITH, DECODE_BITS  # noqa: E402
from moeserve.kernels.gemm.splitk import SplitKWorkspace  # noqa: E402


def _weight(n, k, scale, seed):
    packed, block, gs = quantize_nvfp4(
        torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * scale
    )
    return packed, block, torch.as_tensor(gs, dtype=torch.float32).reshape(1)


def _reference(x, gate, up):
    g = x.float() @ dequantize_nvfp4(gate[0], gate[1], gate[2], torch.float32).t()
    u = x.float() @ dequantize_nvfp4(up[0], up[1], up[2], torch.float32).t()
    return torch.nn.functional.silu(g) * u


def _cfg(**kw):
    return dict(dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=1), **kw)


@pytest.mark.parametrize(
    "m,n,k,cfg,decode",
    [
        (1, 40, 96, _cfg(), DECODE_BITS),  # N not a multiple of BLOCK_N
        (1, 32, 80, _cfg(SPLIT_K=3, F16=1), DECODE_BITS),  # K not a multiple of BLOCK_K
        (3, 32, 96, _cfg(SPLIT_K=2), DECODE_ARITH),  # 4 rows per program, one missing
        (6, 48, 64, _cfg(STAGES=2), DECODE_BITS),  # two row blocks, pipelined K loop
        (2, 32, 128, _cfg(SPLIT_K=4, PREFETCH=2), DECODE_BITS),
    ],
)
def test_fused_gate_up_matches_reference(m, n, k, cfg, decode):
    # global scales a decade apart: each half must use its own
    gate, up = _weight(n, k, 0.5, 1), _weight(n, k, 0.05, 2)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    got = gu.nvfp4_gate_up_silu(x, gate, up, config=cfg, decode=decode)
    ref = _reference(x, gate, up)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_split_workspace_left_zeroed_and_reused():
    gate, up = _weight(32, 96, 0.3, 3), _weight(32, 96, 0.3, 4)
    ws = SplitKWorkspace.create(4 * 64, 8, "cpu")
    for seed in (1, 2):
        x = torch.randn(1, 96, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        got = gu.nvfp4_gate_up_silu(x, gate, up, ws, config=_cfg(SPLIT_K=3), decode=DECODE_BITS)
        ref = _reference(x, gate, up)
        torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
        assert not ws.partial.any() and not ws.locks.any()


def test_mismatched_weights_rejected():
    gate, up = _weight(32, 96, 0.3, 3), _weight(16, 96, 0.3, 4)
    with pytest.raises(ValueError):
        gu.nvfp4_gate_up_silu(torch.zeros(1, 96, dtype=torch.bfloat16), gate, up)
