"""Offline batch generation: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.engine.core import build_engine
from moeserve.engine.errors import RequestFailed, failure_message
from moeserve.engine.outputs import TokenLogprob
from moeserve.sampling import SamplingParams


@dataclass
class Completion:
    """One prompt's generation, put together from its outputs."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    """Offline batch generation: `LLM(model).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = build_engine(model, **kwargs)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self, prompts: list[str] | list[list[int]] | str, params: SamplingParams | None = None
    ) -> list[Completion]:
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        ids_list = [
            p if isinstance(p, list) else self.tokenizer.encode(p)
            for p in prompts  # type: ignore[arg-type]
        ]
        rids = []
        for ids in ids_list:
            rid = f"offline-{self._counter}"
            self._counter += 1
            self.engine.add_request(rid, ids, params)
            rids.append(rid)
        acc = {
            r: Completion("", [], None, [] if params.logprobs is not None else None) for r in rids
        }
        while self.engine.has_unfinished():
            outs = self.engine.step()
            for rid, e in self.engine.take_failures():
                raise RequestFailed(f"request {rid} failed: {failure_message(e)}") from e
            for out in outs:
                c = acc[out.request_id]
                c.text += out.text
                c.token_ids += out.token_ids
                if out.logprobs is not None and c.logprobs is not None:
                    c.logprobs += out.logprobs
                if out.prompt_logprobs is not None:
                    c.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    c.finish_reason = out.finish_reason
        return [acc[r] for r in rids]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Completion:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([self.tokenizer.encode(prompt, add_special_tokens=False)], params)[0]
