"""MLA cache-write kernel vs its torch reference, under the Triton CPU interpreter."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported (triton.jit reads it)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import moeserve.kernels.attention.kv_cache as kv_cache_mod  # noqa: E402


def _interpreter_fp8_rounding_shim() -> None:
    """The triton 3.6 interpreter's fp32 -> fp8 cast drops the carry when rounding up
    (1.99 -> 1.0); the GPU's cvt.rn.satfinite is exact. Let torch (round to nearest even)
    do narrowing float casts so the test checks the kernel, not the interpreter."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_moeserve_fp8_shim", False):
        return
    tl = interpreter.tl
    targets = {tl.float8e4nv: torch.float8_e4m3fn, tl.bfloat16: torch.bfloat16}
    original = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        dst = targets.get(dst_type.scalar)
        if dst is None or src.dtype.scalar != tl.float32:
            return original(self, src, dst_type, rounding_mode)
        narrowed = torch.from_numpy(src.data.astype(np.float32)).to(dst)
        bits = narrowed.view(torch.uint8 if dst == torch.float8_e4m3fn else torch.int16)
        data = bits.numpy().view(interpreter._get_np_dtype(dst_type))
        return interpreter.TensorHandle(data, dst_type.scalar)

    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
    interpreter._moeserve_fp8_shim = True


_interpreter_fp8_rounding_shim()
if not isinstance(kv_cache_mod._write_mla_cache_kernel, InterpretedFunction):
    kv_cache_mod = importlib.reload(kv_cache_mod)

# Triton's own jit helpers (tl.cdiv, tl.max, ...) are built when triton is first imported;
# if that happened before TRITON_INTERPRET=1 was set (another test imported it first),
# interpreted kernels cannot call them. Say so instead of failing obscurely.
_TRITON_INTERPRETED = isinstance(triton.language.cdiv, InterpretedFunction)


@pytest.fixture(autouse=True)
def _require_interpreted_triton():
    if not _TRITON_INTERPRETED:
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set; set it in tests/conftest.py"
            " (os.environ.setdefault('TRITON_INTERPRET', '1')) or in the environment"
        )


FP8 = torch.float8_e4m3fn


def _inputs(tokens: int, num_pages: int, page_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    c = (torch.randn(tokens, 512, generator=gen) * 3).to(torch.bfloat16)
    k_pe = (torch.randn(tokens, 64, generator=gen) * 3).to(torch.bfloat16)
    # Distinct random slots over permuted pages; every third token is padding (-1).
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens].long()
    slots[::3] = -1
    return c, k_pe, slots


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_bf16_write_is_exact_and_skips_negative_slots(page_size):
    c, k_pe, slots = _inputs(23, 40 // page_size + 2, page_size, seed=page_size)
    cache = torch.full((40 // page_size + 2, page_size, 576), float("nan"), dtype=torch.bfloat16)
    ref = cache.clone()
    kv_cache_mod.write_mla_cache(c, k_pe, cache, slots)
    kv_cache_mod.write_mla_cache_ref(c, k_pe, ref, slots)
    assert torch.equal(cache.isnan(), ref.isnan())  # same rows written, others untouched
    assert torch.equal(torch.nan_to_num(cache), torch.nan_to_num(ref))
    # Independent check of placement: token 1 has a valid slot.
    s = int(slots[1])
    assert torch.equal(cache[s // page_size, s % page_size, :512], c[1])
    assert torch.equal(cache[s // page_size, s % page_size, 512:], k_pe[1])


@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_write_quantises_with_scale_and_saturates(page_size):
    c, k_pe, slots = _inputs(23, 64 // page_size + 1, page_size, seed=5)
    c[1, :4] = torch.tensor([1e4, -1e4, 0.0, 0.3])  # the first two saturate (scale 0.5 -> 2e4)
    scale = torch.tensor([0.5])
    shape = (64 // page_size + 1, page_size, 576)
    cache = torch.zeros(shape, dtype=FP8)
    ref = torch.zeros(shape, dtype=FP8)
    kv_cache_mod.write_mla_cache(c, k_pe, cache, slots, scale)
    kv_cache_mod.write_mla_cache_ref(c, k_pe, ref, slots, scale)
    got, want = cache.float(), ref.float()
    assert torch.equal(got, want)
    s = int(slots[1])
    row = cache[s // page_size, s % page_size].float()
    assert row[0] == 448 and row[1] == -448 and row[2] == 0
    assert abs(float(row[3]) * 0.5 - 0.3) < 0.3 * 0.07  # dequantised value close to the input


def test_fp8_requires_scale():
    c, k_pe, slots = _inputs(4, 4, 16, seed=1)
    with pytest.raises(ValueError, match="kv_scale"):
        kv_cache_mod.write_mla_cache(c, k_pe, torch.zeros(4, 16, 576, dtype=FP8), slots)
