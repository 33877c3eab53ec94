"""The implementations of MLA attention over the paged latent cache, one per kernel family.

The kernel plan picks one class of `BACKENDS` per model (`KernelPlan.mla`); each MLA layer
builds its own instance (`MLAAttention.use_kernel_plan`), which holds what its kernels need
(packed weights, the stored kv_b_proj view, the decode scratch) and serves the layer's
`attend`: the step's rows written into the cache, then the decode rows and the prefill
rows, each as the backend groups them:

- `TorchMLA` (CPU, other shapes): absorbed form for a decode-only batch, else the expanded
  form per sequence for every row;
- `NativeMLA` (native CPU kernels, bf16 cache): the absorbed form for every row, so a row's
  result does not depend on how its sequence was split into steps;
- `TritonMLA` (CUDA, the published 512 + 64 layout): the W_UK product into the absorbed query
  and one launch that ropes q_pe and k_pe and writes the cache (the W_UK kernel's own at
  decode sizes), the leading single-token sequences through the split-KV decode kernel, the
  prefill chunks through the prefill kernel, then the W_UV product. Strided views, no host
  syncs: capturable;
- `TritonPrefillMLA` (--deterministic): every row through the prefill kernel (key tiles from
  position 0), absorbed products by the batch-invariant GEMM;
- `GluonMLA` / `GluonPreferMLA` (Hopper): the Triton backend whose captured decode takes the
  Gluon kernel (TMA + wgmma) always, or where it measured faster.

Kernels are looked up on their modules at each call (tests count and replace them there).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from moeserve.kernels import cpu as cpu_kernels
from moeserve.kernels.attention import kv_cache as cache_kernels
from moeserve.kernels.attention import mla_absorb as absorb_kernels
from moeserve.kernels.attention import mla_decode as decode_kernels
from moeserve.kernels.attention import mla_decode_gluon as gluon_kernels
from moeserve.kernels.attention import mla_prefill as prefill_kernels
from moeserve.kernels.formats import E4M3_MAX
from moeserve.kernels.gemm import invariant as invariant_kernels
from moeserve.layers.attention.metadata import AttentionMetadata
from moeserve.layers.linear import LinearBase
from moeserve.layers.norm import RMSNorm
from moeserve.layers.quant.base import UnquantizedLinearMethod
from moeserve.layers.quant.scheme import SchemeLinearMethod, dense_weight
from moeserve.layers.rotary import RotaryEmbedding

log = logging.getLogger(__name__)

StoredWeight = tuple[torch.Tensor, torch.Tensor | None]  # kv_b_proj as stored, its block scale


@dataclass
class MLADecodeScratch:
    """Split-KV partials of the decode kernels, shared by all MLA layers of a model (their
    calls are stream-ordered). One flat buffer, viewed per batch, so a captured graph uses
    fixed addresses; sized for every batch <= max_batch at the largest context. `gluon`:
    the Gluon kernel (kernels/attention/mla_decode_gluon.py) serves "always", or where it
    measured faster ("prefer"), or never (None), as the layers' backend says; which kernel
    serves a batch then follows from static sizes only. The Triton kernel's fused-merge
    counters are zero between calls (each call resets the ones it used), so the layers
    share them too."""

    partial_out: torch.Tensor  # flat, [rows * heads * 512] in the partials' dtype
    partial_lse: torch.Tensor  # flat fp32 [rows * heads]
    counters: torch.Tensor  # flat int32, zeroed: merge_counters_needed(max_batch, heads)
    num_heads: int
    sm_count: int
    gluon: str | None = None  # "prefer", "always" or None

    @staticmethod
    def plan(
        batch: int, num_heads: int, max_context: int, sm_count: int, gluon: str | None
    ) -> tuple[Callable, int]:
        """(decode kernel, its default split count) for a launch of these static sizes."""
        md, mg = decode_kernels, gluon_kernels
        if gluon is not None and (
            gluon == "always" or mg.prefer_gluon(batch, num_heads, max_context)
        ):
            splits = mg.gluon_default_num_splits(batch, num_heads, max_context, sm_count)
            return mg.mla_decode_gluon, splits
        splits = md.default_num_splits(batch, num_heads, max_context, sm_count=sm_count)
        return md.mla_decode, splits

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        num_heads: int,
        max_context: int,
        dtype: torch.dtype,
        device: torch.device | str,
        sm_count: int,
        gluon: str | None = None,
    ) -> MLADecodeScratch:
        rows = max(
            b * cls.plan(b, num_heads, max_context, sm_count, gluon)[1]
            for b in range(1, max_batch + 1)
        )
        # the kernel's partials: fp32 for an fp32 output, else bf16 (see mla_decode)
        po_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
        lat = decode_kernels.KV_LORA_RANK
        po = torch.empty(rows * num_heads * lat, dtype=po_dtype, device=device)
        pl = torch.empty(rows * num_heads, dtype=torch.float32, device=device)
        counters = torch.zeros(
            decode_kernels.merge_counters_needed(max_batch, num_heads),
            dtype=torch.int32,
            device=device,
        )
        return cls(po, pl, counters, num_heads, sm_count, gluon)

    def workspace(
        self, batch: int, max_context: int
    ) -> tuple[Callable, decode_kernels.MLADecodeWorkspace, int] | None:
        """(decode kernel, workspace view, num_splits) for this batch, or None if it does not
        fit."""
        kernel, splits = self.plan(batch, self.num_heads, max_context, self.sm_count, self.gluon)
        n = batch * self.num_heads * splits
        if n > self.partial_lse.numel():
            return None
        if decode_kernels.merge_counters_needed(batch, self.num_heads) > self.counters.numel():
            return None
        po = self.partial_out[: n * decode_kernels.KV_LORA_RANK]
        po = po.view(batch, self.num_heads, splits, -1)
        pl = self.partial_lse[:n].view(batch, self.num_heads, splits)
        return kernel, decode_kernels.MLADecodeWorkspace(po, pl, self.counters), splits


class MLALayer(Protocol):
    """What a backend reads of its MLA layer (`MLAAttention`'s public attributes)."""

    num_heads: int  # this rank's
    nope: int
    rope: int
    v_dim: int
    kv_lora: int
    latent_dim: int
    scale: float
    rotary_emb: RotaryEmbedding
    kv_cache: torch.Tensor  # [pages, page_size, latent_dim]
    kv_scale: torch.Tensor  # the FP8 cache's scale
    kv_b_proj: LinearBase
    kv_a_layernorm: RMSNorm


class MLABackend(Protocol):
    """What an MLA layer asks of its backend."""

    name: ClassVar[str]  # the key in BACKENDS
    label: ClassVar[str]  # what the kernel plan prints for it
    capturable: ClassVar[bool]  # decode can be captured in a CUDA graph
    fused_a_norms: ClassVar[bool]  # both a-norms in one Triton launch

    def process_weights(self) -> None:
        """What the kernels need from the loaded weights, once."""

    def for_cache(self, dtype: torch.dtype) -> MLABackend:
        """The backend that serves a cache of `dtype` (itself, where it reads that dtype)."""

    def prepare_cuda_graph(self, max_batch: int, max_context: int, shared: dict) -> None: ...

    def attend(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        c: torch.Tensor,
        k_pe: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, h, nope + rope], normalised latent c [T, L], raw k_pe [T, R]: the step's rows
        written into the cache, attention over it -> [T, h, v]."""


class _Backend:
    """What every MLA backend shares: the absorbed weights as dense views of kv_b_proj, and
    the torch form of the cache write and reads."""

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    capturable: ClassVar[bool] = False
    fused_a_norms: ClassVar[bool] = False
    keeps_dense: ClassVar[bool] = False  # keep the dense absorbed weight between calls

    def __init__(self, layer: MLALayer) -> None:
        self.layer = layer
        self.dense: torch.Tensor | None = None  # kv_b_proj's dense weight, where kept

    def process_weights(self) -> None:
        return None

    def for_cache(self, dtype: torch.dtype) -> MLABackend:
        return self

    def prepare_cuda_graph(self, max_batch: int, max_context: int, shared: dict) -> None:
        return None

    def absorb_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [h, nope, L] and W_UV [h, v, L]: views of kv_b_proj's dense weight (kept by
        the kernel backends: the same storage for a dense layer, one dequantized copy else)."""
        a = self.layer
        w = self.dense
        if w is None or w.dtype != dtype:
            w = dense_weight(a.kv_b_proj, dtype)
            if self.keeps_dense:
                self.dense = w
        w = w.view(a.num_heads, a.nope + a.v_dim, -1)
        return w[:, : a.nope], w[:, a.nope :]

    # ---- the cache in torch ---------------------------------------------------------------------
    def write_cache(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        c: torch.Tensor,
        k_pe: torch.Tensor,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_nope, roped q_pe), the step's [c | roped k_pe] rows stored (a negative slot is a
        padding token: not stored)."""
        a = self.layer
        q_nope, q_pe = q.split([a.nope, a.rope], dim=-1)
        q_pe, k_pe = a.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        slots = md.slot_mapping
        keep = slots >= 0
        rows = torch.cat([c, k_pe.squeeze(1)], dim=-1)[keep].float()
        cache = a.kv_cache
        if cache.dtype == torch.float8_e4m3fn:
            rows = (rows / a.kv_scale).clamp(-E4M3_MAX, E4M3_MAX)
        rows = rows.to(cache.dtype)
        flat = cache.view(-1, a.latent_dim)
        if flat.dtype == torch.float8_e4m3fn:  # no fp8 index_copy on the CPU: copy the bytes
            flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
        flat.index_copy_(0, slots[keep], rows)
        return q_nope, q_pe

    def dequant(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if rows.dtype == torch.float8_e4m3fn:
            return (rows.float() * self.layer.kv_scale).to(dtype)
        return rows.to(dtype)

    def gather(
        self, table: torch.Tensor, n: int, page_size: int, dtype: torch.dtype
    ) -> torch.Tensor:
        pages = table[: -(-n // page_size)].long()
        return self.dequant(self.layer.kv_cache[pages].flatten(0, 1)[:n], dtype)


class TorchMLA(_Backend):
    name = "torch"
    label = "torch (gather + einsum)"

    def attend(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        c: torch.Tensor,
        k_pe: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        q_nope, q_pe = self.write_cache(positions, q, c, k_pe, md)
        if md.is_decode_only:
            return self.decode(q_nope, q_pe, md)
        return self.prefill(q_nope, q_pe, md)

    def prefill(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """Per sequence: expand its cached latents to per-head keys/values, causal SDPA."""
        a = self.layer
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = q.new_empty(q.shape[0], a.num_heads, a.v_dim)
        start = 0
        for b, (qlen, slen) in enumerate(zip(md.query_lens_host, md.seq_lens_host, strict=True)):
            rows = self.gather(md.block_tables[b], slen, md.page_size, q.dtype)
            kv = a.kv_b_proj(rows[:, : a.kv_lora]).view(slen, a.num_heads, -1)
            k_nope, v = kv.split([a.nope, a.v_dim], dim=-1)
            k_pe = rows[:, None, a.kv_lora :].expand(slen, a.num_heads, a.rope)
            k = torch.cat([k_nope, k_pe], dim=-1)
            # query i sits at absolute position slen - qlen + i and sees keys <= it
            mask = torch.ones(qlen, slen, dtype=torch.bool, device=q.device).tril(slen - qlen)
            o = F.scaled_dot_product_attention(
                q[start : start + qlen].transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=mask,
                scale=a.scale,
            )
            out[start : start + qlen] = o.transpose(0, 1)
            start += qlen
        return out

    def decode(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """One query per sequence, attending the 576-wide latent rows directly."""
        a = self.layer
        dtype = q_nope.dtype
        w_uk, w_uv = self.absorb_weights(dtype)  # [h, nope, L], [h, v, L]
        q_lat = torch.einsum("bhd,hdl->bhl", q_nope, w_uk)
        q = torch.cat([q_lat, q_pe], dim=-1)  # [B, h, L + R]
        length, ps = md.max_seq_len, md.page_size
        pages = md.block_tables[:, : -(-length // ps)].long()
        rows = self.dequant(a.kv_cache[pages].flatten(1, 2)[:, :length], dtype)  # [B, n, L+R]
        scores = torch.einsum("bhd,bnd->bhn", q, rows).float() * a.scale
        valid = torch.arange(length, device=q.device)[None, :] < md.seq_lens[:, None]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        p = scores.softmax(dim=-1).to(dtype)
        o_lat = torch.einsum("bhn,bnl->bhl", p, rows[..., : a.kv_lora])
        return torch.einsum("bhl,hvl->bhv", o_lat, w_uv)


class NativeMLA(_Backend):
    """Every row in the absorbed form through the native CPU kernels: W_UK [h, nope, L] as h
    linear weights [L, nope] and W_UV [h, v, L] as h [v, L], packed once after loading (a
    dense copy of kv_b_proj only). The kernel plan chooses it for bf16 activations and even
    widths; the native attention reads a bf16 cache."""

    name = "native"
    label = "native CPU paged attention"

    def __init__(self, layer: MLALayer) -> None:
        super().__init__(layer)
        self.packed: tuple[list, list] | None = None

    def process_weights(self) -> None:
        a = self.layer
        w = dense_weight(a.kv_b_proj, torch.bfloat16)
        w = w.view(a.num_heads, a.nope + a.v_dim, a.kv_lora)
        uk = [cpu_kernels.pack_bf16(w[h, : a.nope].t()) for h in range(a.num_heads)]
        uv = [cpu_kernels.pack_bf16(w[h, a.nope :]) for h in range(a.num_heads)]
        self.packed = (uk, uv)

    def for_cache(self, dtype: torch.dtype) -> MLABackend:
        if dtype == torch.bfloat16:
            return self
        log.info("MLA: a %s cache: torch attention (the native CPU kernel reads bf16)", dtype)
        return TorchMLA(self.layer)

    def attend(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        c: torch.Tensor,
        k_pe: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        a = self.layer
        q_nope, q_pe = self.write_cache(positions, q, c, k_pe, md)
        tokens, heads, lat = q.shape[0], a.num_heads, a.kv_lora
        uk, uv = self.packed
        q_abs = q.new_empty(tokens, heads, a.latent_dim)
        for h in range(heads):
            q_abs[:, h, :lat] = cpu_kernels.linear(q_nope[:, h], uk[h])
        q_abs[:, :, lat:] = q_pe
        rows = a.kv_cache.unsqueeze(2)  # [pages, page, 1 KV head, L + R]: keys and values
        o_lat = cpu_kernels.attention(
            q_abs,
            rows,
            rows,
            md.block_tables,
            md.query_lens_host,
            md.seq_lens_host,
            a.scale,
            lat,
        )
        o = q.new_empty(tokens, heads, a.v_dim)
        for h in range(heads):
            o[:, h] = cpu_kernels.linear(o_lat[:, h], uv[h])
        return o


class TritonMLA(_Backend):
    """Absorbed MLA for every token through the Triton kernels (module docstring). The two
    absorbed products read kv_b_proj as stored (block-FP8 or 16-bit, kernels/attention/
    mla_absorb.py) for decode-sized batches, else run as bmm on its dense weight."""

    name = "triton"
    label = "Triton MLA decode (absorbed, split-KV)"
    capturable = True
    fused_a_norms = True
    keeps_dense = True
    gluon: ClassVar[str | None] = None  # the decode scratch's Gluon role (MLADecodeScratch)

    def __init__(self, layer: MLALayer) -> None:
        super().__init__(layer)
        self.scratch: MLADecodeScratch | None = None  # prepare_cuda_graph
        # kv_b_proj as stored where the absorbed-product kernels read its format
        self.stored: StoredWeight | None = None

    def process_weights(self) -> None:
        """kv_b_proj as stored, when the absorbed-product kernels read that format:
        block-FP8 with 128x128 scales or 16-bit."""
        a = self.layer
        layer, method = a.kv_b_proj, a.kv_b_proj.method
        self.stored = None
        stored: StoredWeight | None = None
        if isinstance(method, SchemeLinearMethod):
            stored = method.scheme.elementwise_view(method.tensors(layer))
        elif isinstance(method, UnquantizedLinearMethod):
            stored = (layer.weight, None)
        if stored is None:
            return
        try:
            absorb_kernels.check_absorb_weight(*stored, a.num_heads, a.nope, a.v_dim)
            self.stored = stored
        except ValueError as e:
            log.info("MLA: absorbed products through bmm (%s)", e)

    def prepare_cuda_graph(self, max_batch: int, max_context: int, shared: dict) -> None:
        """Static decode state for graph capture: the split-KV scratch (one for all layers,
        kept in `shared`) and the absorbed kv_b_proj weight, dequantized once (dequantizing a
        quantized one per call would copy a host-side table inside the graph)."""
        a = self.layer
        dtype = a.kv_a_layernorm.weight.dtype
        dev = a.kv_cache.device
        key = f"mla_decode_scratch/{a.num_heads}/{dtype}"
        scratch = shared.get(key)
        if scratch is None:
            sm = torch.cuda.get_device_properties(dev).multi_processor_count
            scratch = MLADecodeScratch.allocate(
                max_batch, a.num_heads, max_context, dtype, dev, sm, self.gluon
            )
            shared[key] = scratch
        self.scratch = scratch
        self.dense = dense_weight(a.kv_b_proj, dtype)

    def absorb(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        mode: str,
        cache_write: cache_kernels.CacheWrite | None = None,
    ) -> bool:
        """out = the absorbed product `mode` ("uk": q_nope @ W_UK, "uv": o_lat @ W_UV^T) of
        x [T, h, *]: the kernel on the stored weight for decode-sized T, else bmm on the
        dense weight. True where the kernel ran, and then it also did `cache_write`."""
        stored = self.stored
        heads = self.layer.num_heads
        if stored is not None and x.shape[0] <= absorb_kernels.absorb_max_rows(
            mode, stored[0], heads
        ):
            absorb_kernels.absorb_gemv(
                x, *stored, out, mode, self.layer.nope, cache_write=cache_write
            )
            return True
        w_uk, w_uv = self.absorb_weights(x.dtype)
        if mode == "uk":
            torch.bmm(x.transpose(0, 1), w_uk, out=out.transpose(0, 1))
        else:
            torch.bmm(x.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
        return False

    def attend(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        c: torch.Tensor,
        k_pe: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        q_abs, kv_scale = self.write_absorbed(positions, q, c, k_pe, md)
        o_lat = q.new_empty(q.shape[0], self.layer.num_heads, self.layer.kv_lora)
        self.attend_latent(q_abs, o_lat, kv_scale, md)
        o = q.new_empty(q.shape[0], self.layer.num_heads, self.layer.v_dim)
        self.absorb(o_lat, o, "uv")
        return o

    def attend_latent(
        self,
        q_abs: torch.Tensor,
        o_lat: torch.Tensor,
        kv_scale: torch.Tensor | None,
        md: AttentionMetadata,
    ) -> None:
        """o_lat = attention of the absorbed queries over the latent cache: the leading
        single-token sequences by the decode kernel, the prefill chunks (causal over their
        cached context and themselves) by the prefill kernel."""
        n_dec = self.decode(q_abs, o_lat, kv_scale, md)
        if n_dec < md.num_seqs:
            self.prefill(q_abs, o_lat, kv_scale, md, n_dec, md.max_prefill_query_len)

    def write_absorbed(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        c: torch.Tensor,
        k_pe: torch.Tensor,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the absorbed query [T, h, L + R], the FP8 cache scale or None): q_nope @ W_UK
        straight into its first L columns, and roped q_pe into the last R by the launch that
        ropes k_pe and writes the cache: the W_UK kernel's own at decode sizes, else a
        launch of its own."""
        a = self.layer
        lat = a.kv_lora
        q_abs = q.new_empty(q.shape[0], a.num_heads, lat + a.rope)
        rot = a.rotary_emb
        kv_scale = a.kv_scale if a.kv_cache.dtype == torch.float8_e4m3fn else None
        rope = cache_kernels.CacheRope(
            positions, rot.cos, rot.sin, q[..., a.nope :], q_abs[..., lat:]
        )
        write = cache_kernels.CacheWrite(c, k_pe, a.kv_cache, md.slot_mapping, kv_scale, rope)
        if not self.absorb(q[..., : a.nope], q_abs[..., :lat], "uk", write):
            cache_kernels.write_mla_cache(c, k_pe, a.kv_cache, md.slot_mapping, kv_scale, rope)
        return q_abs, kv_scale

    def decode(
        self,
        q_abs: torch.Tensor,
        o_lat: torch.Tensor,
        kv_scale: torch.Tensor | None,
        md: AttentionMetadata,
    ) -> int:
        """The leading one-token sequences (the first n_dec tokens) through the split-KV
        decode kernel (the scratch's choice of kernel where it is prepared); n_dec."""
        n_dec = md.num_decode_seqs
        if not n_dec:
            return 0
        kernel, ws, splits = decode_kernels.mla_decode, None, None
        if self.scratch is not None:
            plan = self.scratch.workspace(n_dec, md.block_tables.shape[1] * md.page_size)
            if plan is not None:
                kernel, ws, splits = plan
        kernel(
            q_abs[:n_dec],
            self.layer.kv_cache,
            md.block_tables[:n_dec],
            md.seq_lens[:n_dec],
            self.layer.scale,
            o_lat[:n_dec],
            kv_scale=kv_scale,
            num_splits=splits,
            workspace=ws,
        )
        return n_dec

    def prefill(
        self,
        q_abs: torch.Tensor,
        o_lat: torch.Tensor,
        kv_scale: torch.Tensor | None,
        md: AttentionMetadata,
        first: int,
        max_q_len: int,
    ) -> None:
        """Sequences `first`.. through the prefill kernel over their cached context."""
        prefill_kernels.mla_prefill(
            q_abs,
            self.layer.kv_cache,
            md.query_start[first:],
            md.seq_lens[first:],
            md.block_tables[first:],
            self.layer.scale,
            o_lat,
            kv_scale=kv_scale,
            max_q_len=max_q_len,
        )


class TritonPrefillMLA(TritonMLA):
    """--deterministic: every row through the prefill kernel (key tiles from position 0),
    the absorbed products per head by the batch-invariant GEMM (kernels/gemm/invariant.py)."""

    name = "triton-prefill"
    label = "Triton MLA prefill kernel"

    def process_weights(self) -> None:
        return None  # the products never read the stored weight

    def absorb(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        mode: str,
        cache_write: cache_kernels.CacheWrite | None = None,
    ) -> bool:
        w_uk, w_uv = self.absorb_weights(x.dtype)
        w = w_uk.transpose(1, 2) if mode == "uk" else w_uv  # [h, N, K] views
        invariant_kernels.gemm16(x.transpose(0, 1), w, out=out.transpose(0, 1))
        return False

    def attend_latent(
        self,
        q_abs: torch.Tensor,
        o_lat: torch.Tensor,
        kv_scale: torch.Tensor | None,
        md: AttentionMetadata,
    ) -> None:
        self.prefill(q_abs, o_lat, kv_scale, md, 0, max(md.query_lens_host))


class GluonMLA(TritonMLA):
    """--mla-decode-kernel gluon: captured decode through the Gluon kernel at every size."""

    name = "gluon"
    label = "Gluon MLA decode (TMA + wgmma)"
    gluon = "always"


class GluonPreferMLA(TritonMLA):
    """Captured decode through the Gluon kernel where it measured faster, else Triton's."""

    name = "gluon-prefer"
    label = "Gluon MLA decode (TMA + wgmma) / Triton"
    gluon = "prefer"


BACKENDS: dict[str, type[_Backend]] = {
    cls.name: cls
    for cls in (TorchMLA, NativeMLA, TritonMLA, TritonPrefillMLA, GluonMLA, GluonPreferMLA)
}
