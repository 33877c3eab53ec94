"""The NVFP4 format (ModelOpt layout): E2M1 codes, packing, the one quantizer and dequantizer.

Layout of one quantized linear with weight [N, K] (K a multiple of 16), see shared/SPECS.md:
  packed  uint8          [N, K/2]   two E2M1 codes per byte along K, element 2i in the LOW nibble
  scale   float8_e4m3fn  [N, K/16]  one block scale per 16 elements
  global  float32 scalar            amax(W) / (6*448); dequantization multiplies by it
E2M1 code = sign<<3 | idx, idx 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6.

Pure torch (no Triton), so the checkpoint writer and the loaders can use it without the
kernels; it is the oracle the Triton kernels are tested against.
"""

from __future__ import annotations

import torch

from moeserve.kernels.formats import E4M3_MAX

E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
# Decision boundaries between neighbouring E2M1 magnitudes, and whether a tie goes UP
# (round-half-to-even: a tie goes to the neighbour whose index is even).
_E2M1_BOUNDS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP: tuple[bool, ...] = (False, True, False, True, False, True, False)


def e2m1_table(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The 16 E2M1 values indexed by the 4-bit code (sign in bit 3)."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return torch.cat([mags, -mags]).to(device=device, dtype=dtype)


def unpack_e2m1_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K] (low nibble first)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def pack_e2m1_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) -> uint8 [..., K/2], element 2i in the low nibble."""
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def dequantize_nvfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """packed uint8 [..., N, K/2], scale e4m3 [..., N, K/16], global fp32 scalar -> [..., N, K].

    Leading batch dims (stacked experts) are allowed; a global scale with one value per
    leading index ([E]) is broadcast over its expert.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    k = packed.shape[-1] * 2
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * NVFP4_BLOCK != k:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match packed {tuple(packed.shape)}"
        )
    codes = unpack_e2m1_codes(packed).long()
    vals = e2m1_table(packed.device)[codes]
    block = scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1)
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device)
    gs = gs.reshape(gs.shape + (1,) * (packed.dim() - gs.dim()))  # [E] -> [E, 1, 1]
    return (vals * block * gs).to(dtype)


def e2m1_round_index(x: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 values -> E2M1 magnitude index 0..7 (uint8), round-half-to-even,
    saturating above 6."""
    idx = torch.zeros_like(x, dtype=torch.uint8)
    for bound, tie_up in zip(_E2M1_BOUNDS, _E2M1_TIE_UP, strict=True):
        idx += (x >= bound if tie_up else x > bound).to(torch.uint8)
    return idx


def e2m1_encode(q: torch.Tensor) -> torch.Tensor:
    """fp32 values already divided by their scales -> uint8 E2M1 codes. A value that rounds
    to magnitude 0 gets code 0, never 8 (negative zero): every exporter writes +0, and one
    byte pattern per value keeps checkpoints comparable byte for byte."""
    idx = e2m1_round_index(q.abs())
    return idx | (((q < 0) & (idx > 0)).to(torch.uint8) << 3)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's global scale amax / (6*448) as fp32; amax 0 (an all-zero tensor) gets
    1 / (6*448) so that dequantization stays finite."""
    amax = amax.float()
    return torch.where(amax > 0, amax, torch.ones_like(amax)) / (E2M1_MAX * E4M3_MAX)


def quantize_nvfp4_with_global(
    w: torch.Tensor, global_scale: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of 16) with a given global scale (gate/up of one expert share
    one) -> (packed uint8 [N, K/2], scale e4m3 [N, K/16]).

    ModelOpt convention: block scale = block_amax / (6*global) cast to e4m3 (an all-zero block
    gets 1); code = round-half-to-even of w / (scale*global) on the E2M1 grid (e2m1_encode).
    """
    if w.dim() != 2 or w.shape[1] % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 quantization wants [N, K] with K % 16 == 0, got {tuple(w.shape)}")
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=w.device)
    blocks = w.float().unflatten(1, (-1, NVFP4_BLOCK))  # [N, K/16, 16]
    bmax = blocks.abs().amax(dim=-1)
    scale = (bmax / (E2M1_MAX * gs)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    # All-zero blocks, and blocks so small that their scale underflowed e4m3, get scale 1:
    # their codes then round to (nearly) zero instead of dividing by zero.
    scale = torch.where(scale.float() > 0, scale.float(), torch.ones_like(bmax)).to(
        torch.float8_e4m3fn
    )
    q = blocks / (scale.float() * gs).unsqueeze(-1)
    return pack_e2m1_codes(e2m1_encode(q).flatten(1)), scale


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of 16) -> (packed uint8 [N,K/2], scale e4m3 [N,K/16], global fp32 []).

    The global scale is nvfp4_global_scale(amax(|w|)); the rest is quantize_nvfp4_with_global.
    """
    if w.dim() != 2 or w.shape[1] % NVFP4_BLOCK:
        raise ValueError(f"quantize_nvfp4 wants [N, K] with K % 16 == 0, got {tuple(w.shape)}")
    gs = nvfp4_global_scale(w.float().abs().amax())
    packed, scale = quantize_nvfp4_with_global(w, gs)
    return packed, scale, gs
