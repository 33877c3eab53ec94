"""Fused routed-expert kernels: NVFP4 (nvfp4.py) and block-FP8 / 16-bit (fp8.py)."""
