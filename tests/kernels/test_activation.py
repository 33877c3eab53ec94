"""The fused SiLU * up kernel (CPU interpreter) against silu(g) * u computed in float64."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from moeserve.kernels.elementwise.activation import silu_mul  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "inter"), [(1, 2048), (3, 1500), (0, 64)])
def test_silu_mul_matches_float64(dtype, tokens, inter):
    g = torch.Generator().manual_seed(inter + tokens)
    wide = torch.randn(tokens, 2 * inter + 7, generator=g) * 4  # a column view: row stride
    gu = wide[:, : 2 * inter].to(dtype)
    out = silu_mul(gu)
    x = gu.double()
    gate, up = x[:, :inter], x[:, inter:]
    want = gate / (1 + torch.exp(-gate)) * up
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-6  # one bf16 ulp (the interpreter truncates)
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="2I"):
        silu_mul(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="out must be"):
        silu_mul(torch.zeros(2, 8), out=torch.zeros(2, 3))
