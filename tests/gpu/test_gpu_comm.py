"""One-shot all-reduce (both protocols) on 2 GPUs against NCCL and the fp32 reference, eager
and inside a CUDA graph replayed 200 times back-to-back. Runs where >= 2 GPUs are:

    timeout 900 env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python3 -m pytest -q -s tests/gpu/test_gpu_comm.py

Each rank generates every rank's inputs (seeded), so it computes the reference itself:
the sum in fp32 in rank order, rounded once (what the kernels promise bit-exactly), and
for the fused call the residual add and RMSNorm. NCCL's all-reduce (+ torch add + norm) is
the independent peer: equal to 1 bf16 ulp. In the graph each call compares its outputs with
precomputed expectations and counts mismatches on the device, so a stale read or a race in
any of the 200 replays shows up, not only in the last one.
"""

from __future__ import annotations

import faulthandler
import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from moeserve.kernels.comm import allreduce as ar
from moeserve.parallel import comm as cm

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs of one host"
)

WORLD = 2
HIDDEN = 7168  # Kimi-K2.5 / DeepSeek-V3
TOKENS = (1, 8, 64, 1000)  # 14 KB .. 14 MB per rank
EPS = 1e-6
REPLAYS = 200
WORKER_TIMEOUT_S = 420  # each rank dumps its stacks and exits past this (no silent hang)
JOIN_TIMEOUT_S = 480


def _bf16_far(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor | None = None):
    """Elements further apart than about one bf16 ulp of `mag` (default: of `want`)."""
    g, w = got.float(), want.float()
    m = w.abs() if mag is None else torch.maximum(w.abs(), mag.float().abs())
    return (g - w).abs() > 1e-2 + 8e-3 * m


def _far_from_nccl(y, r, nccl_sum, nccl_y, nccl_r, w) -> bool:
    """NCCL rounds the sum to bf16 before the residual add, the fused kernel does not: the
    residuals may differ by an ulp of the larger of sum and residual (double rounding), and
    the normed outputs by that ulp as the norm scales it plus their own rounding."""
    inv_rms = torch.rsqrt(nccl_r.float().pow(2).mean(-1, keepdim=True) + EPS)
    r_mag = torch.maximum(nccl_sum.float().abs(), nccl_r.float().abs())
    y_mag = nccl_y.float().abs() + r_mag * w.float().abs() * inv_rms
    return bool(_bf16_far(r, nccl_r, r_mag).any() or _bf16_far(y, nccl_y, y_mag).any())


def _inputs(n: int, rank: int, device: torch.device, salt: int = 0):
    g = torch.Generator().manual_seed(100_000 * salt + 1000 * n + rank)
    return torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16).to(device)


def _case(n: int, rank: int, device: torch.device, salt: int = 0):
    """(this rank's partial, residual, weight, every rank's partial)."""
    parts = [_inputs(n, q, device, salt) for q in range(WORLD)]
    g = torch.Generator().manual_seed(7 + n + 31 * salt)
    res = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16).to(device)
    w = (0.5 + torch.rand(HIDDEN, generator=g)).to(torch.bfloat16).to(device)
    return parts[rank], res, w, parts


def _nccl_reference(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor):
    s = x.clone()
    dist.all_reduce(s)
    r = s + res
    return s, F.rms_norm(r, (HIDDEN,), w, EPS), r


def _eager_checks(comm: cm.OneShotCommunicator, rank: int, device, report: dict) -> None:
    for n in TOKENS:
        x, res, w, parts = _case(n, rank, device)
        want_sum = ar.all_reduce_reference(parts)
        want_y, want_r = ar.all_reduce_add_rmsnorm_reference(parts, res, w, EPS)
        nccl_sum, nccl_y, nccl_r = _nccl_reference(x, res, w)

        got_sum = comm.all_reduce(x.clone())
        assert torch.equal(got_sum, want_sum), f"{n} tokens: one-shot sum != fp32 sum"
        assert not _bf16_far(got_sum, nccl_sum).any(), f"{n} tokens: one-shot sum vs NCCL"

        y, r = comm.all_reduce_add_rmsnorm(x.clone(), res, w, EPS)
        assert torch.equal(r, want_r), f"{n} tokens: fused residual != fp32 reference"
        assert not _bf16_far(y, want_y).any(), f"{n} tokens: fused norm vs reference"
        assert not _far_from_nccl(y, r, nccl_sum, nccl_y, nccl_r, w), (
            f"{n} tokens: fused vs NCCL + torch norm"
        )
        # every rank holds the same bits
        both = [torch.empty_like(y) for _ in range(WORLD)]
        dist.all_gather(both, y)
        assert torch.equal(both[0], both[1]), f"{n} tokens: ranks disagree"
        report[f"eager_{n}"] = {
            "max_abs_vs_nccl_norm": float((y.float() - nccl_y.float()).abs().max()),
            "max_abs_vs_nccl_residual": float((r.float() - nccl_r.float()).abs().max()),
        }
    comm.check()


def _auto_checks(comm, rank: int, device, report: dict) -> None:
    """The default communicator: one-shot up to its threshold, NCCL + the Triton add_rmsnorm
    above it (1000 tokens); both within a bf16 ulp of NCCL + torch add + norm."""
    routes = {}
    for n in TOKENS:
        x, res, w, parts = _case(n, rank, device, salt=3)
        nccl_sum, nccl_y, nccl_r = _nccl_reference(x, res, w)
        y, r = comm.all_reduce_add_rmsnorm(x.clone(), res, w, EPS)
        if comm.takes_rows(x):  # one-shot: the fp32 sum rounded once, bit-exact
            want_y, want_r = ar.all_reduce_add_rmsnorm_reference(parts, res, w, EPS)
            bad = (r != want_r).sum().item()
            far = (r.float() - want_r.float()).abs().max().item()
            assert bad == 0, f"auto, {n} tokens: {bad} residuals != fp32 reference (max {far})"
        assert not _far_from_nccl(y, r, nccl_sum, nccl_y, nccl_r, w), (
            f"auto communicator, {n} tokens: fused vs NCCL + torch norm: max |r - r_nccl| "
            f"{(r.float() - nccl_r.float()).abs().max().item()}, |y - y_nccl| "
            f"{(y.float() - nccl_y.float()).abs().max().item()}"
        )
        s = comm.all_reduce(x.clone())
        assert not _bf16_far(s, nccl_sum).any(), f"auto communicator, {n} tokens: sum vs NCCL"
        routes[n] = "one-shot" if comm.takes_rows(x) else "nccl"
    report["auto_routes"] = routes
    assert routes[1] == "one-shot" and routes[1000] == "nccl", routes
    comm.check()


def _graph_checks(comm: cm.OneShotCommunicator, rank: int, device, report: dict) -> None:
    """One graph: per size, a fused call and an in-place plain call on two input sets each,
    every output compared on the device with its precomputed expectation."""
    cases = []
    for n in TOKENS:
        for salt in (1, 2):
            x, res, w, parts = _case(n, rank, device, salt)
            want_y, want_r = ar.all_reduce_add_rmsnorm_reference(parts, res, w, EPS)
            cases.append((x, res, w, ar.all_reduce_reference(parts), want_y, want_r))
    bad = torch.zeros(4, dtype=torch.int64, device=device)
    work = [torch.empty_like(c[0]) for c in cases]

    def body() -> None:
        for (x, res, w, want_sum, want_y, want_r), buf in zip(cases, work, strict=True):
            y, r = comm.all_reduce_add_rmsnorm(x, res, w, EPS)
            bad[0] += (r != want_r).sum()
            bad[1] += _bf16_far(y, want_y).sum()
            buf.copy_(x)
            s = comm.all_reduce(buf)
            bad[2] += (s != want_sum).sum()

    body()  # eager once more (also the graph's warm-up)
    torch.cuda.synchronize()
    assert int(bad.sum()) == 0, f"eager pass before capture: mismatches {bad.tolist()}"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    bad.zero_()
    dist.barrier()
    for _ in range(REPLAYS):  # back-to-back, no host sync in between
        graph.replay()
    torch.cuda.synchronize()
    comm.check()
    counts = bad.tolist()
    report["graph"] = {"replays": REPLAYS, "calls_per_replay": 2 * len(cases), "bad": counts}
    assert sum(counts) == 0, f"mismatches over {REPLAYS} replays (residual, norm, sum): {counts}"


def _worker(rank: int, protocol: str, store: str, out_dir: str) -> None:
    faulthandler.dump_traceback_later(WORKER_TIMEOUT_S, exit=True)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=120),
    )
    report: dict = {"protocol": protocol}
    auto = cm.create_communicator(
        dist.group.WORLD,
        rank,
        WORLD,
        device,
        max_tokens=max(TOKENS),
        hidden=HIDDEN,
        dtype=torch.bfloat16,
        protocol=protocol,
    )
    report["auto"] = auto.describe()
    assert isinstance(auto, cm.OneShotCommunicator), auto.describe()
    _auto_checks(auto, rank, device, report)
    # one-shot for every size here, 14 MB included, to test the kernels beyond the threshold
    comm = cm.create_communicator(
        dist.group.WORLD,
        rank,
        WORLD,
        device,
        max_tokens=max(TOKENS),
        hidden=HIDDEN,
        dtype=torch.bfloat16,
        one_shot_max_bytes=max(TOKENS) * HIDDEN * 2,
        prefer="one-shot",
        protocol=protocol,
    )
    report["forced"] = comm.describe()
    assert isinstance(comm, cm.OneShotCommunicator), comm.describe()
    assert comm.bufs.capacity_rows == max(TOKENS)
    _eager_checks(comm, rank, device, report)
    _graph_checks(comm, rank, device, report)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("protocol", ar.PROTOCOLS)
def test_one_shot_matches_nccl_eager_and_in_graphs(tmp_path, monkeypatch, protocol):
    for k, v in cm.NO_MULTICAST_ENV.items():
        monkeypatch.setenv(k, v)  # inherited by the spawned ranks
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(r, protocol, str(tmp_path / "store"), str(tmp_path)))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(JOIN_TIMEOUT_S)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, f"{protocol}: ranks still running after {JOIN_TIMEOUT_S} s"
    assert [p.exitcode for p in procs] == [0] * WORLD, [p.exitcode for p in procs]
    for r in range(WORLD):
        report = json.loads((tmp_path / f"rank{r}.json").read_text())
        print(f"\nrank {r} [{protocol}]\n  auto:   {report['auto']}\n  forced: {report['forced']}")
        print(f"  graph: {report['graph']}\n  auto routes: {report['auto_routes']}")
        for n in TOKENS:
            print(f"  {n:5d} tokens vs NCCL: {report[f'eager_{n}']}")
