"""Every NVFP4 GEMM / MoE kernel path on the GPU against the fp32 torch references, including
the register-fed mma.sync paths (inline PTX, which the CPU interpreter cannot run). Runs where
a GPU is: python3 -m pytest -q tests/gpu/test_gpu_nvfp4_kernels.py"""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.gemm import nvfp4_format as fmt
from moeserve.kernels.gemm import nvfp4_gemm as nv
from moeserve.kernels.moe import nvfp4 as moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    ref = ref.float()
    err = (got.float() - ref).abs().max().item()
    assert err <= 1e-2 * ref.abs().max().item(), (err, ref.abs().max().item())


def test_probes_pass():
    dev = torch.device("cuda")
    assert nv.probe_decode(dev) == nv.DECODE_ASM
    assert nv.probe_gemv_mma(dev)


@pytest.mark.parametrize("kernel", ["gemv", "gemv_mma", "mma", "dequant"])
@pytest.mark.parametrize("m", [1, 3, 8, 13])
def test_gemm_paths(kernel, m):
    torch.manual_seed(m)
    n, k = 384, 1536  # N a multiple of every tile, K of the MMA GEMV's 256-wide steps
    packed, scale, gs = fmt.quantize_nvfp4(torch.randn(n, k, device="cuda") * 0.02)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = nv.nvfp4_gemm(x, packed, scale, gs, kernel=kernel)
    _close(y, nv.nvfp4_gemm_ref(x, packed, scale, gs))


def _moe_case(m: int) -> tuple:
    """m tokens routed to 4 of 12 small quantized experts: (x, ids, weights, expert tensors)."""
    e, h, i, topk = 12, 512, 256, 4
    parts13 = [fmt.quantize_nvfp4(torch.randn(2 * i, h, device="cuda") * 0.05) for _ in range(e)]
    parts2 = [fmt.quantize_nvfp4(torch.randn(h, i, device="cuda") * 0.05) for _ in range(e)]
    w13, s13, g13 = (torch.stack([p[j] for p in parts13]) for j in range(3))
    w2, s2, g2 = (torch.stack([p[j] for p in parts2]) for j in range(3))
    ids = torch.stack([torch.randperm(e, device="cuda")[:topk] for _ in range(m)]).int()
    tw = torch.rand(m, topk, device="cuda")
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    return x, ids, tw, (w13, s13, g13, w2, s2, g2)


@pytest.mark.parametrize("kernel", ["gemv", "gemv_mma", "mma"])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_moe_paths(kernel, m):
    torch.manual_seed(100 + m)
    x, ids, tw, (w13, s13, g13, w2, s2, g2) = _moe_case(m)
    y = moe.fused_moe_nvfp4(x, ids, tw, w13, s13, g13, w2, s2, g2, kernel=kernel)
    _close(y, moe.fused_moe_nvfp4_ref(x, ids, tw, w13, s13, g13, w2, s2, g2))


@pytest.mark.parametrize("split_k", [1, 3])
def test_gemv_with_programmatic_dependent_launch_in_a_graph(split_k):
    """PDL: each GEMV reads the previous one's output (a chain in one CUDA graph, so a wait
    placed too late would read a stale x); bit-equal to the same chain without PDL."""
    from moeserve.kernels.configs import tile_config

    torch.manual_seed(7)
    n = k = 1024
    ws = [fmt.quantize_nvfp4(torch.randn(n, k, device="cuda") * 0.03) for _ in range(4)]
    base = dict(tile_config("nvfp4_gemv", 1, f"{n}x{k}"), SPLIT_K=split_k)
    x0 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def chain(cfg: dict) -> list[torch.Tensor]:
        outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            x = x0
            for w, o in zip(ws, outs, strict=True):
                x = nv.nvfp4_gemm(x, *w, out=o, config=cfg, kernel="gemv")
        g.replay()
        torch.cuda.synchronize()
        return outs

    plain, pdl = chain(dict(base, PDL=0)), chain(dict(base, PDL=1))
    for a, b in zip(plain, pdl, strict=True):
        assert torch.equal(a, b)
    x = x0
    for w, got in zip(ws, plain, strict=True):  # and the chain itself against the reference
        ref = nv.nvfp4_gemm_ref(x, *w)
        _close(got, ref)
        x = got


@pytest.mark.parametrize("stages", [0, 3])
@pytest.mark.parametrize("x_scale", [1e-3, 1.0, 3e3])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_gemv_f16_products(m, x_scale, stages):
    """F16: the f16x2 inline-PTX products on x scaled per row by a power of two, against the
    fp32 reference, for activations from 1e-3 to 3e3 (f16 alone would lose the small ones and
    overflow the large ones' block sums); one row has a single huge outlier."""
    torch.manual_seed(m)
    n, k = 384, 1536
    packed, scale, gs = fmt.quantize_nvfp4(torch.randn(n, k, device="cuda") * 0.02)
    x = torch.randn(m, k, device="cuda") * x_scale
    x[0, 5] = 3e4 * x_scale  # the scale follows the row's max
    x = x.to(torch.bfloat16)
    cfg = dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=2, num_warps=4, num_stages=1, STAGES=stages)
    y = nv.nvfp4_gemm(x, packed, scale, gs, config=dict(cfg, F16=1), kernel="gemv")
    _close(y, nv.nvfp4_gemm_ref(x, packed, scale, gs))
    rest = nv.nvfp4_gemm_ref(x[1:], packed, scale, gs) if m > 1 else None
    if rest is not None:  # rows without the outlier keep their own precision
        _close(y[1:], rest)


@pytest.mark.parametrize("m", [1, 5])
def test_moe_gemv_f16_products(m):
    torch.manual_seed(200 + m)
    x, ids, tw, (w13, s13, g13, w2, s2, g2) = _moe_case(m)
    cfg = dict(MP=1 if m == 1 else 2, BLOCK_N=16, BLOCK_K=256, num_warps=2, num_stages=1)
    y = moe.fused_moe_nvfp4(
        x, ids, tw, w13, s13, g13, w2, s2, g2, kernel="gemv", gate_up_config=dict(cfg, F16=1)
    )
    _close(y, moe.fused_moe_nvfp4_ref(x, ids, tw, w13, s13, g13, w2, s2, g2))


def _gate_up_ref(x, gate, up):
    g = nv.nvfp4_gemm_ref(x, *gate).float()
    u = nv.nvfp4_gemm_ref(x, *up).float()
    return torch.nn.functional.silu(g) * u


@pytest.mark.parametrize("split_k", [0, 1, 4])
@pytest.mark.parametrize("m", [1, 3])
def test_fused_gate_up_silu(m, split_k):
    """The MLP's separate NVFP4 gate and up GEMVs with SiLU * up in one launch (global scales
    a decade apart), against the fp32 reference; the split-K workspace is left zeroed."""
    from moeserve.kernels.configs import tile_config
    from moeserve.kernels.gemm import nvfp4_gate_up as gu
    from moeserve.kernels.gemm.splitk import SplitKWorkspace

    torch.manual_seed(300 + m)
    n, k = 256, 1536
    gate = fmt.quantize_nvfp4(torch.randn(n, k, device="cuda") * 0.2)
    up = fmt.quantize_nvfp4(torch.randn(n, k, device="cuda") * 0.02)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = SplitKWorkspace.create(16 * 2 * n, 256, "cuda")
    cfg = dict(tile_config(gu.TABLE, m, f"{n}x{k}"), SPLIT_K=split_k)
    got = gu.nvfp4_gate_up_silu(x, gate, up, ws, config=cfg)
    _close(got, _gate_up_ref(x, gate, up))
    assert not ws.partial.any() and not ws.locks.any()


def test_moe_split_k_replays_with_other_ranks_experts():
    """The one-token GEMV with split-K (gate_up and down) in a CUDA graph replayed for several
    routings, some slots another rank's (ids past E): each replay matches the reference on the
    local slots, so the tile counters are back at zero after every launch."""
    torch.manual_seed(9)
    x, ids, tw, w = _moe_case(1)
    e = w[0].shape[0]
    counters = torch.zeros(
        moe.combine_counters_needed(x.shape[1], w[0].shape[1] // 2, ids.shape[1]),
        dtype=torch.int32,
        device="cuda",
    )
    cfg = dict(MP=1, BLOCK_N=16, BLOCK_K=128, num_warps=2, num_stages=1, SPLIT_K=4, DOWN_SPLIT_K=2)
    out = torch.empty_like(x)
    static_ids = ids.clone()
    g = torch.cuda.CUDAGraph()
    moe.fused_moe_nvfp4(x, static_ids, tw, *w, out=out, gate_up_config=cfg, kernel="gemv",
                        combine_counters=counters)  # fmt: skip
    with torch.cuda.graph(g):
        moe.fused_moe_nvfp4(x, static_ids, tw, *w, out=out, gate_up_config=cfg, kernel="gemv",
                            combine_counters=counters)  # fmt: skip
    for seed in range(4):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        route = torch.randperm(e, device="cuda", generator=gen)[: ids.shape[1]].int()[None]
        foreign = torch.arange(ids.shape[1], device="cuda")[None] < seed  # the first `seed` slots
        static_ids.copy_(torch.where(foreign, route + e, route))
        g.replay()
        torch.cuda.synchronize()
        local_tw = torch.where(foreign, torch.zeros_like(tw), tw)
        _close(out, moe.fused_moe_nvfp4_ref(x, route, local_tw, *w))
    assert not counters.any()


def test_programmatic_dependent_launch_chain_in_a_graph():
    """The decode MLP's kernels with PDL (--pdl on): add + RMSNorm -> fused gate/up SiLU ->
    down GEMV -> fused MoE GEMV accumulating into it, each reading the previous one's output,
    captured in one CUDA graph: bit-equal to the same graph without PDL."""
    from moeserve.kernels.elementwise.norm import add_rmsnorm
    from moeserve.kernels.gemm import nvfp4_gate_up as gu

    torch.manual_seed(11)
    x0, ids, tw, w = _moe_case(1)
    h = x0.shape[1]
    gate, up = (fmt.quantize_nvfp4(torch.randn(256, h, device="cuda") * 0.05) for _ in range(2))
    down = fmt.quantize_nvfp4(torch.randn(h, 256, device="cuda") * 0.05)
    res0 = torch.randn_like(x0)
    norm_w = torch.rand(h, device="cuda", dtype=torch.bfloat16) + 0.5

    def chain(pdl: bool) -> torch.Tensor:
        out = torch.empty_like(x0)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y, _ = add_rmsnorm(x0, res0, norm_w, 1e-6, pdl=pdl)
            a = gu.nvfp4_gate_up_silu(y, gate, up, pdl=pdl)
            s = nv.nvfp4_gemm(a, *down, out=out, kernel="gemv", pdl=pdl)
            moe.fused_moe_nvfp4(y, ids, tw, *w, out=s, accumulate=True, kernel="gemv", pdl=pdl)
        g.replay()
        torch.cuda.synchronize()
        return out

    plain = chain(False)
    assert torch.equal(chain(True), plain)
    y, _ = add_rmsnorm(x0, res0, norm_w, 1e-6)
    ref = nv.nvfp4_gemm_ref(_gate_up_ref(y, gate, up).to(torch.bfloat16), *down).float()
    _close(plain, ref + moe.fused_moe_nvfp4_ref(y, ids, tw, *w).float())
