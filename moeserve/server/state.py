"""What every endpoint shares: the engine, the configuration and the helpers built over the
engine's tokenizer, plus admission of new work (draining, choice cap, queue bound)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from moeserve.config import ServerConfig
from moeserve.engine.errors import EngineInputError
from moeserve.multimodal.images import ImageLimits
from moeserve.sampling import SamplingParams
from moeserve.server import parsers
from moeserve.server.errors import ApiError, from_engine
from moeserve.server.generation import GenerationGroup, QueueCounter, SubRequest
from moeserve.server.logprobs import LogprobFormatter
from moeserve.server.metrics import HttpMetrics
from moeserve.server.prompts import PromptBuilder


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ServerState:
    """One app's shared state (`app.state.server`)."""

    engine: Any
    config: ServerConfig
    reasoning_parser: str | None
    tool_parser: str | None
    metrics: HttpMetrics = field(default_factory=HttpMetrics)
    queue: QueueCounter = field(default_factory=QueueCounter)
    draining: bool = False  # SIGTERM received: running requests finish, new ones get 503
    prompts: PromptBuilder = field(init=False)
    logprobs: LogprobFormatter = field(init=False)
    # the tool-call markers the model has tokens of its own for: token id -> marker
    tool_marker_ids: dict[int, str] = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.config
        self.prompts = PromptBuilder(
            self.engine.tokenizer,
            getattr(self.engine, "image_processor", None),
            ImageLimits(
                cfg.max_image_bytes,
                cfg.max_image_pixels,
                cfg.media_fetch_timeout,
                ImageLimits.parse_domains(cfg.allowed_media_domains),
            ),
            cfg.max_images_per_request,
        )
        self.logprobs = LogprobFormatter(self.engine.tokenizer)
        self.tool_marker_ids = parsers.marker_token_ids(self.tool_parser, self.engine.tokenizer)

    @property
    def parses_tool_calls(self) -> bool:
        return self.tool_parser not in (None, parsers.NONE_PARSER)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        """The configured served name, else (config left at its default) the engine's."""
        configured = self.config.served_model_name
        if configured == ServerConfig().served_model_name:
            return getattr(self.engine, "model_name", None) or configured
        return configured

    def check_model(self, model: str | None) -> None:
        if model is None:
            return
        known = (
            self.model_name,
            self.config.served_model_name,
            getattr(self.engine, "model_name", None),
        )
        if model not in known:
            raise ApiError(
                f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                404,
                "NotFoundError",
                "model",
                "model_not_found",
            )

    def check_choice_count(self, count: int, param: str) -> None:
        cap = self.config.max_choices_per_request
        if count > cap:
            raise ApiError(
                f"This request asks for {count} completions (prompts x n); this server "
                f"allows at most {cap} per request (--max-choices-per-request).",
                param=param,
            )

    def check_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        fields: Any,
        prompt_param: str,
        images: list | None = None,
    ) -> int:
        """The engine's checks of one prompt and its parameters, before anything is admitted;
        returns max_tokens, resolved. A refusal is a 400 naming the request's own field
        (`fields`: the request model's)."""
        try:
            if images:
                return self.engine.validate(prompt_ids, params, images)
            return self.engine.validate(prompt_ids, params)
        except EngineInputError as e:
            raise from_engine(e, fields, prompt_param) from e

    def group(self, subs: list[SubRequest]) -> GenerationGroup:
        """Admit a request's engine requests (draining, choice cap, queue bound) as a group."""
        if self.draining:
            raise ApiError(
                "The server is shutting down; retry on another instance.",
                503,
                "service_unavailable",
                code="shutting_down",
            )
        self.check_choice_count(len(subs), "n")
        return GenerationGroup(
            self.engine, subs, self.config.request_timeout, self.queue, self.config.max_queue_len
        )
