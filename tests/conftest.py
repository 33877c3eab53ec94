"""Suite-wide settings that must hold before any test module imports triton."""

import os

# Triton kernels run on the CPU through the interpreter in tests; the variable is read when
# triton is first imported, so it must be set before any module imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")
