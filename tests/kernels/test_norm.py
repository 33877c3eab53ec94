"""RMSNorm kernels (plain, + residual, MLA's pair of a-norms) vs their torch references and
vs torch's own F.rms_norm, under the Triton CPU interpreter."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported (triton.jit reads it)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import moeserve.kernels.elementwise.norm as norm_mod  # noqa: E402
from tests.kernels.interpreter_shims import install_interpreter_shims  # noqa: E402
from tests.kernels.rounding_shim import install_bf16_rounding_shim  # noqa: E402

install_interpreter_shims()
install_bf16_rounding_shim()
if not isinstance(norm_mod._rms_norm_kernel, InterpretedFunction):
    norm_mod = importlib.reload(norm_mod)

BF16_ULP = 2.0**-7  # relative spacing of bf16 values (8 significant bits)


def _within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 results: at most one rounding step apart (the fp32 sums differ in order only)."""
    g, w = got.float(), want.float()
    assert torch.all((g - w).abs() <= BF16_ULP * w.abs() + 1e-30), (g - w).abs().max()
    assert (g == w).float().mean() > 0.95  # and almost always identical


def _x(rows: int, cols: int, dtype: torch.dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=gen) * scale).to(dtype)


def _w(cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1000)
    return (1.0 + 0.3 * torch.randn(cols, generator=gen)).to(dtype)


@pytest.mark.parametrize(("rows", "cols"), [(1, 7168), (5, 1536), (3, 100), (7, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_matches_reference_and_torch(rows, cols, dtype):
    x, w = _x(rows, cols, dtype, rows + cols), _w(cols, dtype, cols)
    got = norm_mod.rms_norm(x, w, 1e-6)
    ref = norm_mod.rms_norm_ref(x, w, 1e-6)
    # the independent oracle: torch's own fused op (what the CPU path of RMSNorm runs)
    torch_y = F.rms_norm(x, (cols,), w, 1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(got, torch_y, rtol=2e-6, atol=1e-6)
    else:
        _within_one_ulp(got, ref)
        _within_one_ulp(got, torch_y)


def test_rms_norm_strided_rows_and_in_place():
    """A column slice of a wider buffer (row stride 40), normalised in place."""
    buf = _x(6, 40, torch.bfloat16, 3)
    keep = buf.clone()
    view = buf[:, 4:36]
    w = _w(32, torch.bfloat16, 1)
    ref = norm_mod.rms_norm_ref(view.clone(), w, 1e-5)
    out = norm_mod.rms_norm(view, w, 1e-5, out=view)
    assert out.data_ptr() == view.data_ptr()
    _within_one_ulp(buf[:, 4:36], ref)
    assert torch.equal(buf[:, :4], keep[:, :4]) and torch.equal(buf[:, 36:], keep[:, 36:])


@pytest.mark.parametrize(("rows", "cols"), [(1, 7168), (9, 300)])
def test_add_rmsnorm_sum_rounded_then_normalised(rows, cols):
    dtype = torch.bfloat16
    x, r, w = _x(rows, cols, dtype, 1), _x(rows, cols, dtype, 2, 10.0), _w(cols, dtype, 3)
    y, res = norm_mod.add_rmsnorm(x, r, w, 1e-6)
    # the torch path of the layer: the add in the activation dtype, then torch's rms_norm
    s = x + r
    assert torch.equal(res, s)
    _within_one_ulp(y, F.rms_norm(s, (cols,), w, 1e-6))
    ry, rs = norm_mod.add_rmsnorm_ref(x, r, w, 1e-6)
    assert torch.equal(rs, s)
    _within_one_ulp(y, ry)


def test_add_rmsnorm_in_place():
    dtype = torch.bfloat16
    x, r, w = _x(4, 96, dtype, 5), _x(4, 96, dtype, 6), _w(96, dtype, 7)
    want_y, want_r = norm_mod.add_rmsnorm_ref(x, r, w, 1e-6)
    y, res = norm_mod.add_rmsnorm(x, r, w, 1e-6, out=x, residual_out=r)
    assert y.data_ptr() == x.data_ptr() and res.data_ptr() == r.data_ptr()
    assert torch.equal(r, want_r)
    _within_one_ulp(x, want_y)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize(("n_a", "n_b", "rest"), [(1536, 512, 64), (48, 32, 8), (24, 40, 0)])
def test_rms_norm_pair(in_place, n_a, n_b, rest):
    dtype = torch.bfloat16
    x = _x(3, n_a + n_b + rest, dtype, n_a)
    wa, wb = _w(n_a, dtype, 1), _w(n_b, dtype, 2)
    x0 = x.clone()
    out = norm_mod.rms_norm_pair(x, wa, wb, 1e-6, 1e-5, out=x if in_place else None)
    assert (out.data_ptr() == x.data_ptr()) == in_place
    # oracle: two independent torch rms_norms on the column ranges, the rest untouched
    _within_one_ulp(out[:, :n_a], F.rms_norm(x0[:, :n_a], (n_a,), wa, 1e-6))
    _within_one_ulp(out[:, n_a : n_a + n_b], F.rms_norm(x0[:, n_a : n_a + n_b], (n_b,), wb, 1e-5))
    assert torch.equal(out[:, n_a + n_b :], x0[:, n_a + n_b :])
    _within_one_ulp(out, norm_mod.rms_norm_pair_ref(x0, wa, wb, 1e-6, 1e-5))


def test_shape_checks():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="weight"):
        norm_mod.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="contiguous last dim"):
        norm_mod.rms_norm(torch.zeros(8, 2).t(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        norm_mod.rms_norm_pair(x, torch.ones(6), torch.ones(4), 1e-6, 1e-6)
    with pytest.raises(TypeError, match="residual dtype"):
        norm_mod.add_rmsnorm(x, x.bfloat16(), torch.ones(8), 1e-6)
