"""MoE routing in one launch: router logits -> (top-k weights, expert ids).

Semantics are those of ``moeserve.layers.routing.select_experts`` (DeepSeek-V2/V3, Kimi):

- scores = sigmoid(logits) or softmax(logits) (fp32);
- choice = scores + e_score_correction_bias (when given);
- with ``n_group > 1``: each group of E / n_group consecutive experts gets a score (noaux_tc:
  the sum of its best two choice values; group_limited_greedy: its best one), the
  ``topk_group`` best groups are kept, the others' experts are excluded;
- ids = the top_k experts by choice; weights = their *unbiased* scores;
- noaux_tc: weights renormalised to sum 1 (norm_topk_prob), then times routed_scaling_factor;
  greedy / group_limited_greedy (V2): renormalised if norm_topk_prob and top_k > 1, else
  times routed_scaling_factor (the V2 reference applies one or the other).

Ties (equal choice values, or equal group scores) go to the LOWER expert (group) index, in
both the kernel and ``route_ref``; ids are listed best first. ``select_experts`` (torch.topk)
leaves tie order unspecified, so the two agree as sets wherever there are no exact ties.

Shared experts as slots (``shared_slots`` S > 0, see ``moeserve.layers.moe``): each token's
row gets S more columns after its top_k, ids ``shared_first_id + j`` (default E: the slots
after the routed experts) and weight exactly 1.0 (no renormalising, no routed_scaling_factor),
written by the same launch.

Layouts: ``logits [T, E]`` float (fp32 from the gate GEMV; last dim contiguous), ``bias
[E]`` or None, outputs ``weights [T, k + S]`` fp32 and ``ids [T, k + S]`` int32 (preallocated
ones may be passed). One program per token holds its whole row (E up to 1024) in registers;
every top-k step is one argmax reduction. The launch depends only on shapes: CUDA-graph
capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.runtime import interpreting

MAX_EXPERTS = 1024
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")
SCORING_FUNCS = ("sigmoid", "softmax")
# noaux_tc group score = sum of the best this many biased scores of the group
_GROUP_TOP = 2
# renormalisation guard of the reference (weights / (sum + eps))
RENORM_EPS = 1e-20


@triton.jit
def route_score(x, m, denom, SOFTMAX: tl.constexpr):
    if SOFTMAX:
        return tl.exp(x - m) / denom
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def route_rows(
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
    ROWS: tl.constexpr,
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
):
    """Route the logit rows r0 .. r0 + ROWS - 1, x [ROWS, NG_P2, GS_P2] (fp32, -inf outside the
    real experts; g [1,NG_P2,1], j [1,1,GS_P2] their group / in-group index vectors; the same
    values stored at logits_ptr) by the rules of the module docstring, and store the weights /
    ids of those rows below `tokens`. _route_kernel calls it for one row per program,
    router_fused.py's last program for all the rows of its launch."""
    e = g * group_size + j
    valid = (g < N_GROUP) & (j < group_size)
    if SOFTMAX:
        m = tl.max(tl.max(x, axis=2), axis=1)[:, None, None]
        ex = tl.where(valid, tl.exp(x - m), 0.0)
        denom = tl.sum(tl.sum(ex, axis=2), axis=1)[:, None, None]
    else:
        m = 0.0
        denom = 1.0
    score = route_score(x, m, denom, SOFTMAX)
    choice = score
    if HAS_BIAS:
        choice += tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))

    if N_GROUP > 1:
        best, first = tl.max(
            choice, axis=2, return_indices=True, return_indices_tie_break_left=True
        )
        if GROUP_TOP2:
            second = tl.max(tl.where(j == first[:, :, None], float("-inf"), choice), axis=2)
            gscore = best + second
        else:
            gscore = best
        g2 = tl.arange(0, NG_P2)[None, :]
        gscore = tl.where(g2 < N_GROUP, gscore, float("-inf"))
        keep = g2 < 0
        for _ in tl.static_range(TOPK_GROUP):
            gi = tl.argmax(gscore, axis=1, tie_break_left=True)
            hit = g2 == gi[:, None]
            keep = keep | hit
            gscore = tl.where(hit, float("-inf"), gscore)
        choice = tl.where(keep[:, :, None], choice, float("-inf"))

    # top-k over the flattened rows: flat order is expert order, so the leftmost maximum is
    # the lowest expert id among equals
    flat = tl.reshape(choice, [ROWS, NG_P2 * GS_P2])
    f = tl.arange(0, NG_P2 * GS_P2)[None, :]
    kk = tl.arange(0, K_P2)[None, :]
    ids = tl.zeros([ROWS, K_P2], tl.int32)
    for i in tl.static_range(TOP_K):
        fi = tl.argmax(flat, axis=1, tie_break_left=True)[:, None]
        ids = tl.where(kk == i, ((fi // GS_P2) * group_size + fi % GS_P2).to(tl.int32), ids)
        flat = tl.where(f == fi, float("-inf"), flat)

    # weights: the chosen experts' unbiased scores, recomputed from their logits (the same
    # arithmetic as the scores above, so the same values)
    tl.debug_barrier()  # the logits stored by every thread are visible to every thread
    tt = r0 + tl.arange(0, ROWS)[:, None]
    rows = tt < tokens
    kmask = kk < TOP_K
    xs = tl.load(
        logits_ptr + tt * stride_lt + ids, mask=rows & kmask, other=0.0, cache_modifier=".cg"
    ).to(tl.float32)
    if SOFTMAX:
        m2 = tl.reshape(m, [ROWS])[:, None]
        denom2 = tl.reshape(denom, [ROWS])[:, None]
    else:
        m2 = 0.0
        denom2 = 1.0
    w = tl.where(kmask, route_score(xs, m2, denom2, SOFTMAX), 0.0)
    if RENORM:
        w = w / (tl.sum(w, axis=1)[:, None] + RENORM_EPS)
    w = w * scale
    tl.store(w_ptr + tt * stride_wt + kk, w, mask=rows & kmask)
    tl.store(ids_ptr + tt * stride_it + kk, ids, mask=rows & kmask)
    if SHARED > 0:  # shared experts as slots: columns TOP_K.., weight 1 for every token
        ss = tl.arange(0, S_P2)[None, :]
        smask = rows & (ss < SHARED)
        ones = tl.full([ROWS, S_P2], 1.0, tl.float32)
        tl.store(w_ptr + tt * stride_wt + TOP_K + ss, ones, mask=smask)
        sid = (shared_first_id + ss + tt * 0).to(tl.int32)
        tl.store(ids_ptr + tt * stride_it + TOP_K + ss, sid, mask=smask)


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    w_ptr,
    ids_ptr,
    stride_lt,
    stride_wt,
    stride_it,
    group_size,
    scale,
    shared_first_id,
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
):
    """One program per token: its row of logits as [1, groups, experts per group] (padded to
    powers of two), routed by route_rows."""
    t = tl.program_id(0)
    g = tl.arange(0, NG_P2)[None, :, None]
    j = tl.arange(0, GS_P2)[None, None, :]
    valid = (g < N_GROUP) & (j < group_size)
    row = logits_ptr + t.to(tl.int64) * stride_lt
    x = tl.load(row + g * group_size + j, mask=valid, other=float("-inf")).to(tl.float32)
    route_rows(
        x, g, j, t, t + 1, logits_ptr, stride_lt, bias_ptr, w_ptr, ids_ptr, stride_wt,
        stride_it, group_size, scale, shared_first_id, 1, N_GROUP, NG_P2, GS_P2, TOPK_GROUP,
        TOP_K, K_P2, SOFTMAX, HAS_BIAS, GROUP_TOP2, RENORM, RENORM_EPS, SHARED, S_P2,
    )  # fmt: skip


def weight_rule(
    topk_method: str, top_k: int, norm_topk_prob: bool, routed_scaling_factor: float
) -> tuple[bool, float]:
    """(renormalise?, factor applied after) as select_experts does per method."""
    if topk_method == "noaux_tc":
        return norm_topk_prob, routed_scaling_factor
    if top_k > 1 and norm_topk_prob:
        return True, 1.0
    return False, routed_scaling_factor


def check_route_args(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    scoring_func: str,
    topk_method: str,
    shared_slots: int = 0,
) -> tuple[int, int]:
    if logits.dim() != 2 or not logits.is_floating_point() or logits.stride(-1) != 1:
        raise ValueError("logits must be a float [T, E] tensor with a contiguous last dim")
    tokens, experts = logits.shape
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"the router kernel handles 1..{MAX_EXPERTS} experts, got {experts}")
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"unsupported scoring_func {scoring_func!r}")
    if topk_method not in TOPK_METHODS:
        raise ValueError(f"unsupported topk_method {topk_method!r}")
    if shared_slots < 0:
        raise ValueError(f"shared_slots must be >= 0, got {shared_slots}")
    if bias is not None and (bias.shape != (experts,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{experts}] vector")
    grouped = n_group > 1 and topk_method != "greedy"
    if grouped:
        if experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(
                f"{experts} experts do not split into {n_group} groups keeping {topk_group}"
            )
        if topk_method == "noaux_tc" and experts // n_group < _GROUP_TOP:
            raise ValueError(f"noaux_tc groups need at least {_GROUP_TOP} experts")
    available = topk_group * (experts // n_group) if grouped else experts
    if not 1 <= top_k <= available:
        raise ValueError(f"top_k {top_k} must be in 1..{available}")
    return tokens, experts


def check_out(t: torch.Tensor, name: str, shape: tuple[int, int], dtype: torch.dtype) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or t.stride(-1) != 1:
        raise ValueError(f"{name} must be {dtype} {list(shape)} with a contiguous last dim")


def route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    scoring_func: str = "sigmoid",
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    topk_method: str = "noaux_tc",
    shared_slots: int = 0,
    shared_first_id: int | None = None,
    out_weights: torch.Tensor | None = None,
    out_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights fp32 [T, top_k + S], expert ids int32 [T, top_k + S])
    in one launch, S = `shared_slots` columns of shared experts (ids `shared_first_id` + j,
    default E; weight 1) after the top_k (see the module docstring). On a CPU without the
    Triton interpreter it runs ``route_ref``."""
    tokens, experts = check_route_args(
        logits, bias, top_k, n_group, topk_group, scoring_func, topk_method, shared_slots
    )
    first_shared = experts if shared_first_id is None else shared_first_id
    width = top_k + shared_slots
    if out_weights is None:
        out_weights = torch.empty(tokens, width, dtype=torch.float32, device=logits.device)
    if out_ids is None:
        out_ids = torch.empty(tokens, width, dtype=torch.int32, device=logits.device)
    check_out(out_weights, "out_weights", (tokens, width), torch.float32)
    check_out(out_ids, "out_ids", (tokens, width), torch.int32)
    kw = dict(
        n_group=n_group,
        topk_group=topk_group,
        scoring_func=scoring_func,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=routed_scaling_factor,
        topk_method=topk_method,
    )
    if not logits.is_cuda and not interpreting():
        w, i = route_ref(
            logits, bias, top_k, shared_slots=shared_slots, shared_first_id=first_shared, **kw
        )
        out_weights.copy_(w)
        out_ids.copy_(i)
        return out_weights, out_ids
    if tokens == 0:
        return out_weights, out_ids
    grouped = n_group > 1 and topk_method != "greedy"
    groups = n_group if grouped else 1
    renorm, scale = weight_rule(topk_method, top_k, norm_topk_prob, routed_scaling_factor)
    ng_p2 = triton.next_power_of_2(groups)
    gs_p2 = triton.next_power_of_2(experts // groups)
    _route_kernel[(tokens,)](
        logits,
        bias if bias is not None else logits,
        out_weights,
        out_ids,
        logits.stride(0),
        out_weights.stride(0),
        out_ids.stride(0),
        experts // groups,
        float(scale),
        first_shared,
        N_GROUP=groups,
        NG_P2=ng_p2,
        GS_P2=gs_p2,
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
        # one warp per token up to 512 experts: the reductions stay within warp shuffles
        num_warps=max(1, ng_p2 * gs_p2 // 512),
    )
    return out_weights, out_ids


def route_ref(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    scoring_func: str = "sigmoid",
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    topk_method: str = "noaux_tc",
    shared_slots: int = 0,
    shared_first_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch reference of :func:`route` with the same tie rule (stable sorts: among equals
    the lower index first), shared-slot columns included."""
    check_route_args(
        logits, bias, top_k, n_group, topk_group, scoring_func, topk_method, shared_slots
    )
    x = logits.float()
    scores = x.sigmoid() if scoring_func == "sigmoid" else x.softmax(dim=-1)
    choice = scores if bias is None else scores + bias.float()
    tokens, experts = choice.shape
    if n_group > 1 and topk_method != "greedy":
        grouped = choice.view(tokens, n_group, experts // n_group)
        if topk_method == "noaux_tc":
            top = grouped.sort(dim=-1, descending=True, stable=True).values[..., :_GROUP_TOP]
            group_scores = top.sum(-1)
        else:
            group_scores = grouped.amax(dim=-1)
        keep = group_scores.sort(dim=-1, descending=True, stable=True).indices[:, :topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(
            ~group_mask.repeat_interleave(experts // n_group, 1), -torch.inf
        )
    ids = choice.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    renorm, scale = weight_rule(topk_method, top_k, norm_topk_prob, routed_scaling_factor)
    if renorm:
        weights = weights / (weights.sum(-1, keepdim=True) + RENORM_EPS)
    weights, ids = weights * scale, ids.to(torch.int32)
    if shared_slots:
        first = experts if shared_first_id is None else shared_first_id
        shared = torch.arange(first, first + shared_slots, dtype=torch.int32)
        weights = torch.cat([weights, weights.new_ones(tokens, shared_slots)], 1)
        ids = torch.cat([ids, shared.to(ids.device).expand(tokens, shared_slots)], 1)
    return weights, ids
