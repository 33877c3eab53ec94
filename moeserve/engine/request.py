"""A request's state as the scheduler and engine see it (no torch)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moeserve.engine.errors import ContextLengthExceeded, EngineInputError
from moeserve.sampling import SamplingError, SamplingParams

if TYPE_CHECKING:
    from moeserve.multimodal.inputs import ImageInput


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
    # images whose embeddings replace placeholder tokens of the prompt, in prompt order
    images: list[ImageInput] = field(default_factory=list)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole sequence."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    def hash_slice(self, start: int, end: int) -> list[int]:
        """`token_slice` as the prefix cache hashes it: an image's placeholder positions
        carry values of the image's content hash instead of the placeholder id."""
        out = self.token_slice(start, end)
        for im in self.images:
            for pos in range(max(start, im.offset), min(end, im.end)):
                out[pos - start] = im.hash_value(pos - im.offset)
        return out

    def hash_ids(self) -> list[int]:
        """The whole sequence as the prefix cache hashes it (rare paths: prefix matching)."""
        return self.hash_slice(0, self.num_tokens)

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


def validate_images(
    prompt_ids: list[int], images: list[ImageInput], placeholder: int | None
) -> None:
    """A request's images: a model with a vision encoder (`placeholder`: its image token id),
    each image's placeholder run inside the prompt, in order, without overlap."""
    if not images:
        return
    if placeholder is None:
        raise EngineInputError("This model takes no images (it has no vision encoder).")
    end = 0
    for im in images:
        run = prompt_ids[im.offset : im.end] if im.offset >= end else []
        if len(run) != im.num_tokens or any(t != placeholder for t in run):
            raise EngineInputError(
                "An image's placeholder tokens are not where the request says.", in_prompt=True
            )
        end = im.end
