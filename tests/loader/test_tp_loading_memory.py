"""Under tensor / expert parallelism each rank reads only its slices of the checkpoint, each
once: the bytes a rank reads from the files stay within its share of the model (the sum of
its parameters), far below the checkpoint, and the slices hold the single-process values.
Kimi-K2.5 keeps its BF16 shared expert a separate MLP; Moonlight's two NVFP4 shared experts are
slots of the expert banks, each cut from the one stored tensor, lazily too."""

from __future__ import annotations

import os

import pytest
import torch

from moeserve.loader.base import LoadRequest
from moeserve.loader.safetensors import ReadStats, load_safetensors_model
from moeserve.parallel.groups import TPGroup
from moeserve.testing.checkpoints import TinyShape, write_checkpoint

SHAPE = TinyShape(layers=3, experts=8, hidden=128, heads=4, moe_intermediate=64)


def _share(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _checkpoint_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(path, f))
        for f in os.listdir(path)
        if f.endswith(".safetensors")
    )


@pytest.fixture(scope="module", params=["kimi-k2.5", "moonlight"])
def checkpoint(tmp_path_factory, request):
    return write_checkpoint(
        str(tmp_path_factory.mktemp("mem") / request.param),
        request.param,
        "nvfp4-modelopt",
        shape=SHAPE,
    ).path


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
def test_each_rank_reads_only_its_share(checkpoint, ep):
    # bf16: the parameters keep the checkpoint's dtypes, so bytes kept = bytes read
    single_stats = ReadStats()
    single = load_safetensors_model(
        LoadRequest(checkpoint, "hf", torch.bfloat16), stats=single_stats
    ).model
    full = _share(single)
    assert single_stats.bytes_read <= 1.05 * full  # one process reads the model once
    total = 0
    for rank in range(2):
        stats = ReadStats()
        tp = TPGroup(rank=rank, size=2, expert_parallel=ep)  # loading needs no collective
        model = load_safetensors_model(
            LoadRequest(checkpoint, "hf", torch.bfloat16, tp=tp), stats=stats
        ).model
        share = _share(model)
        # what it reads is what it keeps (the acceptance bound is 1.5x; a loader that read
        # whole tensors and sliced them afterwards would read ~1.4x here and fail)
        assert 0.9 * share <= stats.bytes_read <= 1.1 * share, (rank, stats.bytes_read, share)
        assert share < 0.75 * full  # the routed experts, attention and vocab are split
        total += stats.bytes_read
        # this rank's slices are the single-process tensors' slices
        bank, ref = model.model.layers[1].mlp.experts.w13, single.model.layers[1].mlp.experts.w13
        if ep:
            torch.testing.assert_close(bank.weight, ref.weight[rank * 4 : (rank + 1) * 4])
        else:
            inter = ref.weight.shape[1] // 2
            half = inter // 2
            gate = ref.weight[:, rank * half : (rank + 1) * half]
            up = ref.weight[:, inter + rank * half : inter + (rank + 1) * half]
            torch.testing.assert_close(bank.weight, torch.cat([gate, up], 1))
    # two ranks together read about one model plus the replicated parts, never two models
    assert total < 1.5 * _checkpoint_bytes(checkpoint)
