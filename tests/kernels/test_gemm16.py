"""The batch-invariant 16-bit GEMM (kernels/gemm/invariant.py, CPU interpreter) against an fp64
reference: plain and batched, transposed weight views (the absorbed MLA products read
kv_b_proj's dense weight through them), bf16 and fp32 outputs, ragged sizes."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from moeserve.kernels.gemm.invariant import gemm16  # noqa: E402
from tests.kernels.interpreter_shims import install_interpreter_shims  # noqa: E402

install_interpreter_shims()


@pytest.mark.parametrize("m, n, k", [(1, 70, 96), (19, 64, 130), (33, 17, 64)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_plain(m, n, k, out_dtype):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    y = gemm16(x, w, out_dtype)
    ref = x.double() @ w.double().t()
    assert y.dtype == out_dtype and y.shape == (m, n)
    # bf16 out: one ulp (the interpreter truncates fp32 -> bf16 where the GPU rounds)
    tol = 1e-5 if out_dtype == torch.float32 else 2.0**-7
    assert ((y.double() - ref).abs() <= tol * ref.abs().max()).all()


def test_batched_transposed_views_into_a_strided_out():
    gen = torch.Generator().manual_seed(3)
    heads, t, nope, lat = 3, 5, 16, 48
    q = torch.randn(t, heads, nope + 8, generator=gen).bfloat16()
    w = torch.randn(heads, nope, lat, generator=gen).bfloat16()  # W_UK as stored: [h, nope, L]
    out = torch.zeros(t, heads, lat + 8, dtype=torch.bfloat16)
    x = q[..., :nope].transpose(0, 1)  # [h, T, nope]
    gemm16(x, w.transpose(1, 2), out=out[..., :lat].transpose(0, 1))
    ref = torch.einsum("thd,hdl->thl", q[..., :nope].double(), w.double())
    got = out[..., :lat].double()
    assert ((got - ref).abs() <= 2.0**-7 * ref.abs().max()).all()
    assert (out[..., lat:] == 0).all()  # nothing written past the view
