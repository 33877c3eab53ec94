"""Per-forward state: the batch layout attention needs, built by the runner once per step.

Batch layout: the step's tokens of all sequences are concatenated ([T] ids and positions);
sequence b owns tokens query_start[b]:query_start[b+1]. Its cache holds seq_lens[b] tokens
after this step, of which the last query_lens[b] are new (context_lens = already cached).

The runner puts the sequences with one new token (decodes) first, then the multi-token ones
(prefill chunks): the GPU MLA path sends the leading single-token run through the decode
kernel and the rest through the prefill kernel (any order is correct, that one is fast).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: page * page_size + offset to write each new token
    block_tables: torch.Tensor  # [B, max_pages] int32, padded with 0 (never read past seq_lens)
    seq_lens: torch.Tensor  # [B] int32 tokens in the cache after this step
    query_start: torch.Tensor  # [B+1] int32 cumulative query lengths
    page_size: int
    # host copies: the CPU path loops over sequences without device syncs
    seq_lens_host: list[int]
    query_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens_host)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)

    @cached_property
    def num_decode_seqs(self) -> int:
        """How many sequences at the front of the batch have one new token each (they are
        also the first num_decode_seqs tokens)."""
        n = 0
        for q in self.query_lens_host:
            if q != 1:
                break
            n += 1
        return n

    @cached_property
    def max_prefill_query_len(self) -> int:
        """The longest query among the sequences after the leading single-token run."""
        return max(self.query_lens_host[self.num_decode_seqs :], default=0)


@dataclass
class ForwardContext:
    """Everything a forward pass needs besides token ids and positions."""

    attn: AttentionMetadata
