"""Text-level reasoning and tool-call parsers for chat completions.

Both parsers consume decoded text deltas (special tokens kept) and are incremental: a
marker split across two deltas is recognised because the tail of a delta that could be the
start of a marker is held back until the next delta decides. Non-streaming responses run
the same parsers over the whole text, so both paths agree by construction.

Parsers are chosen by name (`--reasoning-parser`, `--tool-call-parser`):
- reasoning: "kimi_k2" (`<think>...</think>`, reasoning also ends at the tool-call
  section), "deepseek_r1" (`<think>...</think>`), "none".
- tools: "kimi_k2" (Kimi-K2 and K2.5 write the same markers:
  `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>`), "none".

Where the model's tokenizer has a tool-call marker as one token of its own, the marker
counts only when the model produced that token (`MarkerTokens`): the same characters
written as ordinary text, e.g. a model quoting the format, stay text.

A turn that must call a tool (tool_choice "required" or a named function) starts inside
the tool-call section: the server appends `forced_call_prefix` to the prompt (after closing
an open reasoning block), and the tool-call parser resumes from that prefix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

NONE_PARSER = "none"


def _find_first(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """Earliest occurrence of any marker in text: (position, marker), or None."""
    best: tuple[int, str] | None = None
    for m in markers:
        i = text.find(m)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, m)
    return best


def _partial_suffix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some marker: the part
    that must be held back because the next delta may complete the marker."""
    longest = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), longest, -1):
            if text.endswith(m[:k]):
                longest = k
                break
    return longest


class MarkerTokens:
    """Which marker strings the model produced as their own special tokens.

    Text and token ids arrive together, ids never after the text they decode to, so each id
    seen is a credit for one occurrence of its marker in the text; a gated marker (one the
    tokenizer has a token for) is recognised only while it has credit. Markers without a
    token of their own are always recognised."""

    def __init__(self, marker_ids: Mapping[int, str]) -> None:
        self._marker_of = dict(marker_ids)
        self._gated = frozenset(marker_ids.values())
        self._credit: Counter[str] = Counter()

    def see(self, token_ids: Iterable[int]) -> None:
        for t in token_ids:
            marker = self._marker_of.get(t)
            if marker is not None:
                self._credit[marker] += 1

    def allows(self, marker: str) -> bool:
        return marker not in self._gated or self._credit[marker] > 0

    def allowed(self, markers: Iterable[str]) -> tuple[str, ...]:
        return tuple(m for m in markers if self.allows(m))

    def take(self, marker: str) -> None:
        """The parser consumed one occurrence of `marker`."""
        if marker in self._gated:
            self._credit[marker] -= 1


UNGATED = MarkerTokens({})  # every marker recognised: text-only parsing


# ----------------------------------------------------------------------------- reasoning


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    # markers that also end reasoning but belong to what follows (kept in the content)
    implicit_ends: tuple[str, ...] = ()


KIMI_TOOL_SECTION_BEGINS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
KIMI_TOOL_SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")

REASONING_FORMATS: MappingProxyType[str, ReasoningFormat] = MappingProxyType(
    {
        "kimi_k2": ReasoningFormat("<think>", "</think>", KIMI_TOOL_SECTION_BEGINS),
        "deepseek_r1": ReasoningFormat("<think>", "</think>"),
    }
)


class ReasoningParser:
    """Splits generated text into (reasoning, content).

    `in_reasoning=True` when the prompt already opened the reasoning block (e.g. Kimi's
    thinking-mode generation prompt ends with `<think>`). Otherwise a start marker is
    honoured only before any non-whitespace content, so a model that answers directly and
    later mentions the marker in prose is not misparsed.
    """

    _PRE, _REASONING, _CONTENT = "pre", "reasoning", "content"

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool = False) -> None:
        self.fmt = fmt
        self._state = self._REASONING if in_reasoning else self._PRE
        self._buf = ""
        # the implicit ends are tool-call markers: recognised as the tool parser does
        self.markers = UNGATED

    def feed(self, text: str) -> tuple[str, str]:
        """Consume a delta; returns the (reasoning, content) that can be emitted now."""
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            if self._state == self._CONTENT:
                content.append(self._buf)
                self._buf = ""
            elif self._state == self._PRE:
                stripped = self._buf.lstrip()
                if not stripped:
                    break  # only whitespace so far: undecided
                if stripped.startswith(self.fmt.start):
                    self._buf = stripped[len(self.fmt.start) :]
                    self._state = self._REASONING
                elif self.fmt.start.startswith(stripped):
                    break  # could still become the start marker
                else:
                    self._state = self._CONTENT
            else:  # reasoning: look for its end
                ends = (self.fmt.end, *self.markers.allowed(self.fmt.implicit_ends))
                hit = _find_first(self._buf, ends)
                if hit is None:
                    keep = _partial_suffix_len(self._buf, ends)
                    reasoning.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                pos, marker = hit
                reasoning.append(self._buf[:pos])
                rest = pos + len(marker) if marker == self.fmt.end else pos
                self._buf = self._buf[rest:]
                self._state = self._CONTENT
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """End of generation: whatever is held back is emitted as what it is so far."""
        buf, self._buf = self._buf, ""
        if self._state == self._REASONING:
            return buf, ""
        return "", buf


# ----------------------------------------------------------------------------- tool calls


@dataclass
class ToolCallDelta:
    """One streamed piece of a tool call (OpenAI `delta.tool_calls[i]`)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class KimiToolFormat:
    section_begins: tuple[str, ...] = KIMI_TOOL_SECTION_BEGINS
    section_ends: tuple[str, ...] = KIMI_TOOL_SECTION_ENDS
    call_begin: str = "<|tool_call_begin|>"
    argument_begin: str = "<|tool_call_argument_begin|>"
    call_end: str = "<|tool_call_end|>"

    @property
    def markers(self) -> tuple[str, ...]:
        return (
            *self.section_begins,
            *self.section_ends,
            self.call_begin,
            self.argument_begin,
            self.call_end,
        )

    def call_prefix(self, name: str | None, index: int) -> str:
        """The start of a tool call the server writes for the model: the section and one
        call opened, and for a named function its header too (`functions.NAME:IDX`, the id
        Kimi's templates give the IDX-th call of a conversation), so that the model writes
        only the arguments."""
        prefix = self.section_begins[0] + self.call_begin
        if name is not None:
            prefix += f"functions.{name}:{index}{self.argument_begin}"
        return prefix


TOOL_FORMATS: MappingProxyType[str, KimiToolFormat] = MappingProxyType(
    {"kimi_k2": KimiToolFormat()}
)


def kimi_function_name(header: str) -> str:
    """`functions.get_weather:0` -> `get_weather` (the header is also the call id)."""
    name = header.strip()
    if name.startswith("functions."):
        name = name[len("functions.") :]
    head, sep, idx = name.rpartition(":")
    return head if sep and idx.isdigit() else name


@dataclass
class ToolParseResult:
    content: str = ""
    deltas: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser:
    """Incremental parser of Kimi-K2 tool-call sections in the content stream."""

    _CONTENT, _SECTION, _HEADER, _ARGS = "content", "section", "header", "args"

    def __init__(self, fmt: KimiToolFormat) -> None:
        self.fmt = fmt
        self._state = self._CONTENT
        self._buf = ""
        self._index = -1  # index of the call being parsed
        self.calls: list[ToolCall] = []
        self.markers = UNGATED
        self._pending: list[ToolCallDelta] = []  # from a resumed prefix, sent with the next

    def resume(self, prefix: str) -> None:
        """Continue after `prefix`, the start of a tool call the server wrote into the prompt
        (`KimiToolFormat.call_prefix`): its markers are the server's own, so they count
        whatever the token ids say; a call it opened is announced with the next output."""
        markers, self.markers = self.markers, UNGATED
        try:
            self._pending = self.feed(prefix).deltas  # what was pending comes first in it
        finally:
            self.markers = markers

    def feed(self, text: str) -> ToolParseResult:
        f = self.fmt
        self._buf += text
        out = ToolParseResult()
        out.deltas, self._pending = self._pending, []
        content: list[str] = []
        while self._buf:
            if self._state == self._CONTENT:
                if self._emit_until(f.section_begins, content):
                    break
                self._state = self._SECTION
            elif self._state == self._SECTION:
                ends = self.markers.allowed((f.call_begin, *f.section_ends))
                hit = _find_first(self._buf, ends)
                if hit is None:
                    # whitespace between calls is dropped; keep a possible partial marker
                    keep = _partial_suffix_len(self._buf, ends)
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                pos, marker = hit
                self.markers.take(marker)
                self._buf = self._buf[pos + len(marker) :]
                self._state = self._HEADER if marker == f.call_begin else self._CONTENT
            elif self._state == self._HEADER:
                if not self.markers.allows(f.argument_begin):
                    break
                pos = self._buf.find(f.argument_begin)
                if pos < 0:
                    break
                self.markers.take(f.argument_begin)
                header = self._buf[:pos].strip()
                self._buf = self._buf[pos + len(f.argument_begin) :]
                self._index += 1
                call = ToolCall(id=header, name=kimi_function_name(header), arguments="")
                self.calls.append(call)
                out.deltas.append(ToolCallDelta(self._index, call.id, call.name, ""))
                self._state = self._ARGS
            else:  # arguments until the end of the call
                args: list[str] = []
                done = not self._emit_until((f.call_end,), args)
                self._add_args("".join(args), out)
                if not done:
                    break
                self._state = self._SECTION
        out.content = "".join(content)
        return out

    def _emit_until(self, markers: tuple[str, ...], sink: list[str]) -> bool:
        """Move buffered text before the first marker into sink and drop the marker.
        Returns True when no marker was found (the buffer then only holds a partial one)."""
        markers = self.markers.allowed(markers)
        hit = _find_first(self._buf, markers)
        if hit is None:
            keep = _partial_suffix_len(self._buf, markers)
            sink.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return True
        pos, marker = hit
        self.markers.take(marker)
        sink.append(self._buf[:pos])
        self._buf = self._buf[pos + len(marker) :]
        return False

    def _add_args(self, text: str, out: ToolParseResult) -> None:
        if not text:
            return
        self.calls[self._index].arguments += text
        if out.deltas and out.deltas[-1].index == self._index:
            out.deltas[-1].arguments += text
        else:
            out.deltas.append(ToolCallDelta(self._index, arguments=text))

    def flush(self) -> ToolParseResult:
        """End of generation: a partial marker in content is content; unfinished
        arguments are emitted as they are; an unfinished header is dropped."""
        out = ToolParseResult()
        out.deltas, self._pending = self._pending, []
        buf, self._buf = self._buf, ""
        if self._state == self._CONTENT:
            out.content = buf
        elif self._state == self._ARGS:
            self._add_args(buf, out)
        return out


# ----------------------------------------------------------------------------- combined


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    """Reasoning parser then tool-call parser over one choice's text stream; either may be
    absent. Non-streaming callers feed the whole text once and then flush."""

    def __init__(
        self,
        reasoning: ReasoningParser | None = None,
        tools: ToolCallParser | None = None,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    def use_marker_tokens(self, marker_ids: Mapping[int, str]) -> None:
        """Recognise these markers (token id -> marker) only when the model produced their
        token; call `see_tokens` with each output's ids before feeding its text."""
        ledger = MarkerTokens(marker_ids)
        if self.reasoning is not None:
            self.reasoning.markers = ledger
        if self.tools is not None:
            self.tools.markers = ledger

    def see_tokens(self, token_ids: Iterable[int]) -> None:
        # both parsers share one ledger: the reasoning parser only looks, the tool parser
        # consumes
        if self.tools is not None:
            self.tools.markers.see(token_ids)
        elif self.reasoning is not None:
            self.reasoning.markers.see(token_ids)

    def resume_tool_call(self, prefix: str) -> None:
        """The prompt ends with `prefix`, the start of a tool call (see `ToolCallParser.
        resume`)."""
        if self.tools is not None and prefix:
            self.tools.resume(prefix)

    def feed(self, text: str) -> ChatDelta:
        return self._step(text, final=False)

    def flush(self) -> ChatDelta:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> ChatDelta:
        out = ChatDelta()
        if self.reasoning is not None:
            out.reasoning, content = self.reasoning.feed(text)
            if final:
                more_r, more_c = self.reasoning.flush()
                out.reasoning += more_r
                content += more_c
        else:
            content = text
        if self.tools is not None:
            res = self.tools.feed(content)
            out.content, out.tool_calls = res.content, res.deltas
            if final:
                tail = self.tools.flush()
                out.content += tail.content
                merge_tool_deltas(out.tool_calls, tail.deltas)
        else:
            out.content = content
        return out


def merge_tool_deltas(into: list[ToolCallDelta], more: list[ToolCallDelta]) -> None:
    for d in more:
        if into and into[-1].index == d.index and d.id is None:
            into[-1].arguments += d.arguments
        else:
            into.append(d)


def reasoning_starts_open(fmt: ReasoningFormat, prompt_text: str) -> bool:
    """Whether the rendered prompt leaves the model inside a reasoning block (its generation
    prompt ends with an unclosed start marker, as in Kimi/DeepSeek thinking modes)."""
    tail = prompt_text.rstrip()
    return tail.endswith(fmt.start)


def reasoning_close(parser_name: str | None, prompt_text: str) -> str:
    """The end marker that closes the reasoning block the prompt leaves open, else ''
    (`parser_name`: a reasoning or tool-call parser's, whose family sets the markers)."""
    fmt = REASONING_FORMATS.get(parser_name or "")
    return fmt.end if fmt is not None and reasoning_starts_open(fmt, prompt_text) else ""


def forced_call_prefix(tool_parser: str, name: str | None, index: int) -> str:
    """What the server appends to a prompt (after `reasoning_close`) so that the turn is a
    tool call: of any function (`name` None, tool_choice "required"), or of `name`."""
    return TOOL_FORMATS[tool_parser].call_prefix(name, index)


def call_end_marker(tool_parser: str) -> str:
    return TOOL_FORMATS[tool_parser].call_end


def marker_token_ids(tool_parser: str | None, tokenizer: Any) -> dict[int, str]:
    """The tool-call markers the tokenizer has a token of its own for: token id -> marker."""
    if not tool_parser or tool_parser == NONE_PARSER:
        return {}
    ids: dict[int, str] = {}
    for marker in TOOL_FORMATS[tool_parser].markers:
        encoded = list(tokenizer.encode(marker, add_special_tokens=False))
        if len(encoded) == 1 and tokenizer.decode(encoded, skip_special_tokens=False) == marker:
            ids[encoded[0]] = marker
    return ids


REASONING_PARSER_NAMES = (*REASONING_FORMATS, NONE_PARSER)  # for --reasoning-parser choices
TOOL_PARSER_NAMES = (*TOOL_FORMATS, NONE_PARSER)  # for --tool-call-parser choices


def check_parser_names(reasoning_parser: str | None, tool_parser: str | None) -> None:
    """Raise ValueError (one sentence) for an unknown parser name."""
    if reasoning_parser not in (None, NONE_PARSER, *REASONING_FORMATS):
        raise ValueError(
            f"Unknown reasoning parser {reasoning_parser!r}; "
            f"choose one of {', '.join(REASONING_PARSER_NAMES)}."
        )
    if tool_parser not in (None, NONE_PARSER, *TOOL_FORMATS):
        raise ValueError(
            f"Unknown tool-call parser {tool_parser!r}; "
            f"choose one of {', '.join(TOOL_PARSER_NAMES)}."
        )


def make_output_parser(
    reasoning_parser: str | None,
    tool_parser: str | None,
    prompt_text: str,
    use_tools: bool,
) -> ChatOutputParser:
    """The parser for one choice of one request."""
    reasoning = None
    if reasoning_parser and reasoning_parser != NONE_PARSER:
        fmt = REASONING_FORMATS[reasoning_parser]
        reasoning = ReasoningParser(fmt, in_reasoning=reasoning_starts_open(fmt, prompt_text))
    tools = None
    if use_tools and tool_parser and tool_parser != NONE_PARSER:
        tools = ToolCallParser(TOOL_FORMATS[tool_parser])
    return ChatOutputParser(reasoning, tools)
