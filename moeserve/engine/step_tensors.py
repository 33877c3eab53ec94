"""A step's index lists on the device: packed on the host into one int64 array, copied in one
piece (from pinned memory on GPUs), and read as views of that buffer (`StepTensors`).

A step that replays a decode graph is packed with its padding columns, its first four lists
[4, width] in the layout of the graphs' static input, so that its copy lands there directly;
the int32 lists (query starts, table entries) go two to a word, in the dtype their users take.
"""

from __future__ import annotations

import numpy as np
import torch

from moeserve.engine.step import StepInput, iter_page_updates

STEP_LISTS = (
    "ids", "positions", "rows", "seq_lens", "logit_rows", "query_lens", "query_start",
    "upd_rows", "upd_cols", "upd_pages", "hidden_rows", "embed_rows",
)  # fmt: skip
PINNED_MIN_WORDS = 1 << 12  # the smallest pinned staging buffer

# (first word, length, int32) of each list of `STEP_LISTS` in the packed array
Spans = list[tuple[int, int, bool]]


class StepTensors:
    """A step's index tensors on the device: views of one copied buffer, made when first read
    (a replayed decode step reads almost none of them, and each view costs host time).

    ids, positions, rows, seq_lens, logit_rows, query_lens: int64; query_start: int32 [B + 1];
    upd_rows, upd_cols (int64), upd_pages (int32): the page-table entries the step appends;
    hidden_rows: a draft step's rows of the hidden states it reads; embed_rows: the rows
    whose embeddings are an image's."""

    def __init__(self, packed: torch.Tensor, spans: Spans, staged: bool = False) -> None:
        self.packed = packed  # the whole buffer, the lists at `spans`
        self.spans = dict(zip(STEP_LISTS, spans, strict=True))
        self.staged = staged  # `packed` is the decode graphs' static input buffer

    def __getattr__(self, name: str) -> torch.Tensor:
        span = self.__dict__.get("spans", {}).get(name)
        if span is None:
            raise AttributeError(name)
        a, n, half = span
        view = (
            self.packed[a : a + (n + 1) // 2].view(torch.int32)[:n]
            if half
            else self.packed[a : a + n]
        )
        setattr(self, name, view)
        return view


def pack_step(step: StepInput, width: int, padding: tuple[int, ...]) -> tuple[np.ndarray, Spans]:
    """The step's index lists in one int64 array and where each one is. `width`: the padded
    batch of the graph that replays it (0: eager), its head lists padded to it with the
    values of `padding` (one per head list)."""
    upd_rows: list[int] = []
    upd_cols: list[int] = []
    upd_pages: list[int] = []
    for row, col, new in iter_page_updates(step.page_updates):
        upd_rows.extend([row] * len(new))
        upd_cols.extend(range(col, col + len(new)))
        upd_pages.extend(new)
    qstart = [0]
    for q in step.query_lens:
        qstart.append(qstart[-1] + q)
    head = (step.ids, step.positions, step.rows, step.seq_lens)
    tail = (
        (step.logit_rows, False),
        (step.query_lens, False),
        (qstart, True),
        (upd_rows, False),
        (upd_cols, False),
        (upd_pages, True),
        (step.hidden_rows, False),
        (step.embed_rows, False),
    )
    spans: Spans = []
    o = 0
    for part in head:
        spans.append((o, len(part), False))
        o += max(len(part), width)
    for part, half in tail:
        o += o & 1  # 16-byte aligned (Triton specialises pointer arguments on it)
        spans.append((o, len(part), half))
        o += (len(part) + 1) // 2 if half else len(part)
    host = np.empty(o, dtype=np.int64)
    pads = padding if width else (0,) * len(head)
    for (a, n, _), part, pad in zip(spans[: len(head)], head, pads, strict=True):
        host[a : a + n] = part
        if n < width:
            host[a + n : a + width] = pad
    for (a, n, half), (part, _) in zip(spans[len(head) :], tail, strict=True):
        (host[a:].view(np.int32) if half else host[a:])[:n] = part
    return host, spans


class Staging:
    """Host->device copies of int64 arrays through two pinned buffers used in turn (CUDA): the
    copy is queued without waiting for the GPU (a copy from pageable memory would wait for it
    to drain, defeating overlap), and a buffer is refilled only once its last copy has run.
    On a CPU device the array is used as it is (or copied into `out`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bufs: list[torch.Tensor | None] = [None, None]
        self.done: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def to_device(self, host: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """`host` on the device: in `out`'s first words if given, else in a new tensor."""
        if self.device.type != "cuda":
            if out is None:
                return torch.from_numpy(host)
            out[: host.size].copy_(torch.from_numpy(host))
            return out[: host.size]
        self.turn ^= 1
        i, n = self.turn, host.size
        if self.done[i] is not None:
            self.done[i].synchronize()
        buf = self.bufs[i]
        if buf is None or buf.numel() < n:
            size = max(n, 2 * (buf.numel() if buf is not None else 0), PINNED_MIN_WORDS)
            buf = self.bufs[i] = torch.empty(size, dtype=torch.int64, pin_memory=True)
        buf[:n].numpy()[:] = host
        dev = torch.empty(n, dtype=torch.int64, device=self.device) if out is None else out[:n]
        dev.copy_(buf[:n], non_blocking=True)
        event = self.done[i] = torch.cuda.Event()
        event.record()
        return dev
