"""Native CPU kernels with a fixed arithmetic order (csrc/kernels.c), their weight layouts and
their torch references.

What they guarantee: every output element is computed by one sequence of floating-point
operations that depends only on its own inputs (not on the rows beside it, the number of
rows, the thread count, or whether a key was written in this step or an earlier one). So a
sequence's logits depend only on its tokens: prefix-cache hits, chunk sizes, one token per
step or several, alone or batched, all give the same bits. torch's CPU GEMMs and attention
choose their kernels and blocking by shape (a one-row GEMM takes another path than a
37-row one), which is why these exist.

Activations are bf16; weights are packed once into tiles of 16 output columns (`pack_*`):
dense bf16 pairs, 4-bit codes in groups of 32 with fp32 scales and offsets (GGUF Q4_1's own
form), or int8 with per-column fp32 scales. Each packer has a torch reference
(`*_reference`), used by the tests as the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.kernels.cpu.build import Native, load

TILE = 16  # output columns per tile
GROUP = 32  # q4: inputs per scale group
Q4_BIAS = 128  # q4 codes enter the products as the bf16 value 128 + q
QUAD = 4  # q4: tiles whose blocks alternate group by group
Q4_CODES = 256  # q4: bytes of codes per (tile, group)
# attention: query positions per work item (they share the key / value loads)
ATTENTION_POSITIONS = 16

__all__ = [
    "PackedWeight",
    "attention",
    "attention_reference",
    "linear",
    "linear_reference",
    "native",
    "pack_bf16",
    "pack_i8",
    "pack_q4",
    "pack_q4h",
    "sigmoid_",
    "silu_mul",
]


def native() -> Native | None:
    """The loaded native library, or None (built once per machine; see build.py)."""
    return load()[0]


def set_threads(n: int) -> None:
    """Threads of the native kernels (their own pool, not torch's; default: every core)."""
    lib = native()
    if lib is not None:
        lib.lib.ms_set_threads(n)


def native_status() -> str:
    """One line: which CPU kernels serve, or why torch's do."""
    return load()[1]


@dataclass(frozen=True)
class PackedWeight:
    """One linear weight [n, k] in a native layout (see csrc/kernels.c)."""

    fmt: str  # "bf16", "q4", "q4h" or "i8"
    n: int
    k: int
    data: torch.Tensor
    scale: torch.Tensor | None = None  # i8: s [tiles * 16] (q4, q4h: inside the blocks)
    offset: torch.Tensor | None = None

    @property
    def tiles(self) -> int:
        return -(-self.n // TILE)

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.data, self.scale, self.offset)
            if t is not None
        )


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return (
        t
        if t.shape[0] == rows
        else torch.nn.functional.pad(t, (0,) * (2 * t.dim() - 1) + (rows - t.shape[0],))
    )


def pack_bf16(w: torch.Tensor) -> PackedWeight:
    """w [n, k] (k even) -> tiles [n/16][k/2][16][2] bf16."""
    n, k = w.shape
    if k % 2:
        raise ValueError(f"native bf16 weights need an even input size, got {k}")
    t = -(-n // TILE)
    wp = _pad_rows(w.to(torch.bfloat16), t * TILE).view(t, TILE, k // 2, 2)
    return PackedWeight("bf16", n, k, wp.permute(0, 2, 1, 3).contiguous())


def pack_i8(q: torch.Tensor, scale: torch.Tensor) -> PackedWeight:
    """q [n, k] int8, scale [n] -> tiles [n/16][k][16] int8 and fp32 scales [n/16 * 16]."""
    n, k = q.shape
    t = -(-n // TILE)
    qp = _pad_rows(q.to(torch.int8), t * TILE).view(t, TILE, k)
    s = _pad_rows(scale.float().reshape(n), t * TILE)
    return PackedWeight("i8", n, k, qp.permute(0, 2, 1).contiguous(), scale=s.contiguous())


def _q4_blocks(codes: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """codes [n, k] in 0..15 and two per-group scale tensors [n, k/32] (fp32 or fp16) -> the
    q4 blocks, [tiles / 4][k / 32][4][codes, scales[0], scales[1]] bytes (csrc/kernels.c). In
    the codes of a (tile, group), byte u*64 + lane*16 + half*8 + 2*(j%4) + e (lane = j // 4)
    holds column j's codes for k-pair 4u + half (low nibble) and 4u + 2 + half (high nibble),
    k parity e: what q4_unpack's byte unpacking turns into VDPBF16PS operands."""
    n, k = codes.shape
    if k % GROUP:
        raise ValueError(f"native q4 weights need input sizes divisible by {GROUP}, got {k}")
    t, g = -(-n // (TILE * QUAD)) * QUAD, k // GROUP
    q = _pad_rows(codes.to(torch.uint8), t * TILE)
    # k = g*32 + u*8 + v*2 + e, v = nibble * 2 + half; column j = lane * 4 + jj
    q = q.view(t, 4, 4, g, 4, 2, 2, 2)  # [t, lane, jj, g, u, nibble, half, e]
    byte = q[:, :, :, :, :, 0] | (q[:, :, :, :, :, 1] << 4)  # [t, lane, jj, g, u, half, e]
    parts = [byte.permute(0, 3, 4, 1, 5, 2, 6).reshape(t, g, Q4_CODES)]  # [t, g, u lane half jj e]
    for v in scales:
        per_tile = _pad_rows(v, t * TILE).view(t, TILE, g).transpose(1, 2).contiguous()
        parts.append(per_tile.view(torch.uint8).view(t, g, -1))
    blocks = torch.cat(parts, dim=-1)  # [t, g, block]
    return blocks.view(t // QUAD, QUAD, g, -1).transpose(1, 2).contiguous().view(-1)


def pack_q4(codes: torch.Tensor, d: torch.Tensor, c: torch.Tensor) -> PackedWeight:
    """codes [n, k] in 0..15 and per-group fp32 d, c [n, k/32] (w = d * (128 + q) + c)."""
    return PackedWeight("q4", *codes.shape, _q4_blocks(codes, (d.float(), c.float())))


def pack_q4h(codes: torch.Tensor, d: torch.Tensor, lo: torch.Tensor) -> PackedWeight:
    """codes [n, k] in 0..15 and per-group d, lo [n, k/32] that are fp16 values (w = d * q +
    lo, GGUF Q4_1's form; the kernels compute it as d * (128 + q) + c with c = lo - 128 d in
    fp32, which is what `pack_q4` gets from the same values)."""
    d16, lo16 = d.half(), lo.half()
    if not (torch.equal(d16.float(), d.float()) and torch.equal(lo16.float(), lo.float())):
        raise ValueError("pack_q4h takes scales and minimums that are fp16 values")
    return PackedWeight("q4h", *codes.shape, _q4_blocks(codes, (d16, lo16)))


def fp16_exact(*tensors: torch.Tensor) -> bool:
    """Whether every value is an fp16 value (so `pack_q4h` keeps it exactly)."""
    return all(torch.equal(t.half().float(), t.float()) for t in tensors)


# ---- kernels --------------------------------------------------------------------------------
def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.bfloat16:
        raise TypeError(f"native CPU kernels take bf16 activations, got {x2.dtype}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def linear(
    x: torch.Tensor, w: PackedWeight, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """x [..., k] bf16 @ w^T -> [..., n] in `out_dtype` (bf16 or fp32)."""
    lib = native()
    x2 = _rows(x)
    m = x2.shape[0]
    if x2.shape[1] != w.k:
        raise ValueError(f"input size {x2.shape[1]} does not match the weight's {w.k}")
    y = torch.empty(m, w.n, dtype=out_dtype)
    fp32 = int(out_dtype == torch.float32)
    if m:
        if w.fmt in ("q4", "q4h"):
            lib.lib.ms_gemm_q4(
                x2.data_ptr(), x2.stride(0), m, w.data.data_ptr(), int(w.fmt == "q4h"), w.k, w.n,
                y.data_ptr(), w.n, fp32,
            )  # fmt: skip
        elif w.fmt == "i8":
            lib.lib.ms_gemm_i8(
                x2.data_ptr(), x2.stride(0), m, w.data.data_ptr(), w.scale.data_ptr(),
                w.k, w.n, y.data_ptr(), w.n, fp32,
            )  # fmt: skip
        else:
            lib.lib.ms_gemm_bf16(
                x2.data_ptr(), x2.stride(0), m, w.data.data_ptr(), w.k, w.n, y.data_ptr(), w.n,
                fp32,
            )  # fmt: skip
    return y.view(*x.shape[:-1], w.n)


def silu_mul(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up in bf16 (fp32 inside, rounded once); with `up` None, `gate` is a merged
    [..., 2i] gate-up output and the halves are used."""
    g2 = _rows(gate)
    if up is None:
        i = g2.shape[1] // 2
        u2, ldu, u_ptr = g2, g2.stride(0), g2.data_ptr() + i * g2.element_size()
    else:
        i = g2.shape[1]
        u2 = _rows(up)
        if u2.shape != (g2.shape[0], i):
            raise ValueError(f"gate {tuple(g2.shape)} and up {tuple(u2.shape)} differ")
        ldu, u_ptr = u2.stride(0), u2.data_ptr()
    m = g2.shape[0]
    out = torch.empty(m, i, dtype=torch.bfloat16)
    if m:
        native().lib.ms_silu_mul(g2.data_ptr(), g2.stride(0), u_ptr, ldu, m, i, out.data_ptr(), i)
    return out.view(*gate.shape[:-1], i)


def sigmoid_(x: torch.Tensor) -> torch.Tensor:
    """In place on a contiguous fp32 tensor."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise TypeError("sigmoid_ takes a contiguous fp32 tensor")
    if x.numel():
        native().lib.ms_sigmoid(x.data_ptr(), x.numel())
    return x


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    v_dim: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new query rows over its paged cache.

    q [T, H, Dqk] bf16 (rows of the sequences in order, each sequence's query_lens[b] rows,
    the last ones of its seq_lens[b] positions); k_cache, v_cache [pages, page_size, KVH,
    D*] bf16 views (v may be a column view of k: MLA's latent rows serve as both, the values
    their first `v_dim` columns); block_tables [B, W] int32. Returns [T, H, v_dim] bf16."""
    lib = native()
    t, h, dqk = q.shape
    pages, page_size, kvh = k_cache.shape[:3]
    for c in (k_cache, v_cache):
        if (
            c.dtype != torch.bfloat16
            or c.stride(-1) != 1
            or c.stride(1) != c.stride(0) // page_size
        ):
            raise ValueError("native attention reads bf16 caches with contiguous tokens")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(t, h, v_dim, dtype=torch.bfloat16)
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.int()
    tables = tables.contiguous()
    b = len(query_lens)
    starts = [0]
    for n in query_lens[:-1]:
        starts.append(starts[-1] + n)
    meta = torch.tensor([starts, list(query_lens), list(seq_lens)], dtype=torch.int64)
    rc = lib.lib.ms_attention(
        q.data_ptr(), q.stride(0), q.stride(1), h, kvh, dqk, v_dim,
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(2), tables.data_ptr(), tables.stride(0), page_size, b,
        meta[0].data_ptr(), meta[1].data_ptr(), meta[2].data_ptr(), scale,
        out.data_ptr(), out.stride(0), out.stride(1), ATTENTION_POSITIONS,
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"native attention cannot serve {h} heads over {kvh} KV heads of {dqk}")
    return out


# ---- references (the tests' oracles: fp64, straight from the definitions) -------------------
def linear_reference(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x @ W^T in fp64 from the packed weight's own definition."""
    return x.double() @ unpack(w).double().t()


def unpack(w: PackedWeight) -> torch.Tensor:
    """The dense [n, k] weight a packed weight stands for (fp64)."""
    t = w.tiles
    if w.fmt == "bf16":
        dense = w.data.view(t, w.k // 2, TILE, 2).permute(0, 2, 1, 3).reshape(t * TILE, w.k)
        return dense[: w.n].double()
    if w.fmt == "i8":
        dense = w.data.view(t, w.k, TILE).permute(0, 2, 1).reshape(t * TILE, w.k).double()
        return (dense * w.scale.double()[:, None])[: w.n]
    g = w.k // GROUP
    tq = -(-t // QUAD) * QUAD
    half = w.fmt == "q4h"
    blocks = w.data.view(tq // QUAD, g, QUAD, -1).transpose(1, 2).reshape(tq, g, -1)
    b = blocks[:, :, :Q4_CODES].reshape(tq, g, 4, 4, 2, 4, 2)  # [t, g, u, lane, half, jj, e]
    codes = torch.stack([b & 15, b >> 4], dim=4)  # [t, g, u, lane, nibble, half, jj, e]
    codes = codes.permute(0, 3, 6, 1, 2, 4, 5, 7).reshape(tq * TILE, w.k)  # [n, k]
    sdt = torch.float16 if half else torch.float32
    d, c = blocks[:, :, Q4_CODES:].contiguous().view(sdt).view(tq, g, 2, TILE).unbind(2)

    def per_column(v: torch.Tensor) -> torch.Tensor:  # [t, g, 16] -> [n, k]
        return v.double().transpose(1, 2).reshape(tq * TILE, g).repeat_interleave(GROUP, 1)

    d, c = per_column(d), per_column(c)
    if half:  # c holds the group minimum lo: w = d * q + lo
        return (d * codes.double() + c)[: w.n]
    return (d * (Q4_BIAS + codes.double()) + c)[: w.n]


def attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    v_dim: int,
) -> torch.Tensor:
    """fp64 causal attention over the gathered cache rows, sequence by sequence."""
    h = q.shape[1]
    page_size, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape[0], h, v_dim, dtype=torch.float64)
    start = 0
    for b, (ql, sl) in enumerate(zip(query_lens, seq_lens, strict=True)):
        pages = block_tables[b, : -(-sl // page_size)].long()
        k = k_cache[pages].flatten(0, 1)[:sl].double()  # [sl, kvh, dqk]
        v = v_cache[pages].flatten(0, 1)[:sl, :, :v_dim].double()
        k = k.repeat_interleave(h // kvh, dim=1)
        v = v.repeat_interleave(h // kvh, dim=1)
        qb = q[start : start + ql].double()  # [ql, h, dqk]
        s = torch.einsum("qhd,khd->hqk", qb, k) * scale
        pos = torch.arange(sl - ql, sl)[:, None]
        s = s.masked_fill(torch.arange(sl)[None, :] > pos, float("-inf"))
        out[start : start + ql] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        start += ql
    return out
