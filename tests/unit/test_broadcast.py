"""The shared-memory step channel: every reader gets every message whole and in order (also
messages longer than one chunk), the writer never overwrites a chunk a reader has not read,
and a side whose peer is gone gets ChannelClosed instead of waiting forever."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from moeserve.parallel.broadcast import ChannelClosed, ShmChannel

CAPACITY = 64  # bytes: 8 int64 per chunk, so most messages below take several chunks


def _messages() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(-(2**40), 2**40, size=int(n)) for n in rng.integers(1, 40, size=60)]


def _read_all(name: str, reader: int, count: int, spin_s: float, q: mp.Queue) -> None:
    ch = ShmChannel(name, 2, capacity=CAPACITY, spin_s=spin_s)
    q.put((reader, [ch.read(reader).tolist() for _ in range(count)]))


@pytest.mark.parametrize("spin_s", [0.0, 2e-3], ids=["sleep-poll", "busy-poll"])
def test_two_readers_get_every_message_whole_and_in_order(spin_s):
    sent = _messages()
    ch = ShmChannel(None, 2, capacity=CAPACITY, spin_s=spin_s)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_read_all, args=(ch.name, r, len(sent), spin_s, q)) for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        for m in sent:
            ch.write(m, alive=lambda: all(p.is_alive() for p in procs))
        got = dict(q.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
        ch.close()
    want = [m.tolist() for m in sent]
    assert got[0] == want and got[1] == want


def test_a_writer_whose_reader_is_gone_gets_channel_closed():
    ch = ShmChannel(None, 1, capacity=CAPACITY, spin_s=0.0)
    try:
        ch.write(np.arange(8))  # fills the only chunk; nobody acknowledges it
        with pytest.raises(ChannelClosed):
            ch.write(np.arange(8), alive=lambda: False)
    finally:
        ch.close()


def test_a_reader_whose_writer_is_gone_gets_channel_closed():
    ch = ShmChannel(None, 1, capacity=CAPACITY, spin_s=0.0)
    reader = ShmChannel(ch.name, 1, capacity=CAPACITY, spin_s=0.0)
    try:
        with pytest.raises(ChannelClosed):
            reader.read(0, alive=lambda: False)
    finally:
        reader.close()
        ch.close()
