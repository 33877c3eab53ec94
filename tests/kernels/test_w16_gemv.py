"""The 16-bit split-K GEMV with fused RMSNorm segments (kernels/gemm/w16_gemv.py) under the
Triton CPU interpreter, against an fp32 torch reference: 1-4 rows, bf16 and fp16, one and
several K-splits, with and without norm segments, a reused workspace, a strided out view, and
the argument checks. Shapes are MLA's merged q_a / kv_a projection scaled down: N = 96 + 32 +
16 (two normalised segments and a raw tail), K a few hundred."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported (triton.jit reads it)

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import moeserve.kernels.gemm.w16_gemv as wg  # noqa: E402
from tests.kernels.interpreter_shims import install_interpreter_shims  # noqa: E402
from tests.kernels.rounding_shim import install_bf16_rounding_shim  # noqa: E402

install_interpreter_shims()
install_bf16_rounding_shim()
if not isinstance(wg._w16_gemv_kernel, InterpretedFunction):
    wg = importlib.reload(wg)

N_A, N_B, N_REST = 96, 32, 16  # q_a (1536), kv_a (512), rope (64) over 16
N = N_A + N_B + N_REST
K = 320  # five 64-column tiles: splits of 3 leave a ragged last split
EPS_A, EPS_B = 1e-6, 1e-5
# relative spacing of the output dtype's values: one rounding of the fp32 result
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
FP32_SLACK = 2.0**-18  # fp32 summation-order differences, relative to sum |x_k w_k|
NORM_SLACK = 1e-5  # the same through the normalisation (its outputs are O(1))
SMALL = {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1, "STAGES": 2}


def _inputs(t: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.5).to(dtype)
    return x, w


def _norm_weights(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1000)
    wa = (1.0 + 0.3 * torch.randn(N_A, generator=gen)).to(dtype)
    wb = (1.0 + 0.3 * torch.randn(N_B, generator=gen)).to(dtype)
    return wa, wb


def _segments(wa: torch.Tensor, wb: torch.Tensor) -> tuple[wg.NormSegment, ...]:
    return (wg.NormSegment(0, N_A, wa, EPS_A), wg.NormSegment(N_A, N_B, wb, EPS_B))


def _reference(
    x: torch.Tensor, w: torch.Tensor, norms: tuple[wg.NormSegment, ...] = ()
) -> torch.Tensor:
    """fp32: x @ w^T, then y = v * rsqrt(mean(v^2) + eps) * weight on each segment."""
    y = x.float() @ w.float().t()
    for seg in norms:
        v = y[:, seg.start : seg.start + seg.width].clone()
        rstd = torch.rsqrt(v.pow(2).mean(dim=1, keepdim=True) + seg.eps)
        y[:, seg.start : seg.start + seg.width] = v * rstd * seg.weight.float()
    return y


def _check(
    got: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    norms: tuple[wg.NormSegment, ...] = (),
) -> None:
    """Within one rounding of the output dtype of the fp32 reference (plus fp32 slack)."""
    ref = _reference(x, w, norms)
    tol = ULP[got.dtype] * ref.abs() + FP32_SLACK * (x.float().abs() @ w.float().abs().t())
    for seg in norms:
        tol[:, seg.start : seg.start + seg.width] += NORM_SLACK
    err = (got.float() - ref).abs()
    assert got.dtype == x.dtype and got.shape == ref.shape
    assert torch.all(err <= tol), f"max error {err.max().item()} (tolerance {tol.min().item()})"


@pytest.mark.parametrize("t", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("with_norms", [False, True])
def test_matches_fp32_reference(t, dtype, split, with_norms):
    x, w = _inputs(t, N, K, dtype, seed=t + 10 * split)
    norms = _segments(*_norm_weights(dtype, t)) if with_norms else ()
    # K_FOLD 8 (lane sums) at several rows, elementwise accumulators at one
    cfg = {**SMALL, "SPLIT_K": split, "K_FOLD": 8 if t > 1 else 1}
    assert wg.planned_split(t, N, K, x.device, cfg) == split
    _check(wg.w16_gemv(x, w, norms=norms, config=cfg), x, w, norms)


@pytest.mark.parametrize("t", [1, 4])
def test_table_config_with_automatic_split(t):
    k = 1024  # four 256-column tiles: the automatic split takes two
    x, w = _inputs(t, N, k, torch.bfloat16, seed=5)
    assert wg.planned_split(t, N, k, x.device) > 1
    norms = _segments(*_norm_weights(torch.bfloat16, 5))
    _check(wg.w16_gemv(x, w), x, w)
    _check(wg.w16_gemv(x, w, norms=norms), x, w, norms)


def test_even_k_split_and_single_segment_with_fp32_weight():
    k = 384  # six 64-column tiles over 3 splits: no K masks
    x, w = _inputs(2, N, k, torch.bfloat16, seed=7)
    norms = (wg.NormSegment(N_A, N_B, torch.rand(N_B) + 0.5, 1e-6),)  # a middle segment only
    cfg = {**SMALL, "SPLIT_K": 3, "BLOCK_N": 16}
    _check(wg.w16_gemv(x, w, norms=norms, config=cfg), x, w, norms)


def test_segments_wider_than_one_norm_chunk(monkeypatch):
    # a small chunk so the normalising program loops over column chunks
    monkeypatch.setattr(wg, "NORM_BLOCK_MAX", 32)
    x, w = _inputs(3, N, K, torch.bfloat16, seed=8)
    norms = _segments(*_norm_weights(torch.bfloat16, 8))
    _check(wg.w16_gemv(x, w, norms=norms, config={**SMALL, "SPLIT_K": 2}), x, w, norms)


def test_workspace_serves_consecutive_calls_and_is_left_zeroed():
    ws = wg.W16Workspace.allocate(4, N, 3, "cpu")
    cfg = {**SMALL, "SPLIT_K": 3}
    wa, wb = _norm_weights(torch.bfloat16, 0)
    outs = []
    for seed, t in ((1, 4), (2, 4), (3, 1)):  # different inputs and row counts, one workspace
        x, w = _inputs(t, N, K, torch.bfloat16, seed)
        norms = _segments(wa, wb) if seed != 2 else ()
        got = wg.w16_gemv(x, w, norms=norms, workspace=ws, config=cfg)
        _check(got, x, w, norms)
        assert torch.all(ws.counters == 0)
        outs.append(got)
    # the same call again gives the same bits (partials summed in split order)
    x, w = _inputs(1, N, K, torch.bfloat16, 3)
    again = wg.w16_gemv(x, w, norms=_segments(wa, wb), workspace=ws, config=cfg)
    assert torch.equal(again, outs[-1])


def test_for_shape_fits_every_row_count():
    ws = wg.W16Workspace.for_shape(N, 1024, "cpu")
    for t in range(1, 5):
        assert ws.fits(t, N, wg.planned_split(t, N, 1024, torch.device("cpu")))


def test_out_view_with_row_stride():
    t, pad = 3, 8
    x_wide = _inputs(t, 1, K + 16, torch.bfloat16, seed=9)[0]
    x = x_wide[:, 16:]  # x with a row stride too
    w = _inputs(1, N, K, torch.bfloat16, seed=9)[1]
    buf = torch.full((t, N + 3 * pad), 7.0, dtype=torch.bfloat16)
    out = buf[:, pad : pad + N]
    norms = _segments(*_norm_weights(torch.bfloat16, 9))
    got = wg.w16_gemv(x, w, out=out, norms=norms, config={**SMALL, "SPLIT_K": 2})
    assert got.data_ptr() == out.data_ptr()
    _check(out, x, w, norms)
    assert torch.all(buf[:, :pad] == 7.0) and torch.all(buf[:, pad + N :] == 7.0)


def test_supported():
    x, w = _inputs(4, N, K, torch.bfloat16, seed=0)
    assert wg.w16_gemv_supported(x, w)
    assert not wg.w16_gemv_supported(x.float(), w.float())
    assert not wg.w16_gemv_supported(x, w.half())
    assert not wg.w16_gemv_supported(torch.cat([x, x[:1]]), w)  # 5 rows
    assert not wg.w16_gemv_supported(x[:, :-4], w[:, :-4].contiguous())  # K % 8


def test_bad_inputs_raise_value_error():
    x, w = _inputs(2, N, K, torch.bfloat16, seed=0)
    wa, wb = _norm_weights(torch.bfloat16, 0)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        wg.w16_gemv(x.float(), w.float())
    with pytest.raises(ValueError, match="x's dtype"):
        wg.w16_gemv(x, w.half())
    with pytest.raises(ValueError, match="contiguous"):
        wg.w16_gemv(x, w[:, : K // 2])
    with pytest.raises(ValueError, match=f"w must be contiguous \\[N, {K}\\]"):
        wg.w16_gemv(x, w[:, : K // 2].contiguous())  # K differs from x's
    with pytest.raises(ValueError, match="x must be \\[T, K\\]"):
        wg.w16_gemv(x[0], w)
    with pytest.raises(ValueError, match="multiple of 8"):
        wg.w16_gemv(x[:, :-4], w[:, :-4].contiguous())
    with pytest.raises(ValueError, match="at most 4 rows"):
        wg.w16_gemv(torch.cat([x, x, x]), w)
    with pytest.raises(ValueError, match="out must be"):
        wg.w16_gemv(x, w, out=torch.empty(2, N + 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must have"):
        wg.w16_gemv(x, w, out=torch.empty(2, N, dtype=torch.float16))
    with pytest.raises(ValueError, match="disjoint"):
        wg.w16_gemv(x, w, norms=(wg.NormSegment(0, N_A, wa, 1e-6),
                                 wg.NormSegment(N_A - 1, N_B, wb, 1e-6)))  # fmt: skip
    with pytest.raises(ValueError, match="disjoint"):
        wg.w16_gemv(x, w, norms=(wg.NormSegment(N - 8, N_B, wb, 1e-6),))  # past N
    with pytest.raises(ValueError, match="contiguous \\[96\\] vector"):
        wg.w16_gemv(x, w, norms=(wg.NormSegment(0, N_A, wb, 1e-6),))
    small = wg.W16Workspace.allocate(1, N, 1, "cpu")
    with pytest.raises(ValueError, match="workspace too small"):
        wg.w16_gemv(x, w, workspace=small, config={**SMALL, "SPLIT_K": 3})
