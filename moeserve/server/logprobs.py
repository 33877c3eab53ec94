"""Log-probabilities in the two OpenAI formats: chat's per-token objects and the legacy
completions' parallel lists."""

from __future__ import annotations

from typing import Any

from moeserve.engine.outputs import TokenLogprob
from moeserve.server.protocol import CompletionLogprobs


def prompt_entries(
    prompt_ids: list[int], prompt_logprobs: list[TokenLogprob | None] | None
) -> list[tuple[int, TokenLogprob | None]]:
    """Pair each prompt token with its logprob. An engine may leave out the first token's
    entry (nothing conditions it); it is then None, as when the engine sends None."""
    lps = list(prompt_logprobs or [])
    if len(lps) == len(prompt_ids) - 1:
        lps = [None, *lps]
    return list(zip(prompt_ids, lps, strict=True))


class LogprobFormatter:
    """Formats engine logprobs with the tokenizer's text of each token (special tokens
    included: a logprob belongs to the token the model produced)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat(self, lps: list[TokenLogprob], top_n: int) -> list[dict[str, Any]]:
        """`logprobs.content` entries of a chat choice."""
        out = []
        for lp in lps:
            tok = self.token_str(lp.token_id)
            top = [
                {"token": (s := self.token_str(t)), "logprob": v, "bytes": list(s.encode())}
                for t, v in lp.top[:top_n]
            ]
            out.append(
                {
                    "token": tok,
                    "logprob": lp.logprob,
                    "bytes": list(tok.encode()),
                    "top_logprobs": top,
                }
            )
        return out

    def completion(
        self, entries: list[tuple[int, TokenLogprob | None]], top_n: int, offset: int
    ) -> tuple[CompletionLogprobs, int]:
        """Legacy logprobs of consecutive tokens (id, logprob or None for the first prompt
        token) whose text starts at `offset`; also returns the offset after them. The token
        itself is always among its top_logprobs (vLLM's convention; lm-eval's greedy check
        relies on it)."""
        res = CompletionLogprobs()
        for token_id, lp in entries:
            tok = self.token_str(token_id)
            res.tokens.append(tok)
            res.text_offset.append(offset)
            offset += len(tok)
            if lp is None:
                res.token_logprobs.append(None)
                res.top_logprobs.append(None)
                continue
            res.token_logprobs.append(lp.logprob)
            top = {self.token_str(t): v for t, v in lp.top[:top_n]}
            top.setdefault(tok, lp.logprob)
            res.top_logprobs.append(top)
        return res, offset


def extend_completion_logprobs(into: CompletionLogprobs, more: CompletionLogprobs) -> None:
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(into, name).extend(getattr(more, name))
