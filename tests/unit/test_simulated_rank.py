"""Rank simulation (`--simulate-rank`, moeserve/parallel/simulated.py): a simulated rank holds
the shapes a real rank 0 holds (the published Kimi-K2.5 config on the meta device; a tiny
checkpoint through the real sharded loaders), a simulated engine decodes on the CPU, and the
routing override gives the slot counts its docstring states."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from moeserve.config import ConfigError, EngineConfig, parse_rank_layout
from moeserve.engine import profile
from moeserve.engine.offline import LLM
from moeserve.layers.moe import DeepseekMoE
from moeserve.loader import load_model
from moeserve.loader.source import describe_source
from moeserve.models.registry import model_class
from moeserve.parallel.groups import TPGroup
from moeserve.parallel.simulated import (
    ALL_REDUCE_SCOPE,
    SimulatedRouting,
    busiest_rank,
    dithered,
    routing_table,
    simulated_group,
)
from moeserve.sampling import SamplingParams
from moeserve.testing.checkpoints import write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
KIMI = str(ROOT / "benchmarks/configs/kimi-k2.5-nvfp4")
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]


def _shapes(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    return {n: (tuple(t.shape), t.dtype) for n, t in tensors}


@pytest.fixture(scope="module")
def tiny_kimi(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("sim")
    return write_checkpoint(str(root / "kimi"), "kimi-k2.5", "nvfp4-modelopt", seed=3).path


# ---- (a) shapes: a simulated rank is rank 0 of the real layout -------------------------------
@pytest.mark.parametrize("layout", ["tp8-ep", "tp8", "tp4-ep"])
def test_published_kimi_rank_shapes_on_meta(layout):
    src = describe_source(KIMI)
    cfg = src.config.with_layers(3)  # the dense layer and two MoE layers
    size, ep = parse_rank_layout(layout)
    build = model_class(cfg.architecture)
    with torch.device("meta"):
        real = build(cfg, src.quant, TPGroup(0, size, None, expert_parallel=ep), torch.bfloat16)
        sim = build(cfg, src.quant, simulated_group(layout), torch.bfloat16)
    assert _shapes(sim) == _shapes(real)
    # by hand from the published config: 64 heads, 384 experts, 163840 tokens, 18432 dense
    layers = sim.model.layers
    assert layers[1].self_attn.num_heads == 64 // size
    assert layers[1].mlp.experts.layout.num_local == (384 // size if ep else 384)
    assert sim.model.embed_tokens.weight.shape[0] == 163840 // size
    assert sim.lm_head.weight.shape[0] == 163840 // size
    dense = layers[0].mlp
    gate = dense.gate_up_proj if dense.gate_up_proj is not None else dense.gate_proj
    assert gate.local_output in (18432 // size, 2 * 18432 // size)
    assert (layers[1].mlp.routing_override is not None) == ep


def test_tiny_checkpoint_loads_as_a_real_rank_zero(tiny_kimi):
    """The simulated engine's model has the shapes the real sharded loaders give rank 0 of a
    TP2 + EP deployment (weights loaded and processed for the CPU alike)."""
    real = load_model(tiny_kimi, torch.float32, "cpu", tp=TPGroup(0, 2, None, True))
    llm = LLM(tiny_kimi, device="cpu", dtype="float32", max_model_len=128, simulate_rank="tp2-ep")
    sim = llm.engine.runner.model
    assert _shapes(sim) == _shapes(real.model)
    moes = [m for m in sim.modules() if isinstance(m, DeepseekMoE)]
    assert moes and all(m.experts.layout.num_local == 4 for m in moes)  # 8 experts / 2
    # every MoE layer has its own place in the dithering sequence
    assert [m.routing_override.layer for m in moes] == list(range(len(moes)))


# ---- (b) a simulated engine decodes --------------------------------------------------------
@pytest.mark.parametrize("layout", ["tp2-ep", "tp2"])
def test_simulated_engine_decodes_on_cpu(tiny_kimi, layout):
    llm = LLM(tiny_kimi, device="cpu", dtype="float32", max_model_len=128, simulate_rank=layout)
    assert llm.engine.runner.tp.size == 2 and llm.engine.runner.tp.rank == 0
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    vocab = llm.engine.loaded.config.vocab_size
    assert [len(o.token_ids) for o in outs] == [4, 4]
    assert all(0 <= t < vocab for o in outs for t in o.token_ids)
    # the LM head holds half the vocabulary and still returns logits of the full width
    model = llm.engine.runner.model
    hidden = torch.zeros(3, llm.engine.loaded.config.hidden_size)
    assert model.compute_logits(hidden).shape == (3, vocab)


def test_serving_builds_hold_no_routing_override(tiny_kimi):
    llm = LLM(tiny_kimi, device="cpu", dtype="float32", max_model_len=128)
    moes = [m for m in llm.engine.runner.model.modules() if isinstance(m, DeepseekMoE)]
    assert moes and all(m.routing_override is None for m in moes)


def test_settings_are_checked():
    cfg = EngineConfig.from_settings(simulate_rank="tp8-ep")
    assert cfg.parallel.simulate_rank == "tp8-ep"
    assert parse_rank_layout("tp4") == (4, False)
    for bad in ("tp1", "tp8-xp", "8", "tp-ep", "tp8ep"):
        with pytest.raises(ConfigError, match="tpN or tpN-ep"):
            EngineConfig.from_settings(simulate_rank=bad)
    with pytest.raises(ConfigError, match="names its own layout"):
        EngineConfig.from_settings(simulate_rank="tp8", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="names its own layout"):
        EngineConfig.from_settings(simulate_rank="tp8", enable_expert_parallel=True)


def test_all_reduce_stand_in_is_reported_in_the_profilers_row():
    assert ALL_REDUCE_SCOPE == profile.LABEL + "all-reduce"
    assert "all-reduce" in profile.COMPONENTS
    tp = simulated_group("tp4", "cpu")
    x, r = torch.randn(2, 8), torch.randn(2, 8)
    y, s = tp.all_reduce_add_rmsnorm(x.clone(), r, torch.ones(8), 1e-6)
    assert torch.equal(s, x + r) and y.shape == (2, 8)
    assert tp.all_reduce(x) is x and tp.min_int(7) == 7
    assert tp.all_gather(x, dim=-1).shape == (2, 32)


# ---- (c) routing -----------------------------------------------------------------------------
# the module docstring's figures for Kimi-K2.5 (E = 384, k = 8, N = 8): T -> (S*, D*)
KIMI_STATED = {1: (2.58, 2.58), 8: (12.2, 11.1), 64: (75.7, 38.5)}


@pytest.mark.parametrize("tokens", sorted(KIMI_STATED))
def test_busiest_rank_matches_the_stated_figures(tokens):
    e = busiest_rank(384, 8, 8, tokens)
    slots, distinct = KIMI_STATED[tokens]
    tol = 0.01 if tokens == 1 else 0.1 if tokens == 8 else 0.5
    assert e.slots == pytest.approx(slots, abs=tol)
    assert e.distinct == pytest.approx(distinct, abs=tol)
    assert e.mean_slots == tokens
    assert e.distinct <= e.slots


def test_group_limited_routing_concentrates_the_load():
    """DeepSeek-V3 (256 experts, 8 groups of 32, best 4 groups): a token's 8 experts sit on at
    most 4 of the 8 ranks, so the busiest rank gets more than under free routing."""
    free = busiest_rank(256, 8, 8, 1)
    grouped = busiest_rank(256, 8, 8, 1, n_group=8, topk_group=4)
    assert grouped.slots > free.slots + 0.2


@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_kimi_tables_give_the_stated_slots(tokens):
    sim = SimulatedRouting(384, 8, 8, layer=0)
    e = sim.expected(tokens)
    totals = [0, 0]
    layers = 60
    for j in range(layers):
        sim.layer = j
        slots, distinct = sim.counts(tokens)
        table = sim.table(tokens)
        local = table < 48
        assert table.shape == (tokens, 8)
        assert int(local.sum()) == slots
        assert len(set(table[local].tolist())) == distinct
        per_token = local.sum(1)
        assert int(per_token.max() - per_token.min()) <= 1
        assert all(len(set(row)) == 8 for row in table.tolist())  # distinct within a token
        assert bool(((table >= 48) | local).all()) and int(table.max()) < 384
        totals[0] += slots
        totals[1] += distinct
    # the layers' counts add up to the expectation (dithering)
    assert totals[0] == pytest.approx(layers * e.slots, abs=1)
    assert totals[1] == pytest.approx(layers * e.distinct, abs=1)


def test_batch_one_alternates_around_the_expectation():
    s = busiest_rank(384, 8, 8, 1).slots
    assert [dithered(s, j) for j in range(8)] == [3, 2, 3, 2, 3, 2, 3, 3]


def test_table_spreads_slots_over_distinct_experts():
    t = routing_table(tokens=4, top_k=4, local_experts=8, num_experts=32, slots=10, distinct=5)
    local = t < 8
    assert int(local.sum()) == 10
    assert sorted(set(t[local].tolist())) == [0, 1, 3, 4, 6]  # spread over the 8
    counts = torch.bincount(t[local], minlength=8)
    assert int(counts.max()) == 2  # 10 slots over 5 experts: 2 each


def test_ids_keep_the_routers_dtype_and_reuse_one_table():
    sim = SimulatedRouting(8, 2, 2, layer=0)
    router = torch.zeros(3, 2, dtype=torch.int32)
    a, b = sim.ids(router), sim.ids(router.clone())
    assert a.dtype == torch.int32 and a.shape == (3, 2) and a is b
    with pytest.raises(ValueError):
        sim.ids(torch.zeros(3, 3, dtype=torch.int32))


def test_the_engine_routes_by_the_table(tiny_kimi, monkeypatch):
    """The experts of a simulated EP rank receive the table's ids, not the router's."""
    llm = LLM(tiny_kimi, device="cpu", dtype="float32", max_model_len=128, simulate_rank="tp2-ep")
    moe = next(m for m in llm.engine.runner.model.modules() if isinstance(m, DeepseekMoE))
    seen = []
    original = moe.experts.forward

    def experts(x, weights, ids, add_to=None):
        seen.append(ids)
        return original(x, weights, ids, add_to)

    monkeypatch.setattr(moe.experts, "forward", experts)
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert seen and all(torch.equal(ids, moe.routing_override.table(ids.shape[0])) for ids in seen)


def test_start_up_line():
    tp = simulated_group("tp8-ep")
    assert tp.describe().startswith("simulating rank 0 of 8 (TP8 + EP) on one device")
    assert (
        dataclasses.replace(tp, expert_parallel=False)
        .describe()
        .startswith("simulating rank 0 of 8 (TP8) on one device")
    )
