"""Block-FP8 dequantization and the W8A16 Triton GEMM (CPU interpreter)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from moeserve.kernels import fp8_block_gemm as f8  # noqa: E402


def test_dequantize_applies_each_block_scale():
    # 200 x 300 -> 2 x 3 blocks; weight all ones, so the result is the block-scale map itself.
    w = torch.ones(200, 300).to(torch.float8_e4m3fn)
    si = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    d = f8.dequantize_fp8_block(w, si, torch.float32)
    assert d[0, 0] == 1 and d[127, 127] == 1 and d[127, 128] == 2 and d[0, 299] == 3
    assert d[128, 0] == 4 and d[199, 200] == 5 and d[199, 299] == 6 and d[199, 256] == 6


def test_quantize_round_trip():
    torch.manual_seed(0)
    w = torch.randn(130, 260)
    q, si = f8.quantize_fp8_block(w)
    assert si.shape == (2, 3) and q.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(
        f8.dequantize_fp8_block(q, si, torch.float32), w, rtol=7e-2, atol=1e-2
    )


SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=2)


@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (1, 200, 300, None),  # default config, ragged N and K (partial scale blocks)
        (3, 130, 260, dict(SMALL, SPLIT_K=2)),
        (20, 33, 100, dict(SMALL, BLOCK_N=16, BLOCK_K=32)),
    ],
)
def test_triton_matches_reference(m, n, k, cfg):
    torch.manual_seed(m)
    q, si = f8.quantize_fp8_block(torch.randn(n, k))
    si = si * torch.rand_like(si)  # distinct scales per block
    x = torch.randn(m, k).to(torch.bfloat16)
    ref = f8.fp8_block_gemm_ref(x, q, si).float()
    y = f8.fp8_block_gemm(x, q, si, config=cfg)
    torch.testing.assert_close(y.float(), ref, rtol=1.6e-2, atol=1e-2 * ref.abs().max().item())


def test_block_k_must_divide_128():
    q, si = f8.quantize_fp8_block(torch.randn(16, 256))
    with pytest.raises(ValueError):
        f8.fp8_block_gemm(torch.randn(1, 256).bfloat16(), q, si, config=dict(SMALL, BLOCK_K=96))
