"""How the kernels run in this process: compiled for a GPU, or under Triton's CPU interpreter."""

from __future__ import annotations

import os

# the values Triton reads as true for its boolean settings (triton.knobs, `getenv_bool`)
_TRUE = ("1", "true", "on", "yes")


def interpreting() -> bool:
    """True under TRITON_INTERPRET, read as Triton reads it (its CPU interpreter: no inline
    PTX, no global timer, fp32 dots where the kernels ask for them)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE
