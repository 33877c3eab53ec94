"""The one-launch router (gate GEMV + routing, kernels/routing/router_fused.py) on the Triton CPU
interpreter, against the torch fp32 reference: select_experts on x.float() @ W.float().T (the
model's routing), route_ref on the same logits (same tie rule, same column order), and
kernels/routing/router.py's route on the kernel's own logits (identical routing decisions).
DeepSeek-V3 and Kimi routing at a small hidden size, every T up to FUSED_MAX_TOKENS, shared
slots, repeated calls through one workspace (the arrival counter must come back to zero)."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported (triton.jit reads it)

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import moeserve.kernels.routing.router as router_mod  # noqa: E402
import moeserve.kernels.routing.router_fused as fused_mod  # noqa: E402
from moeserve.layers.routing import select_experts  # noqa: E402
from tests.kernels.interpreter_shims import install_interpreter_shims  # noqa: E402

install_interpreter_shims()
if not isinstance(router_mod._route_kernel, InterpretedFunction):
    router_mod = importlib.reload(router_mod)
if not isinstance(fused_mod._router_fused_kernel, InterpretedFunction):
    fused_mod = importlib.reload(fused_mod)

HIDDEN = 256  # small: the interpreter runs every program in numpy
DEEPSEEK = dict(E=256, k=8, n_group=8, topk_group=4, scale=2.5, scoring="sigmoid", bias=True)
KIMI = dict(E=384, k=8, n_group=1, topk_group=1, scale=2.827, scoring="sigmoid", bias=True)
CONFIGS = {"deepseek": DEEPSEEK, "kimi": KIMI}
# A routing decision counts as clear when the reference's deciding gaps (k-th vs (k+1)-th
# choice, kept vs dropped group score) exceed this: far above fp32 summation-order noise of a
# 256-term dot product, so the kernel's logits must decide the same way.
CLEAR_MARGIN = 1e-4
# a multi-split launch shape that the interpreter runs quickly at HIDDEN
SMALL_SPLIT = fused_mod.FusedRouterConfig(block_e=64, block_k=32, split_k=4, num_warps=4)


def _kw(c: dict) -> dict:
    return dict(
        scoring_func=c["scoring"],
        topk_method="noaux_tc",
        n_group=c["n_group"],
        topk_group=c["topk_group"],
        norm_topk_prob=True,
        routed_scaling_factor=c["scale"],
    )


def _weights(c: dict, seed: int, hidden: int = HIDDEN) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(c["E"], hidden, generator=gen) / hidden**0.5 * 2).to(torch.bfloat16)
    b = 0.1 * torch.randn(c["E"], generator=gen) if c["bias"] else None
    return w, b


def _x(tokens: int, seed: int, hidden: int = HIDDEN) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)


def _ref_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the bf16 operands, accumulated in fp64 (bf16 products are exact)."""
    return (x.double() @ w.double().t()).float()


def _clear_rows(logits: torch.Tensor, bias: torch.Tensor | None, c: dict) -> torch.Tensor:
    """Rows whose routing the reference decides by more than CLEAR_MARGIN."""
    choice = logits.sigmoid() + (0 if bias is None else bias)
    t, e = choice.shape
    clear = torch.ones(t, dtype=torch.bool)
    if c["n_group"] > 1:
        gs = choice.view(t, c["n_group"], -1).topk(2, dim=-1).values.sum(-1)
        top = gs.sort(-1, descending=True).values
        clear &= (top[:, c["topk_group"] - 1] - top[:, c["topk_group"]]) > CLEAR_MARGIN
        keep = gs.topk(c["topk_group"], dim=-1).indices
        mask = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // c["n_group"], 1), -torch.inf)
    top = choice.sort(-1, descending=True).values
    return clear & ((top[:, c["k"] - 1] - top[:, c["k"]]) > CLEAR_MARGIN)


def _same_routing(w, ids, sw, sids) -> None:
    """Kernel columns vs select_experts' (torch.topk order): same sets, weights per expert."""
    order, sorder = ids.long().sort(-1), sids.long().sort(-1)
    assert torch.equal(order.values, sorder.values)
    torch.testing.assert_close(
        w.gather(1, order.indices), sw.gather(1, sorder.indices), rtol=1e-5, atol=1e-6
    )


def _check_against_references(x, gw, bias, c, w, ids, ws, slots: int) -> None:
    k, e = c["k"], c["E"]
    tokens = x.shape[0]
    kw = _kw(c)
    assert w.shape == ids.shape == (tokens, k + slots)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    ref = _ref_logits(x, gw)
    # 1. the GEMV: fp32 logits within summation-order noise of the fp64 reference
    torch.testing.assert_close(ws.logits[:tokens], ref, rtol=1e-5, atol=1e-5)
    # 2. routing semantics: route (kernels/routing/router.py) on the kernel's own logits, same
    # columns
    rw, rids = router_mod.route(ws.logits[:tokens].clone(), bias, k, shared_slots=slots, **kw)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)
    # 3. against the model's torch routing on the fp32 reference logits
    clear = _clear_rows(ref, bias, c)
    assert clear.float().mean() >= 0.5, "test data too tie-prone to check anything"
    sw, sids = select_experts(ref, k, correction_bias=bias, **kw)
    qw, qids = router_mod.route_ref(ref, bias, k, shared_slots=slots, **kw)
    assert torch.equal(ids[clear], qids[clear])  # route_ref: best first, same tie rule
    torch.testing.assert_close(w[clear], qw[clear], rtol=1e-5, atol=1e-6)
    _same_routing(w[clear, :k], ids[clear, :k], sw[clear], sids[clear])
    if slots:
        assert torch.equal(ids[:, k:].long(), torch.arange(e, e + slots).expand(tokens, slots))
        assert torch.equal(w[:, k:], torch.ones(tokens, slots))


@pytest.mark.parametrize("slots", [0, 1])
@pytest.mark.parametrize("tokens", list(range(1, fused_mod.FUSED_MAX_TOKENS + 1)))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_matches_references(name, tokens, slots):
    c = CONFIGS[name]
    gw, bias = _weights(c, seed=tokens)
    x = _x(tokens, seed=tokens)
    ws = fused_mod.RouterFusedWorkspace.create(c["E"], "cpu")
    assert fused_mod.fused_route_supported(x, gw)
    # NaN / -1 filled outputs: the launch must write every column itself
    wbuf = torch.full((tokens, c["k"] + slots), float("nan"))
    ibuf = torch.full((tokens, c["k"] + slots), -1, dtype=torch.int32)
    w, ids = fused_mod.route_fused(
        x,
        gw,
        bias,
        c["k"],
        shared_slots=slots,
        weights_out=wbuf,
        ids_out=ibuf,
        workspace=ws,
        config=SMALL_SPLIT,
        **_kw(c),
    )
    assert w.data_ptr() == wbuf.data_ptr() and ids.data_ptr() == ibuf.data_ptr()
    _check_against_references(x, gw, bias, c, w, ids, ws, slots)
    assert ws.counter.item() == 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_workspace_reuse_resets_counter(name):
    """Many calls through one workspace with new x, changing T and launch shapes (all rows
    routed at once, one and two rows per pass): every call must route (the counter returns to
    0, so each launch finds its own last program)."""
    c = CONFIGS[name]
    gw, bias = _weights(c, seed=7)
    ws = fused_mod.RouterFusedWorkspace.create(c["E"], "cpu")
    shapes = [
        SMALL_SPLIT,
        fused_mod.FusedRouterConfig(block_e=128, block_k=64, split_k=1, num_warps=4, route_rows=1),
        fused_mod.FusedRouterConfig(block_e=128, block_k=16, split_k=16, num_warps=4, route_rows=2),
    ]
    for call, tokens in enumerate([3, 3, 1, 8, 5, 7, 6, 8]):
        x = _x(tokens, seed=50 + call)
        w, ids = fused_mod.route_fused(
            x, gw, bias, c["k"], workspace=ws, config=shapes[call % len(shapes)], **_kw(c)
        )
        assert ws.counter.item() == 0
        _check_against_references(x, gw, bias, c, w, ids, ws, slots=0)


def test_default_shape_and_real_hidden_tail():
    """plan_config's launch shape (what the GPU runs) and a hidden size that no K split
    divides: masked K tails must add nothing."""
    c = DEEPSEEK
    hidden = 200
    gw, bias = _weights(c, seed=3, hidden=hidden)
    x = _x(2, seed=3, hidden=hidden)
    ws = fused_mod.RouterFusedWorkspace.create(c["E"], "cpu")
    w, ids = fused_mod.route_fused(x, gw, bias, c["k"], shared_slots=1, workspace=ws, **_kw(c))
    _check_against_references(x, gw, bias, c, w, ids, ws, slots=1)


@pytest.mark.parametrize(
    "case",
    [
        # DeepSeek-V2 routing: softmax scores, group max, no bias, scaled without renorm
        dict(E=160, k=6, n_group=8, topk_group=3, scale=16.0, method="group_limited_greedy"),
        dict(E=64, k=6, n_group=1, topk_group=1, scale=16.0, method="greedy"),
    ],
)
def test_softmax_methods_match_route(case):
    tokens = 3
    gen = torch.Generator().manual_seed(11)
    gw = (torch.randn(case["E"], HIDDEN, generator=gen) / 8).to(torch.bfloat16)
    x = _x(tokens, seed=11)
    kw = dict(
        scoring_func="softmax",
        topk_method=case["method"],
        n_group=case["n_group"],
        topk_group=case["topk_group"],
        norm_topk_prob=False,
        routed_scaling_factor=case["scale"],
    )
    ws = fused_mod.RouterFusedWorkspace.create(case["E"], "cpu")
    w, ids = fused_mod.route_fused(x, gw, None, case["k"], workspace=ws, config=SMALL_SPLIT, **kw)
    ref = _ref_logits(x, gw)
    torch.testing.assert_close(ws.logits[:tokens], ref, rtol=1e-5, atol=1e-5)
    rw, rids = router_mod.route(ws.logits[:tokens].clone(), None, case["k"], **kw)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)
    sw, sids = select_experts(ref, case["k"], **{**kw, "correction_bias": None})
    _same_routing(w, ids, sw, sids)


def test_ties_go_to_the_lower_expert():
    """All-equal gate rows: every logit ties, so ids must be the lowest experts of the lowest
    groups, best first, exactly route_ref's order."""
    c = DEEPSEEK
    gw = torch.ones(c["E"], HIDDEN, dtype=torch.bfloat16)
    x = _x(2, seed=0)
    ws = fused_mod.RouterFusedWorkspace.create(c["E"], "cpu")
    w, ids = fused_mod.route_fused(x, gw, None, c["k"], workspace=ws, config=SMALL_SPLIT, **_kw(c))
    rw, rids = router_mod.route_ref(ws.logits[:2].clone(), None, c["k"], **_kw(c))
    assert torch.equal(ids, rids)
    assert torch.equal(ids[0], torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.int32))
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)


def test_supported_and_rejected_inputs():
    gw = torch.zeros(256, HIDDEN, dtype=torch.bfloat16)
    ok = torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
    assert fused_mod.fused_route_supported(ok, gw)
    assert fused_mod.prefer_fused_route(ok[:1], gw)
    assert not fused_mod.prefer_fused_route(ok[: fused_mod.FUSED_WINS_MAX_TOKENS + 1], gw)
    too_many = torch.zeros(fused_mod.FUSED_MAX_TOKENS + 1, HIDDEN, dtype=torch.bfloat16)
    assert not fused_mod.fused_route_supported(too_many, gw)
    assert not fused_mod.fused_route_supported(ok.float(), gw)
    assert not fused_mod.fused_route_supported(ok[:0], gw)
    assert not fused_mod.fused_route_supported(ok[:, :128], gw)
    big = torch.zeros(fused_mod.FUSED_MAX_EXPERTS + 1, HIDDEN, dtype=torch.bfloat16)
    assert not fused_mod.fused_route_supported(ok, big)
    with pytest.raises(ValueError):
        fused_mod.route_fused(too_many, gw, None, 8, **_kw(DEEPSEEK))
    small_ws = fused_mod.RouterFusedWorkspace.create(256, "cpu", max_tokens=2)
    with pytest.raises(ValueError):
        fused_mod.route_fused(ok, gw, None, 8, workspace=small_ws, **_kw(DEEPSEEK))


def test_load_time_probe_passes_here_and_fails_on_a_wrong_kernel(monkeypatch):
    # the probe Router runs at load: route_fused's logits and top experts against x @ W^T
    # (cached per device and shape: each case below takes a shape of its own)
    cpu = torch.device("cpu")
    assert fused_mod.probe_route_fused(cpu, 256, 256)

    real = fused_mod.route_fused

    def wrong_logits(*args, workspace, **kw):
        out = real(*args, workspace=workspace, **kw)
        workspace.logits.add_(1.0)
        return out

    monkeypatch.setattr(fused_mod, "route_fused", wrong_logits)
    assert not fused_mod.probe_route_fused(cpu, 256, 128)

    def failing(*args, **kw):
        raise RuntimeError("no such kernel here")

    monkeypatch.setattr(fused_mod, "route_fused", failing)
    assert not fused_mod.probe_route_fused(cpu, 128, 256)
