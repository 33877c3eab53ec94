"""Tensor parallelism over 2 gloo processes on the CPU gives the single-process tokens
(NVFP4 experts and BF16 attention sharded by the loaders' TP slicing)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeserve.dist.parallel import TPGroup
from moeserve.loader.checkpoint_writer import write_checkpoint
from moeserve.loader.safetensors import load_safetensors_model

PROMPT = [5, 6, 7, 8, 9, 10]
STEPS = 8


def _worker(rank: int, world: int, store: str, path: str, out: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.models.helpers import PagedRunner

    torch.set_num_threads(1)
    # a file store: no port to race for between picking it and binding it
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    tp = TPGroup(rank, world, dist.group.WORLD)
    lm = load_safetensors_model(path, torch.float32, tp=tp)
    tokens = PagedRunner(lm.model).greedy(PROMPT, STEPS)
    if rank == 0:
        torch.save(tokens, out)
    dist.barrier()  # both ranks are done with every collective
    # leave without tearing gloo down: its teardown in a spawned process aborts now and
    # then ("terminate called without an active exception"), which says nothing of TP
    os._exit(0)


@pytest.mark.parametrize(
    "like,fmt",
    [("kimi-k2.5", "nvfp4-modelopt"), ("deepseek-v3", "nvfp4-ct"), ("moonlight", "bf16")],
)
def test_tp2_matches_single_process(tmp_path, like, fmt):
    from tests.models.helpers import PagedRunner

    wc = write_checkpoint(str(tmp_path / "ck"), like, fmt, seed=7)
    single = PagedRunner(load_safetensors_model(wc.path, torch.float32).model).greedy(PROMPT, STEPS)
    out = str(tmp_path / "tokens.pt")
    store = str(tmp_path / "gloo_store")
    mp.spawn(_worker, args=(2, store, wc.path, out), nprocs=2, join=True)
    assert torch.load(out) == single
