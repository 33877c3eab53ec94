"""MoE routing: top-k over router logits, and the gate GEMV fused with it."""
