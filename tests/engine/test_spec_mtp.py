"""Speculative decoding with DeepSeek-V3's own MTP layer (`{"method": "mtp"}`) through the
engine, on tiny DeepSeek-V3 block-FP8 and BF16 checkpoints at bf16 on the CPU:

- the tokens and top-3 log-probabilities equal plain decoding's, batched (prompts of mixed
  lengths, max_tokens cut inside a draft), for 1 and 3 draft tokens per step;
- every draft the engine proposed is what the MTP module predicts when run over the whole
  final sequence in one pass (the engine computes it incrementally: catching up after each
  step on the accepted positions only, its cache rows on the sequence's pages, further
  tokens chained on its own output): the first draft token for every proposal, the chained
  ones for the last proposals. The native CPU kernels give the same bits either way.

Random weights make the drafts wrong: the rejection and rollback paths are exercised, and
the second check is what shows the drafts are the module's.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.engine.draft import DraftModelProposer
from moeserve.engine.offline import LLM
from moeserve.loader import load_model
from moeserve.sampling import SamplingParams
from moeserve.testing.checkpoints import write_checkpoint
from tests.models.helpers import one_sequence

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(40, 75)), [7] * 20]
MAX_TOKENS = [20, 13, 17, 9]
PAGE = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {
        fmt: write_checkpoint(str(root / fmt), "deepseek-v3", fmt, seed=5).path
        for fmt in ("fp8-block", "bf16")
    }


def _generate(path: str, k: int | None, record: list | None = None) -> list:
    spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive": False} if k else None
    kw = {"speculative_config": spec} if spec else {}
    llm = LLM(path, device="cpu", dtype="bfloat16", max_model_len=256, **kw)
    if record is not None:
        prop = llm.engine.proposer
        assert isinstance(prop, DraftModelProposer)
        inner = prop.propose

        def propose(rid: str, max_tokens: int) -> list[int]:
            req = llm.engine.live[rid].req
            record.append((rid, req.num_tokens, list(prop.drafts.get(rid, []))))
            return inner(rid, max_tokens)

        prop.propose = propose
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=3) for n in MAX_TOKENS
    ]
    eng = llm.engine
    rids = []
    for i, (p, q) in enumerate(zip(PROMPTS, params, strict=True)):
        eng.add_request(f"r{i}", p, q)
        rids.append(f"r{i}")
    toks: dict[str, list] = {r: [] for r in rids}
    while eng.has_unfinished():
        for out in eng.step():
            toks[out.request_id] += [
                (t, lp.logprob, lp.top) for t, lp in zip(out.token_ids, out.logprobs, strict=True)
            ]
    if record is not None:
        assert eng.metrics.spec.drafts > 0
    return [toks[r] for r in rids]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("fmt", ["fp8-block", "bf16"])
def test_mtp_tokens_equal_plain_tokens(checkpoints, fmt, k):
    assert _generate(checkpoints[fmt], k, []) == _generate(checkpoints[fmt], None)


class _Reference:
    """The model with its MTP module, driven by hand over one sequence at a time."""

    def __init__(self, path: str) -> None:
        self.model = load_model(path, torch.bfloat16, "cpu", mtp=True).model
        for layer in self.model.attention_layers():
            layer.bind_kv_cache(64, PAGE, torch.bfloat16, "cpu")

    @torch.inference_mode()
    def drafts(self, seq: list[int], upto: int, k: int) -> list[int]:
        """The draft after the sequence's first `upto` tokens: the MTP module over positions
        0..upto-2 in one pass, then chained k - 1 times on its own output."""
        m, t = self.model, torch.tensor(seq[:upto])
        h = m(t, torch.arange(upto), one_sequence(0, upto, PAGE))
        pos = torch.arange(upto - 1)
        normed, carried = m.forward_draft(t[1:], pos, h[:-1], one_sequence(0, upto - 1, PAGE))
        out = [int(m.compute_logits(normed[-1:]).argmax())]
        for j in range(1, k):
            p = upto - 2 + j
            normed, carried = m.forward_draft(
                torch.tensor([out[-1]]),
                torch.tensor([p]),
                carried[-1:],
                one_sequence(p, 1, PAGE),
            )
            out.append(int(m.compute_logits(normed).argmax()))
        return out


def test_drafts_are_the_mtp_modules_predictions(checkpoints):
    path, k = checkpoints["fp8-block"], 3
    record: list = []
    outs = _generate(path, k, record)
    seqs = {f"r{i}": PROMPTS[i] + [t for t, *_ in outs[i]] for i in range(len(PROMPTS))}
    ref = _Reference(path)
    checked = chained = 0
    for rid, upto, draft in record:
        if not draft:
            continue
        assert draft == ref.drafts(seqs[rid], upto, len(draft)), (rid, upto)
        checked += 1
        chained += len(draft) > 1
    assert checked >= 20 and chained >= 10, (checked, chained)
