"""MLA attention over the paged latent cache: decode (Triton, Gluon), prefill,
the absorbed W_UK / W_UV products and the RoPE + cache write."""
