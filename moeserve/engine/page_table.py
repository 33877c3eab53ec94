"""The persistent page table on the device (one row per running sequence, `StepInput.rows`)
and the attention metadata derived from it: each sequence's table row, each token's cache
slot, the query starts."""

from __future__ import annotations

import torch

from moeserve.engine.step import StepInput
from moeserve.engine.step_tensors import StepTensors
from moeserve.layers.attention.metadata import AttentionMetadata

PAD_SLOT = -1  # write_mla_cache skips negative slots


class PageTable:
    """One rank's page table [rows, pages per sequence] int32; empty until `allocate`."""

    def __init__(self, page_size: int, device: torch.device) -> None:
        self.page_size = page_size
        self.device = device
        self.table = torch.zeros(0, 0, dtype=torch.int32, device=device)
        self.decode_query_start: torch.Tensor | None = None

    def allocate(self, rows: int, width: int, decode_rows: int = 0) -> None:
        """A zeroed table; with `decode_rows`, the static query starts (0, 1, 2, ...) of decode
        batches up to that size, so graphs copy nothing in for them."""
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=self.device)
        if decode_rows:
            self.decode_query_start = torch.arange(
                decode_rows + 1, dtype=torch.int32, device=self.device
            )

    def write(self, st: StepTensors) -> None:
        """The page-table entries the step appends."""
        self.table.index_put_((st.upd_rows, st.upd_cols), st.upd_pages)

    def metadata(
        self,
        positions: torch.Tensor,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        query_lens: list[int],
        seq_lens_host: list[int],
        table_width: int,
        query_start: torch.Tensor | None = None,
        query_lens_dev: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """Attention metadata on the device from the table: each sequence's table row, and
        each token's cache slot (negative for padding: seq_len 0)."""
        ps = self.page_size
        tables = self.table.index_select(0, rows)[:, :table_width]
        if all(q == 1 for q in query_lens):
            tok_tables = tables
            valid = seq_lens > 0
        else:
            counts = (
                query_lens_dev
                if query_lens_dev is not None
                else torch.tensor(query_lens, device=self.device)
            )
            tok_tables = tables.repeat_interleave(counts, dim=0, output_size=len(positions))
            valid = None
        page = tok_tables.gather(1, (positions // ps)[:, None]).squeeze(1).long()
        slots = page * ps + positions % ps
        if valid is not None:
            slots = torch.where(valid, slots, PAD_SLOT)
        if query_start is None:
            qstart = [0]
            for q in query_lens:
                qstart.append(qstart[-1] + q)
            query_start = torch.tensor(qstart, dtype=torch.int32, device=self.device)
        return AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=seq_lens.to(torch.int32),
            query_start=query_start,
            page_size=ps,
            seq_lens_host=seq_lens_host,
            query_lens_host=query_lens,
        )

    def decode_metadata(
        self, positions: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor
    ) -> AttentionMetadata:
        """A captured decode batch's metadata (one-token rows; static query starts)."""
        assert self.decode_query_start is not None
        b = positions.shape[0]
        return self.metadata(
            positions,
            rows,
            seq_lens,
            [1] * b,
            [1] * b,
            self.table.shape[1],
            query_start=self.decode_query_start[: b + 1],
        )

    def step_metadata(self, step: StepInput, st: StepTensors) -> AttentionMetadata:
        """An eager step's metadata (tables as wide as its longest sequence needs)."""
        return self.metadata(
            st.positions,
            st.rows,
            st.seq_lens,
            step.query_lens,
            step.seq_lens,
            -(-max(step.seq_lens) // self.page_size),
            query_start=st.query_start,
            query_lens_dev=st.query_lens,
        )
