"""--deterministic on a GPU, CUDA graphs on, for tiny Kimi-K2.5 NVFP4 and DeepSeek-V3 block-FP8
checkpoints in the published 512 + 64 MLA layout (the Triton kernels apply):

- one prompt's last-position logits are bit-identical whether it is prefilled whole, in
  chunks of 16 or 64, with its first half computed in an earlier step, its last tokens
  decoded one per step (graph replays) or verified four at once;
- 8 prompts generated together give the tokens and log-probabilities of each alone.

The default kernels (row-count dispatch, split-K) are run through the same checks and what
differs is printed: that is what --deterministic buys and what it is measured against
(benchmarks/results/decode_layer_deterministic.md)."""

from __future__ import annotations

import pytest
import torch
from step_split import PROMPT_LEN, SPLITS, last_logits, random_prompt

from moeserve.engine.offline import LLM
from moeserve.sampling import SamplingParams
from moeserve.testing.checkpoints import KERNEL_SHAPE, write_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FORMATS = {
    "kimi-k2.5-nvfp4": ("kimi-k2.5", "nvfp4-modelopt"),
    "deepseek-v3-fp8": ("deepseek-v3", "fp8-block"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("det")
    return {
        name: write_checkpoint(str(root / name), like, fmt, shape=KERNEL_SHAPE, seed=11).path
        for name, (like, fmt) in FORMATS.items()
    }


def _engine(path: str, deterministic: bool) -> LLM:
    return LLM(path, device="cuda", max_model_len=512, max_num_seqs=8, deterministic=deterministic)


def _split_differences(llm: LLM) -> dict[str, float]:
    ids = random_prompt(llm)
    whole = last_logits(llm, ids, [PROMPT_LEN])
    assert whole.isfinite().all()
    out = {}
    for what, splits in SPLITS.items():
        got = last_logits(llm, ids, splits)
        out[what] = float((got - whole).abs().max())
    return out


def _batch_differences(llm: LLM) -> int:
    prompts = [random_prompt(llm, 20 + 7 * i, seed=i) for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)

    def key(c):
        return c.token_ids, [(lp.logprob, lp.top) for lp in c.logprobs]

    together = [key(c) for c in llm.generate(prompts, params)]
    alone = [key(llm.generate([p], params)[0]) for p in prompts]
    return sum(a != b for a, b in zip(alone, together, strict=True))


@pytest.mark.parametrize("name", list(FORMATS))
def test_deterministic_logits_do_not_depend_on_step_split_or_batch(checkpoints, name):
    llm = _engine(checkpoints[name], deterministic=True)
    assert llm.engine.runner.graphs is not None, "decode must replay CUDA graphs"
    diffs = _split_differences(llm)
    assert all(d == 0.0 for d in diffs.values()), diffs
    assert _batch_differences(llm) == 0


@pytest.mark.parametrize("name", list(FORMATS))
def test_default_kernels_report(checkpoints, name):
    """Informational: how far the default kernels are from step-split and batch invariance."""
    llm = _engine(checkpoints[name], deterministic=False)
    print(
        f"\n{name} default kernels: split max diff {_split_differences(llm)}, "
        f"batched != alone: {_batch_differences(llm)} of 8"
    )
