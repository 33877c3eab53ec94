"""Number formats and fixed layouts the kernels are written for (no torch, no Triton: the
kernel plan and the format references read them too)."""

from __future__ import annotations

E4M3_MAX = 448.0  # largest finite float8 e4m3 (e4m3fn): no inf, saturating conversions

# the MLA latent row the Triton MLA kernels are written for (DeepSeek-V3, Kimi): the
# normalised latent c, then the roped k_pe
MLA_KV_LORA_RANK = 512
MLA_ROPE_DIM = 64
MLA_LATENT_LAYOUT = (MLA_KV_LORA_RANK, MLA_ROPE_DIM)
