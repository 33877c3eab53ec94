"""Placeholder ids resolved by the Triton kernel (CPU interpreter) and by the torch reference,
against a plain Python loop."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import torch  # noqa: E402
import triton  # noqa: E402

from moeserve.kernels.elementwise import tokens  # noqa: E402


def _oracle(ids: list[int], src: list[int]) -> list[int]:
    return [src[min(-1 - i, len(src) - 1)] if i < 0 else i for i in ids]


def test_kernel_and_reference_match_the_loop():
    ids = torch.tensor([5, -1, -3, 0, -2, 77, -9] * 40, dtype=torch.int64)  # two programs
    src = torch.tensor([101, 102, 103, 104], dtype=torch.int64)
    want = _oracle(ids.tolist(), src.tolist())
    assert tokens.resolve_placeholders_ref(ids, src).tolist() == want
    out = torch.empty_like(ids)
    n = ids.numel()
    grid = (triton.cdiv(n, tokens.BLOCK),)
    tokens._resolve_kernel[grid](ids, src, out, n, src.numel(), BLOCK=tokens.BLOCK)
    assert out.tolist() == want
