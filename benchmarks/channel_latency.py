"""Latency of the shared-memory step channel (moeserve/parallel/broadcast.py): rank 0 writes one
small step message every P ms, a reader process stamps its arrival; per spin policy (the CPU
ranks' short busy-poll, the GPU ranks' long one) and period, the median / p90 / max delay from
write to read. A reader that has gone to sleep-polling adds its wake-up to every step.

  PYTHONPATH=$PWD python benchmarks/channel_latency.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
from common import git_commit

from moeserve.parallel.broadcast import SPIN_S_CPU, SPIN_S_GPU, ShmChannel

PERIODS_MS = (1, 5, 20)
MESSAGES = 150
SKIP = 10  # the first messages meet a reader still starting up


def _reader(name: str, spin_s: float, q: mp.Queue) -> None:
    ch = ShmChannel(name, 1, spin_s=spin_s)
    delays = []
    while True:
        msg = ch.read(0)
        now = time.perf_counter_ns()
        if msg[0] < 0:
            break
        delays.append((now - int(msg[0])) / 1000)
    q.put(delays)


def measure(spin_s: float, period_ms: float) -> dict:
    ch = ShmChannel(None, 1, spin_s=spin_s)
    q: mp.Queue = mp.Queue()
    p = mp.Process(target=_reader, args=(ch.name, spin_s, q))
    p.start()
    time.sleep(0.3)
    for _ in range(MESSAGES):
        ch.write(np.array([time.perf_counter_ns(), 0, 0, 0], dtype=np.int64))
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < period_ms / 1000:
            pass  # rank 0 busy with its step
    ch.write(np.array([-1], dtype=np.int64))
    delays = sorted(q.get()[SKIP:])
    p.join()
    ch.close()
    return {
        "median_us": statistics.median(delays),
        "p90_us": delays[int(0.9 * len(delays))],
        "max_us": delays[-1],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="folder for channel_latency.{json,md}")
    args = ap.parse_args()
    rows = []
    for name, spin in (("CPU ranks", SPIN_S_CPU), ("GPU ranks", SPIN_S_GPU)):
        for period in PERIODS_MS:
            r = {
                "policy": name,
                "spin_ms": spin * 1000,
                "period_ms": period,
                **measure(spin, period),
            }
            rows.append(r)
            print(r, flush=True)
    if args.out:
        meta = {
            "commit": git_commit(None),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        }
        Path(args.out, "channel_latency.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1)
        )
        lines = [
            "# Step channel: write-to-read delay (shared memory, one reader)",
            "",
            f"commit {meta['commit']}, {meta['cpus']} CPUs. Method: benchmarks/channel_latency.py.",
            "",
            "| policy | busy-poll window | step period | median | p90 | max |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['policy']} | {r['spin_ms']:.0f} ms | {r['period_ms']} ms | "
            f"{r['median_us']:.0f} us | {r['p90_us']:.0f} us | {r['max_us']:.0f} us |"
            for r in rows
        ]
        Path(args.out, "channel_latency.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
