"""MLA prefill (causal, cached prefix) vs its fp32 torch reference, under the interpreter.

The reference applies an explicit causal mask on absolute positions over rows gathered by
torch indexing; the kernel walks permuted pages through the block table. Unused cache
rows are NaN.
"""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported (triton.jit reads it)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import moeserve.kernels.attention.mla_prefill as mla_prefill_mod  # noqa: E402
from tests.kernels.interpreter_shims import install_interpreter_shims  # noqa: E402
from tests.kernels.mla_cases import make_case  # noqa: E402

install_interpreter_shims()
if not isinstance(mla_prefill_mod._mla_prefill_kernel, InterpretedFunction):
    mla_prefill_mod = importlib.reload(mla_prefill_mod)

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


LATENT = 576
FP8 = torch.float8_e4m3fn
SMALL = mla_prefill_mod.MLAPrefillConfig(block_m=4, block_h=4, block_n=16, num_warps=4)


def _run(prefix_lens, new_lens, heads, page_size, dtype, config=SMALL, seed=0):
    totals = [p + n for p, n in zip(prefix_lens, new_lens, strict=True)]
    _, cache, bt, seq, kv_scale = make_case(totals, heads, page_size, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(sum(new_lens), heads, LATENT, generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, *np.cumsum(new_lens).tolist()], dtype=torch.int32)
    out = torch.full((q.shape[0], heads, 512), float("nan"), dtype=torch.bfloat16)
    mla_prefill_mod.mla_prefill(q, cache, cu, seq, bt, 0.1352, out, kv_scale, config=config)
    ref = torch.empty(q.shape[0], heads, 512)
    mla_prefill_mod.mla_prefill_ref(q, cache, cu, seq, bt, 0.1352, ref, kv_scale)
    return out.float(), ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize(
    ("page_size", "prefix_lens", "new_lens"),
    [
        (1, [0, 9], [7, 5]),  # fresh prompt + chunk after a prefix, page size 1
        (16, [21, 0, 40], [13, 18, 1]),  # mixed, a single new token (decode-like row)
        (64, [70], [11]),  # prefix spans two pages, chunk crosses the page boundary
        (5, [12], [9]),  # page size not a power of two
    ],
)
def test_prefill_matches_reference(dtype, page_size, prefix_lens, new_lens):
    out, ref = _run(prefix_lens, new_lens, 4, page_size, dtype, seed=page_size)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_prefill_is_causal():
    # Changing a later new token's cache row must not change earlier queries' outputs.
    out, ref = _run([5], [12], 4, 16, torch.bfloat16, seed=3)
    # First query (position 5) sees 6 keys only: compare against decode-style attention.
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    totals = [17]
    q0, cache, bt, seq, _ = make_case(totals, 4, 16, torch.bfloat16, seed=3)
    del q0
    gen = torch.Generator().manual_seed(103)
    q = torch.randn(12, 4, LATENT, generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, 12], dtype=torch.int32)
    a = torch.empty(12, 4, 512, dtype=torch.bfloat16)
    mla_prefill_mod.mla_prefill(q, cache, cu, seq, bt, 0.1352, a, config=SMALL)
    cache[bt[0, 1], 0] = 100.0  # token 16, the last one
    b = torch.empty(12, 4, 512, dtype=torch.bfloat16)
    mla_prefill_mod.mla_prefill(q, cache, cu, seq, bt, 0.1352, b, config=SMALL)
    assert torch.equal(a[:11], b[:11])
    assert not torch.equal(a[11], b[11])


def test_prefill_more_heads_than_block_and_wide_rows():
    cfg = mla_prefill_mod.MLAPrefillConfig(block_m=2, block_h=8, block_n=32, num_warps=4)
    out, ref = _run([3, 30], [6, 9], 12, 16, torch.bfloat16, config=cfg, seed=9)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
