"""Request fields -> the engine's SamplingParams of one choice.

Checks that need the model (token ids against the vocabulary) are the engine's
(`LLMEngine.validate`); its refusal reaches the client as a 400 naming the same field.
"""

from __future__ import annotations

from moeserve.sampling import SEED_MAX, SEED_MIN, SamplingError, SamplingParams
from moeserve.server.errors import ApiError, param_named
from moeserve.server.protocol import ChatCompletionRequest, CompletionRequest


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    max_tokens: int | None,
    seed: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    skip_special_tokens: bool | None = None,
    extra_stop: tuple[str, ...] = (),
    extra_stop_token_ids: tuple[int, ...] = (),
) -> SamplingParams:
    """The engine's parameters of one choice (`max_tokens` None: what the context leaves);
    a bad combination is a 400 naming its field. `extra_stop*`: where the server itself
    ends the generation, besides the request's own stops."""
    optional = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            seed=seed,
            logit_bias=req.logit_bias_ids,
            stop=(*(req.stop or ()), *extra_stop),
            stop_token_ids=(*(req.stop_token_ids or ()), *extra_stop_token_ids),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=(
                req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
            ),
            **{k: v for k, v in optional.items() if v is not None},
        )
    except SamplingError as e:
        raise ApiError(str(e), param=param_named(str(e), type(req).model_fields)) from e


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice i's seed: seed + i, wrapped into the generator's range, so the n choices of a
    seeded request differ from each other yet repeat across requests."""
    if seed is None:
        return None
    return (seed + i - SEED_MIN) % (SEED_MAX - SEED_MIN) + SEED_MIN
