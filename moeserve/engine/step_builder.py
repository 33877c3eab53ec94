"""A scheduled batch as one step's inputs (`StepInput`), and where each request's logits rows
are in it (`StepPlan`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.engine.scheduler import ScheduledBatch
from moeserve.engine.step import RowAllocator, StepInput


@dataclass
class StepPlan:
    """Where a step's logits rows go: batch index -> its sampling row, and its prompt-logprob
    rows (first row, the prompt positions they score)."""

    sample: dict[int, int] = field(default_factory=dict)
    prompt: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # i -> (row, start, n)
    # i -> its draft (verified on rows sample[i] .. sample[i] + len(draft))
    verify: dict[int, list[int]] = field(default_factory=dict)
    # i -> (its first token's row in the step, its first position, its token count)
    spans: dict[int, tuple[int, int, int]] = field(default_factory=dict)


def build_step(
    batch: ScheduledBatch, rows: RowAllocator, slot_of: dict[str, int] | None = None
) -> tuple[StepInput, StepPlan]:
    """The step's inputs, single-token sequences first (the attention backends' order), and
    where each sequence's logits rows are. Host work grows with the step's new tokens and
    pages, not with the sequences' lengths. `slot_of`: the in-flight step's row of each
    request whose last token is still on the GPU (it enters as a placeholder id).

    A request verifying a draft of k tokens enters as k + 1 one-token rows that share its
    page-table row, row j seeing the cache up to its own position: the decode kernels (and
    CUDA graphs) compute them, causal among themselves, exactly as decoding them one per
    step would."""
    step = StepInput([], [], [], [], [])
    plan = StepPlan()
    reqs, counts = batch.requests, batch.num_tokens
    order = [i for i, n in enumerate(counts) if n == 1]
    order += [i for i, n in enumerate(counts) if n != 1 and reqs[i].draft]
    order += [i for i, n in enumerate(counts) if n != 1 and not reqs[i].draft]
    for i in order:
        req, n = reqs[i], counts[i]
        start = req.num_computed
        t0 = len(step.ids)
        known = req.token_slice(start, min(start + n, req.num_tokens))
        step.ids.extend(known)
        row = rows.row(req.request_id)
        rows.updates(row, req.pages, step.page_updates)
        step.positions.extend(range(start, start + n))
        plan.spans[i] = (t0, start, n)
        for im in req.images:  # image tokens of this chunk (a chunk may cut an image)
            a, b = max(start, im.offset), min(start + n, im.end)
            if a < b:
                step.embed_rows.extend(range(t0 + a - start, t0 + b - start))
                step.images.append((im, a - im.offset, b - a))
        if req.draft:  # the last token, then the draft to verify, one row each
            step.ids.extend(req.draft)
            step.rows.extend([row] * n)
            step.seq_lens.extend(range(start + 1, start + n + 1))
            step.query_lens.extend([1] * n)
            plan.sample[i] = len(step.logit_rows)
            plan.verify[i] = list(req.draft)
            step.logit_rows.extend(range(t0, t0 + n))
            continue
        if len(known) < n:  # its last token is still on the GPU: a placeholder
            assert slot_of is not None, "a pending token needs the step in flight"
            step.ids.append(-1 - slot_of[req.request_id])
        step.rows.append(row)
        step.seq_lens.append(start + n)
        step.query_lens.append(n)
        if req.params.prompt_logprobs is not None and start < len(req.prompt_ids):
            # row j predicts token start+j+1; stay within the prompt
            count = min(start + n, len(req.prompt_ids) - 1) - start
            plan.prompt[i] = (len(step.logit_rows), start, max(0, count))
            step.logit_rows.extend(range(t0, t0 + max(0, count)))
        if batch.samples(i) and len(req.output_ids) + req.pending < req.max_tokens:
            plan.sample[i] = len(step.logit_rows)
            step.logit_rows.append(t0 + n - 1)
    return step, plan
