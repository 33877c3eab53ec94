"""Speculative decoding with EAGLE-3 draft heads (`{"method": "eagle3", "model": PATH}`) through
the engine, on a tiny Kimi-K2.5 NVFP4 checkpoint at bf16 on the CPU, with a tiny MLA head and a
tiny Llama-style head written by `moeserve make-checkpoint` in the published layouts:

- the tokens and top-3 log-probabilities equal plain decoding's, batched (prompts of mixed
  lengths, max_tokens cut inside a draft), for 1 and 3 draft tokens per step;
- with drafts forced to the plain continuation (wrong from some position on, every other
  time), drafts are accepted, fully and in part, and the output is still plain decoding's;
  every draft the head proposed meanwhile (after catching up on several accepted positions
  at once) is what the head predicts when run over the whole final sequence in one pass:
  the target's aux hidden states for it, then the head, chained on its own output;
- a head whose one-token draft vocabulary maps (d2t) to the token the target emits most gets
  its own drafts accepted, and the output is plain decoding's;
- bad heads (no folder, aux layers the target does not have) are one-sentence errors.

Random weights make the head's own drafts wrong: rejection and rollback run in the first
test, acceptance in the second and third. The native CPU kernels give the same bits however a
sequence is split into steps, so the drafts must equal the one-pass reference exactly.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.engine.draft import DraftModelProposer
from moeserve.engine.offline import LLM
from moeserve.loader import load_model
from moeserve.models.eagle3 import capture_aux_hidden
from moeserve.sampling import SamplingParams
from moeserve.testing.checkpoints import TinyShape, write_checkpoint, write_eagle3_checkpoint
from tests.models.helpers import one_sequence

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(40, 75)), [7] * 20]
MAX_TOKENS = [20, 13, 17, 9]
PAGE = 16
HEADS = ("kimi-k2.5-eagle3-mla", "kimi-k2.5-eagle3")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = write_checkpoint(
        str(root / "kimi"), "kimi-k2.5", "nvfp4-modelopt", TinyShape(layers=3), seed=5
    ).path
    heads = {
        like: write_eagle3_checkpoint(str(root / like), like, target, seed=6).path for like in HEADS
    }
    return target, heads


def _engine(target: str, head: str | None, k: int = 3) -> LLM:
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": k, "adaptive": False}
    kw = {"speculative_config": spec} if head else {}
    return LLM(target, device="cpu", dtype="bfloat16", max_model_len=256, threads=1, **kw)


def _generate(llm: LLM) -> list:
    eng = llm.engine
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=3) for n in MAX_TOKENS
    ]
    rids = [f"r{i}" for i in range(len(PROMPTS))]
    for rid, p, q in zip(rids, PROMPTS, params, strict=True):
        eng.add_request(rid, p, q)
    toks: dict[str, list] = {r: [] for r in rids}
    while eng.has_unfinished():
        for out in eng.step():
            toks[out.request_id] += [
                (t, lp.logprob, lp.top) for t, lp in zip(out.token_ids, out.logprobs, strict=True)
            ]
    return [toks[r] for r in rids]


@pytest.fixture(scope="module")
def plain(checkpoints):
    return _generate(_engine(checkpoints[0], None))


@pytest.mark.parametrize(("like", "k"), [(HEADS[0], 3), (HEADS[1], 3), (HEADS[0], 1)])
def test_eagle3_tokens_equal_plain_tokens(checkpoints, plain, like, k):
    target, heads = checkpoints
    llm = _engine(target, heads[like], k)
    assert _generate(llm) == plain
    assert llm.engine.metrics.spec.drafts > 0


class _Reference:
    """The target with its head, driven by hand over one sequence at a time."""

    def __init__(self, target: str, head: str) -> None:
        loaded = load_model(target, torch.bfloat16, "cpu", eagle3=head)
        self.model, self.head = loaded.model, loaded.draft
        for layer in self.model.attention_layers() + self.head.attention_layers():
            layer.bind_kv_cache(64, PAGE, torch.bfloat16, "cpu")

    @torch.inference_mode()
    def drafts(self, seq: list[int], upto: int, k: int) -> list[int]:
        """The draft after the sequence's first `upto` tokens: the target over them in one pass
        (its aux layers' hidden states captured), the head over positions 0 .. upto - 2, then
        chained k - 1 times on its own output."""
        m, head, t = self.model, self.head, torch.tensor(seq[:upto])
        aux = torch.zeros(
            upto, len(head.aux_layer_ids) * m.config.hidden_size, dtype=torch.bfloat16
        )
        capture_aux_hidden(m, head.aux_layer_ids, aux)
        m(t, torch.arange(upto), one_sequence(0, upto, PAGE))
        hidden = head.fuse_target_hidden(aux[:-1])
        normed, carried = head.forward_draft(
            t[1:], torch.arange(upto - 1), hidden, one_sequence(0, upto - 1, PAGE)
        )
        out = [int(head.compute_logits(normed[-1:]).argmax())]
        for j in range(1, k):
            p = upto - 2 + j
            normed, carried = head.forward_draft(
                torch.tensor([out[-1]]), torch.tensor([p]), carried[-1:], one_sequence(p, 1, PAGE)
            )
            out.append(int(head.compute_logits(normed).argmax()))
        return out


def test_forced_drafts_are_accepted_and_head_drafts_match_reference(checkpoints, plain):
    target, heads = checkpoints
    head, k = heads[HEADS[0]], 3
    llm = _engine(target, head, k)
    prop = llm.engine.proposer
    assert isinstance(prop, DraftModelProposer)
    inner = prop.propose
    record: list = []
    seqs = {f"r{i}": PROMPTS[i] + [t for t, *_ in plain[i]] for i in range(len(PROMPTS))}

    def propose(rid: str, max_tokens: int) -> list[int]:
        req = llm.engine.live[rid].req
        own = inner(rid, max_tokens)
        record.append((rid, req.num_tokens, own))
        n = req.num_tokens
        forced = seqs[rid][n : n + max_tokens]
        if len(record) % 2 and len(forced) > 1:  # wrong from the second token on
            forced = forced[:1] + [(t + 1) % 100 for t in forced[1:]]
        return forced

    prop.propose = propose
    assert _generate(llm) == plain
    stats = llm.engine.metrics.spec
    assert stats.draft_tokens > stats.accepted_tokens, stats  # rejections too
    assert stats.accepted_per_position[k - 1] > 0, stats  # whole drafts accepted
    ref = _Reference(target, head)
    checked = chained = 0
    for rid, upto, own in record:
        if not own:
            continue
        assert own == ref.drafts(seqs[rid], upto, len(own)), (rid, upto)
        checked += 1
        chained += len(own) > 1
    assert checked >= 8 and chained >= 8, (checked, chained)


def test_bad_heads_are_refused_in_one_sentence(checkpoints, tmp_path):
    from moeserve.config import ConfigError, SpeculativeConfig
    from moeserve.errors import LoadError

    with pytest.raises(ConfigError, match='needs "model"'):
        SpeculativeConfig.parse('{"method": "eagle3"}')
    target, _ = checkpoints
    with pytest.raises(LoadError, match="is not a folder"):
        load_model(target, torch.bfloat16, "cpu", eagle3=str(tmp_path / "nowhere"))
    head = write_eagle3_checkpoint(str(tmp_path / "h"), HEADS[0], target, aux_layers=[0, 1, 7])
    with pytest.raises(LoadError, match=r"aux hidden-state layers \[0, 1, 7\] do not fit") as e:
        load_model(target, torch.bfloat16, "cpu", eagle3=head.path)
    assert "\n" not in str(e.value)


def test_a_head_drafting_the_targets_token_is_accepted(checkpoints, plain, tmp_path):
    """A head whose draft vocabulary is one token, the one the target emits most: d2t maps
    its only draft id to it, so it drafts that token every step, and the target accepts it
    wherever it comes next."""
    target, _ = checkpoints
    emitted = [t for out in plain for t, *_ in out[1:]]
    token = max(set(emitted), key=emitted.count)
    head = write_eagle3_checkpoint(str(tmp_path / "one"), HEADS[0], target, draft_tokens=[token])
    llm = _engine(target, head.path, k=1)
    assert _generate(llm) == plain
    stats = llm.engine.metrics.spec
    assert stats.accepted_tokens >= 2 and stats.draft_tokens > stats.accepted_tokens, stats
