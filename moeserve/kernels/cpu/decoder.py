"""A pre-norm decoder layer (Llama: GQA attention with RoPE over the paged cache, SwiGLU MLP)
in one native call per layer (`ms_decoder_layer` in csrc/kernels.c).

A decode step of a small model is dozens of tiny operations per layer; as torch ops and
ctypes calls each costs more in dispatch than in arithmetic. Here a layer's weights, norms,
RoPE tables and caches are described once (`DecoderLayer`), a step's rows and attention
layout once per forward (`DecoderStep`), and each layer is then one call that the GIL is
released for. Its arithmetic is the layer-by-layer native path's (see the C comment); every
part works row by row, so the batch-independence of the native kernels carries over.
"""

from __future__ import annotations

import ctypes

import torch

from moeserve.kernels.cpu import ATTENTION_POSITIONS, PackedWeight, native

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
FORMATS = {"bf16": 0, "q4": 1, "i8": 2, "q4h": 3}  # csrc/kernels.c: FMT_*


class _Weight(ctypes.Structure):
    _fields_ = [("fmt", _I32), ("w", _P), ("a", _P), ("b", _P), ("K", _I64), ("N", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight), ("down", _Weight),
        ("norm_in", _P), ("norm_post", _P), ("eps", _F32),
        ("H", _I32), ("KVH", _I32), ("D", _I32), ("hidden", _I64), ("inter", _I64),
        ("kc", _P), ("vc", _P), ("page_size", _I32), ("scale", _F32), ("cos", _P), ("sin", _P),
    ]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [
        ("M", _I64), ("positions", _P), ("slots", _P), ("table", _P), ("table_stride", _I64),
        ("B", _I64), ("q_start", _P), ("q_len", _P), ("seq_len", _P), ("pos_tile", _I32),
        ("h", _P), ("qkv", _P), ("att", _P), ("gu", _P), ("act", _P),
    ]  # fmt: skip


def _weight(w: PackedWeight) -> _Weight:
    ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
    return _Weight(FORMATS[w.fmt], w.data.data_ptr(), ptr(w.scale), ptr(w.offset), w.k, w.n)


def _bf16_vector(t: torch.Tensor, n: int, what: str) -> torch.Tensor:
    if t.dtype != torch.bfloat16 or t.shape != (n,):
        raise ValueError(f"{what} must be a bf16 vector of {n}, got {t.dtype} {tuple(t.shape)}")
    return t.contiguous()


class DecoderLayer:
    """One layer's weights, norms, RoPE tables and (after `bind_cache`) KV caches."""

    def __init__(
        self,
        qkv: PackedWeight,
        o: PackedWeight,
        gate_up: PackedWeight,
        down: PackedWeight,
        norm_in: torch.Tensor,
        norm_post: torch.Tensor,
        eps: float,
        heads: int,
        kv_heads: int,
        head_dim: int,
        scale: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """qkv [(heads + 2 kv_heads) * head_dim, hidden] (q, then k, then v rows); o
        [hidden, heads * head_dim]; gate_up [2 * inter, hidden] (gate rows, then up); down
        [hidden, inter]; cos, sin [positions, head_dim / 2] fp32 (RoPE on halves)."""
        hidden, inter = o.n, down.k
        expect = {
            "qkv": (qkv, (heads + 2 * kv_heads) * head_dim, hidden),
            "o": (o, hidden, heads * head_dim),
            "gate_up": (gate_up, 2 * inter, hidden),
            "down": (down, hidden, inter),
        }
        for name, (w, n, k) in expect.items():
            if (w.n, w.k) != (n, k):
                raise ValueError(f"{name} weight is [{w.n}, {w.k}], the layer needs [{n}, {k}]")
        if head_dim % 2 or kv_heads <= 0 or heads % kv_heads:
            raise ValueError(f"{heads} heads over {kv_heads} KV heads of {head_dim} unsupported")
        if cos.dtype != torch.float32 or cos.shape != sin.shape or cos.shape[1] != head_dim // 2:
            raise ValueError("RoPE tables must be fp32 [positions, head_dim / 2]")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.hidden, self.inter = hidden, inter
        self.max_position = cos.shape[0]
        # the struct holds raw pointers: keep what they point to alive
        self._keep = (qkv, o, gate_up, down)
        self._norms = (
            _bf16_vector(norm_in, hidden, "norm_in"),
            _bf16_vector(norm_post, hidden, "norm_post"),
        )
        self._rope = (cos.contiguous(), sin.contiguous())
        self._caches: tuple[torch.Tensor, torch.Tensor] | None = None
        self._s = _Layer(
            _weight(qkv), _weight(o), _weight(gate_up), _weight(down),
            self._norms[0].data_ptr(), self._norms[1].data_ptr(), eps,
            heads, kv_heads, head_dim, hidden, inter, None, None, 0, scale,
            self._rope[0].data_ptr(), self._rope[1].data_ptr(),
        )  # fmt: skip
        self._addr = ctypes.addressof(self._s)

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """k_cache, v_cache [pages, page_size, kv_heads, head_dim] bf16, contiguous."""
        shape = k_cache.shape
        if (
            len(shape) != 4
            or tuple(shape[2:]) != (self.kv_heads, self.head_dim)
            or v_cache.shape != shape
            or any(c.dtype != torch.bfloat16 or not c.is_contiguous() for c in (k_cache, v_cache))
        ):
            raise ValueError("the native decoder layer needs contiguous bf16 K and V caches")
        self._caches = (k_cache, v_cache)
        self._s.kc, self._s.vc = k_cache.data_ptr(), v_cache.data_ptr()
        self._s.page_size = shape[1]

    def cache_is(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        return self._caches is not None and (
            self._caches[0] is k_cache and self._caches[1] is v_cache
        )

    def __call__(
        self, step: DecoderStep, x: torch.Tensor, residual: torch.Tensor, first: bool
    ) -> None:
        """In place: x [M, hidden] bf16 (the previous layer's MLP output, or the embeddings
        when `first`) becomes this layer's MLP output; residual [M, hidden] the stream after
        it. Writes this step's K and V rows into the caches."""
        if self._caches is None:
            raise RuntimeError("bind_cache before running the layer")
        rc = native().lib.ms_decoder_layer(
            self._addr, step.addr, x.data_ptr(), residual.data_ptr(), int(first)
        )
        if rc != 0:
            raise ValueError("the native decoder layer refused its sizes")


class DecoderStep:
    """One forward's rows and attention layout, and the scratch the layers share."""

    def __init__(
        self,
        layer: DecoderLayer,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        query_lens: list[int],
        seq_lens: list[int],
    ) -> None:
        """positions, slots [M] (a negative slot is not written); block_tables [B, W]; each
        sequence's new rows (query_lens, in row order) and keys after the step (seq_lens).
        `layer` gives the sizes (every layer of a model shares them)."""
        m = positions.shape[0]
        if sum(query_lens) != m or len(seq_lens) != len(query_lens):
            raise ValueError("query_lens must cover the step's rows, one seq_len each")
        if m and int(positions.max()) >= layer.max_position:
            raise ValueError(f"positions reach past the RoPE tables ({layer.max_position})")
        self.positions = positions.to(torch.int64).contiguous()
        self.slots = slots.to(torch.int64).contiguous()
        self.tables = block_tables.to(torch.int32).contiguous()
        starts = [0] * len(query_lens)
        for b in range(1, len(query_lens)):
            starts[b] = starts[b - 1] + query_lens[b - 1]
        self.meta = torch.tensor([starts, list(query_lens), list(seq_lens)], dtype=torch.int64)
        width = (layer.heads + 2 * layer.kv_heads) * layer.head_dim
        sizes = (layer.hidden, width, layer.heads * layer.head_dim, 2 * layer.inter, layer.inter)
        self.scratch = torch.empty(m * sum(sizes), dtype=torch.bfloat16)
        parts, off = [], 0
        for n in sizes:
            parts.append(self.scratch.data_ptr() + 2 * off)
            off += m * n
        meta = self.meta.data_ptr()
        self._s = _Step(
            m, self.positions.data_ptr(), self.slots.data_ptr(), self.tables.data_ptr(),
            self.tables.stride(0), len(query_lens), meta, meta + 8 * len(query_lens),
            meta + 16 * len(query_lens), ATTENTION_POSITIONS, *parts,
        )  # fmt: skip
        self.addr = ctypes.addressof(self._s)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm(bf16(x + residual)) * weight, as the decoder layers compute it; residual
    becomes x + residual. x, residual [M, N] bf16 contiguous."""
    m, n = x.shape
    if (
        residual.shape != x.shape
        or x.dtype != torch.bfloat16
        or residual.dtype != x.dtype
        or not (x.is_contiguous() and residual.is_contiguous())
    ):
        raise ValueError("add_rmsnorm takes contiguous bf16 x and residual of one shape")
    w = _bf16_vector(weight, n, "weight")
    out = torch.empty_like(x)
    if m:
        native().lib.ms_add_rmsnorm(
            x.data_ptr(), residual.data_ptr(), w.data_ptr(), eps, m, n,
            out.data_ptr(),
        )  # fmt: skip
    return out
