"""POST /v1/chat/completions: one rendered prompt, n choices, each read by the configured
reasoning and tool-call parsers.

tool_choice "required" or a named function (a server with a --tool-call-parser; tools
declared as for "auto"): the server writes the start of the call into the prompt, after
closing a reasoning block the template left open, so the turn is a call and skips
reasoning. "required" opens the section and a first call, so the model writes at least one
call and picks its functions (names are not checked against tools; it may add more calls).
A named function's header is written too (`functions.NAME:IDX`, IDX = the conversation's
earlier calls), the model writes only its arguments, and generation stops at the end of
that call (at the marker's own token where the tokenizer has one), so it is the only call;
its finish_reason is "stop", as for OpenAI and vLLM, while "required" reports "tool_calls".
Arguments are not checked against the schema: no grammar constrains the sampling.
"""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response

from moeserve.engine.outputs import RequestOutput
from moeserve.server import parsers
from moeserve.server.errors import ApiError
from moeserve.server.generation import SubRequest
from moeserve.server.logprobs import LogprobFormatter
from moeserve.server.params import choice_seed, sampling_params
from moeserve.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    FunctionCallOut,
    ToolCallOut,
)
from moeserve.server.state import ServerState, new_id
from moeserve.server.streaming import Answer, ChoiceStream, respond


class ChatChoiceStream(ChoiceStream):
    """A chat choice: its text split by the output parser into reasoning, content and tool
    calls; logprobs as per-token objects when `top_logprobs` is not None."""

    def __init__(
        self,
        index: int,
        parser: parsers.ChatOutputParser,
        formatter: LogprobFormatter,
        top_logprobs: int | None,
        named_call: bool = False,
    ) -> None:
        super().__init__(index)
        self.parser = parser
        self.formatter = formatter
        self.top_logprobs = top_logprobs
        self.named_call = named_call  # the request named the function to call
        self.reasoning = ""
        self.content = ""
        self.logprobs: list[dict[str, Any]] = []

    @property
    def reported_finish_reason(self) -> str | None:
        """OpenAI reports a turn that ends in tool calls as "tool_calls", not "stop" (but
        "stop" for the call of a function the request named)."""
        if self.finish_reason == "stop" and self.parser.tool_calls and not self.named_call:
            return "tool_calls"
        return self.finish_reason

    def opening(self) -> dict[str, Any]:
        # the role comes first, in a chunk of its own (OpenAI does this)
        return {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def _piece(self, out: RequestOutput, first: bool) -> dict[str, Any] | None:
        self.parser.see_tokens(out.token_ids)
        delta = self.parser.feed(out.text)
        if out.finished:
            tail = self.parser.flush()
            delta.reasoning += tail.reasoning
            delta.content += tail.content
            parsers.merge_tool_deltas(delta.tool_calls, tail.tool_calls)
        self.reasoning += delta.reasoning
        self.content += delta.content
        logprobs = None
        if self.top_logprobs is not None and out.logprobs:
            entries = self.formatter.chat(out.logprobs, self.top_logprobs)
            self.logprobs += entries
            logprobs = {"content": entries}
        finish = self.reported_finish_reason if out.finished else None
        if delta.empty() and finish is None and logprobs is None:
            return None
        piece: dict[str, Any] = {
            "index": self.index,
            "delta": _delta_dict(delta),
            "logprobs": logprobs,
            "finish_reason": finish,
        }
        if finish is not None:
            piece["stop_reason"] = out.stop_reason
        return piece

    def final(self) -> ChatChoice:
        calls = [
            ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in self.parser.tool_calls
        ]
        # content is null, not "", when the turn only reasoned or called tools
        content = self.content if self.content or not (calls or self.reasoning) else None
        message = ChatMessageOut(
            content=content,
            reasoning_content=self.reasoning or None,
            reasoning=self.reasoning or None,
            tool_calls=calls,
        )
        logprobs = None
        if self.top_logprobs is not None:
            logprobs = ChatLogprobs(content=[ChatTokenLogprob(**d) for d in self.logprobs])
        return ChatChoice(
            index=self.index,
            message=message,
            logprobs=logprobs,
            finish_reason=self.reported_finish_reason,
            stop_reason=self.stop_reason,
        )


def _delta_dict(d: parsers.ChatDelta) -> dict[str, Any]:
    """A chat chunk's `delta`: reasoning under both names clients use, then content, then
    tool calls (id, type and name only in a call's first piece)."""
    delta: dict[str, Any] = {}
    if d.reasoning:
        delta["reasoning_content"] = d.reasoning
        delta["reasoning"] = d.reasoning
    if d.content:
        delta["content"] = d.content
    if d.tool_calls:
        calls = []
        for tc in d.tool_calls:
            item: dict[str, Any] = {"index": tc.index}
            if tc.id is not None:
                item.update(id=tc.id, type="function")
                item["function"] = {"name": tc.name, "arguments": tc.arguments}
            else:
                item["function"] = {"arguments": tc.arguments}
            calls.append(item)
        delta["tool_calls"] = calls
    return delta


def _forced_call(st: ServerState, req: ChatCompletionRequest) -> str:
    """The start of the tool call this turn must be (see the module's docstring), or ''."""
    if not req.requires_tool_call:
        return ""
    if not st.parses_tool_calls:
        raise ApiError(
            "tool_choice 'required' or a named function needs a server started with "
            "--tool-call-parser; this one does not parse tool calls.",
            param="tool_choice",
        )
    return parsers.forced_call_prefix(st.tool_parser, req.forced_tool, req.earlier_tool_calls)


def _call_end_stops(st: ServerState, req: ChatCompletionRequest) -> dict[str, Any]:
    """For a named function: stop at the end of its one call, at the marker's own token
    where the model has one, else at its text."""
    if req.forced_tool is None:
        return {}
    marker = parsers.call_end_marker(st.tool_parser)
    ids = tuple(i for i, m in st.tool_marker_ids.items() if m == marker)
    return {"extra_stop_token_ids": ids} if ids else {"extra_stop": (marker,)}


async def chat_completions(st: ServerState, req: ChatCompletionRequest, raw: Request) -> Response:
    st.check_model(req.model)
    call_prefix = _forced_call(st, req)

    def start_call(text: str) -> str:
        # the reasoning parser's markers, else those of the tool parser's model family
        family = st.reasoning_parser
        if family not in parsers.REASONING_FORMATS:
            family = st.tool_parser
        return parsers.reasoning_close(family, text) + call_prefix

    prompt = await anyio.to_thread.run_sync(
        st.prompts.chat, req, start_call if call_prefix else None
    )
    top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    request_id = new_id("chatcmpl")
    stops = _call_end_stops(st, req)
    max_tokens = st.check_request(
        prompt.ids,
        sampling_params(req, req.output_limit, req.seed, top_logprobs, **stops),
        ChatCompletionRequest.model_fields,
        prompt.field,
        prompt.images,
    )
    choices = [
        ChatChoiceStream(
            i,
            # called through the module so that a substituted factory takes effect
            parsers.make_output_parser(
                st.reasoning_parser, st.tool_parser, prompt.text, req.uses_tools
            ),
            st.logprobs,
            top_logprobs,
            named_call=req.forced_tool is not None,
        )
        for i in range(req.n)
    ]
    for c in choices:
        if st.tool_marker_ids:
            c.parser.use_marker_tokens(st.tool_marker_ids)
        c.parser.resume_tool_call(call_prefix)
    subs = [
        SubRequest(
            c.index,
            f"{request_id}-{c.index}",
            prompt.ids,
            sampling_params(
                req,
                max_tokens,
                choice_seed(req.seed, c.index),
                top_logprobs,
                # a parser reads the special tokens that mark reasoning and tool calls
                skip_special_tokens=False if c.parser.active else None,
                **stops,
            ),
            prompt.images or None,
        )
        for c in choices
    ]
    answer = Answer(request_id, "chat.completion.chunk", st.model_name, choices, len(prompt.ids))
    return await respond(raw, st.group(subs), answer, req, ChatCompletionResponse)
