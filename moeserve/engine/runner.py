"""One rank's executor of steps: KV cache, persistent page table, CUDA graphs, the forward and
the logits (the only torch in the engine besides sampling).

Every rank of a tensor-parallel group holds a `ModelRunner` and runs the same `StepInput`s in
the same order (their collectives pair up); rank 0 also schedules, and samples with the
runner's `sampler` (every rank samples the greedy tokens of overlapped steps). Start-up is
collective too: the KV cache is sized on every rank from its own free memory and the
smallest page count wins, and graphs are captured in the same order everywhere.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from moeserve.config import EngineConfig
from moeserve.engine.cuda_graphs import (
    NUM_INPUTS,
    DecodeGraphs,
    graph_blockers,
    padded_size,
    padding_column,
)
from moeserve.engine.memory import MemoryPlan, plan_kv_pages
from moeserve.engine.step import DRAFT_ON_TARGET, StepInput, iter_page_updates
from moeserve.kernels.elementwise.tokens import resolve_placeholders
from moeserve.layers.attention.metadata import AttentionMetadata, ForwardContext
from moeserve.loader.base import LoadedModel
from moeserve.models.eagle3 import capture_aux_hidden
from moeserve.multimodal.cache import EncoderCache
from moeserve.multimodal.inputs import ImageInput
from moeserve.multimodal.kimi import MediaProcessorConfig, largest_image_grid
from moeserve.parallel.groups import SINGLE, TPGroup
from moeserve.sampling import Sampler

log = logging.getLogger(__name__)

PAD_SLOT = -1  # write_mla_cache skips negative slots
# CPU steps of this many tokens or more run with `prefill_threads`: measured on 2 cores,
# a 4k-token prompt prefills at 271 tok/s with the server's 1 thread and ~500 with 2
PREFILL_STEP_TOKENS = 64


_STEP_LISTS = (
    "ids", "positions", "rows", "seq_lens", "logit_rows", "query_lens", "query_start",
    "upd_rows", "upd_cols", "upd_pages", "hidden_rows", "embed_rows",
)  # fmt: skip


class StepTensors:
    """A step's index tensors on the device: views of one copied buffer, made when first read
    (a replayed decode step reads almost none of them, and each view costs host time).

    ids, positions, rows, seq_lens, logit_rows, query_lens: int64; query_start: int32 [B + 1];
    upd_rows, upd_cols (int64), upd_pages (int32): the page-table entries the step appends;
    hidden_rows: a draft step's rows of the hidden states it reads; embed_rows: the rows
    whose embeddings are an image's."""

    def __init__(
        self, packed: torch.Tensor, spans: list[tuple[int, int, bool]], staged: bool = False
    ) -> None:
        self.packed = packed  # the whole buffer, the lists at `spans` (first word, length, int32)
        self.spans = dict(zip(_STEP_LISTS, spans, strict=True))
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


class Staging:
    """Host->device copies of int64 arrays through two pinned buffers used in turn (CUDA): the
    copy is queued without waiting for the GPU, and a buffer is refilled only once its last
    copy has run. On a CPU device the array is used as it is (or copied into `out`)."""

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
            size = max(n, 2 * (buf.numel() if buf is not None else 0), 1 << 12)
            buf = self.bufs[i] = torch.empty(size, dtype=torch.int64, pin_memory=True)
        buf[:n].numpy()[:] = host
        dev = torch.empty(n, dtype=torch.int64, device=self.device) if out is None else out[:n]
        dev.copy_(buf[:n], non_blocking=True)
        event = self.done[i] = torch.cuda.Event()
        event.record()
        return dev


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        device: torch.device | str,
        tp: TPGroup = SINGLE,
    ) -> None:
        self.config = config
        self.loaded = loaded
        self.model = loaded.model
        self.device = torch.device(device)
        self.tp = tp
        self.page_size = config.cache.page_size
        self.kv_dtype = loaded.kv_cache_dtype
        self.vocab_size = loaded.config.vocab_size
        # ids that may be sampled: the tokenizer's (DeepSeek/Kimi pad the LM head beyond it)
        self.vocab_limit = min(
            self.vocab_size, getattr(loaded.tokenizer, "vocab_size", None) or self.vocab_size
        )
        # on every rank: the next step's placeholder ids name the greedy tokens it keeps
        eos_ids = tuple(sorted(set(loaded.config.eos_token_ids)))
        self.sampler = Sampler(self.vocab_limit, eos_ids, self.device)
        self._fed_tokens = self.sampler.device_tokens()  # the last step's placeholder tokens
        model_len = loaded.config.context_len(config.scheduler.max_model_len)
        self.max_rows = config.scheduler.max_num_seqs
        # the captured decode reads placeholder tokens here (a fixed address): a greedy step's
        # tokens are copied in after its LM head, off the path to the next replay
        # (a graph's rows: up to its largest batch, which verify rows may take past max_rows)
        graph_rows = max(1, self.max_rows, config.graph_max_batch(str(self.device)))
        self._graph_tokens = torch.zeros(graph_rows, dtype=torch.int64, device=self.device)
        self._graph_tokens_of: torch.Tensor | None = None  # the tokens it holds
        # a replay's copy of `_graph_tokens` as it found them (its own tokens replace them):
        # what an eager rerun of that step resolves its placeholders from
        self._graph_fed = torch.zeros_like(self._graph_tokens)
        # a captured decode step also computes its logits into this static buffer and, behind
        # them, its greedy tokens into `_graph_tokens` (allocated with the graphs)
        self._graph_logits: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None
        # the draft model: an EAGLE-3 head (a module of its own, `loaded.draft`) or the
        # target's MTP module (the target model drafts through `forward_draft`)
        self.draft = loaded.draft
        self.drafter = self.draft if self.draft is not None else self.model
        # a draft model's inputs: the latest target step's final hidden states (EAGLE-3: its
        # aux layers' hidden states) and the latest draft step's own
        self.keep_hidden = self.draft is not None or getattr(self.model, "mtp", None) is not None
        self.aux_hidden = self._aux_buffer() if self.draft is not None else None
        self.last_hidden: torch.Tensor | None = None
        self.last_draft_hidden: torch.Tensor | None = None
        self.draft_graphs: DecodeGraphs | None = None
        self._staging = Staging(self.device)
        self.encoder_cache = EncoderCache()  # images' embeddings by content (rank 0)
        native = self._native_threads()
        # before the profiling step below; none where the native kernels do the heavy work
        self.prefill_threads = None if native else self._prefill_threads()
        self.memory = self._plan_memory(loaded, model_len)
        self.num_pages = self.memory.kv_pages
        self.max_model_len = min(model_len, self.num_pages * self.page_size)
        self.max_pages_per_seq = -(-self.max_model_len // self.page_size)
        self._bind_cache(self.num_pages)
        # row max_rows is the padding row of graph replays: all zeros, never written
        self.block_table = torch.zeros(
            self.max_rows + 1, self.max_pages_per_seq, dtype=torch.int32, device=self.device
        )
        # a decode batch's query starts (0, 1, 2, ...): static, so graphs copy nothing in
        self._decode_query_start = torch.arange(
            max(self.max_rows, config.graph_max_batch(str(self.device))) + 1,
            dtype=torch.int32,
            device=self.device,
        )
        self.graph_status = ""  # one line for the start-up banner ("" on a CPU)
        self.warm_up_status = ""
        if self.device.type == "cuda":
            self.warm_up_status = self._warm_up()
            log.info("%s", self.warm_up_status)
            self.graph_status = self._capture(config.graph_max_batch(str(self.device)))
            log.info("%s", self.graph_status)

    # ---- start-up ----------------------------------------------------------------------------
    def _native_threads(self) -> bool:
        """Where the native CPU kernels serve (returns True) they run on their own pool, the
        rank's share of all cores (it shares cores with other work without waiting for it:
        kernels/cpu), for every step; torch, left with the glue between them, runs on one
        thread whatever --threads says (its OpenMP workers spin for milliseconds after each
        parallel op, taking a core from the pool: measured 2 threads each, a decode ran at 0.6x
        of torch on 1)."""
        if self.device.type != "cpu" or not self.loaded.kernel_plan.cpu_native:
            return False
        from moeserve.kernels import cpu as cpu_kernels

        share = self.config.load.prefill_threads or max(1, (os.cpu_count() or 1) // self.tp.size)
        cpu_kernels.set_threads(share)
        torch.set_num_threads(1)
        return True

    def _prefill_threads(self) -> int | None:
        """Torch threads for CPU steps of PREFILL_STEP_TOKENS or more (None: no change)."""
        if self.device.type != "cpu":
            return None
        n = self.config.load.prefill_threads or max(1, (os.cpu_count() or 1) // self.tp.size)
        return None if n == torch.get_num_threads() else n

    def _aux_buffer(self) -> torch.Tensor:
        """EAGLE-3: the buffer the target's aux layers write the hidden states entering them
        to (one row per token of the largest step or captured batch), which the head reads."""
        cfg = self.config
        rows = max(cfg.scheduler.max_num_batched_tokens, cfg.graph_max_batch(str(self.device)))
        width = len(self.draft.aux_layer_ids) * self.loaded.config.hidden_size
        buf = torch.zeros(rows, width, dtype=self.draft.fc.weight.dtype, device=self.device)
        capture_aux_hidden(self.model, self.draft.aux_layer_ids, buf)
        return buf

    def _cache_layers(self) -> list[tuple[torch.nn.Module, torch.dtype]]:
        """Every attention layer with its cache dtype: the model's (with its MTP module) in the
        model's, an EAGLE-3 head's in its own; all on the same pages and page table."""
        out = [(layer, self.kv_dtype) for layer in self.model.attention_layers()]
        if self.draft is not None:
            out += [(layer, self.draft.kv_cache_dtype) for layer in self.draft.attention_layers()]
        return out

    def kv_bytes_per_token(self) -> int:
        return sum(layer.kv_cache_bytes_per_token(dtype) for layer, dtype in self._cache_layers())

    def _bind_cache(self, num_pages: int) -> None:
        for layer, dtype in self._cache_layers():
            layer.bind_kv_cache(num_pages, self.page_size, dtype, self.device)
        if self.device.type == "cpu":
            # zeros from calloc are not resident until written: write them now, so the
            # process holds its whole cache from the start (its RSS then stays flat as
            # requests touch new pages, and memory that is not there fails at start-up)
            for cache in self._cache_tensors():
                cache.zero_()

    def _cache_tensors(self) -> list[torch.Tensor]:
        """Every attention layer's KV-cache tensors."""
        out = []
        for layer, _ in self._cache_layers():
            for name in ("kv_cache", "k_cache", "v_cache"):
                cache = getattr(layer, name, None)
                if isinstance(cache, torch.Tensor):
                    out.append(cache)
        return out

    def _plan_memory(self, loaded: LoadedModel, model_len: int) -> MemoryPlan:
        """Pages of the KV cache on this rank, the smallest over the group."""
        cfg = self.config
        per_token = self.kv_bytes_per_token()
        want_tokens = cfg.scheduler.max_num_seqs * model_len
        if self.device.type == "cuda":
            plan = self._profile_gpu(per_token, want_tokens)
        else:
            plan = plan_kv_pages(
                budget_bytes=int(
                    min(
                        _available_ram() * cfg.cache.cpu_memory_fraction,
                        cfg.cache.cpu_max_kv_gib * (1 << 30),
                    )
                ),
                kv_bytes_per_token=per_token,
                page_size=self.page_size,
                want_tokens=want_tokens,
                num_pages=cfg.cache.num_pages,
            )
        pages = self.tp.min_int(plan.kv_pages)
        if pages != plan.kv_pages:
            plan = plan.with_pages(pages)
        return plan

    @torch.inference_mode()
    def _profile_gpu(self, per_token: int, want_tokens: int) -> MemoryPlan:
        """Weights as loaded, the activation peak of the largest eager prefill step and of the
        largest decode batch (what a captured graph's pool holds), then the rest of the
        memory budget to the KV cache."""
        cfg, dev = self.config, self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated(dev)
        tokens = cfg.scheduler.max_num_batched_tokens
        decode_batch = max(1, cfg.graph_max_batch(str(dev)))
        scratch_pages = -(-tokens // self.page_size) + decode_batch + 1
        self._bind_cache(scratch_pages)
        self.block_table = torch.zeros(
            decode_batch + 1, -(-tokens // self.page_size), dtype=torch.int32, device=dev
        )
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        # one prefill of `tokens` tokens, then `decode_batch` one-token sequences
        n_pages = -(-tokens // self.page_size)
        self.block_table[0, :n_pages] = torch.arange(n_pages, dtype=torch.int32, device=dev)
        logit_rows = min(tokens, cfg.scheduler.max_num_seqs)
        prefill = StepInput(
            ids=[0] * tokens,
            positions=list(range(tokens)),
            rows=[0],
            seq_lens=[tokens],
            query_lens=[tokens],
            logit_rows=list(range(tokens - logit_rows, tokens)),
        )
        self.execute_model(prefill)
        torch.cuda.synchronize(dev)
        prefill_peak = torch.cuda.max_memory_allocated(dev) - base
        torch.cuda.reset_peak_memory_stats(dev)
        rows = list(range(1, decode_batch + 1))
        self.block_table[1:, 0] = torch.arange(
            n_pages, n_pages + decode_batch, dtype=torch.int32, device=dev
        )
        decode = StepInput(
            ids=[0] * decode_batch,
            positions=[0] * decode_batch,
            rows=rows,
            seq_lens=[1] * decode_batch,
            query_lens=[1] * decode_batch,
            logit_rows=list(range(decode_batch)),
        )
        self.execute_model(decode)
        torch.cuda.synchronize(dev)
        decode_peak = torch.cuda.max_memory_allocated(dev) - base
        prefill_peak = self._profile_images(base, prefill_peak)
        self._bind_cache(0)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        # memory held outside this process's torch allocator (CUDA context, NCCL, other
        # processes on the GPU): counted against the budget as it is now
        outside = total - free - torch.cuda.memory_reserved(dev)
        graph_reserve = decode_peak if cfg.graph_max_batch(str(dev)) else 0
        budget = int(total * cfg.cache.gpu_memory_utilization)
        return plan_kv_pages(
            budget_bytes=budget - outside - weights - prefill_peak - graph_reserve,
            kv_bytes_per_token=per_token,
            page_size=self.page_size,
            want_tokens=want_tokens,
            num_pages=cfg.cache.num_pages,
            total_bytes=total,
            utilization=cfg.cache.gpu_memory_utilization,
            weights_bytes=weights,
            activation_bytes=prefill_peak,
            graph_bytes=graph_reserve,
            other_bytes=outside,
        )

    @torch.inference_mode()
    def _warm_up(self) -> str:
        """Run the step shapes the JIT kernels specialise on once, before serving: prefill
        chunks of 1 to the token budget (powers of two and one past them: Triton specialises
        integer arguments on ==1 and divisibility by 16, and the kernels pick their tiles
        by size), one chunk after cached context, and a mixed decode + prefill step. Without
        it the first request of each new shape waits ~0.5-1 s for a compilation. The steps
        write into KV pages no request owns yet; the page-table rows are cleared after."""
        t0 = time.perf_counter()
        ps = self.page_size
        budget = min(
            self.config.scheduler.max_num_batched_tokens,
            self.max_model_len,
            (self.num_pages - self.max_rows - 1) * ps,
        )
        if budget < 2:
            return "kernel warm-up skipped (no room in the KV cache)"
        sizes = {budget}
        for p in range(budget.bit_length()):
            sizes |= {n for n in (1 << p, (1 << p) + 1) if n <= budget}
        pages = -(-budget // ps)
        self.block_table[0, :pages] = torch.arange(pages, dtype=torch.int32, device=self.device)
        vocab = self.vocab_limit
        for n in sorted(sizes):
            self.execute_model(_prefill_step(0, n, 0, vocab))
        context = min(ps, budget // 2)  # a later chunk: attention over cached context too
        self.execute_model(_prefill_step(0, budget - context, context, vocab))
        decode = min(self.max_rows, 4)  # one-token rows first, then a prefill chunk
        rows = list(range(1, decode + 1))
        self.block_table[1 : decode + 1, 0] = torch.arange(
            pages, pages + decode, dtype=torch.int32, device=self.device
        )
        chunk = min(17, budget - decode)
        self.execute_model(
            StepInput(
                ids=_varied_ids(decode + chunk, vocab),
                positions=[0] * decode + list(range(chunk)),
                rows=rows + [0],
                seq_lens=[1] * decode + [chunk],
                query_lens=[1] * decode + [chunk],
                logit_rows=list(range(decode)) + [decode + chunk - 1],
            )
        )
        torch.cuda.synchronize(self.device)
        self.block_table.zero_()
        for cache in self._cache_tensors():  # serving starts from an empty cache
            cache.zero_()
        return (
            f"kernels warmed up for {len(sizes) + 2} prefill shapes (1-{budget} tokens) in "
            f"{time.perf_counter() - t0:.1f}s"
        )

    def _capture(self, max_batch: int) -> str:
        if max_batch <= 0:
            return "CUDA graphs off (--enforce-eager)"
        blockers = graph_blockers(self.model)
        if blockers:
            return f"CUDA graphs off: {', '.join(blockers)} cannot be captured; decode runs eager"
        before = torch.cuda.memory_reserved(self.device)
        graphs = self._decode_graphs(max_batch)
        try:
            graphs.capture()
        except RuntimeError as e:  # a host sync or allocation somewhere: serve eagerly
            log.warning("CUDA graph capture failed: %s", e)
            self._graph_logits = None
            return f"CUDA graphs off: capture failed ({str(e).splitlines()[0][:120]})"
        self.memory = self.memory.with_graph_measured(
            torch.cuda.memory_reserved(self.device) - before
        )
        self.graphs = graphs
        if self.keep_hidden:
            self._capture_draft(max_batch)
        check = getattr(self.tp.comm, "check", None)
        if check is not None:
            check()  # a one-shot all-reduce that timed out while capturing says so here
        return graphs.status()

    def _decode_graphs(self, max_batch: int) -> DecodeGraphs:
        """The model's decode graphs (not captured yet). Their static buffer has room for the
        rest of a decode step's index lists (logit rows, query lengths and starts, a few
        appended pages per sequence), which then come in the same copy. The static logits
        buffer their LM head writes is allocated here too."""
        self._graph_logits = torch.empty(
            max_batch, self.vocab_size, dtype=torch.float32, device=self.device
        )
        return DecodeGraphs(
            self._graph_forward,
            self.model,
            self.device,
            max_batch,
            self.max_rows,
            self.max_model_len,
            room=8 * max_batch + 32,
        )

    def _capture_draft(self, max_batch: int) -> None:
        """Graphs of the draft model's one-token steps (its hidden-state input is a static
        buffer filled before each replay); the draft runs eagerly if capture fails. An
        EAGLE-3 head's modules get their own static scratch; the MTP module's is the
        target's."""
        head = self.draft
        if head is not None:
            blockers = graph_blockers(head)
            if blockers:
                log.info("draft model eager: %s cannot be captured", ", ".join(blockers))
                return
            hidden, dtype = head.config.hidden_size, head.norm.weight.dtype
        else:
            hidden = self.loaded.config.hidden_size
            dtype = self.model.model.embed_tokens.weight.dtype
        self._draft_in = torch.zeros(max_batch, hidden, dtype=dtype, device=self.device)
        graphs = DecodeGraphs(
            self._draft_graph_forward,
            head if head is not None else self.model,
            self.device,
            max_batch,
            self.max_rows,
            self.max_model_len,
        )
        try:
            graphs.capture(prepare=head is not None)
        except RuntimeError as e:
            log.warning("CUDA graph capture of the draft model failed: %s", e)
            return
        self.draft_graphs = graphs

    def _draft_graph_forward(
        self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """The captured draft forward of one-token rows: [normed | carried] per row."""
        md = self._decode_metadata(positions, rows, seq_lens)
        normed, carried = self.drafter.forward_draft(
            ids, positions, self._draft_in[: ids.shape[0]], ForwardContext(md)
        )
        return torch.cat([normed, carried], dim=-1)

    # ---- one step ----------------------------------------------------------------------------
    def _tensors(self, step: StepInput, graph_size: int | None = None) -> StepTensors:
        """The step's index lists in one host->device copy (from pinned memory on GPUs: a copy
        from pageable memory would wait for the GPU to drain, defeating overlap), and the
        page-table rows it appends written on the device. A step that replays the graph of
        `graph_size` is packed with its padding columns straight into the graphs' static
        inputs where it fits (`StepTensors.staged`)."""
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
        # the graphs' inputs [4, width] first (each list padded to the graph's size), then
        # the rest; the int32 lists (query starts, table entries) two to a word, in the dtype
        # their users take
        head = (step.ids, step.positions, step.rows, step.seq_lens)
        width = graph_size or 0
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
        spans = []  # (first word, length, int32)
        o = 0
        for part in head:
            spans.append((o, len(part), False))
            o += max(len(part), width)
        for part, half in tail:
            o += o & 1  # 16-byte aligned (Triton specialises pointer arguments on it)
            spans.append((o, len(part), half))
            o += (len(part) + 1) // 2 if half else len(part)
        host = np.empty(o, dtype=np.int64)
        pads = padding_column(self.max_rows) if width else (0,) * len(head)
        for (a, n, _), part, pad in zip(spans[: len(head)], head, pads, strict=True):
            host[a : a + n] = part
            if n < width:
                host[a + n : a + width] = pad
        for (a, n, half), (part, _) in zip(spans[len(head) :], tail, strict=True):
            (host[a:].view(np.int32) if half else host[a:])[:n] = part
        g = self.graphs
        staged = g is not None and graph_size is not None and host.size <= g.staged.numel()
        dev = self._staging.to_device(host, g.staged if staged else None)
        st = StepTensors(dev, spans, staged)
        if upd_pages:
            self.block_table.index_put_((st.upd_rows, st.upd_cols), st.upd_pages)
        return st

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
        """Attention metadata on the device from the persistent page table: each sequence's
        table row, and each token's cache slot (negative for padding: seq_len 0)."""
        ps = self.page_size
        tables = self.block_table.index_select(0, rows)[:, :table_width]
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

    def _decode_metadata(
        self, positions: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor
    ) -> AttentionMetadata:
        """A captured decode batch's metadata (one-token rows; static query starts)."""
        b = positions.shape[0]
        return self.metadata(
            positions,
            rows,
            seq_lens,
            [1] * b,
            [1] * b,
            self.max_pages_per_seq,
            query_start=self._decode_query_start[: b + 1],
        )

    def _step_metadata(self, step: StepInput, st: StepTensors) -> AttentionMetadata:
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

    def _graph_forward(
        self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """The captured decode forward: placeholder ids resolved from `_graph_tokens`,
        metadata from the page table, the model, then every row's logits into
        `_graph_logits` and their greedy tokens into `_graph_tokens` (read by the next
        replay's placeholders once this one has run): a greedy step needs no launch after
        the replay but the copy of its tokens to the host."""
        self._graph_fed.copy_(self._graph_tokens)
        ids = resolve_placeholders(ids, self._graph_fed)
        md = self._decode_metadata(positions, rows, seq_lens)
        hidden = self.model(ids, positions, ForwardContext(md))
        if self._graph_logits is not None:
            n = ids.shape[0]
            logits = self.model.compute_logits(hidden, out=self._graph_logits[:n])
            self.sampler.greedy_into(logits, self._graph_tokens[:n])
        return hidden

    @torch.inference_mode()
    def _execute_draft(self, step: StepInput, st: StepTensors) -> torch.Tensor | None:
        """A draft model's step (eager): its tokens with the hidden states it reads (the
        latest target step's or the latest draft step's rows `hidden_rows`); logits of
        `logit_rows`."""
        source = self.last_hidden if step.draft == DRAFT_ON_TARGET else self.last_draft_hidden
        assert source is not None, "a draft step needs the step it reads from"
        hidden = source.index_select(0, st.hidden_rows)
        if step.draft == DRAFT_ON_TARGET and self.draft is not None:
            hidden = self.draft.fuse_target_hidden(hidden)  # EAGLE-3: fc over the aux layers
        g, b = self.draft_graphs, len(step.rows)
        if g is not None and step.is_decode_only and g.can_run(b):
            self._draft_in[:b].copy_(hidden)
            out = g.run(st.packed[: 4 * b].view(4, -1))
            normed, carried = out.split(out.shape[-1] // 2, dim=-1)
            self.last_draft_hidden = carried  # a view: read before the next replay
            if not step.logit_rows:
                return None
            return self.drafter.compute_logits(normed.index_select(0, st.logit_rows))
        md = self._step_metadata(step, st)
        normed, carried = self.drafter.forward_draft(
            st.ids, st.positions, hidden, ForwardContext(md)
        )
        self.last_draft_hidden = carried
        if not step.logit_rows:
            return None
        return self.drafter.compute_logits(normed.index_select(0, st.logit_rows))

    @torch.inference_mode()
    def execute_model(self, step: StepInput) -> torch.Tensor | None:
        """Run one step; fp32 logits [len(step.logit_rows), vocab] (every rank computes them:
        the LM head is vocab-parallel), or None when no row needs logits. A `greedy` step's
        tokens also stay on the device, in `sampler`, for the next step's placeholder ids."""
        graph_size = self._graph_size(step)
        st = self._tensors(step, graph_size)
        if step.ids and min(step.ids) < 0:  # placeholders: tokens the last step sampled
            # an eager step reruns the latest one (profiling) with the tokens it was given
            src = self._fed_tokens if step.eager else self.sampler.device_tokens()
            # a replay resolves them inside the graph, from `_graph_tokens`
            held = graph_size is not None and self._hold_graph_tokens(src)
            if not held:
                st.ids.copy_(resolve_placeholders(st.ids, src))
            # kept for an eager rerun, where nothing rewrites them: the replay's own copy, or
            # a copy of tokens living in the buffer that replays rewrite
            if held:
                self._fed_tokens = self._graph_fed
            else:
                self._fed_tokens = src.clone() if src._base is self._graph_tokens else src
        if step.draft:
            logits = self._execute_draft(step, st)
            if logits is not None and step.greedy:  # the next draft step's placeholders
                self.sampler.greedy_on_device(logits)
            return logits
        if graph_size is not None:
            g = self.graphs
            if not st.staged:  # too long for the room after the static inputs
                g.inputs_of(graph_size).copy_(
                    st.packed[: NUM_INPUTS * graph_size].view(NUM_INPUTS, -1)
                )
            hidden = g.replay(len(step.rows))
            if self._graph_logits is not None:
                self._graph_tokens_of = None  # the replay wrote its own tokens there
        else:
            embeds = self._image_embeds(step, st)
            md = self._step_metadata(step, st)
            extra = {"embeds": embeds} if embeds is not None else {}
            if self.prefill_threads and step.num_tokens >= PREFILL_STEP_TOKENS:
                decode_threads = torch.get_num_threads()
                torch.set_num_threads(self.prefill_threads)
                try:
                    hidden = self.model(st.ids, st.positions, ForwardContext(md), **extra)
                finally:
                    torch.set_num_threads(decode_threads)
            else:
                hidden = self.model(st.ids, st.positions, ForwardContext(md), **extra)
        if self.keep_hidden:  # a draft model reads them next (sliced: graphs reuse buffers)
            source = hidden if self.aux_hidden is None else self.aux_hidden
            self.last_hidden = source[: step.num_tokens]
        if not step.logit_rows:
            return None
        if graph_size is not None and self._graph_logits is not None:
            b, rows = len(step.rows), step.logit_rows  # rows ascending: all of 0..b-1 or some
            if len(rows) == b and rows[-1] == b - 1:  # the replay's logits and tokens serve
                if step.greedy:
                    tokens = self._graph_tokens[:b]
                    self.sampler.adopt_device_tokens(tokens)
                    self._graph_tokens_of = tokens
                return self._graph_logits[:b]
        logits = self.model.compute_logits(hidden.index_select(0, st.logit_rows))
        if step.greedy and not step.eager:
            tokens = self.sampler.greedy_on_device(logits)
            if self.graphs is not None:  # queued behind the LM head, not before the next replay
                self._hold_graph_tokens(tokens)
        return logits

    def _graph_size(self, step: StepInput) -> int | None:
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

    def _hold_graph_tokens(self, tokens: torch.Tensor) -> bool:
        """Make `_graph_tokens` hold `tokens` (copied unless it already does); False when they
        do not fit."""
        if tokens is self._graph_tokens_of:
            return True
        n = tokens.numel()
        if n > self._graph_tokens.numel():
            return False
        self._graph_tokens[:n].copy_(tokens)
        self._graph_tokens_of = tokens
        return True

    # ---- images ------------------------------------------------------------------------------
    def _profile_images(self, base: int, prefill_peak: int) -> int:
        """The activation peak with images (rank 0, which encodes them): the larger of the
        encoder on the largest image the processor makes and a prefill step, either beside
        a full encoder cache."""
        vision = getattr(self.model, "vision", None)
        if vision is None:
            return prefill_peak
        dev = self.device
        cfg = vision.config
        grid = largest_image_grid(MediaProcessorConfig.for_model(cfg, self.config.model))
        patches = grid[1] * grid[2]
        pixels = torch.zeros(patches, 3, cfg.patch_size, cfg.patch_size)
        torch.cuda.reset_peak_memory_stats(dev)
        self.encode_images([ImageInput(pixels, grid, patches // cfg.merge_size, b"")])
        torch.cuda.synchronize(dev)
        encode_peak = torch.cuda.max_memory_allocated(dev) - base
        log.info(
            "vision encoder: %.2f GiB peak on a %dx%d-patch image",
            encode_peak / (1 << 30),
            grid[1],
            grid[2],
        )
        return max(prefill_peak, encode_peak) + self.encoder_cache.max_bytes

    def _image_embeds(
        self, step: StepInput, st: StepTensors
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, values) of the step's image tokens. Rank 0 holds the vision encoder and
        encodes each image once (its output stays in `encoder_cache` for the image's later
        chunks and later requests); the other ranks receive the values by an all-reduce to
        which they add zeros."""
        if not step.embed_rows:
            return None
        dtype = self.model.model.embed_tokens.weight.dtype
        rows = st.embed_rows
        if step.images:
            encoded = self._encode([im for im, _, _ in step.images])
            values = torch.cat(
                [encoded[im.digest][first : first + n] for im, first, n in step.images]
            ).to(dtype)
        else:
            hidden = self.loaded.config.hidden_size
            values = torch.zeros(len(step.embed_rows), hidden, dtype=dtype, device=self.device)
        if self.tp.size > 1:
            values = self.tp.all_reduce(values.contiguous())
        return rows, values

    def encode_images(self, images: list) -> list[torch.Tensor]:
        """The vision encoder on images (`ImageInput`s) in one batch: one tensor each."""
        vision = self.model.vision
        pixels = torch.cat([im.pixels for im in images]).to(self.device, vision.dtype)
        out = vision(pixels, [im.grid for im in images])
        return list(out.split([im.num_tokens for im in images]))

    def _encode(self, images: list) -> dict[bytes, torch.Tensor]:
        """Each image's embeddings by its digest: from the cache, else encoded now."""
        found: dict[bytes, torch.Tensor] = {}
        todo = []
        for im in images:
            if im.digest in found:
                continue
            hit = self.encoder_cache.get(im.digest)
            if hit is not None:
                found[im.digest] = hit
            elif all(im.digest != t.digest for t in todo):
                todo.append(im)
        if todo:
            for im, out in zip(todo, self.encode_images(todo), strict=True):
                self.encoder_cache.put(im.digest, out)
                found[im.digest] = out
        return found


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def _varied_ids(n: int, vocab: int) -> list[int]:
    """Token ids spread over the vocabulary: tokens route to many experts, as real text does
    (one repeated id would send every token to the same few and skip the kernels' other
    variants)."""
    return [(i * 40503 + 7) % vocab for i in range(n)]


def _prefill_step(row: int, tokens: int, context: int, vocab: int) -> StepInput:
    """One sequence in page-table row `row` computing `tokens` new tokens after `context`
    cached ones (the start-up warm-up's steps)."""
    return StepInput(
        ids=_varied_ids(tokens, vocab),
        positions=list(range(context, context + tokens)),
        rows=[row],
        seq_lens=[context + tokens],
        query_lens=[tokens],
        logit_rows=[tokens - 1],
    )
