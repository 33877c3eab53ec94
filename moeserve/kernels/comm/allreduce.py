"""One-shot all-reduce over peer buffers, optionally fused with the residual add and RMSNorm.

Every rank of a tensor-parallel group holds a *symmetric* buffer that all peers can reach
(``torch.distributed._symmetric_memory``: same size on every rank, mapped into every peer's
address space over NVLink / P2P). One launch on every rank does the whole collective and,
fused, also ``r = sum + residual`` (stored in x's dtype) and ``rmsnorm(r) * weight``. Sums
are taken in fp32 in rank order, so every rank computes bit-identical results.

Two protocols (both: one launch, no closing barrier, graph-capturable):

``flag`` (pull): each program copies its rows of the partial into its rows of the local
buffer (slot ``epoch % 2``), then -- after a CTA barrier -- stores ``epoch`` with release
semantics at system scope into flag ``[program, my rank]`` of every peer, spins (acquire
loads) until every peer's flag in the local flag area has reached ``epoch``, and reads the
peers' rows over NVLink. Why one handshake per call is enough: a rank writes slot ``s``
again two calls later; by then its program 0 has waited, in the call in between, for every
peer's program-0 flag of that call, which a peer posts only once that call's kernel runs,
i.e. after its previous kernel (the last reader of slot ``s``) has finished. Flags hold the
epoch (int64, never wraps): a wait is ``flag >= epoch``; a peer is at most one call ahead.

``lamport`` (push): each program writes its rows of the partial straight into every peer's
buffer (generation ``epoch % 3``, region of the sender), and polls its own buffer until no
element of a peer's rows is still the sentinel ``-0.0`` (senders turn their ``-0.0`` into
``+0.0``; the sum is unchanged). Data and signal are one remote store, so a call costs one
NVLink crossing instead of a flag hop plus a read round trip, and it needs no P2P atomics.
At the end each program resets what the previous call delivered (generation ``epoch - 1``)
to the sentinel. Why three generations suffice: a peer writes generation ``g`` again only at
call ``e + 3``, which it reaches only after this rank's data of call ``e + 2`` arrived, sent
after this rank's call ``e + 1`` kernel, the one that reset ``g``, had finished; and a peer
can be at most one call ahead, writing generation ``e + 1``, reset two calls before.

Both keep a per-program call counter (``epoch``) in local device memory; the grid is fixed
per buffer set, every program bumps its counter every call (all counters agree; a CTA
barrier separates every warp's read of it from the one thread's write), programs
without rows skip the exchange. Launches allocate nothing and the host never waits. A wait
that outlives ``timeout`` (global timer on the GPU, spin count in the CPU interpreter) sets
``status[0] = 1`` and goes on: a group out of step gives wrong numbers and a flag that
:func:`check_status` turns into one clear error, never a hang.

No NVLink multicast (multimem / NVLS) is used anywhere: only loads, stores and atomics on
peer-mapped memory.

Layouts (all contiguous; E = capacity_rows * hidden elements):

- ``x``       ``[n_rows, hidden]`` (fused) or any shape (plain, flattened into rows of
              ``hidden``), dtype of the buffers (bf16 / fp16 / fp32).
- buffers     per rank, flag: ``[2, E]``; lamport: ``[3, world, E]`` filled with ``-0.0``.
- flags       per rank ``[programs, world]`` int64, zero at start (flag protocol only).
- counters    local ``[programs, 2]`` int64, zero at start: epoch, rows of the last call.
- status      local ``[1]`` int32, zero at start.

In the CPU tests the "peers" are plain local tensors (the interpreter reads any pointer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moeserve.kernels.runtime import interpreting

PROTOCOLS = ("lamport", "flag")
# Upper bound on the grid. Waiting programs need their partner program resident on every
# peer; a grid well under the SM count of any target GPU (>= 108) keeps all of them resident.
MAX_PROGRAMS = 64
# Every world size up to 8 is one compiled specialisation (WORLD is a constexpr).
MAX_WORLD = 8
_FLAG_LANES = tl.constexpr(MAX_WORLD)  # one lane per rank when polling the flags
# A wait longer than this means the group is out of step (one rank skipped or added a call):
# generous, because a peer may still be compiling the kernel or preparing its step.
DEFAULT_TIMEOUT_NS = 120 * 10**9
# The interpreter has no clock; its spin bound only needs to end a test that is out of step.
INTERPRETER_MAX_SPINS = 1000
# A row lives in registers (16 warps): wider rows would spill; the communicator uses NCCL.
MAX_HIDDEN = 16384
LAMPORT_GENERATIONS = 3
FLAG_SLOTS = 2


def buffer_elements(protocol: str, capacity_rows: int, hidden: int, world: int) -> int:
    """Elements of one rank's data buffer."""
    if protocol == "flag":
        return FLAG_SLOTS * capacity_rows * hidden
    if protocol == "lamport":
        return LAMPORT_GENERATIONS * world * capacity_rows * hidden
    raise ValueError(f"protocol must be one of {PROTOCOLS}, not {protocol!r}")


def num_programs(capacity_rows: int) -> int:
    """The grid: one program per row up to MAX_PROGRAMS (then several rows per program)."""
    return max(1, min(capacity_rows, MAX_PROGRAMS))


@dataclass(frozen=True)
class PeerBuffers:
    """One rank's view of the group's buffers: its own and every peer's, in rank order.

    On a GPU ``buffers``/``flags`` come from a symmetric-memory rendezvous (peer tensors
    are views of peer memory); in CPU tests they are local tensors standing in for peers.
    """

    protocol: str  # "lamport" or "flag"
    rank: int
    world: int
    buffers: tuple[torch.Tensor, ...]  # world x [buffer_elements] (data dtype)
    flags: tuple[torch.Tensor, ...]  # world x [programs * world] int64 (flag protocol)
    counters: torch.Tensor  # [programs, 2] int64, local; programs = the grid (num_programs)
    status: torch.Tensor  # [1] int32, local
    hidden: int  # row length
    capacity_rows: int  # rows of `hidden` one call may carry
    # what must outlive the views (symmetric allocations and their handles)
    keepalive: Any = field(default=None, repr=False, compare=False)

    @property
    def programs(self) -> int:
        return self.counters.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.buffers[0].dtype

    @property
    def region(self) -> int:
        """Elements of one slot (flag) or one sender's region of a generation (lamport)."""
        return self.capacity_rows * self.hidden

    def validate(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, not {self.protocol!r}")
        if not 2 <= self.world <= MAX_WORLD or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} of world {self.world} (2..{MAX_WORLD} ranks)")
        if len(self.buffers) != self.world:
            raise ValueError("need one buffer per rank")
        if not 1 <= self.hidden <= MAX_HIDDEN:
            raise ValueError(f"rows of {self.hidden} elements (1..{MAX_HIDDEN})")
        if not 1 <= self.programs <= MAX_PROGRAMS or self.counters.shape[1:] != (2,):
            raise ValueError(f"counters must be int64 [programs (1..{MAX_PROGRAMS}), 2]")
        n = buffer_elements(self.protocol, self.capacity_rows, self.hidden, self.world)
        for b in self.buffers:
            if b.dtype != self.dtype or b.numel() != n:
                raise ValueError(f"every buffer must be {self.dtype} with {n} elements")
        if self.protocol == "flag":
            if len(self.flags) != self.world or any(
                f.dtype != torch.int64 or f.numel() != self.programs * self.world
                for f in self.flags
            ):
                raise ValueError("flag areas must be int64 [programs * world], one per rank")
        if self.status.dtype != torch.int32 or self.counters.dtype != torch.int64:
            raise ValueError("status is int32 [1], counters int64")


def sentinel_fill_(t: torch.Tensor) -> torch.Tensor:
    """Fill a lamport buffer with the 'not arrived' value (-0.0)."""
    return t.fill_(-0.0)


# ------------------------------------------------------------------------------- reference


def all_reduce_reference(partials: list[torch.Tensor]) -> torch.Tensor:
    """Sum of every rank's partial, in fp32 and rank order, stored in the partials' dtype."""
    acc = torch.zeros_like(partials[0], dtype=torch.float32)
    for p in partials:
        acc = acc + p.float()
    return acc.to(partials[0].dtype)


def all_reduce_add_rmsnorm_reference(
    partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(r) * weight, r) with r = sum(partials) + residual in fp32, stored in the
    partials' dtype; the norm reads the stored r (what the next layer sees)."""
    acc = torch.zeros_like(partials[0], dtype=torch.float32)
    for p in partials:
        acc = acc + p.float()
    r = (acc + residual.float()).to(partials[0].dtype)
    y = F.rms_norm(r.float(), (r.shape[-1],), weight.float(), eps)
    return y.to(r.dtype), r


# ---------------------------------------------------------------------------------- kernels


@triton.jit
def _now(TIMER: tl.constexpr):
    if TIMER:
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        t = tl.full([], 0, tl.int64)
    return t


@triton.jit
def _row_mask(in_row, row, n_rows, offs, numel, FUSED: tl.constexpr):
    # fused rows are whole; a plain message may end inside its last row
    mask = in_row & (row < n_rows)
    if not FUSED:
        mask = mask & (offs < numel)
    return mask


@triton.jit
def _is_sentinel(v):
    if v.dtype.primitive_bitwidth == 16:
        hit = v.to(tl.int16, bitcast=True) == -32768
    else:
        hit = v.to(tl.int32, bitcast=True) == -2147483648
    return hit


@triton.jit
def _sentinel(BLOCK: tl.constexpr, dtype: tl.constexpr):
    # from its bits: a -0.0 literal is folded into +0.0 by the compiler
    if dtype.primitive_bitwidth == 16:
        bits = tl.full((BLOCK,), -32768, tl.int16)
    else:
        bits = tl.full((BLOCK,), -2147483648, tl.int32)
    return bits.to(dtype, bitcast=True)


@triton.jit
def _preload(x_ptr, res_ptr, w_ptr, offs, cols, in_row, mask, FUSED: tl.constexpr):
    """This rank's partial (-0.0 as +0.0, as sent), the residual and the norm weight of a
    row, issued before the peers' rows are awaited so that their latency hides behind it."""
    mine = tl.load(x_ptr + offs, mask=mask, other=0.0)
    mine = tl.where(_is_sentinel(mine), tl.zeros_like(mine), mine)
    if FUSED:
        res = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    else:
        res = tl.zeros(offs.shape, tl.float32)
        w = res
    return mine, res, w


@triton.jit
def _finish(acc, res, w, offs, mask, out_ptr, res_out_ptr, row_len, eps, FUSED: tl.constexpr):
    """Store the row's sum, or add the residual, store it and store its RMSNorm."""
    if FUSED:
        r = (acc + res).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + offs, r, mask=mask)
        rf = r.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(rf * rf) / row_len + eps)
        tl.store(out_ptr + offs, (rf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _flag_handshake(
    flags,
    status_ptr,
    pid,
    epoch,
    timeout,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    TIMER: tl.constexpr,
):
    """Tell every peer that this program's rows of `epoch` are published; wait for theirs."""
    # every thread's stores to the local buffer happen before the release below
    tl.debug_barrier()
    for q in tl.static_range(WORLD):
        if q != RANK:
            tl.atomic_xchg(flags[q] + pid * WORLD + RANK, epoch, sem="release", scope="sys")
    lanes = tl.arange(0, _FLAG_LANES)
    mine = flags[RANK] + pid * WORLD + lanes
    peer = (lanes < WORLD) & (lanes != RANK)
    seen = tl.atomic_add(mine, 0, mask=peer, sem="acquire", scope="sys")
    late = tl.sum(tl.where(peer & (seen < epoch), 1, 0))
    start = _now(TIMER)
    waited = start - start
    while (late > 0) & (waited < timeout):
        seen = tl.atomic_add(mine, 0, mask=peer, sem="acquire", scope="sys")
        late = tl.sum(tl.where(peer & (seen < epoch), 1, 0))
        if TIMER:
            waited = _now(TIMER) - start
        else:
            waited += 1
    if late > 0:
        tl.atomic_xchg(status_ptr, 1)
    # every thread's reads of peer rows happen after the acquire above
    tl.debug_barrier()


# n_rows changes with the batch: one compiled kernel for all (no recompiling at capture).
# numel stays specialised: its divisibility by 16 is what lets the plain path vectorise.
@triton.jit(do_not_specialize=["n_rows", "timeout"])
def _flag_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    buffers,
    flags,
    counters_ptr,
    status_ptr,
    n_rows,
    numel,
    row_len,
    region,
    eps,
    timeout,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    PROGRAMS: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    BLOCK: tl.constexpr,
    FUSED: tl.constexpr,
    TIMER: tl.constexpr,
):
    pid = tl.program_id(0)
    epoch = tl.load(counters_ptr + 2 * pid) + 1
    # every warp reads the counter before one thread overwrites it (without the barrier a
    # late warp reads the next epoch and uses the other slot: stale rows, silently)
    tl.debug_barrier()
    tl.store(counters_ptr + 2 * pid, epoch)
    slot = (epoch % 2) * region
    cols = tl.arange(0, BLOCK)
    in_row = cols < row_len
    if pid < n_rows:
        for i in range(ROWS_PER_PROGRAM):
            row = pid + i * PROGRAMS
            if row < n_rows:  # later rows only exist in large batches
                offs = row * row_len + cols
                mask = _row_mask(in_row, row, n_rows, offs, numel, FUSED)
                v = tl.load(x_ptr + offs, mask=mask)
                tl.store(buffers[RANK] + slot + offs, v, mask=mask)
        _flag_handshake(flags, status_ptr, pid, epoch, timeout, RANK, WORLD, TIMER)
        for i in range(ROWS_PER_PROGRAM):
            row = pid + i * PROGRAMS
            if row < n_rows:  # later rows only exist in large batches
                offs = row * row_len + cols
                mask = _row_mask(in_row, row, n_rows, offs, numel, FUSED)
                mine, res, w = _preload(x_ptr, res_ptr, w_ptr, offs, cols, in_row, mask, FUSED)
                acc = tl.zeros((BLOCK,), tl.float32)
                for q in tl.static_range(WORLD):
                    if q == RANK:
                        v = mine
                    else:
                        # .cg: from the owner's L2, never a stale L1 line of an older call
                        v = tl.load(
                            buffers[q] + slot + offs, mask=mask, other=0.0, cache_modifier=".cg"
                        )
                    acc += v.to(tl.float32)
                _finish(acc, res, w, offs, mask, out_ptr, res_out_ptr, row_len, eps, FUSED)


@triton.jit
def _lamport_receive(ptrs, mask, status_ptr, timeout, TIMER: tl.constexpr):
    """Load a peer's row from the local buffer once no element is the sentinel any more."""
    v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
    late = tl.sum(tl.where(mask & _is_sentinel(v), 1, 0))
    start = _now(TIMER)
    waited = start - start
    while (late > 0) & (waited < timeout):
        v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
        late = tl.sum(tl.where(mask & _is_sentinel(v), 1, 0))
        if TIMER:
            waited = _now(TIMER) - start
        else:
            waited += 1
    if late > 0:
        tl.atomic_xchg(status_ptr, 1)
    return v


@triton.jit(do_not_specialize=["n_rows", "timeout"])
def _lamport_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    buffers,
    counters_ptr,
    status_ptr,
    n_rows,
    numel,
    row_len,
    region,
    eps,
    timeout,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    PROGRAMS: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    BLOCK: tl.constexpr,
    FUSED: tl.constexpr,
    TIMER: tl.constexpr,
):
    pid = tl.program_id(0)
    epoch = tl.load(counters_ptr + 2 * pid) + 1
    last_rows = tl.load(counters_ptr + 2 * pid + 1)
    # as in _flag_kernel: all warps read the counters before they are overwritten (a late
    # warp would use the next generation and reset the wrong rows)
    tl.debug_barrier()
    tl.store(counters_ptr + 2 * pid, epoch)
    tl.store(counters_ptr + 2 * pid + 1, n_rows.to(tl.int64))
    generation = WORLD * region
    gen = (epoch % 3) * generation
    cols = tl.arange(0, BLOCK)
    in_row = cols < row_len
    if pid < n_rows:
        for i in range(ROWS_PER_PROGRAM):
            row = pid + i * PROGRAMS
            if row < n_rows:  # later rows only exist in large batches
                offs = row * row_len + cols
                mask = _row_mask(in_row, row, n_rows, offs, numel, FUSED)
                v = tl.load(x_ptr + offs, mask=mask, other=0.0)
                v = tl.where(_is_sentinel(v), tl.zeros_like(v), v)
                for q in tl.static_range(WORLD):
                    if q != RANK:
                        tl.store(buffers[q] + gen + RANK * region + offs, v, mask=mask)
        for i in range(ROWS_PER_PROGRAM):
            row = pid + i * PROGRAMS
            if row < n_rows:  # later rows only exist in large batches
                offs = row * row_len + cols
                mask = _row_mask(in_row, row, n_rows, offs, numel, FUSED)
                mine, res, w = _preload(x_ptr, res_ptr, w_ptr, offs, cols, in_row, mask, FUSED)
                acc = tl.zeros((BLOCK,), tl.float32)
                for q in tl.static_range(WORLD):
                    if q == RANK:
                        v = mine
                    else:
                        src = buffers[RANK] + gen + q * region + offs
                        v = _lamport_receive(src, mask, status_ptr, timeout, TIMER)
                    acc += v.to(tl.float32)
                _finish(acc, res, w, offs, mask, out_ptr, res_out_ptr, row_len, eps, FUSED)
    # reset what the previous call delivered here; peers write it again three calls later
    if pid < last_rows:
        old = ((epoch + 2) % 3) * generation
        empty = _sentinel(BLOCK, buffers[RANK].dtype.element_ty)
        for i in range(ROWS_PER_PROGRAM):
            row = pid + i * PROGRAMS
            if row < last_rows:  # later rows only exist in large batches
                for q in tl.static_range(WORLD):
                    if q != RANK:
                        dst = buffers[RANK] + old + q * region + row * row_len + cols
                        tl.store(dst, empty, mask=in_row)


# --------------------------------------------------------------------------------- wrappers


def _launch(
    bufs: PeerBuffers,
    x: torch.Tensor,
    res: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    res_out: torch.Tensor,
    n_rows: int,
    eps: float,
    fused: bool,
    timeout: int | None,
) -> None:
    timer = x.is_cuda and not interpreting()
    if timeout is None:
        timeout = DEFAULT_TIMEOUT_NS if timer else INTERPRETER_MAX_SPINS
    block = triton.next_power_of_2(bufs.hidden)
    head = (x, res, w, out, res_out, bufs.buffers)
    if bufs.protocol == "flag":
        kernel, args = _flag_kernel, (*head, bufs.flags)
    else:
        kernel, args = _lamport_kernel, head
    kernel[(bufs.programs,)](
        *args,
        bufs.counters,
        bufs.status,
        n_rows,
        x.numel(),
        bufs.hidden,
        bufs.region,
        eps,
        timeout,
        RANK=bufs.rank,
        WORLD=bufs.world,
        PROGRAMS=bufs.programs,
        ROWS_PER_PROGRAM=triton.cdiv(bufs.capacity_rows, bufs.programs),
        BLOCK=block,
        FUSED=fused,
        TIMER=timer,
        num_warps=max(1, min(16, block // 512)),
    )


def one_shot_all_reduce(
    bufs: PeerBuffers, x: torch.Tensor, out: torch.Tensor, timeout: int | None = None
) -> torch.Tensor:
    """out = sum over ranks of x (any shape, contiguous, at most capacity_rows * hidden
    elements, the buffers' dtype). ``out`` may be ``x``. Every rank must make the same call."""
    if x.dtype != bufs.dtype or out.dtype != x.dtype or out.numel() != x.numel():
        raise ValueError(f"x/out must be {bufs.dtype} of equal size")
    if not (x.is_contiguous() and out.is_contiguous()):
        raise ValueError("x and out must be contiguous")
    if x.numel() > bufs.region:
        raise ValueError(f"{x.numel()} elements exceed the buffer capacity of {bufs.region}")
    if x.numel() == 0:
        return out
    n_rows = triton.cdiv(x.numel(), bufs.hidden)
    _launch(bufs, x, x, x, out, out, n_rows, 0.0, False, timeout)
    return out


def one_shot_all_reduce_add_rmsnorm(
    bufs: PeerBuffers,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    timeout: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """r = sum over ranks of x + residual; residual_out = r; out = rmsnorm(r) * weight.

    x ``[..., hidden]`` contiguous in the buffers' dtype; residual same shape (any float
    dtype); weight ``[hidden]``; out/residual_out preallocated in x's dtype and shape
    (residual_out may be residual). Every rank must make the same call.
    """
    hidden = bufs.hidden
    if x.dtype != bufs.dtype or x.shape[-1] != hidden:
        raise ValueError(f"x must be {bufs.dtype} [..., {hidden}], got {x.dtype} {tuple(x.shape)}")
    for name, t in (("residual", residual), ("out", out), ("residual_out", residual_out)):
        if t.shape != x.shape or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous with x's shape {tuple(x.shape)}")
    if out.dtype != x.dtype or residual_out.dtype != x.dtype:
        raise ValueError("out and residual_out must have x's dtype")
    if weight.shape != (hidden,) or not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"weight must be [{hidden}], weight and x contiguous")
    n_rows = x.numel() // hidden
    if n_rows > bufs.capacity_rows:
        raise ValueError(f"{n_rows} rows exceed the buffer capacity of {bufs.capacity_rows}")
    if n_rows == 0:
        return out, residual_out
    _launch(bufs, x, residual, weight, out, residual_out, n_rows, eps, True, timeout)
    return out, residual_out


def check_status(bufs: PeerBuffers) -> None:
    """Raise if any wait of this rank timed out (synchronises with the device)."""
    if int(bufs.status.item()) != 0:
        raise RuntimeError(
            f"one-shot all-reduce: rank {bufs.rank} waited past its timeout for a peer; "
            "the ranks' calls are out of step (results since then are wrong)"
        )
