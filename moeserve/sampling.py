"""Sampling parameters (validated) and the batched sampler.

The sampler works on fp32 logits [B, V]. Order of operations (as in vLLM): penalties on the
raw logits, then temperature, then min-p / top-k / top-p truncation, then a draw from a
per-request generator (seeded requests are reproducible whatever else is in the batch).
Logprobs are those of the model's raw distribution (log_softmax of the unmodified logits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class SamplingError(ValueError):
    """Invalid sampling parameters (one clear sentence, shown to the user)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: off; k >= 0: sampled token's logprob + top k
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise SamplingError(msg)

        if self.max_tokens is not None and self.max_tokens < 0:
            bad(f"max_tokens must be at least 0, got {self.max_tokens}.")
        if not 0.0 <= self.temperature <= 100.0:
            bad(f"temperature must be in [0, 100], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            bad(f"top_k must be -1 (off) or a positive integer, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}.")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}.")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                bad(f"{name} must be in [-2, 2], got {v}.")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= self.MAX_LOGPROBS:
                bad(f"{name} must be between 0 and {self.MAX_LOGPROBS}, got {v}.")
        if self.min_tokens < 0:
            bad(f"min_tokens must be at least 0, got {self.min_tokens}.")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings.")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: (logprob of the chosen token, [(token, logprob), ...] top-k) or None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    """Samples one token per row; each row has its own params and token history."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        g = self._generators.get(request_id)
        if g is None:
            g = torch.Generator(device="cpu")
            g.manual_seed(seed)
            self._generators[request_id] = g
        return g

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        request_ids: list[str],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        eos_ids: tuple[int, ...] = (),
    ) -> SampleResult:
        logits = logits.float()
        want_lp = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        if any(p.needs_penalties for p in params):
            logits = logits.clone()
            for i, p in enumerate(params):
                if p.needs_penalties:
                    apply_penalties(logits[i], p, prompt_ids[i], output_ids[i])
        for i, p in enumerate(params):  # min_tokens: keep EOS and stop ids from ending early
            if p.min_tokens and len(output_ids[i]) < p.min_tokens:
                blocked = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
                if blocked:
                    logits[i, blocked] = float("-inf")
        if all(p.greedy for p in params):
            chosen = logits.argmax(dim=-1).tolist()
        else:
            chosen = self._sample(logits, params, request_ids)
        lps: list[tuple[float, list[tuple[int, float]]] | None] = []
        for i, p in enumerate(params):
            if raw_logprobs is None or p.logprobs is None:
                lps.append(None)
                continue
            row = raw_logprobs[i]
            top: list[tuple[int, float]] = []
            if p.logprobs:
                v, ix = row.topk(p.logprobs)
                top = list(zip(ix.tolist(), v.tolist(), strict=True))
            lps.append((float(row[chosen[i]]), top))
        return SampleResult(chosen, lps)

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]
    ) -> list[int]:
        out: list[int] = []
        for i, p in enumerate(params):
            row = logits[i]
            if p.greedy:
                out.append(int(row.argmax()))
                continue
            # drawn on the CPU: per-request seeded generators live there
            probs = truncated_probs(row.cpu() / p.temperature, p.top_k, p.top_p, p.min_p)
            g = self._generator(request_ids[i], p.seed)
            out.append(int(torch.multinomial(probs, 1, generator=g)))
        return out


def apply_penalties(
    row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]
) -> None:
    """In place on one row of logits. Repetition penalty covers prompt and output tokens
    (HF / vLLM convention); presence and frequency penalties cover output tokens only."""
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=row.device)
        if len(seen):
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    if output and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(output, dtype=torch.long, device=row.device).unique(
            return_counts=True
        )
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty


def truncated_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Probabilities of a 1-D logit row after top-k, top-p and min-p truncation."""
    probs = torch.softmax(logits, dim=-1)
    if min_p > 0.0:
        probs = torch.where(probs < min_p * probs.max(), torch.zeros_like(probs), probs)
    if top_k and top_k < probs.numel():
        kth = probs.topk(top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        cum = sorted_p.cumsum(0)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (cum - sorted_p) >= top_p * cum[-1]
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return probs / probs.sum()
