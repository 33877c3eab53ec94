"""Errors the engine hands to the front end, one per outcome the client sees.

Kept free of torch so the HTTP layer can import them cheaply.
"""

from __future__ import annotations


class EngineInputError(ValueError):
    """A request the engine cannot take (one clear sentence for the user): HTTP 400.

    `in_prompt`: the prompt itself is at fault (the front end names its own prompt field);
    otherwise the message starts with the sampling parameter it blames."""

    def __init__(self, message: str, *, in_prompt: bool = False) -> None:
        super().__init__(message)
        self.in_prompt = in_prompt


class ContextLengthExceeded(EngineInputError):
    """The prompt and the completion it asks for do not fit in the context; `max_tokens`
    None: the prompt alone leaves no room."""

    def __init__(self, limit: int, prompt_tokens: int, max_tokens: int | None) -> None:
        self.limit = limit
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        super().__init__(self.describe("prompt"), in_prompt=True)

    def describe(self, prompt_name: str) -> str:
        """The message, naming the prompt as the front end calls it ("prompt", "messages")."""
        head = f"This model's maximum context length is {self.limit} tokens. However, "
        if self.max_tokens is None:
            return (
                f"{head}your request has {self.prompt_tokens} input tokens. Please reduce the "
                f"length of the {prompt_name}."
            )
        return (
            f"{head}you requested {self.prompt_tokens + self.max_tokens} tokens "
            f"({self.prompt_tokens} in the {prompt_name}, {self.max_tokens} in the completion). "
            f"Please reduce the length of the {prompt_name} or completion."
        )


class RequestFailed(RuntimeError):
    """This request alone failed inside the engine (not because of its parameters); the
    engine freed its pages and goes on with the others: HTTP 500 for this request."""


class EngineDead(RuntimeError):
    """The engine stopped (a poisoning error); the process is exiting: HTTP 503."""


def failure_message(e: BaseException) -> str:
    """What a request that failed alone reports: what failed, not a traceback."""
    first = (str(e).strip().splitlines() or [""])[0][:200]
    detail = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return f"Internal error while generating this request ({detail}); other requests go on."
