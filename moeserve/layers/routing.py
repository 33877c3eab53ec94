"""Routing after the router's logits, in torch (the reference the Triton routing kernels,
`moeserve.kernels.routing`, are held to): each token's top experts and their weights, and the
shared experts' slot columns."""

from __future__ import annotations

import torch

from moeserve.kernels import cpu as cpu_kernels

# group score of noaux_tc routing = sum of the best this many biased scores in the group
_NOAUX_GROUP_TOP = 2


def select_experts(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring_func: str = "sigmoid",
    topk_method: str = "noaux_tc",
    correction_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    native: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64).

    Every token's result depends on its own logits only (`native`: the sigmoid by the native
    CPU kernel, whose result does not depend on where an element sits in the tensor; the
    renormalising sums run over the k columns in order).

    noaux_tc (DeepSeek-V3, Kimi): choose on sigmoid scores + correction bias, limited to the
    `topk_group` groups whose best-2 biased scores sum highest; weigh by the *unbiased*
    scores, renormalised (norm_topk_prob), times routed_scaling_factor.
    greedy / group_limited_greedy (DeepSeek-V2 softmax routing): choose on the scores (group
    score = the group's max); renormalise if norm_topk_prob, else scale by
    routed_scaling_factor (the V2 reference applies one or the other).
    """
    logits = logits.float()
    if scoring_func == "sigmoid":
        scores = cpu_kernels.sigmoid_(logits.clone()) if native else logits.sigmoid()
    elif scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"unsupported scoring_func {scoring_func!r}")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    num_tokens, num_experts = choice.shape
    if n_group > 1 and topk_method in ("noaux_tc", "group_limited_greedy"):
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        if topk_method == "noaux_tc":
            group_scores = grouped.topk(_NOAUX_GROUP_TOP, dim=-1).values.sum(-1)
        else:
            group_scores = grouped.amax(dim=-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, -1)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if topk_method == "noaux_tc":
        if norm_topk_prob:
            weights = weights / (_row_sums(weights) + 1e-20)
        weights = weights * routed_scaling_factor
    elif top_k > 1 and norm_topk_prob:
        weights = weights / (_row_sums(weights) + 1e-20)
    else:
        weights = weights * routed_scaling_factor
    return weights, ids


def _row_sums(w: torch.Tensor) -> torch.Tensor:
    """[T, k] -> [T, 1]: the columns added left to right (a fixed order for every row)."""
    total = w[:, :1]
    for j in range(1, w.shape[1]):
        total = total + w[:, j : j + 1]
    return total


def append_shared_slots(
    weights: torch.Tensor, ids: torch.Tensor, first_id: int, slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], ids [T, k]) -> [T, k + slots]: every token also goes to experts
    first_id .. first_id + slots - 1 with weight 1 (shared experts as slots; CPU path, the GPU
    route kernel writes these columns itself)."""
    t = weights.shape[0]
    shared_ids = torch.arange(first_id, first_id + slots, dtype=ids.dtype, device=ids.device)
    return (
        torch.cat([weights, weights.new_ones(t, slots)], 1),
        torch.cat([ids, shared_ids.expand(t, slots)], 1),
    )
