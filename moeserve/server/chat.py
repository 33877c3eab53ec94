"""POST /v1/chat/completions: one rendered prompt, n choices, each read by the configured
reasoning and tool-call parsers."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response

from moeserve.engine.outputs import RequestOutput
from moeserve.server import parsers
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
    ) -> None:
        super().__init__(index)
        self.parser = parser
        self.formatter = formatter
        self.top_logprobs = top_logprobs
        self.reasoning = ""
        self.content = ""
        self.logprobs: list[dict[str, Any]] = []

    @property
    def reported_finish_reason(self) -> str | None:
        """OpenAI reports a turn that ends in tool calls as "tool_calls", not "stop"."""
        if self.finish_reason == "stop" and self.parser.tool_calls:
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


async def chat_completions(st: ServerState, req: ChatCompletionRequest, raw: Request) -> Response:
    st.check_model(req.model)
    prompt = await anyio.to_thread.run_sync(st.prompts.chat, req)
    top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    request_id = new_id("chatcmpl")
    max_tokens = st.check_request(
        prompt.ids,
        sampling_params(req, req.output_limit, req.seed, top_logprobs),
        ChatCompletionRequest.model_fields,
        prompt.field,
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
        )
        for i in range(req.n)
    ]
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
            ),
        )
        for c in choices
    ]
    answer = Answer(request_id, "chat.completion.chunk", st.model_name, choices, len(prompt.ids))
    return await respond(raw, st.group(subs), answer, req, ChatCompletionResponse)
