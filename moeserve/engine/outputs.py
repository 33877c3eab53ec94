"""What the engine hands to its callers: one `RequestOutput` per step per request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """A token's logprob and the top alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """A delta of one request's generation.

    `text`/`token_ids`/`logprobs` hold what is new since the previous output of the same
    request; counts are cumulative. The last output has `finished=True` and a
    `finish_reason` of "stop", "length" or "abort" (`stop_reason`: the stop string or token id
    that matched, None for EOS).
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    stop_reason: str | int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output only, if asked
