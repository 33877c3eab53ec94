"""A request's state as the scheduler and engine see it (no torch)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from moeserve.engine.errors import ContextLengthExceeded, EngineInputError
from moeserve.sampling import SamplingError, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens or what the context leaves
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose KV rows are in the cache
    pages: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    # tokens sampled on the device but not yet seen by the host (overlap scheduling: the next
    # step reads them where they are); counted by the scheduler as tokens to compute
    pending: int = 0
    # speculative decoding: tokens proposed to follow the sequence, verified by the next step
    # (not part of the sequence; only the tokens the target accepts join `output_ids`)
    draft: list[int] = field(default_factory=list)
    # prefix-cache hashing progress: full pages hashed so far and the last one's hash
    hashed_pages: int = 0
    last_hash: bytes | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def all_ids(self) -> list[int]:
        """Prompt + output as a new list: O(length), for rare paths (prefix matching)."""
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole sequence."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_to_compute(self) -> int:
        return self.num_tokens + self.pending - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason


def validate_request(
    prompt_ids: list[int],
    params: SamplingParams,
    vocab_limit: int,
    eos_ids: tuple[int, ...],
    max_model_len: int,
) -> int:
    """Every check a request meets before the engine takes it (the one place they live);
    returns its max_tokens, resolved (None: what the context leaves)."""
    n = len(prompt_ids)
    if n == 0:
        raise EngineInputError("The prompt is empty.", in_prompt=True)
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_limit), None)
    if bad is not None:
        raise EngineInputError(
            f"Token id {bad} in the prompt is outside the vocabulary (0..{vocab_limit - 1}).",
            in_prompt=True,
        )
    try:
        params.check_vocab(vocab_limit, eos_ids)
    except SamplingError as e:
        raise EngineInputError(str(e)) from None
    if params.max_tokens is None:
        if n >= max_model_len:
            raise ContextLengthExceeded(max_model_len, n, None)
        return max_model_len - n
    if n + params.max_tokens > max_model_len:
        raise ContextLengthExceeded(max_model_len, n, params.max_tokens)
    return params.max_tokens
