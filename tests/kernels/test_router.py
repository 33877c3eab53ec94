"""The fused router kernel vs its torch reference (same tie rule), the reference vs the model's
`select_experts`, and ties against a plain-Python oracle; shared-expert slot columns against
select_experts with the columns appended by hand; Triton CPU interpreter."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported (triton.jit reads it)

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import moeserve.kernels.routing.router as router_mod  # noqa: E402
from moeserve.layers.routing import select_experts  # noqa: E402
from tests.kernels.interpreter_shims import install_interpreter_shims  # noqa: E402

install_interpreter_shims()
if not isinstance(router_mod._route_kernel, InterpretedFunction):
    router_mod = importlib.reload(router_mod)

KIMI = dict(E=384, k=8, n_group=1, topk_group=1, scale=2.827)
DEEPSEEK = dict(E=256, k=8, n_group=8, topk_group=4, scale=2.5)

CASES = {
    "kimi": (KIMI, "sigmoid", "noaux_tc", True),
    "deepseek": (DEEPSEEK, "sigmoid", "noaux_tc", True),
    "groups_of_6": (
        dict(E=48, k=5, n_group=8, topk_group=3, scale=1.5),
        "sigmoid",
        "noaux_tc",
        True,
    ),
    "no_renorm": (
        dict(E=20, k=3, n_group=1, topk_group=1, scale=2.0),
        "sigmoid",
        "noaux_tc",
        False,
    ),
    "v2_greedy": (dict(E=64, k=6, n_group=1, topk_group=1, scale=16.0), "softmax", "greedy", False),
    "v2_greedy_norm": (
        dict(E=10, k=2, n_group=1, topk_group=1, scale=3.0),
        "softmax",
        "greedy",
        True,
    ),
    "v2_groups": (
        dict(E=160, k=6, n_group=8, topk_group=3, scale=16.0),
        "softmax",
        "group_limited_greedy",
        False,
    ),
}


def _inputs(tokens: int, experts: int, seed: int, bias: bool) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen) * 2
    b = 0.1 * torch.randn(experts, generator=gen) if bias else None
    return logits, b


def _kw(case: dict, scoring: str, method: str, norm: bool) -> dict:
    return dict(
        n_group=case["n_group"],
        topk_group=case["topk_group"],
        scoring_func=scoring,
        topk_method=method,
        norm_topk_prob=norm,
        routed_scaling_factor=case["scale"],
    )


@pytest.mark.parametrize("tokens", [1, 13])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_and_select_experts(name, tokens):
    case, scoring, method, norm = CASES[name]
    logits, bias = _inputs(tokens, case["E"], seed=tokens, bias=method == "noaux_tc")
    kw = _kw(case, scoring, method, norm)
    w, ids = router_mod.route(logits, bias, case["k"], **kw)
    rw, rids = router_mod.route_ref(logits, bias, case["k"], **kw)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, rids)  # same ids in the same (best-first) order
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)
    # the model's torch routing (torch.topk): the same sets, weights per expert
    sw, sids = select_experts(
        logits, case["k"], correction_bias=bias, **{k: v for k, v in kw.items()}
    )
    order, sorder = ids.long().sort(-1), sids.sort(-1)
    assert torch.equal(order.values, sorder.values)
    torch.testing.assert_close(
        w.gather(1, order.indices), sw.gather(1, sorder.indices), rtol=1e-6, atol=1e-7
    )


def _assert_same_routing(w, ids, sw, sids):
    """Kernel columns vs select_experts' (torch.topk order): same sets, weights per expert."""
    order, sorder = ids.long().sort(-1), sids.long().sort(-1)
    assert torch.equal(order.values, sorder.values)
    torch.testing.assert_close(
        w.gather(1, order.indices), sw.gather(1, sorder.indices), rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize("name", ["deepseek", "kimi", "v2_greedy"])
def test_shared_slots_are_extra_columns_of_weight_one(name, slots):
    """Shared experts as slots: the same launch writes S more columns per token (ids E..E+S-1,
    weight exactly 1.0, unscaled), the routed columns unchanged."""
    case, scoring, method, norm = CASES[name]
    tokens, k, experts = 7, case["k"], case["E"]
    logits, bias = _inputs(tokens, experts, seed=10 + slots, bias=method == "noaux_tc")
    kw = _kw(case, scoring, method, norm)
    # NaN / -1 filled outputs: every column must be written by the kernel itself
    wbuf = torch.full((tokens, k + slots), float("nan"))
    ibuf = torch.full((tokens, k + slots), -1, dtype=torch.int32)
    w, ids = router_mod.route(
        logits, bias, k, shared_slots=slots, out_weights=wbuf, out_ids=ibuf, **kw
    )
    rw, rids = router_mod.route_ref(logits, bias, k, shared_slots=slots, **kw)
    assert w.shape == ids.shape == (tokens, k + slots)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)
    # independent: select_experts, then the shared columns appended by hand
    sw, sids = select_experts(logits, k, correction_bias=bias, **kw)
    shared_ids = torch.tensor([list(range(experts, experts + slots))] * tokens)
    sw = torch.cat([sw, torch.ones(tokens, slots)], 1)
    sids = torch.cat([sids, shared_ids], 1)
    assert torch.equal(ids[:, k:].long(), shared_ids)
    assert torch.equal(w[:, k:], torch.ones(tokens, slots))
    _assert_same_routing(w[:, :k], ids[:, :k], sw[:, :k], sids[:, :k])
    _assert_same_routing(w, ids, sw, sids)
    # the routed columns are what routing without slots gives, bit for bit
    w0, ids0 = router_mod.route(logits, bias, k, **kw)
    assert torch.equal(ids[:, :k], ids0) and torch.equal(w[:, :k], w0)


def test_shared_slots_first_id_strides_and_empty_batch():
    logits, bias = _inputs(4, 256, seed=5, bias=True)
    kw = _kw(DEEPSEEK, "sigmoid", "noaux_tc", True)
    wbuf = torch.full((4, 16), float("nan"))
    ibuf = torch.full((4, 16), -7, dtype=torch.int32)
    w, ids = router_mod.route(
        logits,
        bias,
        8,
        shared_slots=2,
        shared_first_id=300,
        out_weights=wbuf[:, 2:12],
        out_ids=ibuf[:, 3:13],
        **kw,
    )
    rw, rids = router_mod.route_ref(logits, bias, 8, shared_slots=2, shared_first_id=300, **kw)
    assert torch.equal(ibuf[:, 3:13], rids) and (ibuf[:, 11:13] == torch.tensor([300, 301])).all()
    torch.testing.assert_close(wbuf[:, 2:12], rw, rtol=1e-6, atol=1e-7)
    assert wbuf[:, :2].isnan().all() and wbuf[:, 12:].isnan().all()
    assert (ibuf[:, :3] == -7).all() and (ibuf[:, 13:] == -7).all()
    w0, i0 = router_mod.route(torch.zeros(0, 256), bias, 8, shared_slots=1, **kw)
    assert w0.shape == (0, 9) and i0.shape == (0, 9)
    with pytest.raises(ValueError, match="out_weights"):
        router_mod.route(logits, bias, 8, shared_slots=1, out_weights=torch.zeros(4, 8), **kw)


def _python_route(logits, bias, k, n_group, topk_group):
    """Plain-Python noaux_tc selection with the documented tie rule (lower index wins)."""
    out = []
    for row in logits.tolist():
        s = [1.0 / (1.0 + torch.tensor(v).neg().exp().item()) for v in row]
        choice = [torch.tensor(a, dtype=torch.float32).item() for a in s]
        choice = [
            (torch.tensor(c, dtype=torch.float32) + torch.tensor(b, dtype=torch.float32)).item()
            for c, b in zip(choice, bias.tolist(), strict=True)
        ]
        size = len(row) // n_group
        gscore = []
        for g in range(n_group):
            part = sorted(choice[g * size : (g + 1) * size], reverse=True)
            gscore.append(part[0] + part[1] if n_group > 1 else 0.0)
        groups = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
        allowed = [e for e in range(len(row)) if e // size in groups]
        out.append(sorted(allowed, key=lambda e: (-choice[e], e))[:k])
    return out


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_ties_go_to_the_lower_index(n_group, topk_group):
    """Logits on a coarse grid and a bias with repeated values: many exactly equal choice
    values (and group scores); kernel, reference and a plain-Python oracle agree."""
    gen = torch.Generator().manual_seed(11)
    tokens, experts, k = 9, 32, 6
    logits = torch.randint(-2, 3, (tokens, experts), generator=gen).float() / 2
    logits[0] = 0.5  # one row entirely tied
    bias = torch.randint(0, 2, (experts,), generator=gen).float() * 0.25
    kw = dict(n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.0)
    w, ids = router_mod.route(logits, bias, k, **kw)
    rw, rids = router_mod.route_ref(logits, bias, k, **kw)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)
    assert ids.tolist() == _python_route(logits, bias, k, n_group, topk_group)
    if n_group == 1:  # the all-tied row: biased experts first, each run in index order
        biased = [e for e in range(experts) if bias[e] > 0]
        assert ids[0].tolist() == (biased + [e for e in range(experts) if bias[e] == 0])[:k]


def test_preallocated_strided_outputs():
    logits, bias = _inputs(5, 256, seed=3, bias=True)
    wbuf = torch.full((5, 16), float("nan"))
    ibuf = torch.full((5, 16), -7, dtype=torch.int32)
    kw = _kw(DEEPSEEK, "sigmoid", "noaux_tc", True)
    w, ids = router_mod.route(logits, bias, 8, out_weights=wbuf[:, :8], out_ids=ibuf[:, 4:12], **kw)
    rw, rids = router_mod.route_ref(logits, bias, 8, **kw)
    assert w.data_ptr() == wbuf.data_ptr() and torch.equal(ibuf[:, 4:12], rids)
    torch.testing.assert_close(wbuf[:, :8], rw, rtol=1e-6, atol=1e-7)
    assert wbuf[:, 8:].isnan().all() and (ibuf[:, :4] == -7).all() and (ibuf[:, 12:] == -7).all()


def test_bf16_logits_and_empty_batch():
    logits, bias = _inputs(3, 384, seed=4, bias=True)
    kw = _kw(KIMI, "sigmoid", "noaux_tc", True)
    w, ids = router_mod.route(logits.bfloat16(), bias, 8, **kw)
    rw, rids = router_mod.route_ref(logits.bfloat16(), bias, 8, **kw)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)
    w0, i0 = router_mod.route(torch.zeros(0, 384), bias, 8, **kw)
    assert w0.shape == (0, 8) and i0.shape == (0, 8)


def test_argument_checks():
    x = torch.zeros(2, 16)
    with pytest.raises(ValueError, match="groups"):
        router_mod.route(x, None, 2, n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="top_k"):
        router_mod.route(x, None, 9, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="bias"):
        router_mod.route(x, torch.zeros(15), 2)
    with pytest.raises(ValueError, match="scoring_func"):
        router_mod.route(x, None, 2, scoring_func="tanh")
    with pytest.raises(ValueError, match="out_ids"):
        router_mod.route(x, None, 2, out_ids=torch.zeros(2, 2, dtype=torch.int64))
