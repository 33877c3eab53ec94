"""The sampler's errors: a request's invalid parameters, one row that cannot be sampled, and
the test that tells a device failure (which poisons every request) from a row's own."""

from __future__ import annotations

import torch


class SamplingError(ValueError):
    """Invalid sampling parameters (one clear sentence, shown to the user). The message starts
    with the name of the offending field."""


class RowSamplingError(RuntimeError):
    """Sampling failed for one request (not caused by its parameters)."""


def is_device_error(e: BaseException) -> bool:
    """A failure of the device itself (CUDA error, lost device): it poisons every request."""
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(e, accel):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("CUDA error" in text or "CUBLAS_STATUS" in text)


def nothing_to_sample() -> RowSamplingError:
    """The error of a row left with no finite logit."""
    return RowSamplingError("no token can be sampled: every logit is masked or not finite")
