"""Rank 0's side of running steps: on one device, or broadcast to every rank first.

`Executor.execute(step)` returns the step's logits (rank 0's copy: the LM head gathers the
full vocabulary on every rank). A worker that dies takes the server down with one line
(a watchdog thread), never a hang.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from moeserve.engine.runner import ModelRunner
from moeserve.engine.step import StepInput, stop_message
from moeserve.parallel.broadcast import DistChannel, ShmChannel

log = logging.getLogger(__name__)

WATCHDOG_PERIOD_S = 0.5
SHUTDOWN_WAIT_S = 10.0


class Executor:
    """A single-process executor: the runner of this process is the only rank."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute(self, step: StepInput) -> torch.Tensor | None:
        return self.runner.execute_model(step)

    def describe(self) -> str:
        return ""

    def shutdown(self) -> None:
        return None


def start_watchdog(procs: list[mp.process.BaseProcess]) -> threading.Event:
    """A thread that exits this process with one line when any of `procs` dies (set the
    returned event first to stop it, for a planned shutdown)."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(WATCHDOG_PERIOD_S):
            for p in procs:
                if not p.is_alive() and not stop.is_set():
                    print(
                        f"moeserve: error: tensor-parallel {p.name} exited (code {p.exitcode}); "
                        "stopping the server",
                        file=sys.stderr,
                        flush=True,
                    )
                    os._exit(1)

    threading.Thread(target=watch, name="moeserve-watchdog", daemon=True).start()
    return stop


class DistributedExecutor(Executor):
    """Rank 0 of a group: each step goes to the other ranks through `channel`, then runs
    here; the ranks' collectives inside the forward keep them in step. `procs`: the ranks
    this process spawned (watched by `stop_watchdog`'s thread), if any."""

    def __init__(
        self,
        runner: ModelRunner,
        channel: ShmChannel | DistChannel,
        procs: list[mp.process.BaseProcess] | None = None,
        store_dir: tempfile.TemporaryDirectory | None = None,
        stop_watchdog: threading.Event | None = None,
    ) -> None:
        super().__init__(runner)
        self.channel = channel
        self.procs = procs or []
        self.store_dir = store_dir
        self.stop_watchdog = stop_watchdog or threading.Event()

    def _workers_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def execute(self, step: StepInput) -> torch.Tensor | None:
        self.channel.write(step.pack(), alive=self._workers_alive)
        return self.runner.execute_model(step)

    def describe(self) -> str:
        tp = self.runner.tp
        kind = "shared memory" if isinstance(self.channel, ShmChannel) else "gloo broadcast"
        ep = ", expert parallel" if tp.expert_parallel else ""
        comm = tp.comm.describe() if tp.comm is not None else "torch.distributed all-reduce"
        return f"{tp.size} ranks{ep}; steps over {kind}; {comm}"

    def shutdown(self) -> None:
        self.stop_watchdog.set()
        try:
            self.channel.write(stop_message(), alive=self._workers_alive)
        except RuntimeError:
            pass
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
        self.channel.close()
        if dist.is_initialized():  # a later engine in this process starts its own group
            dist.destroy_process_group()
        if self.store_dir is not None:
            self.store_dir.cleanup()
