"""Rotary position embeddings: plain, llama3-scaled and YaRN (DeepSeek-V3 / Kimi).

Two pairings exist: "neox" rotates the two halves of the rotary dims (Llama as HF stores it,
after undoing llama.cpp's row permutation), "interleaved" rotates (x[2i], x[2i+1]) pairs
(DeepSeek's reference model.py; HF de-interleaves first, which gives the same dot products).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moeserve.config import RopeScaling


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1.0 else 1.0


def _yarn_correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))


def inverse_frequencies(
    dim: int, base: float, scaling: RopeScaling | None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] (fp32) and the cos/sin magnitude factor."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if scaling is None:
        return inv.float(), 1.0
    f = scaling.factor
    if scaling.type == "linear":
        return (inv / f).float(), 1.0
    if scaling.type == "llama3":
        orig = scaling.original_max_position_embeddings
        low_wl = orig / scaling.low_freq_factor
        high_wl = orig / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        mid = (1 - smooth) * inv / f + smooth * inv
        out = torch.where(wavelen > low_wl, inv / f, torch.where(wavelen < high_wl, inv, mid))
        return out.float(), 1.0
    if scaling.type == "yarn":
        orig = scaling.original_max_position_embeddings
        low = max(math.floor(_yarn_correction_dim(scaling.beta_fast, dim, base, orig)), 0)
        high = min(math.ceil(_yarn_correction_dim(scaling.beta_slow, dim, base, orig)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1.0 - ramp  # 1: keep the original frequency (high-frequency dims)
        inv = (inv / f) * (1 - extrapolate) + inv * extrapolate
        mag = yarn_mscale(f, scaling.mscale) / yarn_mscale(f, scaling.mscale_all_dim)
        return inv.float(), mag
    raise ValueError(f"unsupported rope scaling type {scaling.type!r}")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the first `rotary_dim` dims of q and k ([T, heads, head_dim])."""

    def __init__(
        self,
        rotary_dim: int,
        max_position: int,
        base: float,
        scaling: RopeScaling | None = None,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        inv, mag = inverse_frequencies(rotary_dim, base, scaling)
        if scaling is not None and scaling.type == "yarn":
            max_position = max(
                max_position, int(scaling.original_max_position_embeddings * scaling.factor)
            )
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
        self.register_buffer("cos", freqs.cos() * mag, persistent=False)
        self.register_buffer("sin", freqs.sin() * mag, persistent=False)
        # all layers of a forward share one positions tensor: gather cos/sin once for it
        self._memo: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        d = self.rotary_dim
        rot, rest = x[..., :d].float(), x[..., d:]
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            y = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
            y = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        y = y.to(x.dtype)
        return y if rest.shape[-1] == 0 else torch.cat((y, rest), dim=-1)

    def _neox_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self._memo
        if m is None or m[0] is not positions or m[1] != dtype:
            cos = self.cos[positions].to(dtype)
            sin = self.sin[positions].to(dtype)
            m = (
                positions,
                dtype,
                torch.cat((cos, cos), -1)[:, None],
                torch.cat((-sin, sin), -1)[:, None],
            )
            self._memo = m
        return m[2], m[3]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.interleaved and q.shape[-1] == self.rotary_dim:
            # HF's form, in the activation dtype: x*cos + rotate_half(x)*sin, q and k at once
            cos, sin = self._neox_tables(positions, q.dtype)
            nq = q.shape[1]
            x = torch.cat((q, k), dim=1)
            half = self.rotary_dim // 2
            y = x * cos + torch.cat((x[..., half:], x[..., :half]), -1) * sin
            return y[:, :nq], y[:, nq:]
        cos = self.cos[positions].unsqueeze(-2)  # [T, 1, d/2]
        sin = self.sin[positions].unsqueeze(-2)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
