"""Kimi-K2.5's vision encoder: the MoonViT tower and the patch-merger projector.

Follows the published modelling code (modeling_kimi_k25.py of moonshotai/Kimi-K2.5, which
builds `MoonViT3dPretrainedModel` and `PatchMergerMLP`), image by image:

1. patches [P, 3, 14, 14] -> `patch_embed.proj` (a 14x14 convolution, stride 14) -> [P, D];
2. + the learned position table `patch_embed.pos_emb.weight` [64, 64, D], resized to the
   image's (h, w) patch grid by bicubic interpolation (align_corners False) unless the grid
   is exactly 64 x 64; single-frame inputs add no temporal term;
3. 27 pre-norm blocks (LayerNorm eps 1e-5): `wqkv` -> q, k, v of 16 heads; 2D rotary
   positions on q and k; full (bidirectional) attention within the image; `wo`; then the MLP
   `fc0` -> GELU (tanh) -> `fc1`;
4. `final_layernorm`, then the 2x2 merge: each 2x2 block of patches becomes one row of
   4 x D values (row-major blocks, the patches of a block in row-major order);
5. the projector: LayerNorm over D (`pre_norm`), the 4 D values of a block as one vector,
   `proj.0` (4D -> 4D), GELU (erf), `proj.2` (4D -> the text model's hidden size).

2D rotary positions (the tower's `Rope2DPosEmbRepeated`): head_dim / 4 frequencies
theta^(-4i / head_dim), theta 10,000; the head dimension is read as head_dim / 2 complex pairs
(consecutive values), pair 2i rotated by the patch's column times frequency i and pair 2i + 1
by its row times frequency i.

Parameter names are the checkpoint's (`vision_tower.*`, `mm_projector.*`): BF16 in the
published BF16 and NVFP4 checkpoints alike, loaded as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import VisionConfig
from moeserve.layers.quant.base import copy_loader

LAYER_NORM_EPS = 1e-5  # the tower's LayerNorms (nn.LayerNorm's default in the published code)
ROPE_THETA = 10000.0
POS_EMB_INTERPOLATION = "bicubic"

Grid = tuple[int, int, int]  # (frames, patch rows, patch columns)


class MoonViTMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden)
        self.fc1 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class MoonViTBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.head_dim = d // self.heads
        self.norm0 = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.norm1 = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.wqkv = nn.Linear(d, 3 * d)
        self.wo = nn.Linear(d, d)
        self.mlp = MoonViTMLP(d, cfg.intermediate_size)

    def forward(
        self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.wqkv(self.norm0(x)).view(n, 3, self.heads, self.head_dim)
        q, k, v = qkv.unbind(1)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        outs = []
        start = 0
        for length in lengths:  # attention within each image only
            sl = slice(start, start + length)
            # [1, heads, length, head_dim]: the layout the fused (flash) kernels take
            o = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1)[None],
                k[sl].transpose(0, 1)[None],
                v[sl].transpose(0, 1)[None],
            )
            outs.append(o[0].transpose(0, 1).reshape(length, -1))
            start += length
        x = x + self.wo(torch.cat(outs))
        return x + self.mlp(self.norm1(x))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x [N, heads, head_dim] by the angles of cos/sin
    [N, head_dim / 2], in fp32 (as the published code, which multiplies complex64 values)."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d, p = cfg.hidden_size, cfg.patch_size
        self.proj = nn.Conv2d(3, d, kernel_size=p, stride=p)
        self.pos_emb = nn.Module()
        self.pos_emb.weight = nn.Parameter(torch.zeros(cfg.pos_emb_height, cfg.pos_emb_width, d))

    def forward(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        x = self.proj(pixels.to(self.proj.weight.dtype)).view(pixels.shape[0], -1)
        table = self.pos_emb.weight
        pos = []
        for t, h, w in grids:
            if (h, w) == tuple(table.shape[:2]):
                grid = table.flatten(0, 1)
            else:
                grid = F.interpolate(
                    table.permute(2, 0, 1)[None], size=(h, w), mode=POS_EMB_INTERPOLATION
                )[0].permute(1, 2, 0)
                grid = grid.flatten(0, 1)
            pos.append(grid.repeat(t, 1))
        return x + torch.cat(pos)


class MoonViTEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MoonViTBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS)
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads

    def rotary(self, grids: Sequence[Grid], device: torch.device) -> tuple[torch.Tensor, ...]:
        """cos, sin [patches, head_dim / 2] of every patch of every image (fp32, computed
        here: a buffer would follow the model to bf16)."""
        angles = []
        quarter = torch.arange(0, self.head_dim, 4, device=device)[: self.head_dim // 4]
        freqs = 1.0 / (ROPE_THETA ** (quarter.float() / self.head_dim))
        for t, h, w in grids:
            rows = torch.arange(h, device=device).repeat_interleave(w).float()
            cols = torch.arange(w, device=device).repeat(h).float()
            a = torch.stack((cols[:, None] * freqs, rows[:, None] * freqs), dim=-1).flatten(1)
            angles.append(a.repeat(t, 1))
        ang = torch.cat(angles)
        return ang.cos(), ang.sin()

    def forward(self, x: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        cos, sin = self.rotary(grids, x.device)
        lengths = [t * h * w for t, h, w in grids]
        for block in self.blocks:
            x = block(x, lengths, cos, sin)
        return self.final_layernorm(x)


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = MoonViTEncoder(cfg)


class PatchMergerProjector(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        merged = d * cfg.merge_size
        self.pre_norm = nn.LayerNorm(d, eps=cfg.projector_ln_eps)
        self.proj = nn.Sequential(
            nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, cfg.text_hidden_size)
        )

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks [tokens, merge_size, D] -> [tokens, text hidden]."""
        return self.proj(self.pre_norm(blocks).flatten(1))


class KimiVisionModel(nn.Module):
    """Patches of one or more images -> one text-model embedding per 2x2 block of patches."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = cfg
        self.vision_tower = VisionTower(cfg)
        self.mm_projector = PatchMergerProjector(cfg)
        self.to(dtype)
        for p in self.parameters():
            p.weight_loader = copy_loader  # replicated: every value as stored

    @property
    def dtype(self) -> torch.dtype:
        return self.mm_projector.pre_norm.weight.dtype

    def tokens_of(self, grid: Grid) -> int:
        """Embeddings one image of this patch grid yields."""
        _, h, w = grid
        kh, kw = self.config.merge_kernel_size
        return (h // kh) * (w // kw)

    def forward(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """pixels [patches, 3, p, p] of the images in order, grids their (t, h, w) ->
        [sum of tokens_of(grid), text hidden], the images' embeddings in order."""
        for t, _, _ in grids:
            if t != 1:
                raise ValueError("the vision encoder takes single images (t = 1), not video")
        tower = self.vision_tower
        x = tower.encoder(tower.patch_embed(pixels, grids), grids)
        kh, kw = self.config.merge_kernel_size
        merged = []
        start = 0
        for t, h, w in grids:
            seq = x[start : start + t * h * w].view(t, h // kh, kh, w // kw, kw, -1)
            # frames averaged (one here), then each kh x kw block's patches side by side
            merged.append(seq.permute(0, 1, 3, 2, 4, 5).mean(0).flatten(0, 1).flatten(1, 2))
            start += t * h * w
        return self.mm_projector(torch.cat(merged))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
