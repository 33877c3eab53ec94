"""CUDA-graph capture and replay of decode steps (the runner's GPU path).

Captured: the model forward (ids, positions, attention metadata -> hidden states) of a
decode-only batch (one new token per sequence), once per padded batch size of
`capture_sizes`, all into one graph memory pool, largest first (the smaller graphs reuse its
blocks). Logits, sampling, and prefill / mixed / larger batches stay eager.

Static inputs: ids, positions and slots ([3, max_batch] int64), seq_lens ([max_batch] int32)
and block tables ([max_batch, max_pages] int32); the graph of size P reads their first P rows.
A batch of b sequences pads to the next captured size. Padding rows are harmless without a
reserved page: slot -1 (write_mla_cache skips negative slots) and seq_len 0 (mla_decode reads
no cache row for them and outputs zeros), so they neither write nor read the KV cache; their
hidden rows are computed and dropped. Block-table entries past a sequence's pages may hold
stale page ids from earlier steps: the kernels never read past seq_lens.

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
from collections.abc import Sequence

import torch
from torch import nn

from moeserve.layers.attention.metadata import AttentionMetadata, ForwardContext

log = logging.getLogger(__name__)

PAD_SLOT = -1  # write_mla_cache skips negative slots
PAD_SEQ_LEN = 0  # mla_decode reads nothing and writes zeros for an empty sequence


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


def pad_rows(
    ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int], size: int
) -> tuple[list[list[int]], list[int]]:
    """([ids, positions, slots] and seq_lens) padded to `size` rows with harmless values."""
    pad = size - len(ids)
    if pad < 0:
        raise ValueError(f"batch of {len(ids)} does not fit a graph of {size}")
    rows = [ids + [0] * pad, positions + [0] * pad, slots + [PAD_SLOT] * pad]
    return rows, seq_lens + [PAD_SEQ_LEN] * pad


def graph_blockers(model: nn.Module) -> list[str]:
    """Class names of the modules that declare they cannot be captured."""
    return sorted(
        {type(m).__name__ for m in model.modules() if not getattr(m, "supports_cuda_graph", True)}
    )


class DecodeGraphs:
    """One captured decode forward per size in `sizes`, sharing static inputs and a pool."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        max_batch: int,
        max_pages: int,
        page_size: int,
    ) -> None:
        self.model = model
        self.device = device
        self.sizes = capture_sizes(max_batch)
        self.max_pages = max_pages
        self.page_size = page_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.contexts: dict[int, ForwardContext] = {}
        self.replays: Counter[int] = Counter()  # padded size -> replays (tests, metrics)
        self.capture_seconds = 0.0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def allocate_inputs(self) -> None:
        """The static input buffers, holding padding rows."""
        n, dev = self.max_batch, self.device
        self.inputs = torch.zeros(3, n, dtype=torch.int64, device=dev)  # ids, positions, slots
        self.inputs[2].fill_(PAD_SLOT)
        self.seq_lens = torch.full((n,), PAD_SEQ_LEN, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, self.max_pages, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=dev)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        n, dev = self.max_batch, self.device
        self.allocate_inputs()
        shared: dict = {}  # scratch that all layers of one kind share
        for m in self.model.modules():
            hook = getattr(m, "prepare_cuda_graph", None)
            if hook is not None:
                hook(n, self.max_pages * self.page_size, shared)
        pool = torch.cuda.graph_pool_handle()
        # warm up on the capture stream (torch's recipe: per-stream lazy state is set up then)
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        for size in reversed(self.sizes):
            ctx = self.context(size)
            ids, positions = self.inputs[0, :size], self.inputs[1, :size]
            with torch.cuda.stream(stream):
                self.model(ids, positions, ctx)  # warm-up: probe, compilation, lazy state
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self.model(ids, positions, ctx)
            self.graphs[size], self.outputs[size], self.contexts[size] = graph, out, ctx
        torch.cuda.synchronize(dev)
        self.capture_seconds = time.perf_counter() - t0

    def context(self, size: int) -> ForwardContext:
        """The attention metadata of the graph of `size`: views of the static inputs."""
        md = AttentionMetadata(
            slot_mapping=self.inputs[2, :size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start=self.query_start[: size + 1],
            page_size=self.page_size,
            # host copies are not read on the captured (kernel) path; they describe the shape
            seq_lens_host=[PAD_SEQ_LEN] * size,
            query_lens_host=[1] * size,
        )
        return ForwardContext(md)

    def can_run(self, batch: int, table_width: int) -> bool:
        return bool(self.graphs) and batch <= self.max_batch and table_width <= self.max_pages

    @torch.inference_mode()
    def run(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        block_table: list[list[int]],
    ) -> torch.Tensor:
        """Replay the decode forward of len(ids) sequences; hidden states [b, H]. The rows
        are a view of the graph's output: valid until the next replay."""
        b = len(ids)
        size = padded_size(b, self.sizes)
        assert size is not None and size in self.graphs, f"no graph for a batch of {b}"
        rows, lens = pad_rows(ids, positions, slots, seq_lens, size)
        self.inputs[:, :size].copy_(torch.tensor(rows, dtype=torch.int64))
        self.seq_lens[:size].copy_(torch.tensor(lens, dtype=torch.int32))
        width = len(block_table[0])
        self.block_tables[:b, :width].copy_(torch.tensor(block_table, dtype=torch.int32))
        self.graphs[size].replay()
        self.replays[size] += 1
        return self.outputs[size][:b]

    def status(self) -> str:
        return (
            f"CUDA graphs on: {len(self.graphs)} decode batch sizes "
            f"({self.sizes[0]}-{self.max_batch}), captured in {self.capture_seconds:.1f}s"
        )
