"""Sampling: validated parameters (`params.py`) and the one owner of sampling, the batched
`Sampler` (`sampler.py`): its logit processing (`logits.py`), per-request state (`rows.py`),
logprobs (`logprobs.py`), speculative verification (`verify.py`) and the greedy tokens kept
on the device for the next step (`device_tokens.py`).

The sampler works on fp32 logits [B, V] on the model's device, in one batched pass. Order of
operations (as in vLLM): the LM head's padded rows (ids the tokenizer does not have) are
masked, then penalties, logit bias and the min_tokens mask on the raw logits, then
temperature, then min-p / top-k / top-p truncation, then a draw. Logprobs are those of the
model's raw distribution over the tokenizer's vocabulary (log_softmax before any of it).

Draws use the exponential race (argmax of p / E with E ~ Exp(1), which picks token i with
probability p_i): unseeded rows take their noise from one batched call, a seeded row from its
own generator on the device, so a seeded request gives the same tokens whatever else is in
the batch.
"""

from moeserve.sampling.device_tokens import DeviceTokens
from moeserve.sampling.errors import RowSamplingError, SamplingError, is_device_error
from moeserve.sampling.logits import truncate, truncated_probs
from moeserve.sampling.params import MAX_LOGIT_BIAS, SEED_MAX, SEED_MIN, SamplingParams
from moeserve.sampling.sampler import Sampler, SampleResult
from moeserve.sampling.verify import VerifyResult

__all__ = [
    "MAX_LOGIT_BIAS",
    "SEED_MAX",
    "SEED_MIN",
    "DeviceTokens",
    "RowSamplingError",
    "SampleResult",
    "Sampler",
    "SamplingError",
    "SamplingParams",
    "VerifyResult",
    "is_device_error",
    "truncate",
    "truncated_probs",
]
