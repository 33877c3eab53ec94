"""Overlap scheduling (step N+1 queued before step N's outputs are processed, its input
tokens read where step N left them) generates exactly what the step-by-step engine does:
greedy batches, stops in the middle of a stream, length limits, preemption under page
pressure, aborts, prefix-cache hits and batches that mix in non-greedy requests."""

from __future__ import annotations

import pytest

from moeserve.engine.offline import LLM
from moeserve.sampling import SamplingParams
from moeserve.testing.checkpoints import write_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36], [40]]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return write_checkpoint(
        str(tmp_path_factory.mktemp("ov") / "kimi"), "kimi-k2.5", "nvfp4-modelopt", seed=4
    ).path


def _engines(path: str, **kw) -> tuple[LLM, LLM]:
    common = dict(device="cpu", dtype="float32", max_model_len=128, page_size=4, **kw)
    return LLM(path, overlap_schedule=False, **common), LLM(path, overlap_schedule=True, **common)


def _run(llm: LLM, prompts, params) -> list[tuple[list[int], str | None]]:
    return [(c.token_ids, c.finish_reason) for c in llm.generate(prompts, params)]


def test_greedy_batches_equal_the_step_by_step_engine(kimi):
    plain, overlap = _engines(kimi, max_num_batched_tokens=8)  # chunked prefills too
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = _run(plain, PROMPTS, params)
    assert _run(overlap, PROMPTS, params) == want
    assert all(len(t) == 12 and r == "length" for t, r in want)


def test_stops_mid_stream_and_max_tokens(kimi):
    plain, overlap = _engines(kimi)
    free = _run(plain, PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    # stop on the 4th token of the first stream: the overlapped engine has already queued
    # one more step for it, whose token must be dropped
    stop = free[0][0][3]
    params = [
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=(stop,)),
        SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
    ]
    for p in params:
        want = _run(plain, PROMPTS, p)
        assert _run(overlap, PROMPTS, p) == want
    assert _run(overlap, PROMPTS[:1], params[0])[0] == (free[0][0][:4], "stop")


def test_preemption_under_page_pressure(kimi):
    # 12 pages of 4 tokens cannot hold four growing sequences: some are preempted, with a
    # token of theirs still on the GPU, and recomputed later
    plain, overlap = _engines(kimi, num_pages=12)
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    want = _run(plain, PROMPTS, params)
    assert _run(overlap, PROMPTS, params) == want
    assert overlap.engine.scheduler.running == [] and overlap.engine.allocator.num_free == 12


def test_mixed_with_sampling_requests_and_prefix_hits(kimi):
    plain, overlap = _engines(kimi)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    prompts = PROMPTS + [PROMPTS[0] + [50, 51]]  # a prefix hit on the first prompt's pages
    for llm in (plain, overlap):
        llm.generate(PROMPTS[:1], greedy)  # fill the prefix cache
    for eng in (plain, overlap):
        for i, p in enumerate(prompts):
            eng.engine.add_request(f"r{i}", p, seeded if i == 1 else greedy)
    outs = []
    for eng in (plain, overlap):
        got: dict[str, list[int]] = {}
        while eng.engine.has_unfinished():
            for o in eng.engine.step():
                got.setdefault(o.request_id, []).extend(o.token_ids)
        outs.append(got)
    assert outs[0] == outs[1] and len(outs[0]) == len(prompts)
    assert overlap.engine.allocator.stats.hits > 0


def test_abort_with_a_token_in_flight(kimi):
    _, overlap = _engines(kimi)
    eng = overlap.engine
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    eng.add_request("a", PROMPTS[0], params)
    eng.add_request("b", PROMPTS[1], params)
    seen: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(4):
        for o in eng.step():
            seen[o.request_id].extend(o.token_ids)
    assert eng._inflight is not None  # a step is queued with a token of "a" pending
    eng.abort("a")
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id == "b"
            seen["b"].extend(o.token_ids)
    assert len(seen["b"]) == 20
    assert eng.allocator.num_free == eng.num_pages and not eng.scheduler.running


def test_host_proposers_overlap_the_steps_that_verify_nothing(kimi):
    """With an n-gram proposer the steps that verify no draft overlap; a draft the policy
    wants for a request whose token is still on the GPU waits for it. Tokens equal the plain
    engine's; both kinds of step happened."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    common = dict(device="cpu", dtype="float32", max_model_len=128, page_size=4)
    plain = LLM(kimi, overlap_schedule=False, **common)
    overlap = LLM(kimi, overlap_schedule=True, speculative_config=spec, **common)
    eng = overlap.engine
    launched = []
    inner = eng._launch_copy
    eng._launch_copy = lambda *a: launched.append(1) or inner(*a)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7], [20, 21, 20, 21, 20], [30, 31, 32, 33]]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    assert _run(overlap, prompts, params) == _run(plain, prompts, params)
    assert eng.metrics.spec.drafts > 0 and len(launched) > 0, (eng.metrics.spec.drafts, launched)
