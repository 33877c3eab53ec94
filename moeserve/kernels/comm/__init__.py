"""Collectives: the fused one-shot all-reduce (+ residual + RMSNorm) over peer memory."""
