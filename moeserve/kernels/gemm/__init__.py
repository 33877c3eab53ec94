"""Linear-layer GEMMs and GEMVs on stored formats (NVFP4, block-FP8, 16-bit), their
split-K workspace, and the batch-invariant schedule (invariant.py)."""
