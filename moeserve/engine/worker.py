"""One process per rank: set up torch.distributed, load this rank's slice of the model, build
its runner; ranks other than 0 then execute every step rank 0 broadcasts until told to stop.

Launch modes (`ParallelConfig.distributed_executor`):
- "mp": rank 0 is the serving process; it spawns ranks 1..N-1 on the GPUs of its host and
  rendezvouses through a file store in a private temporary folder (no port to pick).
- "torchrun": torchrun starts every rank (`torchrun --nnodes H --nproc-per-node G -m
  moeserve.cli serve ...`) with its env:// rendezvous; rank 0 serves HTTP, the others only
  run steps.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moeserve.config import EngineConfig
from moeserve.engine.step import StepInput
from moeserve.parallel.broadcast import (
    SPIN_S_CPU,
    SPIN_S_GPU,
    ChannelClosed,
    DistChannel,
    ShmChannel,
)
from moeserve.parallel.groups import TPGroup

log = logging.getLogger(__name__)

# NVLink multicast is never used: it can take the host's shared GPUs down
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def apply_safe_env() -> None:
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)


@dataclass(frozen=True)
class Rendezvous:
    """How ranks find each other: a file store path (mp) or env:// (torchrun)."""

    rank: int
    world: int
    init_method: str
    device: str  # this rank's device ("cpu" or "cuda:N")


def rank_device(base: str, local_rank: int) -> str:
    """cuda -> cuda:local_rank; cuda:K -> cuda:(K + local_rank); cpu stays cpu."""
    if not base.startswith("cuda"):
        return "cpu"
    first = int(base.split(":")[1]) if ":" in base else 0
    return f"cuda:{first + local_rank}"


def init_distributed(cfg: EngineConfig, rdv: Rendezvous) -> TPGroup:
    """The process group of all ranks (gloo for host tensors, NCCL for GPU tensors) and this
    rank's `TPGroup`. Every collective at start-up times out after dist_timeout_s."""
    timeout = timedelta(seconds=cfg.parallel.dist_timeout_s)
    if rdv.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(rdv.device))
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(
        backend, init_method=rdv.init_method, rank=rdv.rank, world_size=rdv.world, timeout=timeout
    )
    group = dist.group.WORLD
    return TPGroup(
        rank=rdv.rank,
        size=rdv.world,
        group=group,
        expert_parallel=cfg.parallel.enable_expert_parallel,
        cpu_group=group,
    )


def open_channel(tp: TPGroup, device: str) -> ShmChannel | DistChannel:
    """The step channel, agreed by all ranks: shared memory (created by rank 0) when every
    rank is on this host, else a gloo broadcast."""
    spin = SPIN_S_GPU if device.startswith("cuda") else SPIN_S_CPU
    hosts: list[str | None] = [None] * tp.size
    dist.all_gather_object(hosts, socket.gethostname(), group=tp.cpu_group)
    if len(set(hosts)) > 1:
        return DistChannel(tp.cpu_group)
    mine = ShmChannel(None, tp.size - 1, spin_s=spin) if tp.rank == 0 else None
    names = [mine.name if mine is not None else None]
    dist.broadcast_object_list(names, src=0, group=tp.cpu_group)
    return mine if mine is not None else ShmChannel(names[0], tp.size - 1, spin_s=spin)


def worker_loop(runner: object, channel: ShmChannel | DistChannel, rank: int) -> None:
    """Ranks > 0: run every step rank 0 sends, until a stop message (or rank 0 is gone)."""
    parent = os.getppid()
    alive = lambda: os.getppid() == parent  # noqa: E731 (spawned: our parent is rank 0)
    while True:
        step = StepInput.unpack(channel.read(rank - 1, alive))
        if step is None:
            return
        runner.execute_model(step)  # type: ignore[attr-defined]


def run_worker(cfg: EngineConfig, rdv: Rendezvous) -> None:
    """Entry point of ranks > 0 (spawned, or started by torchrun)."""
    apply_safe_env()
    logging.basicConfig(level=logging.WARNING, format=f"rank {rdv.rank}: %(message)s")
    try:
        from moeserve.engine.engine import build_rank

        tp = init_distributed(cfg, rdv)
        runner = build_rank(cfg, tp, rdv.device)
        channel = open_channel(tp, rdv.device)
        dist.barrier(group=tp.cpu_group)  # every rank is ready to serve
        worker_loop(runner, channel, rdv.rank)
    except ChannelClosed:
        sys.exit(0)  # rank 0 went away first; it reported why
    except BaseException as e:  # one line for the operator; rank 0's watchdog stops the rest
        print(f"moeserve: error: rank {rdv.rank}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)  # skip gloo/NCCL teardown, which can abort in spawned processes
