"""A runner's captured decode steps: the target model's decode graphs (their forward also
computes every row's logits into a static buffer and the greedy tokens behind them, into
`DeviceTokens.graph`), and the draft model's one-token steps. Whether to capture at all is
decided once, by the kernel plan (`KernelPlan.cuda_graphs`, the target) and the draft
head's modules; engine/cuda_graphs.py captures and replays."""

from __future__ import annotations

import logging

import torch

from moeserve.engine.cuda_graphs import DecodeGraphs, graph_blockers, padded_size
from moeserve.engine.runner_view import RunnerView
from moeserve.engine.step import StepInput
from moeserve.kernels.elementwise.tokens import resolve_placeholders
from moeserve.layers.attention.metadata import ForwardContext

log = logging.getLogger(__name__)

# int64 words of the graphs' static buffer after the largest graph's inputs, for the rest of a
# decode step's index lists (logit rows, query lengths and starts, a few appended pages per
# sequence): per row, and fixed
ROOM_PER_ROW = 8
ROOM_FIXED = 32


class CapturedDecode:
    """The graphs of one runner (none until `capture`, and none on a CPU)."""

    def __init__(self, runner: RunnerView) -> None:
        self.runner = runner
        self.graphs: DecodeGraphs | None = None
        self.logits: torch.Tensor | None = None  # what the captured LM head writes
        self.draft_graphs: DecodeGraphs | None = None
        self.draft_in: torch.Tensor | None = None  # the captured draft's hidden-state input

    def capture(self, max_batch: int) -> str:
        """Capture decode graphs up to `max_batch` rows; the banner's line."""
        r = self.runner
        plan = r.loaded.kernel_plan
        if max_batch <= 0:
            return "CUDA graphs off (--enforce-eager)"
        if not plan.cuda_graphs:  # the plan's line says which part cannot be captured
            line = next((c for c in plan.choices if c.what == "CUDA graphs"), None)
            why = f": {line.reason}" if line is not None else ""
            return f"CUDA graphs off{why}; decode runs eagerly"
        before = torch.cuda.memory_reserved(r.device)
        graphs = self.target_graphs(max_batch)
        try:
            graphs.capture()
        except RuntimeError as e:  # a host sync or allocation somewhere: serve eagerly
            log.warning("CUDA graph capture failed: %s", e)
            self.logits = None
            return f"CUDA graphs off: capture failed ({str(e).splitlines()[0][:120]})"
        r.memory = r.memory.with_graph_measured(torch.cuda.memory_reserved(r.device) - before)
        self.graphs = graphs
        if r.keep_hidden:
            self._capture_draft(max_batch)
        check = getattr(r.tp.comm, "check", None)
        if check is not None:
            check()  # a one-shot all-reduce that timed out while capturing says so here
        return graphs.status()

    def target_graphs(self, max_batch: int) -> DecodeGraphs:
        """The target model's decode graphs, not captured yet, and the static logits buffer
        their LM head writes."""
        r = self.runner
        self.logits = torch.empty(max_batch, r.vocab_size, dtype=torch.float32, device=r.device)
        return DecodeGraphs(
            self._target_forward,
            r.model,
            r.device,
            max_batch,
            r.max_rows,
            r.max_model_len,
            room=ROOM_PER_ROW * max_batch + ROOM_FIXED,
        )

    def size_for(self, step: StepInput) -> int | None:
        """The padded batch size of the graph that replays `step` (None: it runs eagerly)."""
        g = self.graphs
        if (
            g is None
            or step.draft
            or step.eager
            or step.embed_rows  # images: their embeddings replace rows of the input
            or not step.is_decode_only
            or not g.can_run(len(step.rows))
        ):
            return None
        return padded_size(len(step.rows), g.sizes)

    def _target_forward(
        self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """The captured decode forward: placeholder ids resolved from the tokens graphs read,
        metadata from the page table, the model, then every row's logits into `logits` and
        their greedy tokens into `DeviceTokens.graph` (read by the next replay's
        placeholders once this one has run): a greedy step needs no launch after the replay
        but the copy of its tokens to the host."""
        r = self.runner
        ids = resolve_placeholders(ids, r.tokens.feed_graph())
        md = r.pages.decode_metadata(positions, rows, seq_lens)
        hidden = r.model(ids, positions, ForwardContext(md))
        if self.logits is not None:
            n = ids.shape[0]
            logits = r.model.compute_logits(hidden, out=self.logits[:n])
            r.sampler.greedy_into(logits, r.tokens.graph[:n])
        return hidden

    def _capture_draft(self, max_batch: int) -> None:
        """Graphs of the draft model's one-token steps (its hidden-state input is a static
        buffer filled before each replay); the draft runs eagerly if capture fails. An
        EAGLE-3 head's modules get their own static scratch; the MTP module's is the
        target's."""
        r = self.runner
        head = r.draft
        if head is not None:
            blockers = graph_blockers(head)
            if blockers:
                log.info("draft model eager: %s cannot be captured", ", ".join(blockers))
                return
            hidden, dtype = head.config.hidden_size, head.norm.weight.dtype
        else:
            hidden = r.loaded.config.hidden_size
            dtype = r.model.model.embed_tokens.weight.dtype
        self.draft_in = torch.zeros(max_batch, hidden, dtype=dtype, device=r.device)
        graphs = DecodeGraphs(
            self._draft_forward,
            head if head is not None else r.model,
            r.device,
            max_batch,
            r.max_rows,
            r.max_model_len,
        )
        try:
            graphs.capture(prepare=head is not None)
        except RuntimeError as e:
            log.warning("CUDA graph capture of the draft model failed: %s", e)
            return
        self.draft_graphs = graphs

    def _draft_forward(
        self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """The captured draft forward of one-token rows: [normed | carried] per row."""
        r = self.runner
        md = r.pages.decode_metadata(positions, rows, seq_lens)
        normed, carried = r.drafter.forward_draft(
            ids, positions, self.draft_in[: ids.shape[0]], ForwardContext(md)
        )
        return torch.cat([normed, carried], dim=-1)
