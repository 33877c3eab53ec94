"""All-reduce + residual add + RMSNorm on 2 GPUs, inside CUDA graphs, against its peers.

Run on a host with >= 2 GPUs (one process per GPU, spawned), from the repository root:

  timeout 300 env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      PYTHONPATH=$PWD python benchmarks/allreduce.py --out benchmarks/results

In one run, for 1 / 8 / 64 tokens of 7168 bf16 (14 KB to 917 KB per rank):
- moeserve's fused one-shot all-reduce + residual + RMSNorm (one Triton launch), both
  protocols (lamport: push, data is the signal; flag: pull after a flag handshake);
- NCCL all-reduce + torch add + RMSNorm (today's layer path);
- torch's symmetric-memory ``torch.ops.symm_mem.one_shot_all_reduce`` + torch add + RMSNorm;
and the all-reduce alone for each, up to 256 tokens (3.7 MB) to locate the one-shot / NCCL
crossover (``ONE_SHOT_MAX_BYTES`` in moeserve/parallel/comm.py).

Timing: each method's calls are captured ~100 at a time in a CUDA graph; per repeat the GPUs
are held by a sleep kernel while the host enqueues, aligned by one NCCL all-reduce, then the
graph is replayed between CUDA events; per call = elapsed / calls. Median and spread over
repeats, on every rank. Outputs are checked against the fp32 reference before timing.
Writes allreduce.json and allreduce.md (figure, target <= 5 us at 14 KB, peers, commit, GPU,
torch / triton versions). No hangs: every rank has a watchdog, the parent a deadline, and
init_process_group a timeout; a failure prints one line starting with FAILED.
"""

from __future__ import annotations

import os

# NVLink multicast is never used (it can take the host's shared GPUs down): set before torch,
# NCCL or symmetric memory are loaded in this process and its spawned ranks.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
os.environ.update(NO_MULTICAST_ENV)

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import git_commit  # noqa: E402

HIDDEN = 7168  # Kimi-K2.5 / DeepSeek-V3
EPS = 1e-6
TARGET_US = 5.0  # shared/PERF.md: all-reduce of 14 KB + residual add + RMSNorm, 2 GPUs
PERF_MD_PEERS = "PERF.md, same machine kind: NCCL 18.8 us, torch symm-mem one-shot 6.9 us (14 KB)"
SLEEP_CYCLES = 2_000_000  # ~1 ms: the host enqueues everything before the GPU gets to it
FUSED_TOKENS = (1, 8, 64)
PLAIN_TOKENS = (1, 8, 64, 128, 256)

FUSED = {
    "moeserve fused [lamport]": "one-shot all-reduce + residual + RMSNorm, one launch",
    "moeserve fused [flag]": "one-shot all-reduce + residual + RMSNorm, one launch",
    "nccl + norm": "NCCL all-reduce, torch add + F.rms_norm",
    "symm-mem + norm": "torch.ops.symm_mem.one_shot_all_reduce, torch add + F.rms_norm",
}
PLAIN = {
    "moeserve [lamport]": "one-shot all-reduce",
    "moeserve [flag]": "one-shot all-reduce",
    "nccl": "NCCL all-reduce",
    "symm-mem": "torch.ops.symm_mem.one_shot_all_reduce",
}


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------- one rank


class Rank:
    """This rank's group, communicators and the peers' set-up."""

    def __init__(self, rank: int, world: int, store: str, max_tokens: int) -> None:
        from moeserve.parallel import comm as cm

        self.rank, self.world = rank, world
        torch.cuda.set_device(rank)
        self.device = torch.device("cuda", rank)
        timeout = timedelta(seconds=60)
        dist.init_process_group(
            "nccl", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout
        )
        self.host = dist.new_group(backend="gloo", timeout=timeout)
        self.group_name = dist.group.WORLD.group_name
        self.tiny = torch.zeros(1, device=self.device)
        kw = dict(
            max_tokens=max_tokens,
            hidden=HIDDEN,
            dtype=torch.bfloat16,
            one_shot_max_bytes=max_tokens * HIDDEN * 2,
            prefer="one-shot",
            cpu_group=self.host,
        )
        self.comms = {
            p: cm.create_communicator(dist.group.WORLD, rank, world, self.device, protocol=p, **kw)
            for p in ("lamport", "flag")
        }
        for p, c in self.comms.items():
            if not isinstance(c, cm.OneShotCommunicator):  # never time NCCL under its name
                raise RuntimeError(f"the {p} one-shot path is unavailable: {c.describe()}")
        # what serving would pick with the default threshold
        self.auto = cm.create_communicator(
            dist.group.WORLD,
            rank,
            world,
            self.device,
            max_tokens=max_tokens,
            hidden=HIDDEN,
            dtype=torch.bfloat16,
            cpu_group=self.host,
        )
        self.symm: dict[int, torch.Tensor] = {}

    def symm_buffer(self, n: int) -> torch.Tensor:
        """A symmetric-memory tensor of n tokens for torch's one-shot op (collective)."""
        if n not in self.symm:
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty((n, HIDDEN), dtype=torch.bfloat16, device=self.device)
            buf.zero_()
            symm_mem.rendezvous(buf, self.group_name)
            self.symm[n] = buf
        return self.symm[n]

    def case(self, n: int):
        """(this rank's partial, residual, weight, every rank's partial), seeded."""
        parts = []
        for q in range(self.world):
            g = torch.Generator().manual_seed(1000 * n + q)
            parts.append(torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16).to(self.device))
        g = torch.Generator().manual_seed(7 + n)
        res = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16).to(self.device)
        w = (0.5 + torch.rand(HIDDEN, generator=g)).to(torch.bfloat16).to(self.device)
        return parts[self.rank], res, w, parts

    def time_graph(self, fn, calls: int, repeats: int) -> list[float]:
        """Per-call microseconds of `calls` captured calls, one figure per repeat."""
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        out = []
        for _ in range(repeats):
            dist.barrier(group=self.host)
            torch.cuda._sleep(SLEEP_CYCLES)
            dist.all_reduce(self.tiny)  # both GPUs leave this together
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1000.0 / calls)
        del graph
        return out


def _check_fused(rk: Rank, n: int) -> dict:
    from moeserve.kernels.comm import allreduce as ar

    x, res, w, parts = rk.case(n)
    want_y, want_r = ar.all_reduce_add_rmsnorm_reference(parts, res, w, EPS)
    row = {"tokens": n}
    for proto, comm in rk.comms.items():
        y, r = comm.all_reduce_add_rmsnorm(x.clone(), res, w, EPS)
        row[f"{proto}_residual_exact"] = bool(torch.equal(r, want_r))
        row[f"{proto}_norm_max_abs_err"] = float((y.float() - want_y.float()).abs().max())
    s = x.clone()
    dist.all_reduce(s)
    nccl_y = F.rms_norm(s + res, (HIDDEN,), w, EPS)
    row["nccl_norm_max_abs_diff"] = float((nccl_y.float() - want_y.float()).abs().max())
    row["ok"] = all(row[f"{p}_residual_exact"] for p in rk.comms) and all(
        row[f"{p}_norm_max_abs_err"] < 0.05 for p in rk.comms
    )
    return row


def _fused_methods(rk: Rank, n: int) -> dict:
    x, res, w, _ = rk.case(n)
    zeros = torch.zeros_like(x)  # in-place sums of zeros stay finite over every replay
    buf = rk.symm_buffer(n)
    lam, flag = rk.comms["lamport"], rk.comms["flag"]

    def nccl_norm():
        dist.all_reduce(zeros)
        r = zeros + res
        return F.rms_norm(r, (HIDDEN,), w, EPS), r

    def symm_norm():
        s = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", rk.group_name)
        r = s + res
        return F.rms_norm(r, (HIDDEN,), w, EPS), r

    return {
        "moeserve fused [lamport]": lambda: lam.all_reduce_add_rmsnorm(x, res, w, EPS),
        "moeserve fused [flag]": lambda: flag.all_reduce_add_rmsnorm(x, res, w, EPS),
        "nccl + norm": nccl_norm,
        "symm-mem + norm": symm_norm,
    }


def _plain_methods(rk: Rank, n: int) -> dict:
    zeros = torch.zeros(n, HIDDEN, dtype=torch.bfloat16, device=rk.device)
    buf = rk.symm_buffer(n)
    lam, flag = rk.comms["lamport"], rk.comms["flag"]
    return {
        "moeserve [lamport]": lambda: lam.all_reduce(zeros),
        "moeserve [flag]": lambda: flag.all_reduce(zeros),
        "nccl": lambda: dist.all_reduce(zeros),
        "symm-mem": lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", rk.group_name),
    }


def _stats(xs: list[float]) -> dict:
    s = sorted(xs)
    return {
        "median_us": statistics.median(s),
        "min_us": s[0],
        "max_us": s[-1],
        "p10_us": s[len(s) // 10],
        "p90_us": s[(9 * len(s)) // 10],
        "repeats": len(s),
    }


def rank_main(rank: int, world: int, store: str, opts: dict, out_file: str) -> None:
    faulthandler.dump_traceback_later(opts["rank_timeout_s"], exit=True)
    try:
        rk = Rank(rank, world, store, max(PLAIN_TOKENS))
        result: dict = {
            "describe": {p: c.describe() for p, c in rk.comms.items()},
            "auto": rk.auto.describe(),
            "checks": [_check_fused(rk, n) for n in FUSED_TOKENS],
            "fused": [],
            "plain": [],
        }
        if rank == 0:
            log(f"auto choice: {result['auto']}")
            for p, line in result["describe"].items():
                log(f"{p}: {line}")
            log(f"checks: {json.dumps(result['checks'])}")
        for kind, tokens, make in (
            ("fused", FUSED_TOKENS, _fused_methods),
            ("plain", PLAIN_TOKENS, _plain_methods),
        ):
            for n in tokens:
                for name, fn in make(rk, n).items():
                    times = rk.time_graph(fn, opts["calls"], opts["repeats"])
                    row = {"method": name, "tokens": n, "bytes": n * HIDDEN * 2, **_stats(times)}
                    result[kind].append(row)
                    if rank == 0:
                        log(
                            f"{kind:5s} {n:4d} tokens {name:26s} {row['median_us']:8.2f} us "
                            f"(p10 {row['p10_us']:.2f}, p90 {row['p90_us']:.2f})"
                        )
        for comm in rk.comms.values():
            comm.check()  # no wait timed out on this rank
        gathered: list = [None] * world
        dist.all_gather_object(gathered, result, group=rk.host)
        if rank == 0:
            Path(out_file).write_text(json.dumps(gathered))
        dist.barrier(group=rk.host)
    except Exception:
        traceback.print_exc()
        log(f"FAILED: rank {rank}: {traceback.format_exc().strip().splitlines()[-1]}")
        sys.stdout.flush()
        os._exit(1)
    os._exit(0)  # skip NCCL / gloo teardown: nothing is left to flush


# ------------------------------------------------------------------------------ report


def _commit(given: str | None) -> str:
    return git_commit(given)


def _topology() -> str:
    try:
        cmd = ["nvidia-smi", "topo", "-m"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "nvidia-smi topo -m unavailable"


def summarize(ranks: list[dict], meta: dict) -> dict:
    """Rows with rank 0's spread and the slowest rank's median, and the target verdict."""

    def merge(kind: str) -> list[dict]:
        rows = []
        for i, row in enumerate(ranks[0][kind]):
            medians = [r[kind][i]["median_us"] for r in ranks]
            rows.append({**row, "median_us_slowest_rank": max(medians)})
        return rows

    fused, plain = merge("fused"), merge("plain")

    def us(rows: list[dict], method: str, n: int) -> float:
        row = next(r for r in rows if r["method"] == method and r["tokens"] == n)
        return row["median_us_slowest_rank"]

    from moeserve.parallel.comm import DEFAULT_PROTOCOL

    # the headline is the protocol the server runs (lamport stays measured, not the default:
    # moeserve/parallel/comm.py DEFAULT_PROTOCOL says why)
    best = us(fused, f"moeserve fused [{DEFAULT_PROTOCOL}]", 1)
    crossover = {}
    for proto in ("lamport", "flag"):
        mine = f"moeserve [{proto}]"
        wins = [n for n in PLAIN_TOKENS if us(plain, mine, n) <= us(plain, "nccl", n)]
        crossover[proto] = max(wins) * HIDDEN * 2 if wins else 0
    return {
        "meta": meta,
        "target": {
            "what": "all-reduce of 14 KB (1 x 7168 bf16) + residual add + RMSNorm, graphed",
            "limit_us": TARGET_US,
            "protocol": DEFAULT_PROTOCOL,
            "best_moeserve_us": best,
            "met": best <= TARGET_US,
            "nccl_plus_norm_us": us(fused, "nccl + norm", 1),
            "symm_mem_plus_norm_us": us(fused, "symm-mem + norm", 1),
        },
        "largest_size_where_one_shot_beats_nccl_bytes": crossover,
        "checks": ranks[0]["checks"],
        "describe": ranks[0]["describe"],
        "auto": ranks[0]["auto"],
        "fused": fused,
        "plain": plain,
    }


def write_markdown(path: Path, s: dict) -> None:
    m, t = s["meta"], s["target"]
    lines = [
        "# All-reduce + residual + RMSNorm, 2 GPUs, CUDA graphs",
        "",
        f"GPU {m['gpu']} x{m['world']}, torch {m['torch']}, triton {m['triton']}, commit "
        f"{m['commit']}, {m['date']}. {m['timing']}",
        "",
        f"**Target** ({t['what']}): <= {t['limit_us']} us. Measured with the default "
        f"{t.get('protocol', 'lamport')} protocol: **{t['best_moeserve_us']:.2f} us** "
        f"({'met' if t['met'] else 'missed'}); in the same "
        f"run NCCL + norm {t['nccl_plus_norm_us']:.2f} us, torch symm-mem one-shot + norm "
        f"{t['symm_mem_plus_norm_us']:.2f} us. Earlier: {PERF_MD_PEERS}.",
        "",
        f"Auto choice at start-up: `{s['auto']}`",
        "",
        "## Fused: all-reduce + residual add + RMSNorm (per call, median of the slowest rank; "
        "rank 0 p10-p90)",
        "",
        "| tokens | KB/rank | " + " | ".join(FUSED) + " |",
        "|---|---|" + "---|" * len(FUSED),
    ]

    def table(rows, methods, tokens):
        out = []
        for n in tokens:
            cells = []
            for meth in methods:
                r = next(r for r in rows if r["method"] == meth and r["tokens"] == n)
                cells.append(
                    f"{r['median_us_slowest_rank']:.2f} ({r['p10_us']:.2f}-{r['p90_us']:.2f})"
                )
            out.append(f"| {n} | {n * HIDDEN * 2 / 1024:.0f} | " + " | ".join(cells) + " |")
        return out

    lines += table(s["fused"], FUSED, FUSED_TOKENS)
    lines += [
        "",
        "## All-reduce alone (crossover for ONE_SHOT_MAX_BYTES)",
        "",
        "| tokens | KB/rank | " + " | ".join(PLAIN) + " |",
        "|---|---|" + "---|" * len(PLAIN),
    ]
    lines += table(s["plain"], PLAIN, PLAIN_TOKENS)
    cross = s["largest_size_where_one_shot_beats_nccl_bytes"]
    lines += [
        "",
        "Largest measured size where the one-shot all-reduce is no slower than NCCL: "
        + ", ".join(f"{p} {b / 1024:.0f} KB" for p, b in cross.items()),
        "",
        "## Methods",
        "",
        *[f"- **{k}**: {v}" for k, v in {**FUSED, **PLAIN}.items()],
        "",
        "## Correctness before timing (vs the fp32 reference; NCCL + torch norm for scale)",
        "",
        "```",
        *[json.dumps(c) for c in s["checks"]],
        "```",
        "",
        "## Set-up",
        "",
        *[f"- {p}: `{line}`" for p, line in s["describe"].items()],
        f"- env: {m['env']}",
        "",
        "```",
        m["topology"],
        "```",
    ]
    path.write_text("\n".join(lines) + "\n")


# -------------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results", help="folder for JSON + markdown")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--calls", type=int, default=100, help="calls captured per graph")
    ap.add_argument("--repeats", type=int, default=20, help="timed replays per method and size")
    ap.add_argument("--timeout", type=float, default=270.0, help="seconds before giving up")
    ap.add_argument("--commit", default=None, help="commit id to record")
    args = ap.parse_args()
    if torch.cuda.device_count() < args.world:
        log(f"FAILED: needs {args.world} GPUs, found {torch.cuda.device_count()}")
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    opts = {"calls": args.calls, "repeats": args.repeats, "rank_timeout_s": args.timeout - 10}
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "ranks.json")
        procs = [
            ctx.Process(
                target=rank_main,
                args=(r, args.world, os.path.join(tmp, "store"), opts, result_file),
            )
            for r in range(args.world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + args.timeout
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
        if hung:
            log(f"FAILED: ranks {hung} still running after {args.timeout:.0f} s (killed)")
            return 1
        codes = [p.exitcode for p in procs]
        if any(codes):
            log(f"FAILED: rank exit codes {codes} (see the lines above)")
            return 1
        ranks = json.loads(Path(result_file).read_text())
    meta = {
        "gpu": torch.cuda.get_device_name(0),
        "world": args.world,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "commit": _commit(args.commit),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "timing": (
            f"Per call: a CUDA graph of {args.calls} calls replayed {args.repeats} times after a "
            "sleep kernel and one aligning NCCL all-reduce; elapsed between CUDA events / calls."
        ),
        "env": {k: os.environ.get(k) for k in NO_MULTICAST_ENV},
        "topology": _topology(),
    }
    summary = summarize(ranks, meta)
    (out_dir / "allreduce.json").write_text(json.dumps({**summary, "ranks": ranks}, indent=1))
    write_markdown(out_dir / "allreduce.md", summary)
    t = summary["target"]
    verdict = "MET " if t["met"] else "MISS"
    log(
        f"{verdict} fused all-reduce + residual + RMSNorm at 14 KB: {t['best_moeserve_us']:.2f} us "
        f"(limit {TARGET_US} us; NCCL + norm {t['nccl_plus_norm_us']:.2f} us, symm-mem + norm "
        f"{t['symm_mem_plus_norm_us']:.2f} us) -> {out_dir / 'allreduce.md'}"
    )
    if not all(c["ok"] for c in summary["checks"]):
        log("FAILED: a correctness check before timing failed (see allreduce.md)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
