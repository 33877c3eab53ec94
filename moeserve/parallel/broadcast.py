"""One writer (rank 0) to many readers (the other ranks): each step's input, as an int64 array.

`ShmChannel`: a shared-memory mailbox for the ranks of one host (no syscalls on the hot path:
the writer publishes a sequence number after the payload, readers spin briefly and then
sleep-poll). `DistChannel`: a torch.distributed broadcast on the host-side (gloo) group, for
ranks on several hosts. Both deliver messages in order, whole, to every reader.

Ordering note: the payload is written before the sequence number and read after it; on
x86-64 (the hosts this runs on) stores are not reordered with other stores, nor loads with
other loads, so a reader that sees the new number sees the whole payload.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np
import torch
import torch.distributed as dist

DEFAULT_CAPACITY = 1 << 22  # payload bytes per chunk; longer messages go in several chunks
# A waiting side busy-polls this long before it sleeps between polls. GPU ranks wait between
# steps for as long as a step takes (a 61-layer decode step is ~10 ms), and a sleeping reader
# wakes ~0.2 ms late, a delay every rank's next step (and rank 0's all-reduce) then waits
# for: GPU ranks poll for longer than any decode step (a core each while serving). CPU ranks
# compute on those cores, so they give them back sooner.
SPIN_S_GPU = 50e-3
SPIN_S_CPU = 2e-3
_POLL_S = 2e-4


class ChannelClosed(RuntimeError):
    """The other side went away."""


class ShmChannel:
    """Header (int64): [seq, chunk_len, total_len, offset], then one ack per reader, then
    the payload chunk. The writer waits for every reader's ack of the previous chunk before
    overwriting it."""

    _HDR = 4

    def __init__(
        self,
        name: str | None,
        num_readers: int,
        capacity: int = DEFAULT_CAPACITY,
        spin_s: float = SPIN_S_CPU,
    ) -> None:
        self.num_readers = num_readers
        self.spin_s = spin_s
        self.capacity = capacity // 8
        size = 8 * (self._HDR + num_readers + self.capacity)
        self.owner = name is None
        self.shm = shared_memory.SharedMemory(name=name, create=self.owner, size=size)
        buf = np.ndarray((self._HDR + num_readers + self.capacity,), np.int64, self.shm.buf)
        if self.owner:
            buf[:] = 0
        self.hdr = buf[: self._HDR]
        self.acks = buf[self._HDR : self._HDR + num_readers]
        self.payload = buf[self._HDR + num_readers :]
        self.seq = 0

    @property
    def name(self) -> str:
        return self.shm.name

    def _wait(self, ready: Callable[[], bool], alive: Callable[[], bool], what: str) -> None:
        t0 = time.perf_counter()
        while not ready():
            if time.perf_counter() - t0 > self.spin_s:
                if not alive():
                    raise ChannelClosed(what)
                time.sleep(_POLL_S)

    def write(self, msg: np.ndarray, alive: Callable[[], bool] = lambda: True) -> None:
        total = int(msg.size)
        offset = 0
        while True:
            n = min(self.capacity, total - offset)
            seq = self.seq
            self._wait(
                lambda s=seq: bool((self.acks >= s).all()), alive, "a reader stopped reading"
            )
            self.payload[:n] = msg[offset : offset + n]
            self.hdr[1:4] = (n, total, offset)
            self.seq = seq + 1
            self.hdr[0] = self.seq  # published last
            offset += n
            if offset >= total:
                return

    def read(self, reader: int, alive: Callable[[], bool] = lambda: True) -> np.ndarray:
        out: np.ndarray | None = None
        while True:
            want = self.seq + 1
            self._wait(lambda w=want: int(self.hdr[0]) >= w, alive, "the writer went away")
            n, total, offset = (int(v) for v in self.hdr[1:4])
            if out is None:
                out = np.empty(total, dtype=np.int64)
            out[offset : offset + n] = self.payload[:n]
            self.seq = want
            self.acks[reader] = want
            if offset + n >= total:
                return out

    def close(self) -> None:
        # drop our views before the buffer they point into
        del self.hdr, self.acks, self.payload
        self.shm.close()
        if self.owner:
            self.shm.unlink()


class DistChannel:
    """Broadcast from `src` over a host-side (gloo) process group: length, then payload."""

    def __init__(self, group: object, src: int = 0) -> None:
        self.group = group
        self.src = src

    def write(self, msg: np.ndarray, alive: Callable[[], bool] = lambda: True) -> None:
        t = torch.from_numpy(np.ascontiguousarray(msg, dtype=np.int64))
        dist.broadcast(torch.tensor([t.numel()], dtype=torch.int64), self.src, group=self.group)
        dist.broadcast(t, self.src, group=self.group)

    def read(self, reader: int, alive: Callable[[], bool] = lambda: True) -> np.ndarray:
        n = torch.empty(1, dtype=torch.int64)
        dist.broadcast(n, self.src, group=self.group)
        t = torch.empty(int(n.item()), dtype=torch.int64)
        dist.broadcast(t, self.src, group=self.group)
        return t.numpy()

    def close(self) -> None:
        return None
