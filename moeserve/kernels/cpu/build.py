"""Build and load the native CPU kernels (csrc/kernels.c) once per machine.

The source is compiled by the system C compiler for the CPU at hand (-march=native: the
AVX-512 BF16 build where the CPU has those instructions, portable C elsewhere) into a cache
folder keyed by the source, the compiler and the CPU, then loaded with ctypes. Threads are the
library's own (a pthreads pool, see csrc/kernels.c), every core until `set_threads` says.

Without a compiler, or when the build fails, `load()` says why in one line and the callers
keep torch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "kernels.c"
FLAGS = (
    "-O3",
    "-pthread",
    "-shared",
    "-fPIC",
    # every multiply-add is written as one where it is meant: no contraction behind the
    # source's back, so the order of operations is the source's
    "-ffp-contract=off",
    "-std=gnu11",
)
BUILD_TIMEOUT_S = 120

P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "ms_simd": ([], I32),
    "ms_set_threads": ([I32], None),
    "ms_gemm_bf16": ([P, I64, I64, P, I64, I64, P, I64, I32], None),
    "ms_gemm_q4": ([P, I64, I64, P, I32, I64, I64, P, I64, I32], None),
    "ms_gemm_i8": ([P, I64, I64, P, P, I64, I64, P, I64, I32], None),
    "ms_silu_mul": ([P, I64, P, I64, I64, I64, P, I64], None),
    "ms_sigmoid": ([P, I64], None),
    "ms_attention": (
        [P, I64, I64, I32, I32, I32, I32, P, P, I64, I64, I64, P, I64, I32, I64, P, P, P, F32]
        + [P, I64, I64, I32],
        I32,
    ),
    "ms_decoder_layer": ([P, P, P, P, I32], I32),
    "ms_add_rmsnorm": ([P, P, P, F32, I64, I64, P], None),
}


@dataclass(frozen=True)
class Native:
    """The loaded library and what it was built as."""

    lib: ctypes.CDLL
    simd: bool  # the AVX-512 BF16 build (else portable C)
    path: str

    def describe(self) -> str:
        return "AVX-512 BF16 build" if self.simd else "portable C build"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "moeserve" / "native"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def build(cc: str, march: str = "native") -> Path:
    """The library for this source, compiler and CPU target (`-march`), compiled unless
    already cached."""
    version = subprocess.run(
        [cc, "--version"], capture_output=True, text=True, timeout=30
    ).stdout.splitlines()[:1]
    flags = (*FLAGS, f"-march={march}")
    key = hashlib.sha256(
        SOURCE.read_bytes() + repr((version, flags, _cpu_id())).encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"kernels-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        target = Path(tmp) / out.name
        proc = subprocess.run(
            [cc, *flags, str(SOURCE), "-o", str(target), "-lm"],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["(no output)"])[0]
            raise RuntimeError(f"{cc} failed: {first}")
        os.replace(target, out)  # atomic: concurrent builders (ranks) agree on one file
    return out


def open_library(path: Path) -> Native:
    lib = ctypes.CDLL(str(path))
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    lib.ms_set_threads(os.cpu_count() or 1)  # until the engine sets its share
    return Native(lib, bool(lib.ms_simd()), str(path))


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def load() -> tuple[Native | None, str]:
    """(the native kernels for this CPU or None, one line saying which, or why not)."""
    cc = compiler()
    if cc is None:
        return None, "torch's (no C compiler found to build the native ones)"
    try:
        native = open_library(build(cc))
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
        log.debug("native CPU kernels unavailable", exc_info=True)
        return None, f"torch's (the native ones did not build: {e})"
    return native, f"native ({native.describe()})"
