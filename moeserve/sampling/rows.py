"""Each request's sampler state, built on first sight and kept until `forget`: its generator
(seeded requests), the ids it may not sample before min_tokens, its logit bias and its row of
the penalty counts on the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.sampling.errors import is_device_error
from moeserve.sampling.params import SamplingParams

COUNT_ROWS_MIN_GROWTH = 4  # rows the penalty counts grow by at least


class TokenCounts:
    """Per-request token statistics on the device, one row each, rows reused: whether a token
    is in the prompt (repetition penalty) and how often it was generated (all penalties)."""

    def __init__(self, width: int, device: torch.device) -> None:
        self.width, self.device = width, device
        self.in_prompt = torch.zeros(0, width, dtype=torch.bool, device=device)
        self.generated = torch.zeros(0, width, dtype=torch.int32, device=device)
        self.free: list[int] = []

    def alloc(self, prompt: list[int]) -> int:
        if not self.free:
            n = self.in_prompt.shape[0]
            grow = max(COUNT_ROWS_MIN_GROWTH, n)
            self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros(grow, self.width)])
            self.generated = torch.cat([self.generated, self.generated.new_zeros(grow, self.width)])
            self.free = list(range(n + grow - 1, n - 1, -1))
        slot = self.free.pop()
        self.in_prompt[slot].zero_()
        self.generated[slot].zero_()
        if prompt:
            ids = torch.tensor(prompt, dtype=torch.long).to(self.device)
            self.in_prompt[slot, ids] = True
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def add(self, slots: list[int], tokens: list[int]) -> None:
        """Count one more occurrence of tokens[i] in the row of slots[i] (batched)."""
        if not tokens:
            return
        idx = torch.tensor([slots, tokens], dtype=torch.long).to(self.device)
        ones = torch.ones(len(tokens), dtype=torch.int32, device=self.device)
        self.generated.index_put_((idx[0], idx[1]), ones, accumulate=True)


@dataclass
class RowState:
    """One request's sampler state (kept until `forget`)."""

    params: SamplingParams
    generator: torch.Generator | None
    slot: int  # row of `TokenCounts` (-1: no penalties)
    counted: int  # output tokens already in the counts
    blocked: torch.Tensor | None  # ids masked until min_tokens (on the device)
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None


class RowStates:
    """The requests' sampler states by request id, and the penalty counts they share."""

    def __init__(self) -> None:
        self.rows: dict[str, RowState] = {}
        self.counts: TokenCounts | None = None

    def forget(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None and row.slot >= 0 and self.counts is not None:
            self.counts.release(row.slot)

    def of_batch(
        self,
        request_ids: list[str],
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        logits: torch.Tensor,
        eos_ids: tuple[int, ...],
    ) -> tuple[dict[int, RowState], dict[int, Exception]]:
        """Each batch row's state by its index, and the rows whose own state could not be
        built (they fail alone; a device error propagates)."""
        states: dict[int, RowState] = {}
        errors: dict[int, Exception] = {}
        for j, rid in enumerate(request_ids):
            try:
                states[j] = self.row(rid, params[j], prompt_ids[j], output_ids[j], logits, eos_ids)
            except Exception as e:
                if is_device_error(e):
                    raise
                errors[j] = e
        return states, errors

    def row(
        self,
        request_id: str,
        p: SamplingParams,
        prompt: list[int],
        output: list[int],
        logits: torch.Tensor,
        eos_ids: tuple[int, ...],
    ) -> RowState:
        """This request's state, created on first sight; its penalty counts brought up to
        date with the output tokens added since the last step (only those)."""
        row = self.rows.get(request_id)
        if row is None or row.params is not p:  # new (or an id reused with new params)
            if row is not None:
                self.forget(request_id)
            row = self.new_row(p, prompt, logits, eos_ids)
            self.rows[request_id] = row
        if row.slot >= 0 and len(output) != row.counted:
            counts = self.counts
            assert counts is not None
            if len(output) < row.counted:  # history rewritten: count it again
                counts.generated[row.slot].zero_()
                row.counted = 0
            new = output[row.counted :]
            counts.add([row.slot] * len(new), list(new))
            row.counted = len(output)
        return row

    def new_row(
        self, p: SamplingParams, prompt: list[int], logits: torch.Tensor, eos_ids: tuple[int, ...]
    ) -> RowState:
        dev = logits.device
        gen = None
        if p.seed is not None and not p.greedy:
            gen = torch.Generator(device=dev)
            gen.manual_seed(p.seed)
        slot = -1
        if p.needs_penalties:
            if self.counts is None or self.counts.width != logits.shape[1]:
                self.counts = TokenCounts(logits.shape[1], dev)
            slot = self.counts.alloc(prompt)
        blocked = None
        if p.min_tokens:
            ids = p.blocked_ids(eos_ids)
            if ids:
                blocked = torch.tensor(ids, dtype=torch.long).to(dev)
        bias_ids = bias_values = None
        if p.logit_bias:
            bias_ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long).to(dev)
            bias_values = torch.tensor([v for _, v in p.logit_bias], dtype=torch.float32).to(dev)
        return RowState(p, gen, slot, 0, blocked, bias_ids, bias_values)
