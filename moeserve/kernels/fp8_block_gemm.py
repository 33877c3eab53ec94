"""DeepSeek block-FP8 weights (128x128 ``weight_scale_inv``) and their GEMM.

Layout: weight float8_e4m3fn [N, K]; weight_scale_inv fp32 [ceil(N/128), ceil(K/128)];
dequantization multiplies each 128x128 block by its value (see shared/SPECS.md).
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128


def dequantize_fp8_block(
    w_fp8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16, block: int = FP8_BLOCK
) -> torch.Tensor:
    """w_fp8 e4m3 [N, K], scale_inv fp32 [ceil(N/128), ceil(K/128)] -> [N, K] in dtype."""
    n, k = w_fp8.shape
    nb, kb = -(-n // block), -(-k // block)
    if tuple(scale_inv.shape) != (nb, kb):
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} != {(nb, kb)} for weight {(n, k)}")
    s = scale_inv.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (w_fp8.float() * s).to(dtype)


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], scale_inv fp32 [ceil(N/128), ceil(K/128)]); per-block amax/448.

    Used to make test weights in DeepSeek's published layout.
    """
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    wp = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    wp[:n, :k] = w.float()
    blocks = wp.view(nb, block, kb, block)
    amax = blocks.abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / s[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), s


def fp8_block_gemm_ref(
    x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference: x [M, K] @ dequant(W)^T -> [M, N] in x.dtype (fp32 accumulate)."""
    y = (x.float() @ dequantize_fp8_block(w_fp8, scale_inv, torch.float32).t()).to(x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y
