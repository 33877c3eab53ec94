"""CUDA-graph decode (replayed, padded batches) against the eager GPU path, on tiny NVFP4
checkpoints that use the Triton kernels (MLA cache write + decode, fused NVFP4 MoE, and for
DeepSeek-V3 the NVFP4 GEMM of the shared experts / dense MLP). Runs where a GPU is:

    python3 -m pytest -q -s tests/gpu/test_cuda_graph.py

Graph and eager runs are not bit-identical: the padded batch can pick another MLA split
count (the graph sizes it for the whole context) and cuBLAS may pick another kernel for
another row count. So greedy tokens must be equal, except that a run may part at a near-tie
of the eager run (printed), and logprobs must agree closely up to there.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch

from moeserve.engine.offline import LLM
from moeserve.sampling import SamplingParams
from moeserve.testing.checkpoints import KERNEL_SHAPE, write_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPE = KERNEL_SHAPE  # the published 512 + 64 MLA layout: the Triton kernels apply
STEPS = 32
PROMPT_LENS = (5, 17, 2, 33, 9)
NEAR_TIE = 0.05  # eager top-2 logprob gap below which graph and eager may pick differently
LP_TOL = 0.05  # |logprob difference| of the chosen tokens before any parting


def _prompts(n: int) -> list[list[int]]:
    # byte-level token ids (no special tokens), a different pattern per prompt
    return [[10 + (37 * i + 11 * j) % 240 for j in range(PROMPT_LENS[i])] for i in range(n)]


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list]:
    """Greedy, all requests concurrent; per request its (token, logprob, top-2) steps."""
    eng = llm.engine
    rids = []
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        rid = f"r{time.monotonic_ns()}-{i}"
        params = SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=2)
        eng.add_request(rid, p, params)
        rids.append(rid)
    steps: dict[str, list] = {r: [] for r in rids}
    while eng.has_unfinished():
        for out in eng.step():
            for tok, lp in zip(out.token_ids, out.logprobs or [], strict=True):
                top = sorted((v for _, v in lp.top), reverse=True)
                steps[out.request_id].append((tok, lp.logprob, top))
    return [steps[r] for r in rids]


def _compare(ref: list[list], got: list[list]) -> list[str]:
    """Problems (empty: fine); prints per request where and why the runs part."""
    problems = []
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        assert len(r) == len(g), f"request {i}: {len(r)} vs {len(g)} tokens"
        worst, part = 0.0, None
        for k, ((tr, lr, top), (tg, lg, _)) in enumerate(zip(r, g, strict=True)):
            if tr != tg:
                part = k
                gap = top[0] - top[1] if len(top) > 1 else float("inf")
                print(f"  request {i}: parts at step {k} ({tr} vs {tg}), eager top-2 gap {gap:.4f}")
                if gap > NEAR_TIE:
                    problems.append(f"request {i} parts at step {k} with gap {gap:.4f}")
                break
            worst = max(worst, abs(lr - lg))
        print(f"  request {i}: equal for {len(r) if part is None else part}/{len(r)} steps, "
              f"max |logprob diff| {worst:.5f}")  # fmt: skip
        if worst > LP_TOL:
            problems.append(f"request {i}: logprob diff {worst:.4f} > {LP_TOL}")
    return problems


@pytest.mark.parametrize(
    ("like", "fmt", "kv"),
    [
        ("kimi-k2.5", "nvfp4-modelopt", "bf16"),
        ("kimi-k2.5", "nvfp4-modelopt", "fp8"),
        ("deepseek-v3", "nvfp4-modelopt", "bf16"),  # + NVFP4 GEMMs (shared experts)
        ("deepseek-v3", "fp8-block", "bf16"),  # the fused block-FP8 MoE
        ("deepseek-v3", "bf16", "bf16"),  # the same kernel on 16-bit experts
    ],
)
def test_graph_decode_matches_eager(tmp_path, like, fmt, kv):
    path = str(tmp_path / like)
    write_checkpoint(path, like, fmt, shape=SHAPE, seed=1)
    kw = dict(
        device="cuda",
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=8,
        kv_cache_dtype=kv,
        enable_prefix_caching=False,  # every run prefills its whole prompts: fixed step shapes
    )
    eager = LLM(path, enforce_eager=True, **kw)
    graph = LLM(path, **kw)
    print(f"\n{like} {fmt} kv={kv}\n  eager: {eager.engine.runner.graph_status}")
    print(f"  graph: {graph.engine.runner.graph_status}")
    assert eager.engine.runner.graphs is None
    g = graph.engine.runner.graphs
    assert g is not None, graph.engine.runner.graph_status
    assert g.sizes == [1, 2, 4, 8]
    # warm-up and capture ran all-padding batches: they must not have written the cache
    layers = graph.engine.runner.model.attention_layers()
    assert not any(layer.kv_cache.float().any() for layer in layers)

    problems = []
    # 3 sequences pad to 4; one prefill step, then STEPS - 1 decode steps of all three
    before = Counter(g.replays)
    prompts = _prompts(3)
    ref = _generate(eager, prompts, [STEPS] * 3)
    got = _generate(graph, prompts, [STEPS] * 3)
    used = g.replays - before
    print(f"  3 sequences: replays by padded size {dict(used)}")
    problems += _compare(ref, got)
    assert used == Counter({4: STEPS - 1})

    # 5 sequences finishing at different steps: the batch shrinks 5 -> 1 (pads to 8, 4, 2, 1)
    before = Counter(g.replays)
    prompts, lengths = _prompts(5), [STEPS, 20, STEPS - 4, 8, 12]
    ref = _generate(eager, prompts, lengths)
    got = _generate(graph, prompts, lengths)
    used = g.replays - before
    print(f"  5 sequences: replays by padded size {dict(used)}")
    problems += _compare(ref, got)
    assert used == Counter({8: 7, 4: 12, 2: 8, 1: 4})  # = max(lengths) - 1 decode steps
    assert not problems, problems


def test_bigger_batches_run_eagerly(tmp_path):
    """Decode batches above --cuda-graph-max-bs run the eager forward (same tokens)."""
    path = str(tmp_path / "kimi")
    write_checkpoint(path, "kimi-k2.5", "nvfp4-modelopt", shape=SHAPE, seed=1)
    kw = dict(device="cuda", dtype="bfloat16", max_model_len=256, enable_prefix_caching=False)
    graph = LLM(path, cuda_graph_max_bs=4, **kw)
    g = graph.engine.runner.graphs
    print(f"\n  {graph.engine.runner.graph_status}")
    assert g is not None and g.sizes == [1, 2, 4]
    prompts = _prompts(5)
    got = _generate(graph, prompts, [8] * 5)
    assert not g.replays  # 5 sequences > 4: every decode step ran eagerly
    ref = _generate(LLM(path, enforce_eager=True, **kw), prompts, [8] * 5)
    assert [[t for t, _, _ in r] for r in got] == [[t for t, _, _ in r] for r in ref]


def test_graph_decode_with_mma_moe(tmp_path, monkeypatch):
    """A shape the register-fed mma.sync MoE accepts (H, I multiples of 256): decode batches
    of 5+ sequences take that path, eager and inside the graphs, with the same tokens. (The
    H200 tables start it at 17 tokens, the F16 GEMV winning below; the test lowers that start
    to 5 so that its 5-sequence batches exercise the path.)"""
    from dataclasses import replace

    from moeserve.kernels.moe import nvfp4 as moe

    table_min_rows = moe.min_rows
    monkeypatch.setattr(
        moe, "min_rows", lambda k, key: 5 if k == "moe_gemv_mma" else table_min_rows(k, key)
    )
    calls = Counter()
    real = moe._moe_gemv_mma

    def counted(*args, **kwargs):
        calls[args[0].shape[0]] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(moe, "_moe_gemv_mma", counted)
    path = str(tmp_path / "kimi256")
    write_checkpoint(
        path, "kimi-k2.5", "nvfp4-modelopt", shape=replace(SHAPE, moe_intermediate=256), seed=2
    )
    kw = dict(device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=8,
              enable_prefix_caching=False)  # fmt: skip
    eager = LLM(path, enforce_eager=True, **kw)
    graph = LLM(path, **kw)
    assert graph.engine.runner.graphs is not None, graph.engine.runner.graph_status
    prompts, lengths = _prompts(5), [STEPS, 20, STEPS - 4, 8, 12]
    calls.clear()
    ref = _generate(eager, prompts, lengths)
    print(f"\n  eager MMA-MoE calls by token count {dict(calls)}")
    assert calls[5] > 0  # the 5-sequence decode steps ran the mma.sync MoE
    got = _generate(graph, prompts, lengths)
    problems = _compare(ref, got)
    assert not problems, problems
