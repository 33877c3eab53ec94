"""Offline batch generation: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.engine.core import build_engine
from moeserve.engine.errors import RequestFailed, failure_message
from moeserve.engine.outputs import TokenLogprob
from moeserve.sampling import SamplingParams

OFFLINE_FETCH_S = 30.0  # an http(s) image URL given to LLM.chat


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
        return self._run([(ids, None) for ids in ids_list], params)

    def _run(self, requests: list[tuple[list[int], list | None]], params: SamplingParams):
        """Generate for (prompt ids, images or None) pairs, all in the engine at once."""
        rids = []
        for ids, images in requests:
            rid = f"offline-{self._counter}"
            self._counter += 1
            self.engine.add_request(rid, ids, params, images)
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
        """One chat turn. Image parts as the OpenAI API writes them (`{"type": "image_url",
        "image_url": {"url": "data:..."}}`) or `{"type": "image", "image": PIL.Image}` go to
        the model's vision encoder (models with one)."""
        images = self._images(messages)
        rendered = [_as_image_url(m) for m in messages] if images else messages
        prompt = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        if not images:
            return self.generate([ids], params)[0]
        processor = self.engine.image_processor
        inputs = [processor.preprocess(im) for im in images]
        ids = processor.expand(ids, inputs)
        return self._run([(ids, inputs)], params or SamplingParams())[0]

    def _images(self, messages: list[dict]) -> list:
        """The messages' images (PIL), in order; a ValueError for a model without a vision
        encoder or an image it cannot read."""
        from moeserve.multimodal.images import ImageError, ImageLimits, load_image

        parts = [
            part
            for m in messages
            if isinstance(m.get("content"), list)
            for part in m["content"]
            if isinstance(part, dict) and part.get("type") in ("image_url", "image")
        ]
        if parts and self.engine.image_processor is None:
            raise ValueError("this model takes no images (it has no vision encoder)")
        # in-process callers pass what they choose to: only the server limits what clients send
        limits = ImageLimits(max_bytes=1 << 62, max_pixels=1 << 62, fetch_timeout=OFFLINE_FETCH_S)
        out = []
        for part in parts:
            if part["type"] == "image":
                out.append(part["image"].convert("RGB"))
                continue
            try:
                out.append(load_image(part["image_url"]["url"], limits))
            except ImageError as e:
                raise ValueError(f"invalid image: {e}") from e
        return out


def _as_image_url(message: dict) -> dict:
    """The message as the chat template reads it: an `image` part (a PIL image) written as
    an image_url part (the template renders a placeholder for either)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = [
        {"type": "image_url", "image_url": {"url": ""}} if p.get("type") == "image" else p
        for p in content
    ]
    return {**message, "content": parts}
