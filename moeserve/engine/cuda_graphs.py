"""CUDA-graph capture and replay of decode steps (the runner's GPU path).

Captured: the runner's decode forward (ids, positions, page-table rows, seq_lens -> hidden
states; the attention metadata is derived inside the graph from the runner's persistent page
table) of a decode-only batch, once per padded batch size of `capture_sizes`, all into one
graph memory pool, largest first (the smaller graphs reuse its blocks). The runner's forward
also computes every row's logits into one static buffer and their greedy tokens behind them
(a greedy step then launches nothing after the replay but the copy of its tokens to the
host); other sampling, and prefill / mixed / larger batches stay eager.

Static inputs: one flat int64 buffer, `staged`; the graph of size P reads its first 4 * P words
as [4, P] (ids, positions, rows, seq_lens), so a step's index lists, packed on the host in
that layout with the padding columns, reach it in one host->device copy (its other lists
follow in the room after them). A batch of b sequences pads to the next captured size with
harmless columns (`padding_column`): the padding row of the page table (all zeros, never
written), position 0 and seq_len 0, so the slot is negative (write_mla_cache skips it) and
mla_decode reads no cache row for them; their hidden rows are computed and dropped.

Only models in which no module declares `supports_cuda_graph = False` are captured (the
Triton MLA decode and the fused NVFP4 MoE are capturable; torch paths that loop over
host-side lengths or experts are not). Before capture, modules with `prepare_cuda_graph`
allocate their static scratch (MLA split-KV partials, split-K GEMM workspace, the absorbed
MLA weight), and an eager warm-up forward of each size, on the capture stream, does the
once-only work (the NVFP4 decode probe, which synchronises; Triton compilation for that
shape) outside the capture.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from torch import nn

log = logging.getLogger(__name__)

NUM_INPUTS = 4  # ids, positions, rows, seq_lens


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8, and max_batch itself (so
    every batch up to it pads by less than 8 rows, or to the next power of two below 8)."""
    if max_batch < 1:
        return []
    sizes = {s for s in (1, 2, 4) if s <= max_batch} | set(range(8, max_batch + 1, 8))
    return sorted(sizes | {max_batch})


def padded_size(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size >= batch (sizes ascending); None if batch exceeds them."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


def graph_blockers(model: nn.Module) -> list[str]:
    """Class names of the modules that declare they cannot be captured."""
    return sorted(
        {type(m).__name__ for m in model.modules() if not getattr(m, "supports_cuda_graph", True)}
    )


def padding_column(pad_row: int) -> tuple[int, int, int, int]:
    """A padding column's (id, position, row, seq_len)."""
    return (0, 0, pad_row, 0)


DecodeForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecodeGraphs:
    """One captured decode forward per size in `sizes`, sharing static inputs and a pool."""

    def __init__(
        self,
        forward: DecodeForward,
        model: nn.Module,
        device: torch.device,
        max_batch: int,
        pad_row: int,
        max_context: int,
        room: int = 0,
    ) -> None:
        """`forward(ids, positions, rows, seq_lens)`: the decode forward to capture;
        `model`: whose modules get `prepare_cuda_graph`; `pad_row`: the page-table row of
        padding columns; `room`: int64 words of `staged` after the largest graph's inputs."""
        self.room = room
        self.forward = forward
        self.model = model
        self.device = device
        self.sizes = capture_sizes(max_batch)
        self.pad_row = pad_row
        self.max_context = max_context
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays: Counter[int] = Counter()  # padded size -> replays (tests, metrics)
        self.capture_seconds = 0.0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def allocate_inputs(self) -> None:
        """The static input buffer, and the padding columns `run` fills from."""
        n = self.max_batch
        column = torch.tensor(padding_column(self.pad_row), dtype=torch.int64)
        self.padding = column[:, None].repeat(1, n).to(self.device)
        self.staged = torch.zeros(NUM_INPUTS * n + self.room, dtype=torch.int64, device=self.device)

    def inputs_of(self, size: int) -> torch.Tensor:
        """The static inputs the graph of `size` reads: [4, size], the first 4 * size words of
        `staged`."""
        return self.staged[: NUM_INPUTS * size].view(NUM_INPUTS, size)

    def _run_forward(self, size: int) -> torch.Tensor:
        ids, pos, rows, lens = self.inputs_of(size)
        return self.forward(ids, pos, rows, lens)

    @torch.inference_mode()
    def capture(self, prepare: bool = True) -> None:
        """Capture every size. `prepare=False`: the modules' static scratch already exists
        (a second set of graphs over the same model must not replace the buffers the first
        set's graphs read)."""
        t0 = time.perf_counter()
        self.allocate_inputs()
        shared: dict = {}  # scratch that layers of a kind share
        for m in self.model.modules() if prepare else ():
            hook = getattr(m, "prepare_cuda_graph", None)
            if hook is not None:
                hook(self.max_batch, self.max_context, shared)
        pool = torch.cuda.graph_pool_handle()
        # warm up on the capture stream (torch's recipe: per-stream lazy state is set up then)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for size in reversed(self.sizes):
            with torch.cuda.stream(stream):
                self.inputs_of(size).copy_(self.padding[:, :size])  # all padding columns
                self._run_forward(size)  # warm-up: probe, compilation, lazy state
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self._run_forward(size)
            self.graphs[size], self.outputs[size] = graph, out
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0

    def can_run(self, batch: int) -> bool:
        return bool(self.graphs) and batch <= self.max_batch

    @torch.inference_mode()
    def run(self, inputs: torch.Tensor) -> torch.Tensor:
        """Replay the decode forward of b sequences given as one int64 [4, b] device tensor
        (ids, positions, rows, seq_lens), copied into the static inputs with padding
        columns; see `replay`."""
        b = inputs.shape[1]
        static = self.inputs_of(self._size(b))
        static[:, :b].copy_(inputs)
        if static.shape[1] > b:
            static[:, b:].copy_(self.padding[:, b : static.shape[1]])
        return self.replay(b)

    @torch.inference_mode()
    def replay(self, b: int) -> torch.Tensor:
        """Replay the decode forward of b sequences whose inputs, padding columns included,
        are in place (`inputs_of` the padded size); hidden states [b, H], a view of the
        graph's output: valid until the next replay."""
        size = self._size(b)
        self.graphs[size].replay()
        self.replays[size] += 1
        return self.outputs[size][:b]

    def _size(self, b: int) -> int:
        size = padded_size(b, self.sizes)
        assert size is not None and size in self.graphs, f"no graph for a batch of {b}"
        return size

    def status(self) -> str:
        return (
            f"CUDA graphs on: {len(self.graphs)} decode batch sizes "
            f"({self.sizes[0]}-{self.max_batch}), captured in {self.capture_seconds:.1f}s"
        )
