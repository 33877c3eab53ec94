"""Starting the ranks of an engine and running the ranks other than 0.

Every rank is one process: it sets up torch.distributed, loads its slice of the model and
builds its runner (`join_group`); ranks other than 0 then execute every step rank 0
broadcasts until told to stop (`run_worker`). Rank 0 gets an `Executor` (`build_executor`)
that sends each step to the others before running it.

Launch modes (`ParallelConfig.distributed_executor`):
- "mp": rank 0 is the serving process; it spawns ranks 1..N-1 on the GPUs of its host and
  rendezvouses through a file store in a private temporary folder (no port to pick).
- "torchrun": torchrun starts every rank (`torchrun --nnodes H --nproc-per-node G -m
  moeserve.cli serve ...`) with its env:// rendezvous; rank 0 serves HTTP, the others only
  run steps.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from moeserve.config import (
    ConfigError,
    EngineConfig,
    parse_dtype,
    served_context_len,
)
from moeserve.engine.executor import DistributedExecutor, Executor, start_watchdog
from moeserve.engine.runner import ModelRunner
from moeserve.engine.step import StepInput
from moeserve.layers.kernel_plan import PlanSettings
from moeserve.loader import load_model, resolve_model_path
from moeserve.loader.base import Planning
from moeserve.loader.source import describe_source
from moeserve.parallel.broadcast import (
    SPIN_S_CPU,
    SPIN_S_GPU,
    ChannelClosed,
    DistChannel,
    ShmChannel,
)
from moeserve.parallel.groups import SINGLE, TPGroup
from moeserve.parallel.simulated import simulated_group

log = logging.getLogger(__name__)

# NVLink multicast is never used: it can take the host's shared GPUs down
SAFE_ENV = (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
)


def apply_safe_env() -> None:
    for k, v in SAFE_ENV:
        os.environ.setdefault(k, v)


@dataclass(frozen=True)
class Rendezvous:
    """How ranks find each other: a file store path (mp) or env:// (torchrun)."""

    rank: int
    world: int
    init_method: str
    device: str  # this rank's device ("cpu" or "cuda:N")


def resolve_device(cfg: EngineConfig) -> str:
    return cfg.load.device or ("cuda" if torch.cuda.is_available() else "cpu")


def _gpu_index(device: str) -> int:
    """cuda -> 0, cuda:K -> K."""
    return int(device.split(":")[1]) if ":" in device else 0


def rank_device(base: str, local_rank: int) -> str:
    """cuda -> cuda:local_rank; cuda:K -> cuda:(K + local_rank); cpu stays cpu."""
    if not base.startswith("cuda"):
        return "cpu"
    return f"cuda:{_gpu_index(base) + local_rank}"


# ---- one rank's start-up (collective: every rank runs it, in the same order) ----------------
def join_group(cfg: EngineConfig, rdv: Rendezvous) -> tuple[ModelRunner, ShmChannel | DistChannel]:
    """This rank's runner and the group's step channel; returns once every rank is ready
    to serve."""
    tp = init_distributed(cfg, rdv)
    runner = build_rank(cfg, tp, rdv.device)
    channel = open_channel(tp, rdv.device)
    dist.barrier(group=tp.cpu_group)
    return runner, channel


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


def build_rank(cfg: EngineConfig, tp: TPGroup, device: str) -> ModelRunner:
    """This rank's model slice and runner (every rank, rank 0 included)."""
    if cfg.load.threads:
        torch.set_num_threads(cfg.load.threads)
    torch.manual_seed(cfg.load.seed)
    dtype = parse_dtype(cfg.load.dtype, torch.float32, device)
    if tp.size > 1 and tp.comm is None:  # a simulated rank brings its own
        tp = _with_communicator(cfg, tp, device, dtype)
    t0 = time.perf_counter()
    loaded = load_model(
        cfg.model,
        dtype,
        device,
        quantize=cfg.load.quantization,
        kv_cache_dtype=cfg.cache.kv_cache_dtype,
        num_layers=cfg.load.num_layers,
        load_format=cfg.load.load_format,
        tp=tp,
        seed=cfg.load.seed,
        planning=Planning(settings=plan_settings(cfg, tp.size)),
        mtp=cfg.speculative_config is not None and cfg.speculative_config.method == "mtp",
        eagle3=_eagle3_folder(cfg),
    )
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    loaded = replace(loaded, load_seconds=time.perf_counter() - t0)
    return ModelRunner(cfg, loaded, device, tp).start()


def _eagle3_folder(cfg: EngineConfig) -> str | None:
    """The EAGLE-3 draft head's folder of --speculative-config method eagle3 (else None)."""
    spec = cfg.speculative_config
    return spec.model if spec is not None and spec.method == "eagle3" else None


def plan_settings(cfg: EngineConfig, tp_size: int) -> PlanSettings:
    """The engine settings the kernel plan depends on (the loader adds the dtypes)."""
    return PlanSettings(
        page_size=cfg.cache.page_size,
        mla_decode_kernel=cfg.cache.mla_decode_kernel,
        enforce_eager=cfg.enforce_eager,
        pdl=cfg.pdl,
        deterministic=cfg.load.deterministic,
        cpu_kernels=cfg.load.cpu_kernels,
        tp_size=tp_size,
    )


def _with_communicator(cfg: EngineConfig, tp: TPGroup, device: str, dtype: torch.dtype) -> TPGroup:
    """The group's all-reduce implementation, chosen collectively before the model is built
    (the layers keep the group they are built with)."""
    from moeserve.parallel.comm import create_communicator

    comm = create_communicator(
        tp.group,
        tp.rank,
        tp.size,
        torch.device(device),
        max_tokens=cfg.scheduler.max_num_batched_tokens,
        hidden=model_limits(cfg.model)[0],
        dtype=dtype,
        prefer=cfg.parallel.all_reduce,
        cpu_group=tp.cpu_group,
    )
    return replace(tp, comm=comm)


def model_limits(model: str | None) -> tuple[int, int]:
    """(hidden size, positions) from a checkpoint's description, before loading it."""
    src = describe_source(resolve_model_path(model))
    return src.hidden_size, src.max_positions


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


# ---- ranks > 0 ------------------------------------------------------------------------------
def worker_loop(runner: ModelRunner, channel: ShmChannel | DistChannel, rank: int) -> None:
    """Ranks > 0: run every step rank 0 sends, until a stop message (or rank 0 is gone)."""
    parent = os.getppid()
    alive = lambda: os.getppid() == parent  # noqa: E731 (spawned: our parent is rank 0)
    while True:
        step = StepInput.unpack(channel.read(rank - 1, alive))
        if step is None:
            return
        runner.execute_model(step)


def run_worker(cfg: EngineConfig, rdv: Rendezvous) -> None:
    """Entry point of ranks > 0 (spawned, or started by torchrun)."""
    apply_safe_env()
    logging.basicConfig(level=logging.WARNING, format=f"rank {rdv.rank}: %(message)s")
    try:
        runner, channel = join_group(cfg, rdv)
        worker_loop(runner, channel, rdv.rank)
    except ChannelClosed:
        sys.exit(0)  # rank 0 went away first; it reported why
    except BaseException as e:  # one line for the operator; rank 0's watchdog stops the rest
        print(f"moeserve: error: rank {rdv.rank}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)  # skip gloo/NCCL teardown, which can abort in spawned processes


# ---- rank 0 ---------------------------------------------------------------------------------
def build_executor(cfg: EngineConfig) -> Executor:
    """Rank 0's executor: this process alone, or the group it spawns or joins."""
    device = resolve_device(cfg)
    par = cfg.parallel
    if par.simulate_rank is not None:
        tp = simulated_group(par.simulate_rank, device)
        log.warning("%s", tp.describe())
        return Executor(build_rank(cfg, tp, device))
    if par.distributed_executor == "torchrun":
        return _join_torchrun(cfg, device)
    if par.tensor_parallel_size > 1:
        return _start_spawned_ranks(cfg, device)
    return Executor(build_rank(cfg, SINGLE, device))


def _start_spawned_ranks(cfg: EngineConfig, device: str) -> Executor:
    """Rank 0 here; ranks 1..N-1 spawned on the next devices of this host."""
    world = cfg.parallel.tensor_parallel_size
    if device.startswith("cuda"):
        have = torch.cuda.device_count()
        if _gpu_index(device) + world > have:
            raise ConfigError(
                f"--tensor-parallel-size {world} needs {world} GPUs from {device}; "
                f"this host has {have}."
            )
    # refuse a bad --max-model-len here, once, rather than from every rank
    served_context_len(cfg.scheduler.max_model_len, model_limits(cfg.model)[1])
    apply_safe_env()  # inherited by the spawned ranks
    store = tempfile.TemporaryDirectory(prefix="moeserve-dist-")
    init = f"file://{os.path.join(store.name, 'store')}"
    ctx = mp.get_context("spawn")
    procs = []
    for r in range(1, world):
        rdv = Rendezvous(r, world, init, rank_device(device, r))
        p = ctx.Process(target=run_worker, args=(cfg, rdv), name=f"moeserve-rank{r}", daemon=True)
        p.start()
        procs.append(p)
    stop = start_watchdog(procs)  # a rank that dies while loading stops us too
    runner, channel = join_group(cfg, Rendezvous(0, world, init, rank_device(device, 0)))
    return DistributedExecutor(runner, channel, procs, store, stop)


def _join_torchrun(cfg: EngineConfig, device: str) -> Executor:
    """Rank 0 of a torchrun launch (the other ranks run `run_worker`)."""
    runner, channel = join_group(cfg, torchrun_rendezvous(device))
    return DistributedExecutor(runner, channel)


def torchrun_rendezvous(device: str) -> Rendezvous:
    """This process's rank under torchrun (RANK, WORLD_SIZE, LOCAL_RANK from its env)."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", "0"))
    except (KeyError, ValueError):
        raise ConfigError(
            "--distributed-executor torchrun needs RANK and WORLD_SIZE: start it with torchrun."
        ) from None
    return Rendezvous(rank, world, "env://", rank_device(device, local))
