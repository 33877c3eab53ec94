"""Errors the engine hands to the front end, one per outcome the client sees.

Kept free of torch so the HTTP layer can import them cheaply.
"""

from __future__ import annotations


class EngineInputError(ValueError):
    """A request the engine cannot take (one clear sentence for the user): HTTP 400."""


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
