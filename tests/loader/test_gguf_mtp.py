"""DeepSeek-V3's MTP block read from a deepseek2 GGUF file (`{"method": "mtp"}` on a .gguf).

The file is written by llama.cpp's own converter from a tiny BF16 DeepSeek-V3 folder with one
MTP layer, told to keep that layer the way it keeps DeepSeek-V3.2's (see gguf_fixtures). The
oracle is the same checkpoint's folder, whose MTP block tests/models/test_deepseek_mtp.py
holds to a torch reference: the GGUF model's draft logits equal the folder's, and the engine
drafting from the GGUF gives plain decoding's tokens.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.engine.offline import LLM
from moeserve.errors import LoadError
from moeserve.loader import load_model
from moeserve.sampling import SamplingParams
from moeserve.testing.checkpoints import write_checkpoint
from tests.loader.gguf_fixtures import Job, convert
from tests.models.helpers import one_sequence

PAGE = 16
SEQ = [5, 17, 3, 99, 42, 7, 8, 200, 31, 64, 12]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_mtp")
    folder = write_checkpoint(str(root / "bf16"), "deepseek-v3", "bf16", seed=5).path
    paths = {"nextn": str(root / "nextn.gguf"), "plain": str(root / "plain.gguf")}
    convert(
        [
            Job(folder, "f32", paths["nextn"], nextn=True),
            Job(folder, "f32", paths["plain"]),
        ],
        str(root),
    )
    return folder, paths


@torch.inference_mode()
def _draft_logits(path: str) -> torch.Tensor:
    """The MTP block's logits at every position of SEQ (fp32 model)."""
    m = load_model(path, torch.float32, "cpu", mtp=True).model
    for layer in m.attention_layers():
        layer.bind_kv_cache(8, PAGE, torch.float32, "cpu")
    t, n = torch.tensor(SEQ), len(SEQ)
    h = m(t, torch.arange(n), one_sequence(0, n, PAGE))
    normed, _ = m.forward_draft(t[1:], torch.arange(n - 1), h[:-1], one_sequence(0, n - 1, PAGE))
    return m.compute_logits(normed)


def test_gguf_mtp_block_equals_the_folders(files):
    folder, paths = files
    want, got = _draft_logits(folder), _draft_logits(paths["nextn"])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_gguf_mtp_tokens_equal_plain_tokens(files):
    _, paths = files
    prompts, lengths = [[5, 6, 7, 8, 9, 10], list(range(40, 75))], [17, 9]

    def run(spec: dict | None) -> list[list[int]]:
        kw = {"speculative_config": spec} if spec else {}
        llm = LLM(paths["nextn"], device="cpu", dtype="bfloat16", max_model_len=256, **kw)
        outs = [
            llm.generate(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
            for p, n in zip(prompts, lengths, strict=True)
        ]
        if spec:
            assert llm.engine.metrics.spec.drafts > 0
        return [o.token_ids for o in outs]

    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
    assert run(spec) == run(None)


def test_gguf_without_nextn_block_is_a_clear_error(files):
    _, paths = files
    with pytest.raises(LoadError, match="no MTP"):
        load_model(paths["plain"], torch.float32, "cpu", mtp=True)


def test_check_says_whether_the_nextn_block_is_there(files):
    from moeserve.check import check_checkpoint

    _, paths = files
    with_block = "\n".join(check_checkpoint(paths["nextn"]).lines)
    without = "\n".join(check_checkpoint(paths["plain"]).lines)
    assert "MTP: 1 nextn block(s)" in with_block and "MTP: none" in without
