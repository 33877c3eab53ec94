"""Row-wise kernels: RMSNorm (with the residual add) and SiLU * up."""
