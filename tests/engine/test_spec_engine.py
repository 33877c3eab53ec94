"""Speculative decoding through the engine on MLA models at bf16 on the CPU (native kernels):
for tiny Kimi-K2.5 NVFP4 and DeepSeek-V3 block-FP8 checkpoints, batches of prompts of mixed
lengths give the tokens and top-5 log-probabilities of plain decoding, with max_tokens cut
inside a draft. Every prompt runs twice, so the suffix proposer's cache of finished answers
drafts the second run; prompt lookup drafts where a random model's output repeats. The
oracle is the same engine without speculation; drafts must have been verified and accepted.
"""

from __future__ import annotations

import pytest

from moeserve.engine.offline import LLM
from moeserve.sampling import SamplingParams
from moeserve.testing.checkpoints import write_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(40, 75)), [7] * 20]
MAX_TOKENS = [24, 17, 30, 9]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    kimi = write_checkpoint(str(root / "kimi"), "kimi-k2.5", "nvfp4-modelopt", seed=3).path
    ds = write_checkpoint(str(root / "ds"), "deepseek-v3", "fp8-block", seed=5).path
    return {"kimi-k2.5-nvfp4": kimi, "deepseek-v3-fp8": ds}


def _run(path: str, spec: dict | None) -> tuple[list, LLM]:
    kw = {} if spec is None else {"speculative_config": spec}
    llm = LLM(path, device="cpu", dtype="bfloat16", max_model_len=256, **kw)
    got = []
    for _ in range(2):
        params = [
            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5)
            for n in MAX_TOKENS
        ]
        outs = [llm.generate([p], q)[0] for p, q in zip(PROMPTS, params, strict=True)]
        batched = _batched(llm)
        got.append(
            [(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs]) for o in outs] + batched
        )
    return got, llm


def _batched(llm: LLM) -> list:
    """All prompts in one batch (each with its own max_tokens through separate requests)."""
    eng = llm.engine
    ids = []
    for k, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        rid = f"b{k}-{len(eng.live)}-{eng.metrics.requests}"
        eng.add_request(rid, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        ids.append(rid)
    toks: dict[str, list[int]] = {r: [] for r in ids}
    while eng.has_unfinished():
        for out in eng.step():
            toks[out.request_id] += out.token_ids
    return [toks[r] for r in ids]


@pytest.mark.parametrize(
    ("name", "method"),
    [("kimi-k2.5-nvfp4", "suffix"), ("kimi-k2.5-nvfp4", "ngram"), ("deepseek-v3-fp8", "suffix")],
)
def test_speculative_tokens_equal_plain_tokens(models, name, method):
    want, _ = _run(models[name], None)
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    got, llm = _run(models[name], spec)
    assert got == want
    stats = llm.engine.metrics.spec
    assert stats.drafts > 0 and stats.accepted_tokens > 0, stats


def test_profile_decode_has_speculative_rows(models):
    """--profile-decode with drafts: the table's rows split the step (draft and accept host
    time out of the host row, not on top of it) and count the verified and emitted tokens."""
    spec = {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(
        models["kimi-k2.5-nvfp4"],
        device="cpu",
        dtype="bfloat16",
        max_model_len=256,
        profile_decode=4,
        speculative_config=spec,
    )
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm.generate([PROMPTS[0]], params)
    llm.generate([PROMPTS[0]], params)  # drafted from the first answer
    prof = llm.engine.profiler.result
    assert prof is not None and prof.spec is not None
    assert prof.spec["draft_tokens"] > 0 and prof.spec["tokens"] >= 1
    names = [name for name, _ in prof.rows()]
    assert "speculative: draft (host)" in names and "speculative: accept (host)" in names
    assert sum(ms for _, ms in prof.rows()) <= prof.step_ms * 1.001
    assert "tokens emitted per step" in prof.table()
