"""The MoE router in one launch for decode batches: gate GEMV (x [T, H] bf16 @ W[E, H]^T, fp32
logits) + routing (kernels/routing/router.py's semantics) in a single Triton kernel.

Why: at T <= a few tokens the gate GEMM reads 3.7-5.5 MB of bf16 weight (~1 us of HBM time) but
the GEMM launch + the route launch cost ~9 us per MoE layer inside a CUDA graph; one launch
removes a launch and the logits round trip.

How: the grid splits the E experts into blocks of BLOCK_E and the hidden dim H into SPLIT_K
ranges; each program computes a [T, BLOCK_E] fp32 partial dot product (CUDA-core FMAs: T is at
most FUSED_MAX_TOKENS, tensor cores buy nothing at this size) and stores it into the workspace
partials [SPLIT_K, T, E] with plain stores. Then it bumps an int32 counter (acq_rel); the program
that sees count == programs - 1 is the last one: every partial is visible to it, so it sums the
SPLIT_K partials in split order (deterministic logits, no float atomics), stores the logits
[T, E] into the workspace (kept for inspection / tests), routes all T rows at once and resets
the counter to 0, so the next call or CUDA-graph replay finds it zeroed. In the CPU interpreter
the programs run one after another and the same counter logic picks the final one.

Routing semantics are exactly ``moeserve.kernels.routing.router.route``'s (see its module
docstring): sigmoid / softmax scores (its ``route_score`` helper), e_score_correction_bias,
group-limited top-k (noaux_tc best-2 group score, group_limited_greedy best-1), ties to the
lower expert (group) index, ids best first, weights = unbiased scores, renormalised /
routed_scaling_factor per ``weight_rule``, S shared-slot columns (ids shared_first_id + j,
weight 1.0). The rows are routed together as [T, groups, experts per group] tensors with
router.py's steps (each top-k step one argmax over the flattened rows, weights recomputed from
the chosen experts' logits reloaded from the workspace). The logits differ from ``torch.mm(x,
W.t(), out_dtype=fp32)`` only in fp32 summation order.

One workspace (``RouterFusedWorkspace``) serves any number of sequential launches on one stream
(all MoE layers of a decode graph); launches running concurrently on different streams need
one each.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.kernels.routing.router import (
    RENORM_EPS,
    check_out,
    check_route_args,
    route,
    route_rows,
    weight_rule,
)
from moeserve.kernels.runtime import interpreting

log = logging.getLogger(__name__)

# Largest decode batch the fused launch serves (and the tests cover): every program re-reads
# all T rows of x and the last program routes all T rows alone, so its cost grows with T.
FUSED_MAX_TOKENS = 8
# Largest batch where it beat Router.forward + route on an H200 (benchmarks/results/
# router_fused.md: T=1 8.5 us vs 9.3 (E=256) and 11.2 (E=384); at T=2 it lost for E=256, at
# T>=4 for both).
FUSED_WINS_MAX_TOKENS = 1
# The last program holds [T, E] rows of several fp32 tensors in registers.
FUSED_MAX_EXPERTS = 512
MAX_SPLIT_K = 16  # the workspace holds this many partial [T, E] slices


@dataclass(frozen=True)
class FusedRouterConfig:
    """Launch shape: experts per program, K elements per inner step, K ranges, warps, and
    rows the last program routes per pass (0: all T at once)."""

    block_e: int
    block_k: int
    split_k: int
    num_warps: int
    route_rows: int = 0


# The best shape of the H200 sweep at T=1 (benchmarks/results/router_fused.md); used when the
# caller passes none. Larger T was timed with (4, 256, 4, 4) only: to be swept.
_DEFAULT_CONFIG = FusedRouterConfig(block_e=2, block_k=512, split_k=4, num_warps=4)


def plan_config(tokens: int, experts: int, hidden: int) -> FusedRouterConfig:
    """The launch shape route_fused uses for [tokens, hidden] x [experts, hidden]."""
    del tokens, experts, hidden  # one shape until T > 1 is swept on a GPU
    return _DEFAULT_CONFIG


@dataclass(frozen=True)
class RouterFusedWorkspace:
    """Preallocated scratch of route_fused (CUDA-graph safe): fp32 partial logits, the final fp32
    logits [max_tokens, E] of the last call, and the arrival counter (zero between launches)."""

    partials: torch.Tensor  # fp32 [MAX_SPLIT_K * max_tokens * E]
    logits: torch.Tensor  # fp32 [max_tokens, E]
    counter: torch.Tensor  # int32 [1], 0 between launches

    @staticmethod
    def create(
        num_experts: int,
        device: torch.device | str,
        max_tokens: int = FUSED_MAX_TOKENS,
    ) -> RouterFusedWorkspace:
        return RouterFusedWorkspace(
            torch.empty(MAX_SPLIT_K * max_tokens * num_experts, dtype=torch.float32, device=device),
            torch.zeros(max_tokens, num_experts, dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
        )

    def fits(self, tokens: int, experts: int, split_k: int) -> bool:
        return (
            self.logits.shape[1] == experts
            and self.logits.shape[0] >= tokens
            and self.partials.numel() >= split_k * tokens * experts
        )


def fused_route_supported(x: torch.Tensor, gate_weight: torch.Tensor) -> bool:
    """Whether route_fused serves this (x, gate weight): bf16 [T, H] x with 1 <= T <=
    FUSED_MAX_TOKENS, bf16 [E, H] weight with E <= FUSED_MAX_EXPERTS, both with a contiguous
    last dim, on one CUDA device (or under the Triton interpreter)."""
    if x.dim() != 2 or gate_weight.dim() != 2:
        return False
    if x.dtype != torch.bfloat16 or gate_weight.dtype != torch.bfloat16:
        return False
    if x.device != gate_weight.device or not (x.is_cuda or interpreting()):
        return False
    if x.stride(-1) != 1 or gate_weight.stride(-1) != 1:
        return False
    return (
        1 <= x.shape[0] <= FUSED_MAX_TOKENS
        and x.shape[1] == gate_weight.shape[1]
        and 1 <= gate_weight.shape[0] <= FUSED_MAX_EXPERTS
    )


def prefer_fused_route(x: torch.Tensor, gate_weight: torch.Tensor) -> bool:
    """fused_route_supported and T within the measured win (FUSED_WINS_MAX_TOKENS)."""
    return fused_route_supported(x, gate_weight) and x.shape[0] <= FUSED_WINS_MAX_TOKENS


@triton.jit
def _router_fused_kernel(
    x_ptr,
    gw_ptr,
    bias_ptr,
    part_ptr,
    logits_ptr,
    counter_ptr,
    w_ptr,
    ids_ptr,
    tokens,
    hidden,
    experts,
    stride_xt,
    stride_ge,
    stride_lt,
    stride_wt,
    stride_it,
    group_size,
    scale,
    shared_first_id,
    T_P2: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    N_GROUP: tl.constexpr,
    NG_P2: tl.constexpr,
    GS_P2: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_TOP2: tl.constexpr,
    RENORM: tl.constexpr,
    RENORM_EPS: tl.constexpr,
    SHARED: tl.constexpr,
    S_P2: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    eb = pid // SPLIT_K
    ks = pid % SPLIT_K

    # ---- partial GEMV: [T, BLOCK_E] over this program's K range ----
    t3 = tl.arange(0, T_P2)[:, None, None]
    e3 = eb * BLOCK_E + tl.arange(0, BLOCK_E)[None, :, None]
    k3 = tl.arange(0, BLOCK_K)[None, None, :]
    row_ok = t3 < tokens
    e_ok = e3 < experts
    k_base = ks * (K_ITERS * BLOCK_K)
    acc = tl.zeros([T_P2, BLOCK_E, BLOCK_K], tl.float32)
    for it in tl.static_range(K_ITERS):
        kc = k_base + it * BLOCK_K + k3
        k_ok = kc < hidden
        wv = tl.load(
            gw_ptr + e3.to(tl.int64) * stride_ge + kc,
            mask=e_ok & k_ok,
            other=0.0,
            eviction_policy="evict_first",  # streamed once per call: keep L2 for x
        )
        xv = tl.load(x_ptr + t3 * stride_xt + kc, mask=row_ok & k_ok, other=0.0)
        acc += xv.to(tl.float32) * wv.to(tl.float32)
    part = tl.sum(acc, axis=2)
    t2 = tl.arange(0, T_P2)[:, None]
    e2 = eb * BLOCK_E + tl.arange(0, BLOCK_E)[None, :]
    slice_elems = tokens * experts
    tl.store(
        part_ptr + ks * slice_elems + t2 * experts + e2, part, mask=(t2 < tokens) & (e2 < experts)
    )

    # ---- the last program to arrive routes every row ----
    tl.debug_barrier()  # all threads' partial stores precede the release below
    count = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if count == tl.num_programs(0) - 1:
        g = tl.arange(0, NG_P2)[None, :, None]
        j = tl.arange(0, GS_P2)[None, None, :]
        e = g * group_size + j
        valid = (g < N_GROUP) & (j < group_size)
        # ROWS rows per pass: all of them at once is fewest steps, fewer keep the registers
        # of the whole launch (every program's occupancy) low at larger T
        for r0 in range(0, tokens, ROWS):
            tr = r0 + tl.arange(0, ROWS)[:, None, None]
            live = valid & (tr < tokens)
            offs = tr * experts + e
            x = tl.zeros([ROWS, NG_P2, GS_P2], tl.float32)
            for s in tl.static_range(SPLIT_K):  # split order: the same logits on every call
                x += tl.load(
                    part_ptr + s * slice_elems + offs, mask=live, other=0.0, cache_modifier=".cg"
                )
            tl.store(logits_ptr + tr * stride_lt + e, x, mask=live)
            x = tl.where(valid, x, float("-inf"))
            route_rows(
                x,
                g,
                j,
                r0,
                tokens,
                logits_ptr,
                stride_lt,
                bias_ptr,
                w_ptr,
                ids_ptr,
                stride_wt,
                stride_it,
                group_size,
                scale,
                shared_first_id,
                ROWS,
                N_GROUP,
                NG_P2,
                GS_P2,
                TOPK_GROUP,
                TOP_K,
                K_P2,
                SOFTMAX,
                HAS_BIAS,
                GROUP_TOP2,
                RENORM,
                RENORM_EPS,
                SHARED,
                S_P2,
            )
        tl.atomic_xchg(counter_ptr, 0)  # zero for the next launch / graph replay


def route_fused(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    *,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    shared_slots: int = 0,
    shared_first_id: int | None = None,
    weights_out: torch.Tensor | None = None,
    ids_out: torch.Tensor | None = None,
    workspace: RouterFusedWorkspace | None = None,
    config: FusedRouterConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] bf16, gate_weight [E, H] bf16 -> (weights fp32 [T, top_k + S], ids int32
    [T, top_k + S]) in one launch: the same result as ``route(x @ W^T in fp32, bias, top_k,
    ...)`` (kernels/routing/router.py), up to the fp32 summation order of the logits. Needs
    fused_route_supported(x, gate_weight). `workspace` (RouterFusedWorkspace.create, sized for
    E and at least T tokens) is required for CUDA-graph capture; without one a fresh one is
    allocated. The fp32 logits stay in workspace.logits[:T]. On a CPU without the Triton
    interpreter it runs the torch reference."""
    if not fused_route_supported(x, gate_weight) and (x.is_cuda or interpreting()):
        raise ValueError(
            "route_fused needs bf16 x [T, H] (1 <= T <= "
            f"{FUSED_MAX_TOKENS}) and bf16 W [E <= {FUSED_MAX_EXPERTS}, H] on one device"
        )
    tokens, hidden = x.shape
    experts = gate_weight.shape[0]
    kw = dict(
        n_group=n_group,
        topk_group=topk_group,
        scoring_func=scoring_func,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=routed_scaling_factor,
        topk_method=topk_method,
    )
    # check_route_args validates against a logits tensor; a meta one allocates nothing
    logits_view = torch.empty(tokens, experts, dtype=torch.float32, device="meta")
    check_route_args(
        logits_view, bias, top_k, n_group, topk_group, scoring_func, topk_method, shared_slots
    )
    first_shared = experts if shared_first_id is None else shared_first_id
    width = top_k + shared_slots
    if weights_out is None:
        weights_out = torch.empty(tokens, width, dtype=torch.float32, device=x.device)
    if ids_out is None:
        ids_out = torch.empty(tokens, width, dtype=torch.int32, device=x.device)
    check_out(weights_out, "weights_out", (tokens, width), torch.float32)
    check_out(ids_out, "ids_out", (tokens, width), torch.int32)
    if not x.is_cuda and not interpreting():  # CPU reference: fp32 GEMM, then route's fallback
        logits = x.float() @ gate_weight.float().t()
        if workspace is not None:
            workspace.logits[:tokens].copy_(logits)
        return route(
            logits,
            bias,
            top_k,
            shared_slots=shared_slots,
            shared_first_id=first_shared,
            out_weights=weights_out,
            out_ids=ids_out,
            **kw,
        )

    cfg = config or plan_config(tokens, experts, hidden)
    k_iters = triton.cdiv(triton.cdiv(hidden, cfg.split_k), cfg.block_k)
    split = triton.cdiv(hidden, k_iters * cfg.block_k)  # no program with an empty K range
    if split > MAX_SPLIT_K:
        raise ValueError(f"split_k {split} > MAX_SPLIT_K {MAX_SPLIT_K}")
    if workspace is None:
        workspace = RouterFusedWorkspace.create(experts, x.device, max(tokens, 1))
    if not workspace.fits(tokens, experts, split):
        raise ValueError(f"workspace does not fit {tokens} tokens x {experts} experts")
    grouped = n_group > 1 and topk_method != "greedy"
    groups = n_group if grouped else 1
    renorm, scale = weight_rule(topk_method, top_k, norm_topk_prob, routed_scaling_factor)
    grid = (triton.cdiv(experts, cfg.block_e) * split,)
    t_p2 = triton.next_power_of_2(tokens)
    _router_fused_kernel[grid](
        x,
        gate_weight,
        bias if bias is not None else workspace.logits,
        workspace.partials,
        workspace.logits,
        workspace.counter,
        weights_out,
        ids_out,
        tokens,
        hidden,
        experts,
        x.stride(0),
        gate_weight.stride(0),
        workspace.logits.stride(0),
        weights_out.stride(0),
        ids_out.stride(0),
        experts // groups,
        float(scale),
        first_shared,
        T_P2=t_p2,
        BLOCK_E=cfg.block_e,
        BLOCK_K=cfg.block_k,
        K_ITERS=k_iters,
        SPLIT_K=split,
        N_GROUP=groups,
        NG_P2=triton.next_power_of_2(groups),
        GS_P2=triton.next_power_of_2(experts // groups),
        TOPK_GROUP=topk_group if grouped else 1,
        TOP_K=top_k,
        K_P2=triton.next_power_of_2(top_k),
        SOFTMAX=scoring_func == "softmax",
        HAS_BIAS=bias is not None,
        GROUP_TOP2=topk_method == "noaux_tc",
        RENORM=renorm,
        RENORM_EPS=RENORM_EPS,
        SHARED=shared_slots,
        S_P2=triton.next_power_of_2(max(shared_slots, 1)),
        ROWS=min(cfg.route_rows, t_p2) if cfg.route_rows > 0 else t_p2,
        num_warps=cfg.num_warps,
    )
    return weights_out, ids_out


_PROBE_TOP_K = 2
_PROBE_TOLERANCE = 1e-3  # of the largest |logit|: fp32 sums in another order


@functools.lru_cache(maxsize=8)
def probe_route_fused(device: torch.device, experts: int, hidden: int) -> bool:
    """Whether route_fused runs on `device` for a gate of this shape and reproduces x @ W^T
    (the logits it keeps) and their top experts for one random token and random weights.
    Runs once per (device, shape), at load (it synchronises); False, with one log line, on
    any error or mismatch."""
    g = torch.Generator(device="cpu").manual_seed(0)
    gate_weight = torch.randn(experts, hidden, generator=g).to(torch.bfloat16).to(device)
    x = torch.randn(1, hidden, generator=g).to(gate_weight)
    workspace = RouterFusedWorkspace.create(experts, device, max_tokens=1)
    try:
        _, ids = route_fused(
            x,
            gate_weight,
            None,
            _PROBE_TOP_K,
            scoring_func="softmax",  # monotone and unsaturated: the top logits win
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            workspace=workspace,
        )
        want = x.float() @ gate_weight.float().t()
        tol = _PROBE_TOLERANCE * float(want.abs().max())
        ok = float((workspace.logits[:1] - want).abs().max()) <= tol
        top = want.topk(_PROBE_TOP_K + 1, dim=1)
        if ok and float(top.values[0, -2] - top.values[0, -1]) > 2 * tol:  # no near tie
            chosen = top.indices[0, :_PROBE_TOP_K].sort().values
            ok = torch.equal(ids[0].long().sort().values, chosen)
    except Exception as e:  # noqa: BLE001 (any compile/launch failure means "not this one")
        log.warning("fused router unavailable (%s); the gate GEMM + route kernel serve", e)
        return False
    if not ok:
        log.warning("fused router is wrong here; the gate GEMM + route kernel serve")
    return ok
