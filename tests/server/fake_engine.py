"""A deterministic stand-in for AsyncEngine, for protocol tests without a model.

Tokenizer: one token per character (id = OFFSET + code point) plus a few special tokens.
Generation script: if the decoded prompt contains `SAY:`, the model "says" the text after
the last `SAY:` (up to the end of that turn) and then EOS; otherwise it counts digits
"0123456789..." until max_tokens. Logprobs are a fixed function of the token id, so tests
can compute the expected values by hand.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi.testclient import TestClient

from moeserve.config import ServerConfig
from moeserve.engine.errors import EngineInputError
from moeserve.engine.outputs import RequestOutput, TokenLogprob
from moeserve.engine.request import validate_request
from moeserve.sampling import SamplingParams
from moeserve.server.api import create_app

SPECIALS = [
    "<pad>",
    "<s>",
    "</s>",
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
]
OFFSET = 16
BOS, EOS = 1, 2
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class FakeTokenizer:
    eos_token_id = EOS
    bos_token_id = BOS
    eos_token = "</s>"
    bos_token = "<s>"
    pad_token = "<pad>"
    chat_template = TEMPLATE
    vocab_size = OFFSET + 0x10000
    all_special_ids = set(range(len(SPECIALS)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [BOS] if add_special_tokens else []
        i = 0
        while i < len(text):
            for k, sp in enumerate(SPECIALS):
                if text.startswith(sp, i):
                    ids.append(k)
                    i += len(sp)
                    break
            else:
                ids.append(OFFSET + ord(text[i]))
                i += 1
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = []
        for t in ids:
            if t < OFFSET:
                if not skip_special_tokens and t < len(SPECIALS):
                    out.append(SPECIALS[t])
            else:
                out.append(chr(t - OFFSET))
        return "".join(out)

    def id_to_token(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        if kwargs.get("explode"):
            raise ValueError("the template refuses")
        parts = []
        if tools:
            names = ",".join(t["function"]["name"] for t in tools)
            parts.append(f"<|system|>TOOLS:{names}<|end|>")
        for m in messages:
            parts.append(f"<|{m['role']}|>{m['content']}<|end|>")
        if add_generation_prompt:
            parts.append("<|assistant|>")
            if kwargs.get("thinking"):
                parts.append("<think>")
        return "".join(parts)


def fake_logprob(token_id: int) -> float:
    return -((token_id % 5) + 1) / 10.0


def fake_top(token_id: int, k: int) -> list[tuple[int, float]]:
    """The "model's" top-k: the token itself then its successors, decreasing."""
    return [(token_id + j, fake_logprob(token_id) - j) for j in range(k)]


class FakeEngine:
    def __init__(
        self,
        max_model_len: int = 512,
        delay: float = 0.0,
        model_name: str = "fake-model",
        healthy: bool = True,
    ) -> None:
        self.model_name = model_name
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.delay = delay
        self.healthy = healthy
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self._abort_flags: set[str] = set()

    def script(self, prompt_ids: list[int]) -> list[int] | None:
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        if "SAY:" not in text:
            return None
        said = text.rsplit("SAY:", 1)[1].split("<|end|>", 1)[0]
        return self.tokenizer.encode(said, add_special_tokens=False) + [EOS]

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """The engine's own checks (`validate_request`) against this fake's vocabulary and
        context: the server leaves them to the engine."""
        return validate_request(
            prompt_token_ids, params, self.tokenizer.vocab_size, (EOS,), self.max_model_len
        )

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        limit = self.validate(prompt_token_ids, params)
        n = len(prompt_token_ids)
        text = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
        if "REJECT" in text:
            raise EngineInputError("the fake engine rejects this prompt.")
        self.requests.append((request_id, list(prompt_token_ids), params))
        plp = None
        if params.prompt_logprobs is not None:
            k = params.prompt_logprobs
            plp = [None] + [
                TokenLogprob(t, fake_logprob(t), fake_top(t, k)) for t in prompt_token_ids[1:]
            ]
        script = self.script(prompt_token_ids)
        produced: list[int] = []
        out_text = ""
        if limit == 0:
            self.finished.append(request_id)
            yield RequestOutput(request_id, "", [], [], True, "length", n, 0, prompt_logprobs=plp)
            return
        while True:
            await asyncio.sleep(self.delay)
            if request_id in self._abort_flags:
                return
            if script is not None:
                tok = script[len(produced)] if len(produced) < len(script) else EOS
            else:
                tok = OFFSET + ord("0") + len(produced) % 10
            produced.append(tok)
            lps = None
            if params.logprobs is not None:
                lps = [TokenLogprob(tok, fake_logprob(tok), fake_top(tok, params.logprobs))]
            finish, stop_reason = None, None
            piece = "" if tok == EOS else self.tokenizer.decode([tok], params.skip_special_tokens)
            if tok == EOS and not params.ignore_eos:
                finish = "stop"
            else:
                out_text += piece
                for s in params.stop:
                    if s in out_text:
                        cut = out_text.index(s) + (
                            len(s) if params.include_stop_str_in_output else 0
                        )
                        piece = piece[: len(piece) - (len(out_text) - cut)]
                        finish, stop_reason = "stop", s
                        break
            if finish is None and len(produced) >= limit:
                finish = "length"
            if finish:
                self.finished.append(request_id)
            yield RequestOutput(
                request_id,
                piece,
                [tok],
                lps,
                finish is not None,
                finish,
                n,
                len(produced),
                stop_reason=stop_reason,
                prompt_logprobs=plp if len(produced) == 1 else None,
            )
            if finish:
                return

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._abort_flags.add(request_id)

    def metrics_text(self) -> str:
        n = len(self.requests)
        return f"# TYPE fake_engine_requests_total counter\nfake_engine_requests_total {n}\n"

    def is_healthy(self) -> bool:
        return self.healthy


MODEL = "fake-model"


def make_client(engine=None, api_key=None, reasoning_parser=None, tool_parser=None):
    """A TestClient over create_app(FakeEngine) and the engine (for inspection)."""
    engine = engine or FakeEngine(model_name=MODEL)
    app = create_app(
        engine,
        ServerConfig(api_key=api_key, served_model_name=MODEL),
        reasoning_parser=reasoning_parser,
        tool_parser=tool_parser,
    )
    return TestClient(app), engine
