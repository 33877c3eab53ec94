"""Sampling parameters, validated when they are made (`SamplingParams`), and the ranges the
HTTP schemas check first."""

from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.sampling.errors import SamplingError

SEED_MIN = -(2**63)  # the range torch.Generator.manual_seed takes
SEED_MAX = 2**64  # exclusive
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: off; k >= 0: sampled token's logprob + top k
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # (token id, bias added to its logit), sorted by id
    logit_bias: tuple[tuple[int, float], ...] = ()
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias or ()
        if isinstance(bias, dict):
            bias = bias.items()
        try:
            object.__setattr__(
                self, "logit_bias", tuple(sorted((int(t), float(v)) for t, v in bias))
            )
        except (TypeError, ValueError):
            raise SamplingError(
                "logit_bias must map token ids (integers) to numbers in [-100, 100]."
            ) from None
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise SamplingError(msg)

        if self.max_tokens is not None and self.max_tokens < 0:
            bad(f"max_tokens must be at least 0, got {self.max_tokens}.")
        if not 0.0 <= self.temperature <= 100.0:
            bad(f"temperature must be in [0, 100], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            bad(f"top_k must be -1 (off) or a positive integer, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}.")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}.")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                bad(f"{name} must be in [-2, 2], got {v}.")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= self.MAX_LOGPROBS:
                bad(f"{name} must be between 0 and {self.MAX_LOGPROBS}, got {v}.")
        if self.min_tokens < 0:
            bad(f"min_tokens must be at least 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).")
        if self.seed is not None and not SEED_MIN <= self.seed < SEED_MAX:
            bad(f"seed must be in [-2^63, 2^64), got {self.seed}.")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers.")
        for t, v in self.logit_bias:
            if t < 0:
                bad(f"logit_bias: token id {t} is negative.")
            if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                bad(f"logit_bias values must be in [-100, 100], got {v} for token {t}.")

    def check_vocab(self, vocab_size: int, eos_ids: tuple[int, ...] = ()) -> None:
        """Token ids the request names must exist in the model's vocabulary `[0, vocab_size)`
        (the tokenizer's, not the padded LM head's), and min_tokens must leave something to
        sample."""
        top = vocab_size - 1
        bad_stop = next((t for t in self.stop_token_ids if t >= vocab_size), None)
        if bad_stop is not None:
            raise SamplingError(
                f"stop_token_ids: token id {bad_stop} is outside the vocabulary (0..{top})."
            )
        bad_bias = next((t for t, _ in self.logit_bias if t >= vocab_size), None)
        if bad_bias is not None:
            raise SamplingError(
                f"logit_bias: token id {bad_bias} is outside the vocabulary (0..{top})."
            )
        if self.min_tokens and len(self.blocked_ids(eos_ids)) >= vocab_size:
            raise SamplingError(
                "min_tokens: stop_token_ids (with the end-of-sequence token) cover the whole "
                "vocabulary, so no token could be sampled before min_tokens is reached."
            )

    def blocked_ids(self, eos_ids: tuple[int, ...] = ()) -> tuple[int, ...]:
        """Ids that may not be sampled before min_tokens: stop ids, and EOS unless ignored."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(eos_ids)
        return tuple(sorted(ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
