"""Suite-wide settings that must hold before any test module imports triton."""

import os

import torch

# Without a GPU, Triton kernels run through the interpreter; the variable is read when triton
# is first imported, so it is set here, before any test module imports it. On a GPU machine
# the compiled kernels run (tests/gpu).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
