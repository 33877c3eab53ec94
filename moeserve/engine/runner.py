"""Builds a step's batch tensors, runs the model and samples (the only torch in the engine)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from moeserve.engine.cuda_graphs import DecodeGraphs, graph_blockers
from moeserve.engine.outputs import TokenLogprob
from moeserve.engine.scheduler import ScheduledBatch
from moeserve.layers.attention.metadata import AttentionMetadata, ForwardContext
from moeserve.loader.base import LoadedModel
from moeserve.sampling import Sampler

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """Per scheduled request: the sampled token (None if it did not reach its end), its
    logprob entry, and prompt logprobs for the positions computed this step."""

    tokens: list[int | None]
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: list[list[TokenLogprob | None] | None]


@dataclass
class HostBatch:
    """A step's batch layout as host lists (see layers/attention/metadata.py)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    query_lens: list[int]
    block_table: list[list[int]]  # padded with page 0 to the batch's widest row


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        device: str,
        num_pages: int,
        page_size: int,
        max_model_len: int | None = None,
        graph_max_batch: int = 0,
    ) -> None:
        """`graph_max_batch`: on a CUDA device, capture decode graphs for batches up to this
        many sequences (0: eager, as with --enforce-eager)."""
        self.model = loaded.model
        self.device = torch.device(device)
        self.page_size = page_size
        self.num_pages = num_pages
        self.eos_ids = tuple(loaded.config.eos_token_ids)
        self.sampler = Sampler()
        for layer in self.model.attention_layers():
            layer.bind_kv_cache(num_pages, page_size, loaded.kv_cache_dtype, self.device)
        self.graphs: DecodeGraphs | None = None
        self.graph_status = ""  # one line for the start-up banner ("" on a CPU)
        if self.device.type == "cuda":
            max_len = max_model_len or num_pages * page_size
            self.graph_status = self._capture(graph_max_batch, -(-max_len // page_size))
            log.info("%s", self.graph_status)

    def _capture(self, max_batch: int, max_pages: int) -> str:
        if max_batch <= 0:
            return "CUDA graphs off (--enforce-eager)"
        blockers = graph_blockers(self.model)
        if blockers:
            return f"CUDA graphs off: {', '.join(blockers)} cannot be captured; decode runs eager"
        graphs = DecodeGraphs(self.model, self.device, max_batch, max_pages, self.page_size)
        try:
            graphs.capture()
        except RuntimeError as e:  # a host sync or allocation somewhere: serve eagerly
            log.warning("CUDA graph capture failed: %s", e)
            return f"CUDA graphs off: capture failed ({str(e).splitlines()[0][:120]})"
        self.graphs = graphs
        return graphs.status()

    @staticmethod
    def kv_bytes_per_token(loaded: LoadedModel) -> int:
        return sum(
            layer.kv_cache_bytes_per_token(loaded.kv_cache_dtype)
            for layer in loaded.model.attention_layers()
        )

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)

    # ---- batch tensors ---------------------------------------------------------------------
    def _host_batch(self, batch: ScheduledBatch) -> HostBatch:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        qlens: list[int] = []
        ps = self.page_size
        for req, n in zip(batch.requests, batch.num_tokens, strict=True):
            start = req.num_computed
            toks = req.all_ids[start : start + n]
            ids.extend(toks)
            pos.extend(range(start, start + n))
            slots.extend(req.pages[p // ps] * ps + p % ps for p in range(start, start + n))
            seq_lens.append(start + n)
            qlens.append(n)
        width = max(len(r.pages) for r in batch.requests)
        table = [r.pages + [0] * (width - len(r.pages)) for r in batch.requests]
        return HostBatch(ids, pos, slots, seq_lens, qlens, table)

    def _prepare(self, hb: HostBatch) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        qstart = [0]
        for q in hb.query_lens:
            qstart.append(qstart[-1] + q)
        dev = self.device

        def t(x: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype, device=dev)

        md = AttentionMetadata(
            slot_mapping=t(hb.slots, torch.int64),
            block_tables=t(hb.block_table, torch.int32),
            seq_lens=t(hb.seq_lens, torch.int32),
            query_start=t(qstart, torch.int32),
            page_size=self.page_size,
            seq_lens_host=hb.seq_lens,
            query_lens_host=hb.query_lens,
        )
        return t(hb.ids, torch.int64), t(hb.positions, torch.int64), ForwardContext(md)

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Hidden states [T, H]: a graph replay for a decode-only batch that fits one, else
        the eager forward."""
        hb = self._host_batch(batch)
        g = self.graphs
        decode = all(q == 1 for q in hb.query_lens)
        if g is not None and decode and g.can_run(len(hb.ids), len(hb.block_table[0])):
            return g.run(hb.ids, hb.positions, hb.slots, hb.seq_lens, hb.block_table)
        ids, positions, ctx = self._prepare(hb)
        return self.model(ids, positions, ctx)

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        hidden = self._forward(batch)
        qstart = [0]
        for n in batch.num_tokens:
            qstart.append(qstart[-1] + n)

        rows: list[int] = []  # hidden rows whose logits we need for sampling
        sampling: list[int] = []  # batch indices that sample
        for i, req in enumerate(batch.requests):
            if batch.samples(i) and len(req.output_ids) < req.max_tokens:
                rows.append(qstart[i + 1] - 1)
                sampling.append(i)

        tokens: list[int | None] = [None] * len(batch.requests)
        lps: list[TokenLogprob | None] = [None] * len(batch.requests)
        if rows:
            logits = self.model.compute_logits(hidden[rows])
            reqs = [batch.requests[i] for i in sampling]
            res = self.sampler(
                logits,
                [r.params for r in reqs],
                [r.request_id for r in reqs],
                [r.prompt_ids for r in reqs],
                [r.output_ids for r in reqs],
                self.eos_ids,
            )
            for j, i in enumerate(sampling):
                tokens[i] = res.token_ids[j]
                if res.logprobs[j] is not None:
                    lp, top = res.logprobs[j]
                    lps[i] = TokenLogprob(res.token_ids[j], lp, top)
        prompt_lps = self._prompt_logprobs(batch, hidden, qstart)
        return StepResult(tokens, lps, prompt_lps)

    def _prompt_logprobs(
        self, batch: ScheduledBatch, hidden: torch.Tensor, qstart: list[int]
    ) -> list[list[TokenLogprob | None] | None]:
        """Logprob of each prompt token given what precedes it (None for the first)."""
        out: list[list[TokenLogprob | None] | None] = []
        for i, req in enumerate(batch.requests):
            k = req.params.prompt_logprobs
            start, n = req.num_computed, batch.num_tokens[i]
            if k is None or start >= len(req.prompt_ids):
                out.append(None)
                continue
            entries: list[TokenLogprob | None] = [None] if start == 0 else []
            # row j predicts token start+j+1; stay within the prompt
            last = min(start + n, len(req.prompt_ids) - 1)
            if last > start:
                h = hidden[qstart[i] : qstart[i] + (last - start)]
                logp = torch.log_softmax(self.model.compute_logits(h), dim=-1)
                targets = torch.tensor(req.prompt_ids[start + 1 : last + 1], device=logp.device)
                chosen = logp.gather(1, targets[:, None]).squeeze(1).tolist()
                if k:
                    tv, ti = logp.topk(k, dim=-1)
                    tops = [
                        list(zip(a, b, strict=True))
                        for a, b in zip(ti.tolist(), tv.tolist(), strict=True)
                    ]
                else:
                    tops = [[] for _ in chosen]
                for tok, lp, top in zip(targets.tolist(), chosen, tops, strict=True):
                    entries.append(TokenLogprob(tok, lp, top))
            out.append(entries)
        return out
