"""Programmatic dependent launch (sm_90+) for the decode step's Triton kernels.

A kernel launched with `launch_pdl=True` may start while the kernel before it in the stream is
still running, once that kernel has let it (`gdc_launch_dependents`, here at each kernel's
start) or has finished. It reads what needs no predecessor (weights) first, then waits
(`griddepcontrol.wait`: the previous kernel has completed and its writes are visible) before
it touches activations, so a chain of small kernels streams each one's weights while the one
before it drains. Waiting is transitive: a kernel completes only after its own wait, so every
earlier kernel has completed too; every kernel launched with PDL must therefore wait before
it reads or writes anything another kernel reads or writes.

Triton's own `gdc_wait` returns nothing, so the compiler may move loads above it. `pdl_wait`
returns a zero produced by the same instruction sequence; kernels add it to the pointers of
everything they read or write after the wait, which ties those accesses to it. The CPU
interpreter has no grid dependency control: entry points pass PDL=0 there (`pdl_launch`).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from moeserve.kernels.runtime import interpreting


@triton.jit
def pdl_wait():
    """griddepcontrol.wait; returns int32 0 (see the module docstring)."""
    return tl.inline_asm_elementwise(
        "griddepcontrol.wait;\n\tmov.u32 $0, 0;",
        "=r",
        [],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """At a kernel's start: let the next kernel launch; returns the wait's zero (after waiting)
    where PDL is on, else 0."""
    if PDL:
        gdc_launch_dependents()
        return pdl_wait()
    else:
        return 0


def pdl_launch(wanted: bool) -> bool:
    """Whether a launch uses PDL: asked for, and not in the CPU interpreter."""
    return bool(wanted) and not interpreting()
