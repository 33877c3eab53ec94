"""POST /v1/completions: one or more prompts (text or token ids), n choices each; `echo`
repeats the prompt, with its logprobs when asked (what lm-evaluation-harness scores)."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response

from moeserve.engine.outputs import RequestOutput
from moeserve.server.generation import SubRequest
from moeserve.server.logprobs import LogprobFormatter, extend_completion_logprobs, prompt_entries
from moeserve.server.params import choice_seed, sampling_params
from moeserve.server.prompts import Prompt, count_prompts
from moeserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from moeserve.server.state import ServerState, new_id
from moeserve.server.streaming import Answer, ChoiceStream, respond


class CompletionChoiceStream(ChoiceStream):
    """A completion choice: plain text (the prompt first with `echo`); legacy logprobs with
    their text offsets when `top_logprobs` is not None."""

    def __init__(
        self,
        index: int,
        prompt: Prompt,
        echo: bool,
        formatter: LogprobFormatter,
        top_logprobs: int | None,
        prompt_index: int = 0,
    ) -> None:
        super().__init__(index, prompt_index)
        self.prompt = prompt
        self.echo = echo
        self.formatter = formatter
        self.top_logprobs = top_logprobs
        self.text = ""
        self.logprobs = CompletionLogprobs()
        self.offset = 0  # where the next token's text starts in `text`

    def _piece(self, out: RequestOutput, first: bool) -> dict[str, Any] | None:
        text = ""
        lps = CompletionLogprobs() if self.top_logprobs is not None else None
        if first and self.echo:
            text = self.prompt.text
            if lps is not None:
                entries = prompt_entries(self.prompt.ids, out.prompt_logprobs)
                lps, _ = self.formatter.completion(entries, self.top_logprobs or 0, 0)
            # generated text follows the prompt as the client sent it, whatever the prompt
            # tokens' own texts add up to
            self.offset = len(text)
        text += out.text
        if lps is not None and out.logprobs:
            entries = [(lp.token_id, lp) for lp in out.logprobs]
            more, self.offset = self.formatter.completion(
                entries, self.top_logprobs or 0, self.offset
            )
            extend_completion_logprobs(lps, more)
        self.text += text
        if lps is not None:
            extend_completion_logprobs(self.logprobs, lps)
        finish = self.finish_reason if out.finished else None
        # with logprobs asked for, every output is sent, even one that adds no text
        if not text and lps is None and finish is None:
            return None
        return {
            "index": self.index,
            "text": text,
            "logprobs": lps.model_dump() if lps is not None else None,
            "finish_reason": finish,
            "stop_reason": self.stop_reason if out.finished else None,
        }

    def final(self) -> CompletionChoice:
        return CompletionChoice(
            index=self.index,
            text=self.text,
            logprobs=self.logprobs if self.top_logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


async def completions(st: ServerState, req: CompletionRequest, raw: Request) -> Response:
    st.check_model(req.model)
    # before tokenizing them all
    st.check_choice_count(count_prompts(req.prompt) * req.n, "prompt" if req.n == 1 else "n")
    prompts = await anyio.to_thread.run_sync(st.prompts.completion, req)
    echo_logprobs = req.logprobs if req.echo else None
    request_id = new_id("cmpl")
    subs, choices = [], []
    for p_idx, prompt in enumerate(prompts):
        # the n choices of a prompt differ in their seeds only: one check
        checked = sampling_params(req, req.max_tokens, req.seed, req.logprobs, echo_logprobs)
        budget = st.check_request(prompt.ids, checked, CompletionRequest.model_fields, prompt.field)
        for i in range(req.n):
            index = p_idx * req.n + i
            params = sampling_params(
                req, budget, choice_seed(req.seed, i), req.logprobs, prompt_logprobs=echo_logprobs
            )
            subs.append(SubRequest(index, f"{request_id}-{index}", prompt.ids, params))
            choices.append(
                CompletionChoiceStream(index, prompt, req.echo, st.logprobs, req.logprobs, p_idx)
            )
    if req.echo:
        await anyio.to_thread.run_sync(st.prompts.decode_echoes, prompts)
    prompt_tokens = sum(len(p.ids) for p in prompts)
    answer = Answer(request_id, "text_completion", st.model_name, choices, prompt_tokens)
    return await respond(raw, st.group(subs), answer, req, CompletionResponse)
