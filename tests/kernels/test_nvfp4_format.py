"""The NVFP4 format module: one quantizer (no negative-zero codes) shared by the kernels and the
checkpoint writer, checked against values typed in here; and the module split (no import
circle between the GEMM dispatcher and the GEMVs)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeserve.kernels.gemm import nvfp4_format as fmt
from moeserve.testing import checkpoints as checkpoint_writer

REPO = Path(__file__).resolve().parents[2]

# OCP MX spec, code -> value with the sign in bit 3, written out instead of derived.
E2M1_BY_CODE = [
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
]

# (value at scale*global == 1, expected code): ties go to the even magnitude index, values past
# 6 saturate, and anything that rounds to magnitude 0 is code 0 whatever its sign.
ROUNDING = [
    (0.0, 0),
    (0.1, 0),
    (0.25, 0),  # tie 0 | 0.5
    (0.2501, 1),
    (0.5, 1),
    (0.75, 2),  # tie 0.5 | 1
    (1.25, 2),  # tie 1 | 1.5
    (1.5, 3),
    (1.75, 4),  # tie 1.5 | 2
    (2.5, 4),  # tie 2 | 3
    (3.0, 5),
    (3.5, 6),  # tie 3 | 4
    (5.0, 6),  # tie 4 | 6
    (5.01, 7),
    (6.0, 7),
    (6.5, 7),
    (100.0, 7),
    (-0.1, 0),
    (-0.25, 0),
    (-0.2501, 9),
    (-0.75, 10),
    (-1.25, 10),
    (-1.75, 12),
    (-2.5, 12),
    (-3.5, 14),
    (-5.0, 14),
    (-6.0, 15),
    (-7.0, 15),
]


def _codes(packed: torch.Tensor) -> torch.Tensor:
    return fmt.unpack_e2m1_codes(packed)


def test_dequantize_every_code_matches_the_table():
    codes = torch.arange(16, dtype=torch.uint8)[None, :]
    packed = fmt.pack_e2m1_codes(codes)
    scale = torch.ones(1, 1).to(torch.float8_e4m3fn)
    assert fmt.dequantize_nvfp4(packed, scale, 1.0, torch.float32)[0].tolist() == E2M1_BY_CODE
    assert fmt.e2m1_table().tolist() == E2M1_BY_CODE
    assert torch.equal(_codes(packed), codes)


def test_rounding_index_matches_typed_values():
    x = torch.tensor([abs(v) for v, _ in ROUNDING])
    assert fmt.e2m1_round_index(x).tolist() == [c & 7 for _, c in ROUNDING]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_quantizer_rounding_matches_typed_values(sign):
    # Each 16-value block holds a +-6 and nothing larger, so with global 1 its e4m3 block scale
    # is exactly 1 and the values are rounded as typed. Values above 6 get their own check.
    vals = [(v, c) for v, c in ROUNDING if abs(v) <= 6.0]
    row = [sign * 6.0] + [v for v, _ in vals]
    row += [0.0] * (-len(row) % 16)
    w = torch.tensor(row)[None, :]
    packed, scale = fmt.quantize_nvfp4_with_global(w, torch.tensor(1.0))
    assert scale.float().flatten().tolist() == [1.0] * (len(row) // 16)
    assert _codes(packed)[0, 1 : 1 + len(vals)].tolist() == [c for _, c in vals]
    deq = fmt.dequantize_nvfp4(packed, scale, 1.0, torch.float32)[0, 1 : 1 + len(vals)]
    assert deq.tolist() == [E2M1_BY_CODE[c] for _, c in vals]


def test_quantizer_saturates():
    # The block scale clamps at the e4m3 maximum 448, so 6000 / 448 > 6 saturates to +-6.
    w = torch.tensor([6000.0, -6000.0, 3000.0, -0.5] + [0.0] * 12)[None, :]
    packed, scale = fmt.quantize_nvfp4_with_global(w, 1.0)
    assert scale.float().item() == 448.0
    assert _codes(packed)[0, :4].tolist() == [7, 15, 7, 0]


def _tiny_negatives(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = -torch.rand(64, 256, generator=gen) * 1e-3  # all negative, all far below a quarter step
    w[:, ::16] = torch.randn(64, 16, generator=gen)  # one large value per block sets the scale
    w[:8] = -torch.rand(8, 256, generator=gen) * 1e-30  # blocks whose e4m3 scale underflows
    w[8] = 0.0
    return w


def test_no_negative_zero_codes():
    w = _tiny_negatives(0)
    packed, scale, gs = fmt.quantize_nvfp4(w)
    assert not (_codes(packed) == 8).any()
    assert (_codes(packed) == 0).sum() > w.numel() // 2  # the tiny values really round to 0
    for global_scale in (gs, torch.tensor(1e-3), 0.5):
        packed2, _ = fmt.quantize_nvfp4_with_global(w, global_scale)
        assert not (_codes(packed2) == 8).any()
    same, same_scale = fmt.quantize_nvfp4_with_global(w, gs)
    assert torch.equal(same, packed) and torch.equal(same_scale.float(), scale.float())


def test_checkpoint_writer_uses_the_one_quantizer(tmp_path):
    assert checkpoint_writer.quantize_nvfp4_with_global is fmt.quantize_nvfp4_with_global
    gen = torch.Generator().manual_seed(1)
    ws = {"a": _tiny_negatives(2), "b": _tiny_negatives(3)}
    stored, truth = checkpoint_writer._quantize_group("nvfp4-modelopt", ws, False, gen)
    for n in ws:
        assert not (_codes(stored[f"{n}.weight"]) == 8).any()
        gs = stored[f"{n}.weight_scale_2"]
        packed, scale = fmt.quantize_nvfp4_with_global(ws[n], gs)
        assert torch.equal(stored[f"{n}.weight"], packed)
        assert torch.equal(truth[n], fmt.dequantize_nvfp4(packed, scale, gs, torch.float32))


def _imported_after(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "module", ["moeserve.kernels.gemm.nvfp4_gemv", "moeserve.kernels.gemm.nvfp4_gemv_mma"]
)
def test_gemvs_do_not_import_the_gemm(module):
    assert "moeserve.kernels.gemm.nvfp4_gemm" not in _imported_after(module)


def test_format_needs_no_triton():
    loaded = _imported_after("moeserve.kernels.gemm.nvfp4_format")
    assert "triton" not in loaded and "moeserve.kernels.gemm.splitk" not in loaded


@pytest.mark.parametrize("mma", [False, True])
@pytest.mark.parametrize("n,k", [(128, 512), (96, 512), (7168, 2048), (7168, 8192)])
def test_plan_picks_what_each_call_would(monkeypatch, mma, n, k):
    # The plan a layer builds once must agree with the per-call choice at every row count
    # (tiles.json has shape-specific tables for 7168x2048 and 7168x8192).
    from moeserve.kernels.configs import tile_config
    from moeserve.kernels.gemm import nvfp4_gemm as nv

    monkeypatch.setattr(nv, "gemv_mma_enabled", lambda device: mma)
    packed = torch.zeros(n, k // 2, dtype=torch.uint8)
    plan = nv.plan_nvfp4_gemm(packed)
    assert plan.decode == nv.default_decode(packed.device)
    key, cpu = f"{n}x{k}", torch.device("cpu")
    for m in [*range(1, 300), 4096, 10**9, 10**9 + 1]:
        kernel = nv._default_kernel(m, key, packed, cpu)
        assert plan.pick(m) == (kernel, tile_config(nv._TABLE[kernel], m, key)), m


def test_gemm_with_a_plan_matches_without():
    from moeserve.kernels.gemm import nvfp4_gemm as nv

    gen = torch.Generator().manual_seed(5)
    packed, scale, gs = fmt.quantize_nvfp4(torch.randn(40, 96, generator=gen))
    plan = nv.plan_nvfp4_gemm(packed)
    for m in (1, 3, 20):
        x = torch.randn(m, 96, generator=gen).to(torch.bfloat16)
        want = nv.nvfp4_gemm(x, packed, scale, gs)
        assert torch.equal(nv.nvfp4_gemm(x, packed, scale, gs.reshape(1), plan=plan), want)
