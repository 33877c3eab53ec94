"""What every benchmark script records about the tree it ran from."""

from __future__ import annotations

import subprocess


def git_commit(given: str | None = None, mark_dirty: bool = False) -> str:
    """`given` if set, else HEAD's short hash ("uncommitted" outside git); with `mark_dirty`,
    "+uncommitted" appended when the working tree has changes."""
    if given:
        return given

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "uncommitted"
    if mark_dirty and git("status", "--porcelain"):
        commit += "+uncommitted"
    return commit


def gpu_meta(commit: str | None = None) -> dict[str, str]:
    """What a GPU benchmark record says about where it ran: GPU, torch, triton, python, commit."""
    import platform

    import torch
    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": git_commit(commit),
    }
