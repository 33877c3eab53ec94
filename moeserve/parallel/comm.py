"""Communicators: the device collectives of one tensor-parallel group, chosen once at start-up.

- ``single``: one rank, no collectives (the fused add + RMSNorm still runs).
- ``gloo`` / ``nccl``: torch.distributed on the group (host tensors; GPUs that cannot reach
  each other's memory; GPUs on several hosts; messages above the one-shot threshold).
- ``one-shot (symmetric memory, P2P)``: small all-reduces as one Triton launch per rank that
  exchanges the partials through peer memory (``moeserve.kernels.comm.allreduce``: pushed into
  every peer's buffer by default, or pulled after a flag handshake), fused with the residual
  add and the next RMSNorm; NCCL above ``one_shot_max_bytes`` and for all-gather. Symmetric
  buffers come from ``torch.distributed._symmetric_memory`` with NVLink multicast forced off
  (it can take a host's shared GPUs down). A start-up self-test on every rank must pass, or
  the group falls back to NCCL (and says so).

The choice is `choose_all_reduce`, a pure function of a `Topology` (same host, peer access
between every pair as ``torch.cuda.can_device_access_peer`` says, NVLink or PCIe as nvml says):
one-shot wherever every pair has peer access, PCIe included (with a lower threshold over PCIe);
NCCL otherwise, with ``NCCL_NO_P2P_ENV`` on one host without peer access. `moeserve plan`
evaluates the same function on `planned_topology`.

Layers reach the communicator through their ``TPGroup``; ``describe()`` is the one
start-up line that names the choice and why. Every rank must issue the same collectives in
the same order on one stream (the one-shot kernels count calls on the device to pair them);
``OneShotCommunicator.check()`` raises if a rank ever waited past its timeout.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moeserve.hardware import Interconnect
from moeserve.kernels.comm import allreduce as ar
from moeserve.kernels.elementwise.norm import add_rmsnorm

log = logging.getLogger(__name__)

# Largest message (bytes per rank) the one-shot path takes; NCCL above. On 2 H200s this
# kernel beats NCCL at every size measured, 2.4x at 3.5 MB (256 tokens x 7168 bf16: 17.7 vs
# 43.1 us, benchmarks/results/allreduce.md): 4 MiB there. With more ranks every rank reads
# more peers per row and the crossover is not measured yet: 1 MiB (64 tokens of 7168), where
# torch's one-shot on 2 GPUs already won by 2x (shared/PERF.md).
ONE_SHOT_MAX_BYTES = 1 << 20
ONE_SHOT_MAX_BYTES_2_RANKS = 4 << 20
# Over PCIe each rank pushes its partial to every peer (world - 1 copies over its link) where a
# ring moves about 2x the message: with the figures measured elsewhere on 8 RTX PRO 6000
# (one-shot ~8 us, NCCL ~24 us up to 8 KB, ~54 GB/s P2P) the two cross near
# 16 us x 54 GB/s / (7 - 1.75) ~ 165 KB. An estimate, not a measurement here: 128 KiB.
ONE_SHOT_MAX_BYTES_PCIE = 128 << 10


# "nvlink" (every pair), "pcie" (some pair without NVLink), "unknown" (no nvml to ask)
Link = Literal["nvlink", "pcie", "unknown"]


def one_shot_max_bytes_for(world: int, link: Link = "unknown") -> int:
    """The one-shot threshold for a group of `world` ranks over `link` (see Topology)."""
    if link == "pcie":
        return ONE_SHOT_MAX_BYTES_PCIE
    return ONE_SHOT_MAX_BYTES_2_RANKS if world == 2 else ONE_SHOT_MAX_BYTES


# "lamport" (push; data doubles as the signal) or "flag" (pull after a release/acquire flag
# exchange): moeserve/kernels/comm/allreduce.py; benchmarks/allreduce.py times both. Lamport is
# faster on 2 H200s (4.7 vs 5.6 us fused at 14 KB): one NVLink crossing instead of a flag hop
# plus a read round trip.
DEFAULT_PROTOCOL = "lamport"

ONE_SHOT_NAME = "one-shot (symmetric memory, P2P)"
PREFERENCES = ("auto", "nccl", "one-shot")

# NVLink multicast (NVLS / multimem) is never used: set before any NCCL communicator or
# symmetric-memory rendezvous of this process is created.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# NCCL for GPUs of one host that cannot reach each other's memory (PCIe without P2P): decode's
# all-reduces are small, so the low-latency LL protocol should serve them. NCCL has no
# size-threshold knob; NCCL_PROTO limits its tuner to LL (small messages) and Simple (large
# ones: LL would halve prefill's bandwidth). LL128 is NVLink-only in NCCL's defaults, so on
# PCIe this pins the default rather than changing it. A value the user set is kept.
NCCL_NO_P2P_ENV = {"NCCL_PROTO": "LL,Simple"}
# A start-up self-test wait longer than this marks the one-shot path broken (then NCCL).
SELF_TEST_TIMEOUT_NS = 60 * 10**9
# Calls of each kernel in the self-test: enough to cycle through every buffer generation.
SELF_TEST_ROUNDS = 3
_P2P_NATIVE_ATOMICS = 3  # cudaDevP2PAttrNativeAtomicSupported


class Communicator(Protocol):
    """Collectives over one tensor-parallel group. Every rank makes the same calls in the
    same order with the same shapes."""

    name: str

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks; may work in place (x is consumed)."""
        ...

    def all_reduce_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """r = all_reduce(x) + residual (fp32 math, stored in x.dtype); returns
        (rmsnorm(r) * weight, r). x is consumed."""
        ...

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along dim, in rank order."""
        ...

    def describe(self) -> str:
        """One start-up line naming the choice and why."""
        ...

    def check(self) -> None:
        """Raise if a collective of this rank went wrong without raising at the time (the
        one-shot kernels' timeouts); synchronises, so call it outside CUDA graphs."""
        ...


# ------------------------------------------------------------------------ local add + norm


def _torch_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # the RMSNorm module's formula: the sum is rounded once to x's dtype, the norm reads it
    r = x + residual
    return F.rms_norm(r, (r.shape[-1],), weight, eps), r


def _triton_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # one launch (same numerics as the torch formula); it takes [T, N] rows of one dtype
    if x.dim() == 0 or residual.dtype != x.dtype or residual.shape != x.shape:
        return _torch_add_rmsnorm(x, residual, weight, eps)
    n = x.shape[-1]
    y, r = add_rmsnorm(x.reshape(-1, n), residual.reshape(-1, n), weight, eps)
    return y.view(x.shape), r.view(x.shape)


AddRMSNorm = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]


def local_add_rmsnorm(device: torch.device) -> tuple[AddRMSNorm, str]:
    """The single-device add + RMSNorm for `device` and its name for describe(): the Triton
    kernel of moeserve.kernels.elementwise.norm on GPUs, torch on the CPU (no Triton there)."""
    if device.type == "cuda":
        return _triton_add_rmsnorm, "Triton add_rmsnorm"
    return _torch_add_rmsnorm, "torch add + rms_norm"


# ------------------------------------------------------------------------- communicators


class SingleCommunicator:
    """One rank: collectives are the identity."""

    name = "single"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._add_rmsnorm, self._norm_name = local_add_rmsnorm(torch.device(device))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_reduce_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._add_rmsnorm(x, residual, weight, eps)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x

    def describe(self) -> str:
        return f"communicator: single (1 rank, no collectives; add + RMSNorm: {self._norm_name})"

    def check(self) -> None:
        pass


class TorchCommunicator:
    """torch.distributed collectives on the group (gloo for host tensors, NCCL for GPUs)."""

    def __init__(
        self, group: Any, world: int, backend: str, reason: str, device: torch.device
    ) -> None:
        self.group = group
        self.world = world
        self.name = backend
        self.reason = reason
        self._add_rmsnorm, self._norm_name = local_add_rmsnorm(device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._add_rmsnorm(self.all_reduce(x), residual, weight, eps)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def describe(self) -> str:
        return (
            f"communicator: {self.name} (torch.distributed, {self.world} ranks): {self.reason}; "
            f"add + RMSNorm: {self._norm_name}"
        )

    def check(self) -> None:
        pass  # torch.distributed raises (or times out) on its own


class OneShotCommunicator:
    """Small all-reduces (and all-reduce + residual + RMSNorm) as one launch over symmetric
    peer buffers; anything larger, of another dtype or not contiguous goes to `fallback`."""

    name = ONE_SHOT_NAME

    def __init__(
        self,
        bufs: ar.PeerBuffers,
        fallback: Communicator,
        max_bytes: int,
        reason: str,
        timeout: int | None = None,
    ) -> None:
        bufs.validate()
        self.bufs = bufs
        self.fallback = fallback
        self.max_bytes = max_bytes
        self.reason = reason
        self.timeout = timeout  # None: the kernel module's default for the device

    @property
    def world(self) -> int:
        return self.bufs.world

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the one-shot path handles an all-reduce of x (else the fallback)."""
        b = self.bufs
        return (
            x.dtype == b.dtype
            and x.is_contiguous()
            and 0 < x.numel() <= b.capacity_rows * b.hidden
            and x.numel() * x.element_size() <= self.max_bytes
        )

    def takes_rows(self, x: torch.Tensor) -> bool:
        """Whether the fused all-reduce + add + RMSNorm of x runs in one launch."""
        return x.dim() >= 1 and x.shape[-1] == self.bufs.hidden and self.takes(x)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if not self.takes(x):
            return self.fallback.all_reduce(x)
        return ar.one_shot_all_reduce(self.bufs, x, x, self.timeout)

    def all_reduce_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.takes_rows(x) or residual.shape != x.shape:
            return self.fallback.all_reduce_add_rmsnorm(x, residual, weight, eps)
        out = torch.empty_like(x)
        r = torch.empty_like(x)
        return ar.one_shot_all_reduce_add_rmsnorm(
            self.bufs, x, residual.contiguous(), weight.contiguous(), eps, out, r, self.timeout
        )

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self.fallback.all_gather(x, dim)

    def check(self) -> None:
        """Raise if a wait of this rank timed out (synchronises; call outside graphs)."""
        ar.check_status(self.bufs)

    def describe(self) -> str:
        b = self.bufs
        dtype = str(b.dtype).removeprefix("torch.")
        kib = b.capacity_rows * b.hidden * b.buffers[0].element_size() / 1024
        return (
            f"communicator: {self.name}, {self.world} ranks, {b.protocol} protocol: all-reduce "
            f"of up to {b.capacity_rows} tokens x {b.hidden} {dtype} ({kib:.0f} KiB per rank; "
            f"threshold {self.max_bytes // 1024} KiB) in one launch, fused with residual add + "
            f"RMSNorm; {self.fallback.name} above that and for all-gather; {self.reason}; "
            "NVLink multicast off"
        )


# ----------------------------------------------------------------------------- selection


@dataclass(frozen=True)
class Topology:
    """Where the group's GPUs are, as every rank agrees."""

    same_host: bool
    p2p: bool  # every pair of the group's GPUs can read each other's memory
    detail: str  # why p2p is False, or how the peers are connected
    link: Link = "unknown"


@dataclass(frozen=True)
class AllReduceChoice:
    """The group's all-reduce: `kind` as `choose` returns it, why, the one-shot threshold
    (bytes per rank; NCCL above) and the NCCL settings this choice applies."""

    kind: str  # "single" | "torch" | "one-shot"
    why: str
    one_shot_max_bytes: int
    nccl_env: dict[str, str]

    def line(self) -> str:
        """The choice in one line, as the start-up banner and `moeserve plan` say it."""
        if self.kind == "one-shot":
            return (
                f"one-shot over peer memory up to {self.one_shot_max_bytes // 1024} KiB per rank, "
                f"NCCL above ({self.why})"
            )
        if self.kind == "single":
            return f"none ({self.why})"
        env = " ".join(f"{k}={v}" for k, v in self.nccl_env.items())
        return f"NCCL{f' with {env}' if env else ''} ({self.why})"


def planned_topology(interconnect: Interconnect, hosts: int = 1) -> Topology:
    """The Topology a deployment of GPUs linked by `interconnect` (moeserve.hardware) over
    `hosts` hosts would probe at start-up."""
    if hosts > 1:
        return Topology(False, False, f"the ranks span {hosts} hosts")
    if interconnect == "nvlink":
        return Topology(True, True, "every pair P2P-accessible; NVLink", "nvlink")
    if interconnect == "pcie-p2p":
        return Topology(True, True, "every pair P2P-accessible; PCIe", "pcie")
    return Topology(True, False, "PCIe without peer access", "pcie")


def choose_all_reduce(
    world: int,
    topology: Topology | None,
    prefer: str = "auto",
    symm_mem_reason: str | None = None,
    rows: int = 1,
    one_shot_max_bytes: int | None = None,
) -> AllReduceChoice:
    """The all-reduce of `world` GPU ranks over `topology`, a pure function (no device, no
    environment): one-shot whenever every pair of GPUs has peer access, over NVLink or PCIe;
    NCCL across hosts, and with NCCL_NO_P2P_ENV on one host without peer access.
    `rows`: see one_shot_rows (0: a row does not fit the one-shot buffers)."""
    link = topology.link if topology is not None else "unknown"
    max_bytes = one_shot_max_bytes or one_shot_max_bytes_for(world, link)
    kind, why = choose(world, "cuda", topology, symm_mem_reason, rows, prefer)
    no_p2p = topology is not None and topology.same_host and not topology.p2p
    env = dict(NCCL_NO_P2P_ENV) if kind == "torch" and no_p2p else {}
    return AllReduceChoice(kind, why, max_bytes, env)


def one_shot_rows(max_tokens: int, hidden: int, dtype: torch.dtype, max_bytes: int) -> int:
    """Rows of `hidden` the one-shot buffers hold: the largest batch, capped by the threshold;
    0 where a row is wider than the kernel holds."""
    if hidden > ar.MAX_HIDDEN:
        return 0
    elem = torch.empty((), dtype=dtype).element_size()
    return max(0, min(max_tokens, max_bytes // (hidden * elem)))


def choose(
    world: int,
    device_type: str,
    topology: Topology | None,
    symm_mem_reason: str | None,
    rows: int,
    prefer: str = "auto",
) -> tuple[str, str]:
    """("single" | "torch" | "one-shot", why). `symm_mem_reason`: why torch's symmetric
    memory cannot be used here, None when it can; `rows`: see one_shot_rows."""
    if prefer not in PREFERENCES:
        raise ValueError(f"all-reduce must be one of {', '.join(PREFERENCES)}, not {prefer!r}")
    if world == 1:
        return "single", "one rank"
    if device_type != "cuda":
        return "torch", f"{device_type} tensors"
    if prefer == "nccl":
        return "torch", "NCCL requested"
    if topology is None or not topology.same_host:
        return "torch", "ranks span hosts (one-shot needs peer memory on one host)"
    if not topology.p2p:
        return "torch", f"GPUs cannot reach each other's memory ({topology.detail})"
    if symm_mem_reason is not None:
        return "torch", symm_mem_reason
    if rows < 1:
        return "torch", "a token's row exceeds the one-shot threshold or the kernel's row limit"
    return "one-shot", topology.detail


def _symm_mem_reason() -> str | None:
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return "this torch has no symmetric memory"
    if not (hasattr(symm_mem, "empty") and hasattr(symm_mem, "rendezvous")):
        return "this torch's symmetric memory lacks empty/rendezvous"
    return None


def _cudart() -> Any | None:
    # torch's own runtime first (already loaded: same library, no second runtime)
    major = (torch.version.cuda or "12").split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so", "libcudart.so.12", "libcudart.so.13"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _native_p2p_atomics(a: int, b: int) -> bool | None:
    """Whether atomics from device a reach device b's memory natively (NVLink); None when the
    CUDA runtime cannot be asked (then the start-up self-test decides)."""
    lib = _cudart()
    if lib is None:
        return None
    value = ctypes.c_int(0)
    err = lib.cudaDeviceGetP2PAttribute(ctypes.byref(value), _P2P_NATIVE_ATOMICS, a, b)
    return None if err != 0 else bool(value.value)


def _device_uuid(index: int) -> str:
    return str(getattr(torch.cuda.get_device_properties(index), "uuid", f"index-{index}"))


def _nvml_links(uuids: list[str]) -> Link:
    """`nvlink` when nvml says every pair of these GPUs talks over NVLink, `pcie` when some
    pair does not, `unknown` without nvml (the nvidia-ml-py package) or its answer."""
    try:
        import pynvml
    except ImportError:
        return "unknown"
    try:
        pynvml.nvmlInit()
        try:
            handles = [
                pynvml.nvmlDeviceGetHandleByUUID(u if u.startswith("GPU-") else f"GPU-{u}")
                for u in uuids
            ]
            ok = pynvml.NVML_P2P_STATUS_OK
            nvlink = pynvml.NVML_P2P_CAPS_INDEX_NVLINK
            for i, a in enumerate(handles):
                for b in handles[i + 1 :]:
                    if pynvml.nvmlDeviceGetP2PStatus(a, b, nvlink) != ok:
                        return "pcie"
            return "nvlink"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - an nvml without the call, or no driver: not known
        return "unknown"


def _local_verdict(
    device: torch.device, peers: list[tuple[str, str]], need_atomics: bool
) -> tuple[bool, str]:
    """(P2P to every peer, why not) from this rank's view; peers: (host, device uuid)."""
    host = socket.gethostname()
    local = {_device_uuid(i): i for i in range(torch.cuda.device_count())}
    me = device.index if device.index is not None else torch.cuda.current_device()
    for peer_host, uuid in peers:
        if peer_host != host:
            return False, "ranks span hosts"
        if uuid not in local:
            return False, "a peer GPU is not visible to this process (CUDA_VISIBLE_DEVICES)"
        other = local[uuid]
        if other == me:
            continue
        if not torch.cuda.can_device_access_peer(me, other):
            return False, f"cuda:{me} cannot access cuda:{other} (PCIe without P2P)"
        if need_atomics and _native_p2p_atomics(me, other) is False:
            return False, f"no native P2P atomics between cuda:{me} and cuda:{other} (PCIe)"
    return True, "every pair P2P-accessible"


def probe_topology(
    group: Any, world: int, device: torch.device, need_atomics: bool = False
) -> Topology:
    """Gather every rank's host and GPU, and every rank's verdict on P2P (collective).
    `need_atomics`: also require native atomics on peer memory (the flag protocol)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    me = (socket.gethostname(), _device_uuid(index))
    peers: list[Any] = [None] * world
    dist.all_gather_object(peers, me, group=group)
    same_host = len({h for h, _ in peers}) == 1
    ok, why = (
        _local_verdict(device, peers, need_atomics) if same_host else (False, "ranks span hosts")
    )
    verdicts: list[Any] = [None] * world
    dist.all_gather_object(verdicts, (ok, why), group=group)
    bad = [w for ok_, w in verdicts if not ok_]
    # every rank sees the same uuids, so nvml's answer agrees across ranks
    link = _nvml_links([u for _, u in peers]) if same_host else "unknown"
    how = "NVLink" if link == "nvlink" else "PCIe" if link == "pcie" else "link unknown (no nvml)"
    return Topology(same_host, not bad, f"{bad[0] if bad else why}; {how}", link)


def _peer_views(hdl: Any, local: torch.Tensor, world: int, rank: int) -> tuple[torch.Tensor, ...]:
    """Every rank's copy of `local` as tensors of this process (peer memory mapped here)."""
    n = local.numel()
    view = hdl.get_buffer(rank, (n,), local.dtype, 0)
    # a pooled allocation may sit inside a larger segment: views are relative to its start
    offset = (local.data_ptr() - view.data_ptr()) // local.element_size()
    views = tuple(hdl.get_buffer(q, (n,), local.dtype, offset) for q in range(world))
    if views[rank].data_ptr() != local.data_ptr():
        raise RuntimeError("symmetric-memory views do not line up with the local buffer")
    return views


def build_peer_buffers(
    group: Any,
    rank: int,
    world: int,
    device: torch.device,
    rows: int,
    hidden: int,
    dtype: Any,
    protocol: str = DEFAULT_PROTOCOL,
) -> ar.PeerBuffers:
    """Allocate and exchange the symmetric buffers of the one-shot kernel (collective)."""
    import torch.distributed._symmetric_memory as symm_mem

    name = group.group_name if group is not None else dist.group.WORLD.group_name
    programs = ar.num_programs(rows)
    n = ar.buffer_elements(protocol, rows, hidden, world)
    data = symm_mem.empty(n, dtype=dtype, device=device)
    if protocol == "lamport":
        ar.sentinel_fill_(data)
    data_hdl = symm_mem.rendezvous(data, name)
    keep: tuple[Any, ...] = (data, data_hdl)
    flag_views: tuple[torch.Tensor, ...] = ()
    if protocol == "flag":
        flags = symm_mem.empty(programs * world, dtype=torch.int64, device=device)
        flags.zero_()
        flag_hdl = symm_mem.rendezvous(flags, name)
        flag_views = _peer_views(flag_hdl, flags, world, rank)
        keep += (flags, flag_hdl)
    bufs = ar.PeerBuffers(
        protocol=protocol,
        rank=rank,
        world=world,
        buffers=_peer_views(data_hdl, data, world, rank),
        flags=flag_views,
        counters=torch.zeros(programs, 2, dtype=torch.int64, device=device),
        status=torch.zeros(1, dtype=torch.int32, device=device),
        hidden=hidden,
        capacity_rows=rows,
        keepalive=keep,
    )
    # no rank may write to a peer before that peer's buffers are initialised
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    return bufs


def self_test(
    comm: OneShotCommunicator, device: torch.device, timeout: int = SELF_TEST_TIMEOUT_NS
) -> str | None:
    """Run both kernels a few times against the sum every rank can compute; None when right,
    else what went wrong on this rank (collective)."""
    b, world, rank = comm.bufs, comm.world, comm.bufs.rank
    rows = min(2, b.capacity_rows)
    base = torch.arange(rows * b.hidden, device=device, dtype=torch.float32).remainder(7)
    x = (base + rank).to(b.dtype).view(rows, b.hidden)
    want = (base * world + world * (world - 1) // 2).to(b.dtype).view(rows, b.hidden)
    w = torch.ones(b.hidden, device=device, dtype=b.dtype)
    zero = torch.zeros_like(x)
    try:
        results = []
        for _ in range(SELF_TEST_ROUNDS):
            got = torch.empty_like(x)
            ar.one_shot_all_reduce(b, x.clone(), got, timeout)
            out, r = torch.empty_like(x), torch.empty_like(x)
            ar.one_shot_all_reduce_add_rmsnorm(b, x, zero, w, 1e-6, out, r, timeout)
            results += [got, r]
        ar.check_status(b)  # (synchronises)
    except Exception as e:  # a broken P2P path: report it, the group falls back to NCCL
        return f"{type(e).__name__}: {e}"
    if not all(torch.equal(t, want) for t in results):
        return "one-shot all-reduce gave wrong sums"
    return None


def create_communicator(
    group: Any,
    rank: int,
    world: int,
    device: torch.device,
    *,
    max_tokens: int,
    hidden: int,
    dtype: torch.dtype,
    one_shot_max_bytes: int | None = None,
    prefer: str = "auto",
    cpu_group: Any = None,
    protocol: str = DEFAULT_PROTOCOL,
) -> Communicator:
    """The group's communicator (collective: every rank calls it with the same arguments).

    `max_tokens`: the largest batch of rows of `hidden` an all-reduce will carry (sizes the
    one-shot buffers); `one_shot_max_bytes`: NCCL above it (default: measured per group
    size, `one_shot_max_bytes_for`); `prefer`: "auto", "nccl" or "one-shot"
    (ParallelConfig.all_reduce; "one-shot" still falls back where peers cannot reach each
    other); `cpu_group`: a gloo group for the start-up host collectives (default: `group`);
    `protocol`: the one-shot kernel's ("lamport" or "flag", see
    moeserve.kernels.comm.allreduce).
    """
    if protocol not in ar.PROTOCOLS:
        raise ValueError(f"protocol must be one of {ar.PROTOCOLS}, not {protocol!r}")
    device = torch.device(device)
    if world == 1:
        return SingleCommunicator(device)
    host_group = cpu_group if cpu_group is not None else group
    if device.type != "cuda":
        return TorchCommunicator(group, world, "gloo", f"{device.type} tensors", device)
    for k, v in NO_MULTICAST_ENV.items():
        os.environ[k] = v
    nccl = "nccl"
    topology = probe_topology(host_group, world, device, need_atomics=protocol == "flag")
    if one_shot_max_bytes is None:
        one_shot_max_bytes = one_shot_max_bytes_for(world, topology.link)
    rows = one_shot_rows(max_tokens, hidden, dtype, one_shot_max_bytes)
    choice = choose_all_reduce(
        world, topology, prefer, _symm_mem_reason(), rows, one_shot_max_bytes
    )
    kind, why = choice.kind, choice.why
    if kind != "one-shot":
        # before the group's first NCCL collective (NCCL reads them at communicator creation)
        applied = {k: os.environ.setdefault(k, v) for k, v in choice.nccl_env.items()}
        if applied:
            why += "; " + " ".join(f"{k}={v}" for k, v in applied.items())
        return TorchCommunicator(group, world, nccl, why, device)
    fallback = TorchCommunicator(group, world, nccl, "above the one-shot threshold", device)
    error: str | None
    try:
        bufs = build_peer_buffers(group, rank, world, device, rows, hidden, dtype, protocol)
        comm = OneShotCommunicator(bufs, fallback, one_shot_max_bytes, why)
        error = self_test(comm, device)
    except Exception as e:  # symmetric memory unavailable here (driver, container, ...)
        error = f"{type(e).__name__}: {e}"
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error, group=host_group)
    failed = [(q, e) for q, e in enumerate(errors) if e is not None]
    if failed:
        q, e = failed[0]
        log.warning("one-shot all-reduce disabled: rank %d: %s", q, e)
        why = f"one-shot self-test failed on rank {q}: {e}"
        return TorchCommunicator(group, world, nccl, why, device)
    return comm
