"""Tensor parallelism over 2 gloo processes on the CPU gives the single-process tokens
(NVFP4 experts and BF16 attention sharded by the loaders' TP slicing; shared experts as slots
of the expert banks, one or two of them, NVFP4, BF16 and block-FP8, split like the routed
experts)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeserve.loader import load_model
from moeserve.parallel.groups import TPGroup
from moeserve.testing.checkpoints import TinyShape, write_checkpoint

PROMPT = [5, 6, 7, 8, 9, 10]
STEPS = 8
# block-FP8 over 2 ranks: every split dim (and each of Moonlight's 2 shared experts) holds
# whole 128-wide blocks per rank
FP8_SHAPE = TinyShape(
    hidden=128, heads=4, nope=64, rope=64, v_dim=64, intermediate=256, moe_intermediate=256
)


def _run(runner) -> tuple[torch.Tensor, list[int]]:
    """The prompt's last logits (closer than tokens: a wrong slice of a small expert may
    leave the argmax alone) and the greedy tokens."""
    logits = runner.step({runner.add_sequence(): PROMPT})[0]
    return logits, runner.greedy(PROMPT, STEPS)


def _worker(rank: int, world: int, store: str, path: str, out: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.models.helpers import PagedRunner

    torch.set_num_threads(1)
    # a file store: no port to race for between picking it and binding it
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    tp = TPGroup(rank, world, dist.group.WORLD)
    lm = load_model(path, torch.float32, tp=tp)
    result = _run(PagedRunner(lm.model))
    if rank == 0:
        torch.save(result, out)
    dist.barrier()  # both ranks are done with every collective
    # leave without tearing gloo down: its teardown in a spawned process aborts now and
    # then ("terminate called without an active exception"), which says nothing of TP
    os._exit(0)


@pytest.mark.parametrize(
    "like,fmt,shape",
    [
        ("kimi-k2.5", "nvfp4-modelopt", TinyShape()),
        ("deepseek-v3", "nvfp4-ct", TinyShape()),
        ("moonlight", "bf16", TinyShape()),
        ("moonlight", "fp8-block", FP8_SHAPE),
    ],
)
def test_tp2_matches_single_process(tmp_path, like, fmt, shape):
    from tests.models.helpers import PagedRunner

    wc = write_checkpoint(str(tmp_path / "ck"), like, fmt, shape=shape, seed=7)
    logits, tokens = _run(PagedRunner(load_model(wc.path, torch.float32).model))
    out = str(tmp_path / "tokens.pt")
    store = str(tmp_path / "gloo_store")
    mp.spawn(_worker, args=(2, store, wc.path, out), nprocs=2, join=True)
    tp_logits, tp_tokens = torch.load(out)
    assert tp_tokens == tokens
    torch.testing.assert_close(tp_logits, logits, rtol=1e-4, atol=1e-4)
