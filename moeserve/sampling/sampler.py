"""The batched sampler: one pass over fp32 logits [B, V] on the model's device per step, each
row with its own parameters, state and token history.

One device-to-host copy per step brings back the sampled ids (plus one for the rows that
asked for logprobs); steps of greedy rows under overlap scheduling leave them on the device
instead (`greedy_on_device`, in `tokens`). Penalties read per-request token counts kept on
the device and updated with each step's new tokens only.

A row whose own state cannot be built fails alone (`SampleResult.errors`); a row left with no
finite logit (every token masked, or a penalty that overflowed to nan) fails alone as well:
nothing is ever drawn from a distribution holding inf or nan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moeserve.sampling.device_tokens import DeviceTokens
from moeserve.sampling.errors import is_device_error, nothing_to_sample
from moeserve.sampling.logits import adjust, draw, mask_padded
from moeserve.sampling.logprobs import ScoredToken, logprobs_of, sampled_logprobs
from moeserve.sampling.params import SamplingParams
from moeserve.sampling.rows import RowState, RowStates
from moeserve.sampling.verify import VerifyResult, verify_drafts, verify_draws


@dataclass
class SampleResult:
    # per row: the sampled id, or None where that row failed (see `errors`)
    token_ids: list[int | None]
    # per row: (logprob of the chosen token, [(token, logprob), ...] top-k) or None
    logprobs: list[ScoredToken | None]
    # row -> the error that failed that row alone
    errors: dict[int, Exception] = field(default_factory=dict)


class Sampler:
    """Samples one token per row; each row has its own params, state and token history.

    `vocab_limit`: ids at or beyond it are never sampled nor reported (the LM head of
    DeepSeek/Kimi is padded beyond the tokenizer's vocabulary); None: the logits' width.

    Steps of greedy rows only can leave their tokens on `device` instead (`greedy_on_device`,
    overlap scheduling): the next step is queued before the host has seen them, and its
    input ids name them (`tokens.latest`).
    """

    def __init__(
        self,
        vocab_limit: int | None = None,
        eos_ids: tuple[int, ...] = (),
        device: torch.device | str = "cpu",
        tokens: DeviceTokens | None = None,
    ) -> None:
        self.vocab_limit = vocab_limit
        self.eos_ids = tuple(eos_ids)
        self.states = RowStates()
        self.tokens = tokens if tokens is not None else DeviceTokens(device)

    # ---- greedy tokens kept on the device ----------------------------------------------------
    def greedy_on_device(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax over the allowed vocabulary [B], left on the device (no host
        sync) as the latest greedy step's tokens."""
        self.tokens.latest = logits[:, : self.vocab_limit].argmax(dim=-1)
        return self.tokens.latest

    def greedy_into(self, logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`greedy_on_device`'s argmax written into `out` [B] int64, keeping no state: the op
        a captured decode step runs behind its LM head (see `DeviceTokens.adopt_replay`)."""
        return torch.argmax(logits[:, : self.vocab_limit], dim=-1, out=out)

    # ---- per-request state -----------------------------------------------------------------
    def forget(self, request_id: str) -> None:
        self.states.forget(request_id)

    # ---- scoring given tokens --------------------------------------------------------------
    def logprobs_of(
        self, logits: torch.Tensor, targets: list[int], k: int = 0
    ) -> list[ScoredToken]:
        """Per row of `logits` [n, V]: the logprob of `targets[row]` under the model's raw
        distribution over the allowed vocabulary, and that row's top `k` (token, logprob)."""
        return logprobs_of(logits, targets, k, self.vocab_limit)

    # ---- one step --------------------------------------------------------------------------
    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        request_ids: list[str],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        eos_ids: tuple[int, ...] | None = None,
    ) -> SampleResult:
        eos = self.eos_ids if eos_ids is None else tuple(eos_ids)
        n = len(params)
        token_ids: list[int | None] = [None] * n
        logprobs: list[ScoredToken | None] = [None] * n
        states, errors = self.states.of_batch(
            request_ids, params, prompt_ids, output_ids, logits, eos
        )
        groups = [sorted(states)]
        while groups:
            group = groups.pop()
            if not group:
                continue
            sub = [states[j] for j in group]
            lens = [len(output_ids[j]) for j in group]
            x = logits if len(group) == n else logits[group]
            try:
                ids, lps = self._sample(x, sub, lens)
            except Exception as e:
                if is_device_error(e):
                    raise
                if len(group) == 1:
                    errors[group[0]] = e
                else:  # find the row(s) that fail: each alone
                    groups.extend([j] for j in group)
                continue
            for k, j in enumerate(group):
                if ids[k] is None:
                    errors[j] = nothing_to_sample()
                else:
                    token_ids[j] = ids[k]
                    logprobs[j] = lps[k]
        return SampleResult(token_ids, logprobs, errors)

    def _sample(
        self, logits: torch.Tensor, rows: list[RowState], out_lens: list[int]
    ) -> tuple[list[int | None], list[ScoredToken | None]]:
        """One batched pass over the rows; ids (None: nothing finite to sample) and logprobs."""
        b = logits.shape[0]
        ps = [r.params for r in rows]
        x = logits.float().clone()
        mask_padded(x, self.vocab_limit)
        ks = [p.logprobs for p in ps]
        raw_lp = torch.log_softmax(x, dim=-1) if any(k is not None for k in ks) else None
        x = adjust(x, rows, out_lens, self.states.counts)
        greedy = [p.greedy for p in ps]
        ids = x.argmax(dim=-1) if all(greedy) else draw(x, rows, greedy)
        dead = ~(x > float("-inf")).any(dim=-1)
        host = torch.stack([ids, dead.long()]).tolist()  # the step's one copy to the host
        chosen: list[int | None] = [
            None if d else int(t) for t, d in zip(host[0], host[1], strict=True)
        ]
        lps: list[ScoredToken | None] = [None] * b
        if raw_lp is not None:
            lps = sampled_logprobs(raw_lp, ks, chosen)
        return chosen, lps

    # ---- speculative decoding ----------------------------------------------------------------
    def verify(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        request_ids: list[str],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        drafts: list[list[int]],
        eos_ids: tuple[int, ...] | None = None,
    ) -> VerifyResult:
        """Accept or reject each request's draft against the target's logits (the rule of
        `moeserve.sampling.verify`): request j owns len(drafts[j]) + 1 consecutive rows."""
        eos = self.eos_ids if eos_ids is None else tuple(eos_ids)
        states, errors = self.states.of_batch(
            request_ids, params, prompt_ids, output_ids, logits, eos
        )
        return verify_drafts(
            logits,
            states,
            errors,
            params,
            drafts,
            output_ids,
            self.vocab_limit,
            self.states.counts,
            self._verify_draws,
        )

    def _verify_draws(
        self,
        x: torch.Tensor,
        rows: list[RowState],
        greedy: list[bool],
        guess: list[int],
        target: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The acceptance and rejection rule of sampled rows (`verify_draws`); a method, so a
        sampler of another rule can be checked against this one."""
        return verify_draws(x, rows, greedy, guess, target)
