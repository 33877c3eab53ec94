"""Sampling parameters (validated) and the batched sampler.

The sampler works on fp32 logits [B, V] on the model's device, in one batched pass. Order of
operations (as in vLLM): the LM head's padded rows (ids the tokenizer does not have) are
masked, then penalties, logit bias and the min_tokens mask on the raw logits, then
temperature, then min-p / top-k / top-p truncation, then a draw. Logprobs are those of the
model's raw distribution over the tokenizer's vocabulary (log_softmax before any of it).

Draws use the exponential race (argmax of p / E with E ~ Exp(1), which picks token i with
probability p_i): unseeded rows take their noise from one batched call, a seeded row from its
own generator on the device, so a seeded request gives the same tokens whatever else is in
the batch. One device-to-host copy per step brings back the sampled ids (plus one for the
rows that asked for logprobs); steps of greedy rows under overlap scheduling leave them on
the device instead (`greedy_on_device`). Penalties read per-request token counts kept on the
device and updated with each step's new tokens only.

A row whose own state cannot be built fails alone (`SampleResult.errors`); a row left with no
finite logit (every token masked, or a penalty that overflowed to nan) fails alone as well:
nothing is ever drawn from a distribution holding inf or nan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SEED_MIN = -(2**63)  # the range torch.Generator.manual_seed takes
SEED_MAX = 2**64  # exclusive
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
_TINY = 1e-20  # floor of the exponential noise: p / 0 must never decide a draw


class SamplingError(ValueError):
    """Invalid sampling parameters (one clear sentence, shown to the user). The message starts
    with the name of the offending field."""


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
    # (token id, bias added to its logit), sorted by id
    logit_bias: tuple[tuple[int, float], ...] = ()
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias or ()
        if isinstance(bias, dict):
            bias = bias.items()
        try:
            object.__setattr__(
                self, "logit_bias", tuple(sorted((int(t), float(v)) for t, v in bias))
            )
        except (TypeError, ValueError):
            raise SamplingError(
                "logit_bias must map token ids (integers) to numbers in [-100, 100]."
            ) from None
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
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).")
        if self.seed is not None and not SEED_MIN <= self.seed < SEED_MAX:
            bad(f"seed must be in [-2^63, 2^64), got {self.seed}.")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers.")
        for t, v in self.logit_bias:
            if t < 0:
                bad(f"logit_bias: token id {t} is negative.")
            if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                bad(f"logit_bias values must be in [-100, 100], got {v} for token {t}.")

    def check_vocab(self, vocab_size: int, eos_ids: tuple[int, ...] = ()) -> None:
        """Token ids the request names must exist in the model's vocabulary `[0, vocab_size)`
        (the tokenizer's, not the padded LM head's), and min_tokens must leave something to
        sample."""
        top = vocab_size - 1
        bad_stop = next((t for t in self.stop_token_ids if t >= vocab_size), None)
        if bad_stop is not None:
            raise SamplingError(
                f"stop_token_ids: token id {bad_stop} is outside the vocabulary (0..{top})."
            )
        bad_bias = next((t for t, _ in self.logit_bias if t >= vocab_size), None)
        if bad_bias is not None:
            raise SamplingError(
                f"logit_bias: token id {bad_bias} is outside the vocabulary (0..{top})."
            )
        if self.min_tokens and len(self.blocked_ids(eos_ids)) >= vocab_size:
            raise SamplingError(
                "min_tokens: stop_token_ids (with the end-of-sequence token) cover the whole "
                "vocabulary, so no token could be sampled before min_tokens is reached."
            )

    def blocked_ids(self, eos_ids: tuple[int, ...] = ()) -> tuple[int, ...]:
        """Ids that may not be sampled before min_tokens: stop ids, and EOS unless ignored."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(eos_ids)
        return tuple(sorted(ids))

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
    # per row: the sampled id, or None where that row failed (see `errors`)
    token_ids: list[int | None]
    # per row: (logprob of the chosen token, [(token, logprob), ...] top-k) or None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]
    # row -> the error that failed that row alone
    errors: dict[int, Exception] = field(default_factory=dict)


@dataclass
class VerifyResult:
    # per request: the tokens it emits (the accepted draft prefix, then one more), or None
    # where it failed (see `errors`)
    tokens: list[list[int] | None]
    # per request that asked for logprobs: (logprob, top-k) of each emitted token
    logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None]
    errors: dict[int, Exception] = field(default_factory=dict)


class RowSamplingError(RuntimeError):
    """Sampling failed for one request (not caused by its parameters)."""


def is_device_error(e: BaseException) -> bool:
    """A failure of the device itself (CUDA error, lost device): it poisons every request."""
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(e, accel):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("CUDA error" in text or "CUBLAS_STATUS" in text)


class _Counts:
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
            grow = max(4, n)
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
class _Row:
    """One request's sampler state (kept until `forget`)."""

    params: SamplingParams
    generator: torch.Generator | None
    slot: int  # row of `_Counts` (-1: no penalties)
    counted: int  # output tokens already in the counts
    blocked: torch.Tensor | None  # ids masked until min_tokens (on the device)
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None


class Sampler:
    """Samples one token per row; each row has its own params, state and token history.

    `vocab_limit`: ids at or beyond it are never sampled nor reported (the LM head of
    DeepSeek/Kimi is padded beyond the tokenizer's vocabulary); None: the logits' width.

    Steps of greedy rows only can leave their tokens on `device` instead (`greedy_on_device`,
    overlap scheduling): the next step is queued before the host has seen them, and its
    input ids name them (`device_tokens`).
    """

    def __init__(
        self,
        vocab_limit: int | None = None,
        eos_ids: tuple[int, ...] = (),
        device: torch.device | str = "cpu",
    ) -> None:
        self.vocab_limit = vocab_limit
        self.eos_ids = tuple(eos_ids)
        self._rows: dict[str, _Row] = {}
        self._counts: _Counts | None = None
        # the tokens of the latest `greedy_on_device` step
        self._device_ids = torch.zeros(1, dtype=torch.int64, device=device)

    # ---- greedy tokens kept on the device ----------------------------------------------------
    def greedy_on_device(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax over the allowed vocabulary [B], left on the device (no host
        sync) and kept for `device_tokens`."""
        self._device_ids = logits[:, : self.vocab_limit].argmax(dim=-1)
        return self._device_ids

    def greedy_into(self, logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`greedy_on_device`'s argmax written into `out` [B] int64, keeping no state: the op
        a captured decode step runs behind its LM head (see `adopt_device_tokens`)."""
        return torch.argmax(logits[:, : self.vocab_limit], dim=-1, out=out)

    def adopt_device_tokens(self, tokens: torch.Tensor) -> None:
        """Make `tokens` (a step's `greedy_into` output, still on the device) the latest
        greedy step's tokens."""
        self._device_ids = tokens

    def device_tokens(self) -> torch.Tensor:
        """The tokens of the latest greedy step kept on the device."""
        return self._device_ids

    # ---- per-request state -----------------------------------------------------------------
    def forget(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None and row.slot >= 0 and self._counts is not None:
            self._counts.release(row.slot)

    def _row(
        self,
        request_id: str,
        p: SamplingParams,
        prompt: list[int],
        output: list[int],
        logits: torch.Tensor,
        eos_ids: tuple[int, ...],
    ) -> _Row:
        """This request's state, created on first sight; its penalty counts brought up to
        date with the output tokens added since the last step (only those)."""
        row = self._rows.get(request_id)
        if row is None or row.params is not p:  # new (or an id reused with new params)
            if row is not None:
                self.forget(request_id)
            row = self._new_row(p, prompt, logits, eos_ids)
            self._rows[request_id] = row
        if row.slot >= 0 and len(output) != row.counted:
            counts = self._counts
            assert counts is not None
            if len(output) < row.counted:  # history rewritten: count it again
                counts.generated[row.slot].zero_()
                row.counted = 0
            new = output[row.counted :]
            counts.add([row.slot] * len(new), list(new))
            row.counted = len(output)
        return row

    def _new_row(
        self, p: SamplingParams, prompt: list[int], logits: torch.Tensor, eos_ids: tuple[int, ...]
    ) -> _Row:
        dev = logits.device
        gen = None
        if p.seed is not None and not p.greedy:
            gen = torch.Generator(device=dev)
            gen.manual_seed(p.seed)
        slot = -1
        if p.needs_penalties:
            if self._counts is None or self._counts.width != logits.shape[1]:
                self._counts = _Counts(logits.shape[1], dev)
            slot = self._counts.alloc(prompt)
        blocked = None
        if p.min_tokens:
            ids = p.blocked_ids(eos_ids)
            if ids:
                blocked = torch.tensor(ids, dtype=torch.long).to(dev)
        bias_ids = bias_values = None
        if p.logit_bias:
            bias_ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long).to(dev)
            bias_values = torch.tensor([v for _, v in p.logit_bias], dtype=torch.float32).to(dev)
        return _Row(p, gen, slot, 0, blocked, bias_ids, bias_values)

    # ---- scoring given tokens --------------------------------------------------------------
    def logprobs_of(
        self, logits: torch.Tensor, targets: list[int], k: int = 0
    ) -> list[tuple[float, list[tuple[int, float]]]]:
        """Per row of `logits` [n, V]: the logprob of `targets[row]` under the model's raw
        distribution over the allowed vocabulary, and that row's top `k` (token, logprob)."""
        logp = torch.log_softmax(logits[:, : self.vocab_limit].float(), dim=-1)
        ids = torch.tensor(targets, device=logp.device)
        chosen = logp.gather(1, ids[:, None]).squeeze(1).tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
        if k:
            tv, ti = logp.topk(k, dim=-1)
            tops = [
                list(zip(a, b, strict=True)) for a, b in zip(ti.tolist(), tv.tolist(), strict=True)
            ]
        return list(zip(chosen, tops, strict=True))

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
        logprobs: list[tuple[float, list[tuple[int, float]]] | None] = [None] * n
        errors: dict[int, Exception] = {}
        rows: list[_Row] = []
        ok: list[int] = []
        for j in range(n):
            try:
                rows.append(
                    self._row(request_ids[j], params[j], prompt_ids[j], output_ids[j], logits, eos)
                )
                ok.append(j)
            except Exception as e:  # this request's own state: fail it alone
                if is_device_error(e):
                    raise
                errors[j] = e
        groups = [ok]
        while groups:
            group = groups.pop()
            if not group:
                continue
            sub = [rows[ok.index(j)] for j in group]
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
                    errors[j] = RowSamplingError(
                        "no token can be sampled: every logit is masked or not finite"
                    )
                else:
                    token_ids[j] = ids[k]
                    logprobs[j] = lps[k]
        return SampleResult(token_ids, logprobs, errors)

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
        """Accept or reject each request's draft against the target's logits.

        Request j owns len(drafts[j]) + 1 consecutive rows of `logits`: row i is the target's
        distribution after the sequence and the draft's first i tokens, processed exactly as
        `__call__` processes a row whose history holds those tokens (penalties, bias,
        min_tokens, temperature, truncation). Greedy: the draft's longest prefix equal to the
        rows' argmax, then the argmax after it. Sampled: draft token d at row i is accepted
        with probability p_i(d); at the first rejection the token is drawn from p_i with d
        removed (renormalised), and after a fully accepted draft from the last row. With a
        draft that is one fixed guess (a point mass), this is the rejection rule of
        speculative sampling and every emitted token follows the target's distribution.
        Seeded requests draw from their own generator, so they repeat.
        """
        eos = self.eos_ids if eos_ids is None else tuple(eos_ids)
        n = len(params)
        errors: dict[int, Exception] = {}
        tokens: list[list[int] | None] = [None] * n
        logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None] = [None] * n
        starts, at = [], 0
        for d in drafts:
            starts.append(at)
            at += len(d) + 1
        states: dict[int, _Row] = {}
        for j in range(n):
            try:
                states[j] = self._row(
                    request_ids[j], params[j], prompt_ids[j], output_ids[j], logits, eos
                )
            except Exception as e:
                if is_device_error(e):
                    raise
                errors[j] = e
        ok = sorted(states)
        if not ok:
            return VerifyResult(tokens, logprobs, errors)
        # one virtual row per (request, draft position)
        src, vrows, owner, pos, out_lens, extra = [], [], [], [], [], []
        for j in ok:
            for i in range(len(drafts[j]) + 1):
                src.append(starts[j] + i)
                vrows.append(states[j])
                owner.append(j)
                pos.append(i)
                out_lens.append(len(output_ids[j]) + i)
                extra.append(drafts[j][:i])
        dev = logits.device
        x = logits[torch.tensor(src, dtype=torch.long, device=dev)].float()
        limit = self.vocab_limit
        if limit is not None and limit < x.shape[1]:
            x[:, limit:] = float("-inf")
        want = [params[j].logprobs is not None for j in owner]
        raw_lp = torch.log_softmax(x, dim=-1) if any(want) else None
        pen = [v for v, r in enumerate(vrows) if r.slot >= 0]
        if pen:
            self._apply_penalties(x, pen, vrows, extra)
        self._apply_bias(x, vrows)
        self._apply_min_tokens(x, vrows, out_lens)
        x = torch.nan_to_num(x, nan=float("-inf"))
        dead = ~(x > float("-inf")).any(dim=-1)
        greedy = [r.params.greedy for r in vrows]
        guess = [
            drafts[j][i] if i < len(drafts[j]) else -1 for j, i in zip(owner, pos, strict=True)
        ]
        target = x.argmax(dim=-1)
        if all(greedy):
            accept = target == torch.tensor(guess, device=dev)
            drawn = target
        else:
            accept, drawn = self._verify_draws(x, vrows, greedy, guess, target)
        host = torch.stack([accept.long(), drawn, dead.long()]).tolist()
        emitted_rows: dict[int, list[int]] = {}
        v = 0
        for j in ok:
            k = len(drafts[j])
            got: list[int] | None = []
            used: list[int] = []
            for i in range(k + 1):
                u = v + i
                if host[2][u]:
                    errors[j] = RowSamplingError(
                        "no token can be sampled: every logit is masked or not finite"
                    )
                    got = None
                    break
                used.append(u)
                if i < k and host[0][u]:
                    got.append(drafts[j][i])
                    continue
                got.append(int(host[1][u]))
                break
            v += k + 1
            tokens[j] = got
            if got:
                emitted_rows[j] = used
        if raw_lp is not None:
            self._verify_logprobs(raw_lp, params, tokens, emitted_rows, logprobs)
        return VerifyResult(tokens, logprobs, errors)

    def _verify_draws(
        self,
        x: torch.Tensor,
        rows: list[_Row],
        greedy: list[bool],
        guess: list[int],
        target: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per virtual row: whether its draft token is accepted, and the token drawn where
        it is not (from the distribution with the draft token removed; from the whole
        distribution at a request's last row)."""
        dev = x.device
        ps = [r.params for r in rows]
        temp = torch.tensor(
            [1.0 if g else p.temperature for p, g in zip(ps, greedy, strict=True)],
            dtype=torch.float32,
        ).to(dev)
        big = torch.finfo(torch.float32).max
        scaled = torch.nan_to_num(x / temp[:, None], nan=float("-inf"), posinf=big)
        probs = truncate(
            torch.softmax(scaled, dim=-1),
            [p.top_k for p in ps],
            [p.top_p for p in ps],
            [p.min_p for p in ps],
        )
        probs = probs / probs.sum(dim=-1, keepdim=True).clamp_(min=_TINY)
        has_guess = torch.tensor([g >= 0 for g in guess], device=dev)
        g = torch.tensor([max(0, t) for t in guess], dtype=torch.long, device=dev)
        p_guess = probs.gather(1, g[:, None]).squeeze(1)
        uniform = torch.rand(len(rows), device=dev)
        noise = torch.empty_like(probs).exponential_()
        for v, r in enumerate(rows):
            if r.generator is not None and not greedy[v]:
                uniform[v] = torch.rand(1, device=dev, generator=r.generator)[0]
                noise[v].exponential_(generator=r.generator)
        residual = probs.scatter(1, g[:, None], torch.where(has_guess, 0.0, p_guess)[:, None])
        drawn = (residual / noise.clamp_(min=_TINY)).nan_to_num_(nan=0.0).argmax(dim=-1)
        is_greedy = torch.tensor(greedy, device=dev)
        accept = torch.where(is_greedy, target == g, uniform < p_guess) & has_guess
        return accept, torch.where(is_greedy, target, drawn)

    @staticmethod
    def _verify_logprobs(
        raw: torch.Tensor,
        params: list[SamplingParams],
        tokens: list[list[int] | None],
        emitted_rows: dict[int, list[int]],
        out: list[list[tuple[float, list[tuple[int, float]]]] | None],
    ) -> None:
        """Each emitted token's logprob under its row's raw distribution, and the row's
        top-k, for the requests that asked."""
        asked = [
            j
            for j, p in enumerate(params)
            if p.logprobs is not None and tokens[j] is not None and j in emitted_rows
        ]
        if not asked:
            return
        vs = [v for j in asked for v in emitted_rows[j]]
        ts = [t for j in asked for t in tokens[j]]  # type: ignore[union-attr]
        ks = [params[j].logprobs or 0 for j in asked for _ in emitted_rows[j]]
        scored = iter(Sampler._scored(raw, vs, ts, ks))
        for j in asked:
            out[j] = [next(scored) for _ in emitted_rows[j]]

    def _sample(
        self, logits: torch.Tensor, rows: list[_Row], out_lens: list[int]
    ) -> tuple[list[int | None], list[tuple[float, list[tuple[int, float]]] | None]]:
        """One batched pass over the rows; ids (None: nothing finite to sample) and logprobs."""
        b, width = logits.shape
        ps = [r.params for r in rows]
        x = logits.float().clone()
        limit = self.vocab_limit
        if limit is not None and limit < width:
            x[:, limit:] = float("-inf")
        want_lp = [p.logprobs is not None for p in ps]
        raw_lp = torch.log_softmax(x, dim=-1) if any(want_lp) else None

        pen = [i for i, r in enumerate(rows) if r.slot >= 0]
        if pen:
            self._apply_penalties(x, pen, rows)
        self._apply_bias(x, rows)
        self._apply_min_tokens(x, rows, out_lens)

        greedy = [p.greedy for p in ps]
        # rows with no finite logit left cannot be sampled (nan counts as masked)
        x = torch.nan_to_num(x, nan=float("-inf"))
        if all(greedy):
            ids = x.argmax(dim=-1)
        else:
            ids = self._draw(x, rows, greedy)
        dead = ~(x > float("-inf")).any(dim=-1)
        host = torch.stack([ids, dead.long()]).tolist()  # the step's one copy to the host
        chosen: list[int | None] = [
            None if d else int(t) for t, d in zip(host[0], host[1], strict=True)
        ]
        lps: list[tuple[float, list[tuple[int, float]]] | None] = [None] * b
        if raw_lp is not None:
            lps = self._logprobs(raw_lp, ps, chosen)
        return chosen, lps

    def _apply_penalties(
        self,
        x: torch.Tensor,
        pen: list[int],
        rows: list[_Row],
        extra: list[list[int]] | None = None,
    ) -> None:
        """Repetition penalty over prompt and output tokens (HF / vLLM convention); presence
        and frequency penalties over output tokens only. Batched over the penalised rows.
        `extra[i]`: tokens row i's history holds beyond the request's output (the draft
        tokens before a verified position)."""
        counts = self._counts
        assert counts is not None
        dev = x.device
        slots = torch.tensor([rows[i].slot for i in pen], dtype=torch.long).to(dev)
        idx = torch.tensor(pen, dtype=torch.long).to(dev)
        gen = counts.generated.index_select(0, slots)  # [k, V] int32
        if extra is not None:
            which = [n for n, i in enumerate(pen) for _ in extra[i]]
            if which:
                toks = [t for i in pen for t in extra[i]]
                at = torch.tensor([which, toks], dtype=torch.long).to(dev)
                ones = torch.ones(len(toks), dtype=torch.int32, device=dev)
                gen.index_put_((at[0], at[1]), ones, accumulate=True)
        seen = counts.in_prompt.index_select(0, slots) | (gen > 0)
        ps = [rows[i].params for i in pen]
        rep = torch.tensor([p.repetition_penalty for p in ps], dtype=torch.float32).to(dev)
        freq = torch.tensor([p.frequency_penalty for p in ps], dtype=torch.float32).to(dev)
        pres = torch.tensor([p.presence_penalty for p in ps], dtype=torch.float32).to(dev)
        sub = x.index_select(0, idx)
        r = rep[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
        sub = sub - freq[:, None] * gen.float() - pres[:, None] * (gen > 0).float()
        x.index_copy_(0, idx, sub)

    @staticmethod
    def _apply_bias(x: torch.Tensor, rows: list[_Row]) -> None:
        biased = [(i, r) for i, r in enumerate(rows) if r.bias_ids is not None]
        if not biased:
            return
        dev = x.device
        ids = torch.cat([r.bias_ids for _, r in biased])  # type: ignore[misc]
        vals = torch.cat([r.bias_values for _, r in biased])  # type: ignore[misc]
        counts = torch.tensor([len(r.bias_ids) for _, r in biased])  # type: ignore[arg-type]
        which = torch.tensor([i for i, _ in biased]).repeat_interleave(counts).to(dev)
        x.index_put_((which, ids), vals, accumulate=True)

    @staticmethod
    def _apply_min_tokens(x: torch.Tensor, rows: list[_Row], out_lens: list[int]) -> None:
        """EOS and stop ids cannot be sampled before min_tokens (batched)."""
        early = [
            (i, r)
            for i, r in enumerate(rows)
            if r.blocked is not None and out_lens[i] < r.params.min_tokens
        ]
        if not early:
            return
        dev = x.device
        ids = torch.cat([r.blocked for _, r in early])  # type: ignore[misc]
        counts = torch.tensor([len(r.blocked) for _, r in early])  # type: ignore[arg-type]
        which = torch.tensor([i for i, _ in early]).repeat_interleave(counts).to(dev)
        x.index_put_((which, ids), torch.tensor(float("-inf"), device=dev))

    def _draw(self, x: torch.Tensor, rows: list[_Row], greedy: list[bool]) -> torch.Tensor:
        """Sampled ids [B] on the device (greedy rows take the argmax)."""
        dev = x.device
        ps = [r.params for r in rows]
        temp = torch.tensor(
            [1.0 if g else p.temperature for p, g in zip(ps, greedy, strict=True)],
            dtype=torch.float32,
        ).to(dev)
        scaled = x / temp[:, None]
        # +inf (an overflowed penalty or bias) becomes the largest finite logit: softmax stays
        # defined; rows that are all -inf are reported by the caller, never drawn from
        big = torch.finfo(torch.float32).max
        scaled = torch.nan_to_num(scaled, nan=float("-inf"), posinf=big)
        probs = truncate(
            torch.softmax(scaled, dim=-1),
            [p.top_k for p in ps],
            [p.top_p for p in ps],
            [p.min_p for p in ps],
        )
        noise = torch.empty_like(probs)
        noise.exponential_()
        for i, r in enumerate(rows):
            if r.generator is not None and not greedy[i]:
                noise[i].exponential_(generator=r.generator)
        drawn = (probs / noise.clamp_(min=_TINY)).nan_to_num_(nan=0.0).argmax(dim=-1)
        is_greedy = torch.tensor(greedy).to(dev)
        return torch.where(is_greedy, x.argmax(dim=-1), drawn)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, ps: list[SamplingParams], chosen: list[int | None]
    ) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """The sampled tokens' logprobs and top-k for the rows that asked."""
        want = [i for i, p in enumerate(ps) if p.logprobs is not None and chosen[i] is not None]
        out: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(ps)
        if not want:
            return out
        tokens = [int(chosen[i]) for i in want]  # type: ignore[arg-type]
        ks = [ps[i].logprobs or 0 for i in want]
        for i, entry in zip(want, Sampler._scored(raw, want, tokens, ks), strict=True):
            out[i] = entry
        return out

    @staticmethod
    def _scored(
        raw: torch.Tensor, rows: list[int], tokens: list[int], ks: list[int]
    ) -> list[tuple[float, list[tuple[int, float]]]]:
        """For each (row, token, k): the token's logprob in that row of `raw` and the row's
        top k (token, logprob), in one gather and one top-k."""
        dev = raw.device
        sub = raw.index_select(0, torch.tensor(rows, dtype=torch.long).to(dev))
        ids = torch.tensor(tokens, dtype=torch.long).to(dev)
        picked = sub.gather(1, ids[:, None]).squeeze(1).tolist()
        k = max(ks)
        tops_v: list[list[float]] = [[] for _ in rows]
        tops_i: list[list[int]] = [[] for _ in rows]
        if k:
            v, ix = sub.topk(k, dim=-1)
            tops_v, tops_i = v.tolist(), ix.tolist()
        return [
            (picked[n], list(zip(tops_i[n][:kk], tops_v[n][:kk], strict=True)))
            for n, kk in enumerate(ks)
        ]


def truncate(
    probs: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Batched min-p, top-k and top-p truncation of probabilities [B, V] (rows renormalised
    implicitly: the draw only compares ratios). Same rules as `truncated_probs`."""
    dev = probs.device
    if any(m > 0.0 for m in min_p):
        mp = torch.tensor(min_p, dtype=probs.dtype).to(dev)
        floor = mp[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = torch.where(probs < floor, torch.zeros_like(probs), probs)
    width = probs.shape[1]
    use_k = any(0 < k < width for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if not (use_k or use_p):
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    if use_k:
        ks = torch.tensor([k if 0 < k < width else width for k in top_k]).to(dev)
        kth = sorted_p.gather(1, (ks - 1)[:, None])
        sorted_p = torch.where(sorted_p < kth, torch.zeros_like(sorted_p), sorted_p)
    if use_p:
        tp = torch.tensor(top_p, dtype=probs.dtype).to(dev)
        cum = sorted_p.cumsum(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (cum - sorted_p) >= tp[:, None] * cum[:, -1:]
        drop &= (tp < 1.0)[:, None]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)


def truncated_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Probabilities of a 1-D logit row after top-k, top-p and min-p truncation (the
    one-row reference of `truncate`)."""
    probs = torch.softmax(logits, dim=-1)
    if min_p > 0.0:
        probs = torch.where(probs < min_p * probs.max(), torch.zeros_like(probs), probs)
    if top_k and top_k < probs.numel():
        kth = probs.topk(top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        cum = sorted_p.cumsum(0)
        drop = (cum - sorted_p) >= top_p * cum[-1]
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return probs / probs.sum()
