"""One rank's executor of steps: KV cache, persistent page table, CUDA graphs, the forward and
the logits (the only torch in the engine besides sampling).

Every rank of a tensor-parallel group holds a `ModelRunner` and runs the same `StepInput`s in
the same order (their collectives pair up); rank 0 also schedules, and samples with the
runner's `sampler` (every rank samples the greedy tokens of overlapped steps). `__init__`
builds; `start()` is collective: the KV cache is sized on every rank from its own free
memory (engine/memory_profile.py) and the smallest page count wins, then kernels are warmed
up (engine/warm_up.py) and graphs captured (engine/graph_capture.py) in the same order
everywhere. A step's index lists reach the device in one copy (engine/step_tensors.py); its
attention metadata comes from the page table (engine/page_table.py).
"""

from __future__ import annotations

import logging
import os

import torch

from moeserve.config import EngineConfig
from moeserve.engine.cuda_graphs import NUM_INPUTS, DecodeGraphs, padding_column
from moeserve.engine.graph_capture import CapturedDecode
from moeserve.engine.images import ImageEncoding
from moeserve.engine.memory import MemoryPlan
from moeserve.engine.memory_profile import size_kv_cache
from moeserve.engine.page_table import PageTable
from moeserve.engine.step import DRAFT_ON_TARGET, StepInput
from moeserve.engine.step_tensors import Staging, StepTensors, pack_step
from moeserve.engine.warm_up import warm_up
from moeserve.kernels import cpu as cpu_kernels
from moeserve.kernels.elementwise.tokens import resolve_placeholders
from moeserve.layers.attention.metadata import ForwardContext
from moeserve.loader.base import LoadedModel
from moeserve.models.eagle3 import capture_aux_hidden
from moeserve.parallel.groups import SINGLE, TPGroup
from moeserve.sampling import DeviceTokens, Sampler

log = logging.getLogger(__name__)

# CPU steps of this many tokens or more run with `prefill_threads`: measured on 2 cores,
# a 4k-token prompt prefills at 271 tok/s with the server's 1 thread and ~500 with 2
PREFILL_STEP_TOKENS = 64
KV_CACHE_NAMES = ("kv_cache", "k_cache", "v_cache")  # a layer's cache tensors


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        device: torch.device | str,
        tp: TPGroup = SINGLE,
    ) -> None:
        self.config, self.loaded, self.model, self.tp = config, loaded, loaded.model, tp
        self.device = torch.device(device)
        self.page_size = config.cache.page_size
        self.kv_dtype = loaded.kv_cache_dtype
        self.vocab_size = loaded.config.vocab_size
        # ids that may be sampled: the tokenizer's (DeepSeek/Kimi pad the LM head beyond it)
        tok_vocab = getattr(loaded.tokenizer, "vocab_size", None) or self.vocab_size
        self.vocab_limit = min(self.vocab_size, tok_vocab)
        self.max_rows = config.scheduler.max_num_seqs
        # a graph's rows: up to its largest batch, which verify rows may take past max_rows
        self.graph_rows = max(1, self.max_rows, config.graph_max_batch(str(self.device)))
        # on every rank: the next step's placeholder ids name the greedy tokens kept here
        self.tokens = DeviceTokens(self.device, self.graph_rows)
        eos_ids = tuple(sorted(set(loaded.config.eos_token_ids)))
        self.sampler = Sampler(self.vocab_limit, eos_ids, self.device, tokens=self.tokens)
        self._build_draft_state()
        self.staging = Staging(self.device)
        self.pages = PageTable(self.page_size, self.device)
        self.capture = CapturedDecode(self)
        self.images = ImageEncoding(
            self.model, loaded.config.hidden_size, config.model, tp, self.device
        )
        # none where the native kernels do the heavy work (they have their own threads)
        self.prefill_threads = None if self._native_threads() else self._prefill_threads()
        self.memory: MemoryPlan | None = None  # the rest is set by `start`
        self.num_pages = self.max_model_len = self.max_pages_per_seq = 0
        self.graph_status = self.warm_up_status = ""  # the start-up banner's lines

    def _build_draft_state(self) -> None:
        """The draft model: an EAGLE-3 head (a module of its own, `loaded.draft`) or the
        target's MTP module (the target model drafts through `forward_draft`), and what it
        reads: the latest target step's final hidden states (EAGLE-3: its aux layers') and the
        latest draft step's own."""
        self.draft = self.loaded.draft
        self.drafter = self.draft if self.draft is not None else self.model
        self.keep_hidden = self.draft is not None or getattr(self.model, "mtp", None) is not None
        self.aux_hidden = self._aux_buffer() if self.draft is not None else None
        self.last_hidden: torch.Tensor | None = None
        self.last_draft_hidden: torch.Tensor | None = None

    def start(self) -> ModelRunner:
        """Size and bind the KV cache, then (GPU) warm the kernels up and capture graphs."""
        model_len = self.loaded.config.context_len(self.config.scheduler.max_model_len)
        self.memory = size_kv_cache(self, model_len)
        self.num_pages = self.memory.kv_pages
        self.max_model_len = min(model_len, self.num_pages * self.page_size)
        self.max_pages_per_seq = -(-self.max_model_len // self.page_size)
        self.bind_cache(self.num_pages)
        # row max_rows is the padding row of graph replays: all zeros, never written
        self.pages.allocate(self.max_rows + 1, self.max_pages_per_seq, self.graph_rows)
        if self.device.type == "cuda":
            self.warm_up_status = warm_up(self)
            log.info("%s", self.warm_up_status)
            self.graph_status = self.capture.capture(self.config.graph_max_batch(str(self.device)))
            log.info("%s", self.graph_status)
        return self

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.capture.graphs

    @property
    def draft_graphs(self) -> DecodeGraphs | None:
        return self.capture.draft_graphs

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

    def bind_cache(self, num_pages: int) -> None:
        for layer, dtype in self._cache_layers():
            layer.bind_kv_cache(num_pages, self.page_size, dtype, self.device)
        if self.device.type == "cpu":
            # zeros from calloc are not resident until written: write them now, so the
            # process holds its whole cache from the start (its RSS then stays flat as
            # requests touch new pages, and memory that is not there fails at start-up)
            for cache in self.cache_tensors():
                cache.zero_()

    def cache_tensors(self) -> list[torch.Tensor]:
        """Every attention layer's KV-cache tensors."""
        out = []
        for layer, _ in self._cache_layers():
            for name in KV_CACHE_NAMES:
                cache = getattr(layer, name, None)
                if isinstance(cache, torch.Tensor):
                    out.append(cache)
        return out

    # ---- one step ----------------------------------------------------------------------------
    def tensors(self, step: StepInput, graph_size: int | None = None) -> StepTensors:
        """The step's index lists in one host->device copy, and the page-table rows it
        appends written on the device. A step that replays the graph of `graph_size` is
        packed with its padding columns straight into the graphs' static inputs where it
        fits (`StepTensors.staged`)."""
        width = graph_size or 0
        host, spans = pack_step(step, width, padding_column(self.max_rows) if width else ())
        g = self.capture.graphs
        staged = g is not None and graph_size is not None and host.size <= g.staged.numel()
        st = StepTensors(self.staging.to_device(host, g.staged if staged else None), spans, staged)
        if step.page_updates:
            self.pages.write(st)
        return st

    @torch.inference_mode()
    def execute_model(self, step: StepInput) -> torch.Tensor | None:
        """Run one step; fp32 logits [len(step.logit_rows), vocab] (every rank computes them:
        the LM head is vocab-parallel), or None when no row needs logits. A `greedy` step's
        tokens also stay on the device, in `tokens`, for the next step's placeholder ids."""
        graph_size = self.capture.size_for(step)
        st = self.tensors(step, graph_size)
        if step.ids and min(step.ids) < 0:  # placeholders: tokens the last step sampled
            self._resolve_placeholders(step, st, graph_size)
        if step.draft:
            logits = self._execute_draft(step, st)
            if logits is not None and step.greedy:  # the next draft step's placeholders
                self.sampler.greedy_on_device(logits)
            return logits
        hidden = self._replay(step, st, graph_size) if graph_size else self._forward(step, st)
        if self.keep_hidden:  # a draft model reads them next (sliced: graphs reuse buffers)
            source = hidden if self.aux_hidden is None else self.aux_hidden
            self.last_hidden = source[: step.num_tokens]
        if not step.logit_rows:
            return None
        if graph_size is not None and self.capture.logits is not None:
            b, rows = len(step.rows), step.logit_rows  # rows ascending: all of 0..b-1 or some
            if len(rows) == b and rows[-1] == b - 1:  # the replay's logits and tokens serve
                if step.greedy:
                    self.tokens.adopt_replay(b)
                return self.capture.logits[:b]
        logits = self.model.compute_logits(hidden.index_select(0, st.logit_rows))
        if step.greedy and not step.eager:
            tokens = self.sampler.greedy_on_device(logits)
            if self.capture.graphs is not None:  # queued behind the LM head, not the replay
                self.tokens.hold_in_graph(tokens)
        return logits

    def _resolve_placeholders(
        self, step: StepInput, st: StepTensors, graph_size: int | None
    ) -> None:
        """Placeholder ids name the latest greedy step's tokens (an eager step reruns the
        latest one, profiling, with the tokens it was given); a replay resolves them inside
        the graph, from the tokens graphs read."""
        src = self.tokens.source(step.eager)
        held = graph_size is not None and self.tokens.hold_in_graph(src)
        if not held:
            st.ids.copy_(resolve_placeholders(st.ids, src))
        self.tokens.fed_to_step(src, held)

    def _replay(self, step: StepInput, st: StepTensors, graph_size: int) -> torch.Tensor:
        g = self.capture.graphs
        if not st.staged:  # too long for the room after the static inputs
            g.inputs_of(graph_size).copy_(st.packed[: NUM_INPUTS * graph_size].view(NUM_INPUTS, -1))
        hidden = g.replay(len(step.rows))
        if self.capture.logits is not None:
            self.tokens.replayed()
        return hidden

    def _forward(self, step: StepInput, st: StepTensors) -> torch.Tensor:
        """An eager step: images' embeddings in, more torch threads for a long prefill."""
        embeds = self.images.embeds(step, st)
        ctx = ForwardContext(self.pages.step_metadata(step, st))
        extra = {"embeds": embeds} if embeds is not None else {}
        if not (self.prefill_threads and step.num_tokens >= PREFILL_STEP_TOKENS):
            return self.model(st.ids, st.positions, ctx, **extra)
        decode_threads = torch.get_num_threads()
        torch.set_num_threads(self.prefill_threads)
        try:
            return self.model(st.ids, st.positions, ctx, **extra)
        finally:
            torch.set_num_threads(decode_threads)

    def _execute_draft(self, step: StepInput, st: StepTensors) -> torch.Tensor | None:
        """A draft model's step: its tokens with the hidden states it reads (the latest target
        step's or the latest draft step's rows `hidden_rows`); logits of `logit_rows`."""
        source = self.last_hidden if step.draft == DRAFT_ON_TARGET else self.last_draft_hidden
        assert source is not None, "a draft step needs the step it reads from"
        hidden = source.index_select(0, st.hidden_rows)
        if step.draft == DRAFT_ON_TARGET and self.draft is not None:
            hidden = self.draft.fuse_target_hidden(hidden)  # EAGLE-3: fc over the aux layers
        g, b = self.capture.draft_graphs, len(step.rows)
        if g is not None and step.is_decode_only and g.can_run(b):
            self.capture.draft_in[:b].copy_(hidden)
            out = g.run(st.packed[: NUM_INPUTS * b].view(NUM_INPUTS, -1))
            normed, carried = out.split(out.shape[-1] // 2, dim=-1)
        else:
            ctx = ForwardContext(self.pages.step_metadata(step, st))
            normed, carried = self.drafter.forward_draft(st.ids, st.positions, hidden, ctx)
        self.last_draft_hidden = carried  # a replay's is a view: read before the next one
        if not step.logit_rows:
            return None
        return self.drafter.compute_logits(normed.index_select(0, st.logit_rows))
