"""OpenAI-compatible request and response schemas (pydantic v2).

Requests accept the OpenAI fields plus the vLLM extras users of vLLM/SGLang rely on
(`top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `min_tokens`, `ignore_eos`,
`skip_special_tokens`, `include_stop_str_in_output`, `chat_template_kwargs`,
`add_generation_prompt`, `continue_final_message`). Unknown fields are ignored, as OpenAI
and vLLM do. Range checks that need no model knowledge live here; checks against the model
live in the engine (`LLMEngine.validate`), and prompts.py repeats only those whose error
must name the endpoint's own parameter (the context budget, token ids in a list of prompts).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from moeserve.sampling import MAX_LOGIT_BIAS, SEED_MAX, SEED_MIN

MAX_N = 128  # OpenAI's limit on choices per request
MAX_LOGPROBS = 20  # SamplingParams.MAX_LOGPROBS; kept equal by a test
NAMED_TOOL_CHOICE = '{"type": "function", "function": {"name": ...}}'
ROLES = ("system", "developer", "user", "assistant", "tool")
IMAGE_PART_TYPES = ("image_url",)


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


def find_bad_unicode(value: Any, path: str = "") -> str | None:
    """Path (`messages.0.content`) of the first string, or dict key, holding a lone surrogate
    (JSON allows `"\\ud800"`; no tokenizer can encode it), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and find_bad_unicode(k) is not None:
                return sub
            hit = find_bad_unicode(v, sub)
            if hit is not None:
                return hit
    elif isinstance(value, list):
        for i, v in enumerate(value):
            hit = find_bad_unicode(v, f"{path}.{i}" if path else str(i))
            if hit is not None:
                return hit
    return None


class RequestModel(OpenAIModel):
    """A top-level request body: text that cannot be encoded is rejected, naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = find_bad_unicode(data)
        if where is not None:
            raise ValueError(
                f"{where} holds text that is not valid Unicode (an unpaired surrogate such as "
                "\\ud800)"
            )
        return data


# ----------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ----------------------------------------------------------------------------- requests


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionCall(OpenAIModel):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallIn(OpenAIModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ImageUrl(OpenAIModel):
    url: str
    detail: str | None = None


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None
    image_url: ImageUrl | str | None = None

    @property
    def is_image(self) -> bool:
        return self.type in IMAGE_PART_TYPES

    @property
    def url(self) -> str | None:
        """An image part's URL (None when it has none)."""
        u = self.image_url
        return u.url if isinstance(u, ImageUrl) else u


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in ROLES:
            raise ValueError(f"unknown role {v!r}; expected one of {', '.join(ROLES)}")
        return v

    def text(self) -> str | None:
        """The message content as one string (text parts joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(
                    f"content part of type {part.type!r} is not supported; "
                    "this server only accepts text"
                )
            texts.append(part.text)
        return "".join(texts)

    def image_parts(self) -> list[tuple[int, ContentPart]]:
        """(index in content, part) of the message's image parts."""
        if not isinstance(self.content, list):
            return []
        return [(i, p) for i, p in enumerate(self.content) if p.is_image]

    def to_template(self) -> dict[str, Any]:
        """The dict a chat template sees (absent fields left out); a message with images keeps
        its content as a list of text and image_url parts, which the template renders."""
        d: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        if self.image_parts():
            assert isinstance(self.content, list)
            d["content"] = [
                {"type": "image_url"} if p.is_image else {"type": "text", "text": p.text or ""}
                for p in self.content
                if p.is_image or (p.type == "text" and p.text is not None)
            ]
            if len(d["content"]) != len(self.content):
                self.text()  # raises for the part it cannot take
        else:
            d["content"] = self.text() if self.content is not None else ""
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [tc.model_dump() for tc in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            d["reasoning_content"] = self.reasoning_content
        return d


class _SamplingFields(RequestModel):
    """Fields shared by chat and legacy completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=SEED_MIN, lt=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        items = [v] if isinstance(v, str) else v
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        return items

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"values must be in [-100, 100], got {bias} for token {key}")
        return v

    @model_validator(mode="after")
    def _common_checks(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must contain at least one message")
        return v

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs a final assistant message")
        self._check_tool_choice()
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError(
                f"response_format of type {self.response_format.get('type')!r} "
                "is not supported by this server"
            )
        return self

    def _check_tool_choice(self) -> None:
        """tool_choice is "none", "auto", "required" or {"type": "function", "function":
        {"name": N}} with N one of the declared tools (vLLM's rules); each message starts
        with the field it blames, which the 400 then names."""
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or []]
        if choice is None or choice in ("none", "auto"):
            return
        if isinstance(choice, str):
            if choice != "required":
                raise ValueError(
                    f"tool_choice must be 'none', 'auto', 'required' or a named function "
                    f"{NAMED_TOOL_CHOICE}, not {choice!r}"
                )
            if not names:
                raise ValueError("tool_choice 'required' needs at least one function in tools")
            return
        if choice.get("type", "function") != "function":
            raise ValueError(f"tool_choice.type must be 'function': {NAMED_TOOL_CHOICE}")
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"tool_choice.function.name must name a function: {NAMED_TOOL_CHOICE}")
        if name not in names:
            declared = ", ".join(repr(n) for n in names) if names else "none"
            raise ValueError(
                f"tool_choice.function.name {name!r} is not one of the functions in tools "
                f"(declared: {declared})"
            )

    @property
    def output_limit(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool(self) -> str | None:
        """The function a named tool_choice makes the model call (checked to be a tool)."""
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return None

    @property
    def requires_tool_call(self) -> bool:
        """tool_choice "required" or a named function: the turn must be a tool call."""
        return self.tool_choice == "required" or self.forced_tool is not None

    @property
    def earlier_tool_calls(self) -> int:
        """Tool calls the conversation's assistant turns made so far (the next call's
        `functions.NAME:IDX` index continues from it)."""
        return sum(len(m.tool_calls or []) for m in self.messages if m.role == "assistant")


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported unless it equals n")
        return self

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: PromptInput) -> PromptInput:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


# ----------------------------------------------------------------------------- responses


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, not computed


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "moeserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
