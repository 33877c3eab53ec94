"""Communicators and the one-shot all-reduce kernels, on the CPU.

- The kernels run under TRITON_INTERPRET=1 in one process per rank, all at once, on buffers in
  shared memory standing in for the peers' symmetric memory: the real protocol (flags or
  lamport sentinels, generations, clears) over a sequence of back-to-back calls of changing
  sizes, against the fp32 sum + add + RMSNorm computed here from every rank's inputs.
- Single-process checks of what a rank writes where, of the -0.0 sentinel, and that a missing
  peer ends in a status flag and a clear error instead of a hang.
- The compiled sm_90 code (Triton's own compiler and ptxas, no GPU needed) uses system-scope
  release/acquire for the flags, volatile polls for lamport, stores the sentinel's bits when
  clearing, and no NVLink multicast instruction anywhere.
- The gloo communicator over 2 processes against the single-process sum; the selection
  logic; the single-rank communicator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from moeserve.kernels.comm import allreduce as ar
from moeserve.parallel import comm as cm

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = 40  # not a power of two: masked tail in every row
EPS = 1e-6
JOIN_TIMEOUT_S = 240  # a broken protocol must fail the test, not hang it


# ------------------------------------------------------------------------- shared helpers


def _inputs(call: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + rank)
    x = torch.randn(shape, generator=g).to(dtype)
    if call % 2 == 0 and x.numel() > 1:
        x.view(-1)[1] = -0.0  # a real -0.0 must not look like "not arrived"
    return x


def _residual(call: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 + call)
    return torch.randn(shape, generator=g).to(dtype)


def _weight(hidden: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return 0.5 + torch.rand(hidden, generator=g)


def _group(
    protocol: str,
    world: int,
    rows: int,
    hidden: int,
    dtype: torch.dtype,
    programs: int | None = None,
) -> list[ar.PeerBuffers]:
    """Every rank's PeerBuffers over buffers in shared memory (what a rendezvous gives)."""
    n = ar.buffer_elements(protocol, rows, hidden, world)
    programs = programs or ar.num_programs(rows)
    data = [torch.zeros(n, dtype=dtype).share_memory_() for _ in range(world)]
    if protocol == "lamport":
        for d in data:
            ar.sentinel_fill_(d)
    flags = [torch.zeros(programs * world, dtype=torch.int64).share_memory_() for _ in range(world)]
    return [
        ar.PeerBuffers(
            protocol=protocol,
            rank=r,
            world=world,
            buffers=tuple(data),
            flags=tuple(flags) if protocol == "flag" else (),
            counters=torch.zeros(programs, 2, dtype=torch.int64).share_memory_(),
            status=torch.zeros(1, dtype=torch.int32).share_memory_(),
            hidden=hidden,
            capacity_rows=rows,
        )
        for r in range(world)
    ]


def _join(procs: list, what: str) -> None:
    for p in procs:
        p.join(JOIN_TIMEOUT_S)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"{what}: ranks still running after {JOIN_TIMEOUT_S} s (deadlock)"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * len(procs), f"{what}: rank exit codes {codes}"


# -------------------------------------------- the real protocol, one interpreter per rank

# (kind, rows or elements): sizes change call to call, shrink after large calls (lamport
# clears what the previous call delivered), give programs one to three rows (a small grid
# keeps the interpreter fast; the GPU grid is up to 64), end plain messages inside a row.
CAPACITY = 10
PROGRAMS = 4
SEQUENCE = [
    ("fused", 3),
    ("plain", 5 * HIDDEN + 7),
    ("fused", CAPACITY),
    ("fused", 1),
    ("plain", 1),
    ("fused", 9),
    ("plain", CAPACITY * HIDDEN),
    ("fused", 2),
]
# interpreter spins before a wait gives up (status flag set): generous, because ranks are
# processes that a loaded 2-core machine may not schedule for a while; a broken protocol
# still ends (and the status check below names it)
SPIN_LIMIT = 20_000_000


# one spawn runs both protocols (start-up dominates): lamport in fp16 (16-bit sentinel),
# flag in fp32 (exact norms)
CASES = (("lamport", torch.float16), ("flag", torch.float32))
WORLD = 2  # more ranks than cores would spin against each other; 4 ranks below


def _run_sequence(bufs: ar.PeerBuffers) -> list[list[torch.Tensor]]:
    dtype = bufs.dtype
    w = _weight(bufs.hidden)
    results = []
    for call, (kind, size) in enumerate(SEQUENCE):
        if kind == "fused":
            shape = (size, bufs.hidden)
            x = _inputs(call, bufs.rank, shape, dtype)
            out, r = torch.empty_like(x), torch.empty_like(x)
            ar.one_shot_all_reduce_add_rmsnorm(
                bufs, x, _residual(call, shape, dtype), w, EPS, out, r, SPIN_LIMIT
            )
            results.append([out, r])
        else:
            x = _inputs(call, bufs.rank, (size,), dtype)
            results.append([ar.one_shot_all_reduce(bufs, x, x, SPIN_LIMIT)])  # in place
    return results


def _rank_worker(groups: list[ar.PeerBuffers], out_dir: str, barrier) -> None:
    torch.set_num_threads(1)
    barrier.wait()
    for bufs in groups:  # the start-up self-test first: it must pass, then calls go on
        comm = cm.OneShotCommunicator(bufs, _Recorder(), 1 << 20, "test peers", SPIN_LIMIT)
        assert cm.self_test(comm, torch.device("cpu"), SPIN_LIMIT) is None
    results = [_run_sequence(bufs) for bufs in groups]
    torch.save(results, os.path.join(out_dir, f"rank{groups[0].rank}.pt"))


def _expected(world: int, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    w = _weight(HIDDEN)
    want = []
    for call, (kind, size) in enumerate(SEQUENCE):
        shape = (size, HIDDEN) if kind == "fused" else (size,)
        parts = [_inputs(call, q, shape, dtype) for q in range(world)]
        if kind == "fused":
            y, r = ar.all_reduce_add_rmsnorm_reference(parts, _residual(call, shape, dtype), w, EPS)
            want.append([y, r])
        else:
            want.append([ar.all_reduce_reference(parts)])
    return want


def _check_protocol(protocol, dtype, group, outs) -> None:
    world = len(group)
    for b in group:
        assert int(b.status) == 0, f"{protocol}: a wait timed out on rank {b.rank}"
    want = _expected(world, dtype)
    norm_tol = 2e-3 if dtype == torch.float16 else 1e-5
    for call, (kind, size) in enumerate(SEQUENCE):
        for rank in range(world):
            got = outs[rank][call]
            if kind == "fused":
                # the residual is the exact fp32 sum rounded once; the norm is close
                assert torch.equal(got[1], want[call][1]), (protocol, call, rank)
                torch.testing.assert_close(
                    got[0].float(), want[call][0].float(), atol=norm_tol, rtol=norm_tol
                )
                assert torch.equal(got[0], outs[0][call][0]), "ranks disagree on the norm"
            else:
                assert torch.equal(got[0], want[call][0]), (protocol, call, rank, size)
    calls = 2 * cm.SELF_TEST_ROUNDS + len(SEQUENCE)
    for b in group:
        assert int(b.status) == 0, "a wait timed out"
        assert b.counters[:, 0].tolist() == [calls] * b.programs  # every program, every call
    if protocol == "lamport":
        # only the last call's deliveries are left: everything older was reset to -0.0
        last_rows = SEQUENCE[-1][1]
        g = ar.LAMPORT_GENERATIONS
        for b in group:
            data = b.buffers[b.rank].view(g, world, CAPACITY, HIDDEN)
            keep = torch.zeros_like(data, dtype=torch.bool)
            for q in range(world):
                if q != b.rank:
                    keep[calls % g, q, :last_rows] = True
            stale = data[~keep]
            assert (stale.view(torch.int16) == -32768).all(), "an old delivery was not reset"


def test_protocols_back_to_back_over_concurrent_ranks(tmp_path):
    groups = [_group(p, WORLD, CAPACITY, HIDDEN, dt, PROGRAMS) for p, dt in CASES]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(WORLD)
    procs = [
        ctx.Process(target=_rank_worker, args=([g[r] for g in groups], str(tmp_path), barrier))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    _join(procs, "one-shot protocols")
    outs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for i, (protocol, dtype) in enumerate(CASES):
        _check_protocol(protocol, dtype, groups[i], [o[i] for o in outs])


# ------------------------------------------------------------- single-process, one rank


def _publish_as_peers(group: list[ar.PeerBuffers], me: int, epoch: int, parts, n_rows: int):
    """What every peer's launch of call `epoch` does to rank `me`, per the protocol."""
    b = group[me]
    n = parts[0].numel()
    for q, part in enumerate(parts):
        if q == me:
            continue
        part = part.flatten()
        if b.protocol == "flag":
            slot = (epoch % 2) * b.region
            b.buffers[q][slot : slot + n] = part
            flags = b.flags[me].view(b.programs, b.world)
            flags[: min(n_rows, b.programs), q] = epoch
        else:
            base = (epoch % 3) * b.world * b.region + q * b.region
            # a sender turns -0.0 into +0.0: -0.0 means "not arrived"
            b.buffers[me][base : base + n] = torch.where(part == 0, 0.0, part)


@pytest.mark.parametrize("protocol", ar.PROTOCOLS)
def test_one_rank_writes_where_the_protocol_says(protocol):
    world, me, rows, dtype = 4, 2, 5, torch.float32
    group = _group(protocol, world, rows, HIDDEN, dtype)
    b = group[me]
    w = _weight(HIDDEN)
    for epoch, n in ((1, 3), (2, 5), (3, 1), (4, 2)):
        parts = [_inputs(epoch, q, (n, HIDDEN), dtype) for q in range(world)]
        parts[me].view(-1)[0] = -0.0
        _publish_as_peers(group, me, epoch, parts, n)
        res = _residual(epoch, (n, HIDDEN), dtype)
        out, r = torch.empty_like(parts[me]), torch.empty_like(parts[me])
        ar.one_shot_all_reduce_add_rmsnorm(b, parts[me], res, w, EPS, out, r)
        y, want_r = ar.all_reduce_add_rmsnorm_reference(parts, res, w, EPS)
        assert torch.equal(r, want_r)
        torch.testing.assert_close(out, y, atol=1e-5, rtol=1e-5)
        assert int(b.status) == 0
        mine = parts[me].flatten().clone()
        if protocol == "flag":
            slot = (epoch % 2) * b.region
            assert torch.equal(b.buffers[me][slot : slot + mine.numel()], mine)
            for q in range(world):
                if q == me:
                    continue
                posted = b.flags[q].view(b.programs, world)[:, me]
                assert posted[:n].tolist() == [epoch] * n  # programs with rows signal
                assert (posted[n:] < epoch).all()  # programs without rows do not
        else:
            mine = torch.where(mine == 0, 0.0, mine)  # -0.0 travels as +0.0
            base = (epoch % 3) * world * b.region + me * b.region
            for q in range(world):
                if q != me:
                    sent = b.buffers[q][base : base + mine.numel()]
                    assert torch.equal(sent.view(torch.int32), mine.view(torch.int32))
            # and the peers' deliveries of the previous call were reset
            if epoch > 1:
                prev = ((epoch - 1) % 3) * world * b.region
                old = b.buffers[me][prev : prev + world * b.region].view(world, b.region)
                assert (old.view(torch.int32) == -(2**31)).all()
    assert b.counters[:, 0].tolist() == [4] * b.programs


@pytest.mark.parametrize("protocol", ar.PROTOCOLS)
def test_missing_peer_sets_status_instead_of_hanging(protocol):
    group = _group(protocol, 2, 4, HIDDEN, torch.float32)
    x = torch.randn(2, HIDDEN)
    ar.one_shot_all_reduce(group[0], x, x.clone(), timeout=5)  # nobody publishes
    assert int(group[0].status) == 1
    with pytest.raises(RuntimeError, match="out of step"):
        ar.check_status(group[0])


def test_flag_peer_one_call_ahead_is_accepted():
    group = _group("flag", 2, 2, HIDDEN, torch.float32)
    parts = [torch.randn(1, HIDDEN) for _ in range(2)]
    _publish_as_peers(group, 0, 1, parts, 1)
    group[0].flags[0].view(-1, 2)[0, 1] = 2  # the peer already signalled its next call
    got = ar.one_shot_all_reduce(group[0], parts[0].clone(), torch.empty(1, HIDDEN), timeout=5)
    assert int(group[0].status) == 0
    assert torch.equal(got, ar.all_reduce_reference(parts))


def test_wrappers_reject_what_the_buffers_cannot_hold():
    b = _group("lamport", 2, 4, HIDDEN, torch.float32)[0]
    x = torch.zeros(5, HIDDEN)
    with pytest.raises(ValueError, match="capacity"):
        ar.one_shot_all_reduce(b, x, x)
    with pytest.raises(ValueError, match="float32"):
        y = torch.zeros(2, HIDDEN, dtype=torch.float16)
        ar.one_shot_all_reduce(b, y, y)
    z = torch.zeros(2, HIDDEN)
    with pytest.raises(ValueError, match="rows exceed"):
        big = torch.zeros(5, HIDDEN)
        ar.one_shot_all_reduce_add_rmsnorm(b, big, big, torch.ones(HIDDEN), EPS, big, big)
    with pytest.raises(ValueError, match="weight"):
        ar.one_shot_all_reduce_add_rmsnorm(b, z, z, torch.ones(HIDDEN + 1), EPS, z, z)
    with pytest.raises(ValueError, match="protocol"):
        ar.buffer_elements("ring", 4, HIDDEN, 2)


# ----------------------------------------------- compiled code (Triton's compiler, no GPU)

_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moeserve.kernels.comm import allreduce as ar

def ptx(protocol, world):
    sig = {n: "*bf16" for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}
    sig["buffers"] = tuple(["*bf16"] * world)
    if protocol == "flag":
        sig["flags"] = tuple(["*i64"] * world)
    sig.update(counters_ptr="*i64", status_ptr="*i32", n_rows="i32", numel="i32",
               row_len="i32", region="i32", eps="fp32", timeout="i64")
    const = dict(RANK=0, WORLD=world, PROGRAMS=64, ROWS_PER_PROGRAM=2, BLOCK=8192,
                 FUSED=True, TIMER=True)
    for k in const:
        sig[k] = "constexpr"
    names = list(sig)
    fn = ar._flag_kernel if protocol == "flag" else ar._lamport_kernel
    # what the JIT knows of real arguments: 16-byte aligned pointers, sizes divisible by 16
    div = [["tt.divisibility", 16]]
    attrs = {(names.index(n),): div for n in sig if sig[n] in ("*bf16", "*i64", "*i32")}
    attrs.update({(names.index(n),): div for n in ("numel", "row_len", "region")})
    for j in range(world):
        attrs[(names.index("buffers"), j)] = div
        if protocol == "flag":
            attrs[(names.index("flags"), j)] = div
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 16}).asm["ptx"]

print(json.dumps({p: ptx(p, 2) for p in ("flag", "lamport")}))
"""


def test_compiled_kernels_use_the_intended_memory_operations():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, code in ptx.items():
        assert "multimem" not in code and ".multicast" not in code, f"{name}: NVLink multicast"
        assert "%globaltimer" in code, f"{name}: waits must time out"
    for name, code in ptx.items():
        # the call counter: every warp loads it, one thread stores the next value; a CTA
        # barrier must come between, or a late warp reads the next call's epoch
        first_load = code.index("ld.global.b64")
        first_store = code.index("st.global.b64")
        assert first_load < first_store, name
        assert "bar.sync" in code[first_load:first_store], f"{name}: counter read/write race"
    assert "atom.global.sys.release.exch.b64" in ptx["flag"]
    assert "atom.global.sys.acquire.add.u64" in ptx["flag"]
    assert "ld.global.cg.v4" in ptx["flag"]  # peer rows vectorised, never from L1
    assert "ld.volatile.global.v4" in ptx["lamport"]  # polls vectorised too
    # the clear stores the bits of two bf16 -0.0 (0x80008000), not a folded +0.0
    assert "-2147450880" in ptx["lamport"]


# ---------------------------------------------------------------------------- selection


def test_choose_follows_the_topology():
    p2p = cm.Topology(same_host=True, p2p=True, detail="every pair P2P-accessible")
    pcie = cm.Topology(same_host=True, p2p=False, detail="cuda:0 cannot access cuda:1")
    hosts = cm.Topology(same_host=False, p2p=False, detail="ranks span hosts")
    assert cm.choose(1, "cuda", p2p, None, 8)[0] == "single"
    assert cm.choose(2, "cpu", None, None, 8) == ("torch", "cpu tensors")
    assert cm.choose(2, "cuda", p2p, None, 8) == ("one-shot", "every pair P2P-accessible")
    assert cm.choose(8, "cuda", p2p, None, 8, "one-shot")[0] == "one-shot"
    assert cm.choose(2, "cuda", p2p, None, 8, "nccl") == ("torch", "NCCL requested")
    kind, why = cm.choose(2, "cuda", pcie, None, 8)
    assert kind == "torch" and "cannot access" in why
    assert cm.choose(2, "cuda", hosts, None, 8, "one-shot")[0] == "torch"
    assert cm.choose(2, "cuda", p2p, "no symmetric memory", 8) == ("torch", "no symmetric memory")
    assert cm.choose(2, "cuda", p2p, None, 0)[0] == "torch"
    with pytest.raises(ValueError, match="auto, nccl, one-shot"):
        cm.choose(2, "cuda", p2p, None, 8, "fast")


def test_one_shot_rows_caps_by_threshold():
    # Kimi-K2.5 / DeepSeek-V3 hidden 7168 bf16: 14 KiB a token
    assert cm.one_shot_rows(512, 7168, torch.bfloat16, 1 << 20) == 73
    assert cm.one_shot_rows(64, 7168, torch.bfloat16, 1 << 20) == 64
    assert cm.one_shot_rows(64, 7168, torch.bfloat16, 8 << 10) == 0
    assert cm.one_shot_rows(8, 256, torch.float32, 512 << 10) == 8
    assert cm.one_shot_rows(8, ar.MAX_HIDDEN * 2, torch.bfloat16, 1 << 30) == 0


class _Recorder:
    name = "nccl"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def all_reduce(self, x):
        self.calls.append("all_reduce")
        return x

    def all_reduce_add_rmsnorm(self, x, residual, weight, eps):
        self.calls.append("all_reduce_add_rmsnorm")
        return x, residual

    def all_gather(self, x, dim=-1):
        self.calls.append("all_gather")
        return x

    def describe(self) -> str:
        return "recorder"


def test_one_shot_communicator_routes_by_size_dtype_and_layout():
    bufs = _group("lamport", 2, 4, HIDDEN, torch.float32)[0]
    fallback = _Recorder()
    max_bytes = 3 * HIDDEN * 4
    comm = cm.OneShotCommunicator(bufs, fallback, max_bytes, "test peers", timeout=2)
    w = torch.ones(HIDDEN)
    comm.all_reduce(torch.zeros(4, HIDDEN))  # within capacity, above the threshold
    comm.all_reduce(torch.zeros(2, HIDDEN, dtype=torch.float16))  # another dtype
    comm.all_reduce(torch.zeros(HIDDEN, 2).t())  # not contiguous
    comm.all_reduce_add_rmsnorm(torch.zeros(2, HIDDEN + 8), torch.zeros(2, HIDDEN + 8), w, EPS)
    comm.all_gather(torch.zeros(2, HIDDEN))
    assert fallback.calls == ["all_reduce"] * 3 + ["all_reduce_add_rmsnorm", "all_gather"]
    assert bufs.counters[:, 0].tolist() == [0] * bufs.programs  # no launch so far
    # small messages launch the kernel; with no peer here the wait times out into status
    comm.all_reduce(torch.zeros(2, HIDDEN))
    comm.all_reduce_add_rmsnorm(torch.zeros(3, HIDDEN), torch.zeros(3, HIDDEN), w, EPS)
    assert len(fallback.calls) == 5
    assert bufs.counters[:, 0].tolist() == [2] * bufs.programs
    with pytest.raises(RuntimeError, match="out of step"):
        comm.check()
    line = comm.describe()
    assert "one-shot" in line and "lamport" in line and "4 tokens x 40" in line
    assert "nccl above that" in line and "multicast off" in line


def test_single_rank_communicator():
    comm = cm.create_communicator(
        None, 0, 1, torch.device("cpu"), max_tokens=4, hidden=HIDDEN, dtype=torch.float32
    )
    assert comm.name == "single" and "single" in comm.describe()
    x, res, w = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN), _weight(HIDDEN)
    assert comm.all_reduce(x) is x and comm.all_gather(x) is x
    y, r = comm.all_reduce_add_rmsnorm(x, res, w, EPS)
    want_r = x + res
    assert torch.equal(r, want_r)
    rms = want_r.pow(2).mean(-1, keepdim=True).add(EPS).rsqrt()
    torch.testing.assert_close(y, want_r * rms * w)


# ---------------------------------------------------------------- gloo over 2 processes


def _gloo_worker(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    comm = cm.create_communicator(
        dist.group.WORLD,
        rank,
        world,
        torch.device("cpu"),
        max_tokens=8,
        hidden=HIDDEN,
        dtype=torch.float32,
    )
    x = _inputs(0, rank, (5, HIDDEN), torch.float32)
    res = _residual(0, (5, HIDDEN), torch.float32)
    got = {
        "name": comm.name,
        "describe": comm.describe(),
        "sum": comm.all_reduce(x.clone()),
        "gather_last": comm.all_gather(x, -1),
        "gather_first": comm.all_gather(x, 0),
        "fused": comm.all_reduce_add_rmsnorm(x.clone(), res, _weight(HIDDEN), EPS),
    }
    torch.save(got, f"{out}.{rank}")
    dist.barrier()
    os._exit(0)  # skip gloo teardown (it aborts now and then in spawned processes)


def test_gloo_communicator_matches_single_process(tmp_path):
    world = 2
    out = str(tmp_path / "out")
    mp.spawn(_gloo_worker, args=(world, str(tmp_path / "store"), out), nprocs=world, join=True)
    parts = [_inputs(0, q, (5, HIDDEN), torch.float32) for q in range(world)]
    res = _residual(0, (5, HIDDEN), torch.float32)
    total = parts[0] + parts[1]
    r = total + res
    normed = F.rms_norm(r, (HIDDEN,), _weight(HIDDEN), EPS)
    for rank in range(world):
        got = torch.load(f"{out}.{rank}")
        assert got["name"] == "gloo" and "gloo" in got["describe"]
        torch.testing.assert_close(got["sum"], total)
        assert torch.equal(got["gather_last"], torch.cat(parts, -1))
        assert torch.equal(got["gather_first"], torch.cat(parts, 0))
        torch.testing.assert_close(got["fused"][1], r)
        torch.testing.assert_close(got["fused"][0], normed)
