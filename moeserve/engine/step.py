"""What one step asks every rank to compute: `StepInput`, built on rank 0 from the scheduler's
batch, packed into one int64 array for the broadcast to the other ranks (no torch here).

Batch-table contract (every rank keeps the same state): each running sequence owns a
persistent *row* of the page table (`rows`, < max_num_seqs), assigned when it starts running
and freed when it stops. A step carries only what changed: the pages appended to each row
since the last step (`page_updates`: row, first column, pages...), so host work and broadcast
size grow with the new tokens and pages of the step, never with the context length.

Sequences are ordered single-token rows first (decode, or a one-token prefill tail), then
multi-token (prefill) rows; attention backends rely on that order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# message kinds
STEP = 1
STOP = 2
# StepInput.draft
TARGET = 0
DRAFT_ON_TARGET = 1
DRAFT_ON_DRAFT = 2
_HEADER = 9  # kind, T, B, len(page_updates), L, eager, greedy, draft, len(embed_rows)


@dataclass
class StepInput:
    ids: list[int]  # [T] token ids of the step
    positions: list[int]  # [T]
    rows: list[int]  # [B] page-table row of each sequence
    seq_lens: list[int]  # [B] tokens in the cache after this step
    query_lens: list[int]  # [B] new tokens per sequence (single-token rows first)
    # flattened (row, first column, count, page, page, ...) records: pages appended this step
    page_updates: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)  # hidden rows whose logits are needed
    eager: bool = False  # run the eager forward even where a CUDA graph would serve (profiling)
    # overlap scheduling: every logit row is a greedy sampling row; each rank keeps their
    # argmax on the device for the next step, whose ids may then name them: id -1-j is row
    # j's token of the previous step (a placeholder)
    greedy: bool = False
    # a draft model's step (speculative decoding, method mtp): DRAFT_ON_TARGET reads the
    # hidden states of the latest target step, DRAFT_ON_DRAFT those of the latest draft step,
    # row hidden_rows[t] for token t; TARGET: the model's own step
    draft: int = 0
    hidden_rows: list[int] = field(default_factory=list)
    # token rows whose embeddings come from images (every rank replaces them); `images`, on
    # rank 0 only and not packed: (image, its first token in this step, count) per piece,
    # the pieces in the order of `embed_rows`
    embed_rows: list[int] = field(default_factory=list)
    images: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    def pack(self) -> np.ndarray:
        """One int64 array: header, then ids, positions, rows, seq_lens, query_lens,
        page_updates, logit_rows (and a draft step's hidden_rows, one per token), embed_rows."""
        t, b, p, n = len(self.ids), len(self.rows), len(self.page_updates), len(self.logit_rows)
        h = t if self.draft else 0
        e = len(self.embed_rows)
        out = np.empty(_HEADER + 2 * t + 3 * b + p + n + h + e, dtype=np.int64)
        out[:_HEADER] = (STEP, t, b, p, n, int(self.eager), int(self.greedy), self.draft, e)
        o = _HEADER
        for part in (
            self.ids,
            self.positions,
            self.rows,
            self.seq_lens,
            self.query_lens,
            self.page_updates,
            self.logit_rows,
            self.hidden_rows if self.draft else [],
            self.embed_rows,
        ):
            out[o : o + len(part)] = part
            o += len(part)
        return out

    @staticmethod
    def unpack(a: np.ndarray) -> StepInput | None:
        """The step in `a`, or None for a stop message."""
        kind, t, b, p, n, eager, greedy, draft, e = (int(v) for v in a[:_HEADER])
        if kind == STOP:
            return None
        if kind != STEP:
            raise ValueError(f"unknown step message kind {kind}")
        o = _HEADER
        parts = []
        for size in (t, t, b, b, b, p, n, t if draft else 0, e):
            parts.append(a[o : o + size].tolist())
            o += size
        *fields_, hidden_rows, embed_rows = parts
        return StepInput(
            *fields_,
            eager=bool(eager),
            greedy=bool(greedy),
            draft=draft,
            hidden_rows=hidden_rows,
            embed_rows=embed_rows,
        )


def stop_message() -> np.ndarray:
    out = np.zeros(_HEADER, dtype=np.int64)
    out[0] = STOP
    return out


def iter_page_updates(updates: list[int]):
    """(row, first column, pages) for each record of `StepInput.page_updates`."""
    i = 0
    while i < len(updates):
        row, col, cnt = updates[i], updates[i + 1], updates[i + 2]
        yield row, col, updates[i + 3 : i + 3 + cnt]
        i += 3 + cnt


class RowAllocator:
    """Rank 0's assignment of persistent page-table rows to running sequences, and what each
    row's table on the ranks holds (so only appended pages are sent)."""

    def __init__(self, num_rows: int) -> None:
        self.free = list(range(num_rows - 1, -1, -1))
        self.row_of: dict[str, int] = {}
        self.sent: dict[int, int] = {}  # row -> pages the ranks already hold

    def row(self, request_id: str) -> int:
        r = self.row_of.get(request_id)
        if r is None:
            if not self.free:
                raise RuntimeError("no free page-table row (more running sequences than rows)")
            r = self.free.pop()
            self.row_of[request_id] = r
            self.sent[r] = 0
        return r

    def release(self, request_id: str) -> None:
        r = self.row_of.pop(request_id, None)
        if r is not None:
            self.sent.pop(r, None)
            self.free.append(r)

    def truncate(self, request_id: str, num_pages: int) -> None:
        """The sequence gave back its pages past `num_pages` (rejected draft tokens): the
        next pages it takes are sent from that column on."""
        r = self.row_of.get(request_id)
        if r is not None and self.sent[r] > num_pages:
            self.sent[r] = num_pages

    def updates(self, row: int, pages: list[int], out: list[int]) -> None:
        """Append to `out` the record of the pages of `row` the ranks do not hold yet. A row's
        pages only grow while it is assigned, except where rejected draft tokens gave pages
        back (`truncate`); a preempted sequence releases its row."""
        have = self.sent[row]
        if len(pages) > have:
            new = pages[have:]
            out.extend((row, have, len(new)))
            out.extend(new)
            self.sent[row] = len(pages)
