"""Shared experts as slots of the fused MoE on a GPU (compiled Triton): a DeepSeek-V3 MoE layer
whose shared expert is expert E of the block-FP8 / NVFP4 / BF16 banks gives what the layer with a
separate shared MLP gives, and its fused kernel what the CPU expert loop gives for the same
routing; the route kernel writes the slot column; the layer replays from a CUDA graph. Runs
where a GPU is: python3 -m pytest -q tests/gpu/test_gpu_shared_expert_slots.py"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from moeserve.config import ModelConfig
from moeserve.layers.quant.parse import quant_config_from_checkpoint
from moeserve.loader.base import DEFAULT_PLANNING, build_model
from moeserve.loader.safetensors import checkpoint_files, iterate_tensors
from moeserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from moeserve.models.registry import config_from_hf
from moeserve.parallel.groups import SINGLE
from moeserve.testing.checkpoints import KERNEL_SHAPE, write_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# GEMV and tensor-core schedules of the fused kernel; 8 rows: the shared slot as dense GEMMs
ROWS = (1, 3, 8, 64, 300)


def _with_slots(cfg: ModelConfig, slots: bool) -> ModelConfig:
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, shared_experts_as_slots=slots))


def _model(path: str, device: str, dtype: torch.dtype, slots: bool) -> DeepseekV3ForCausalLM:
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    cfg = _with_slots(config_from_hf(raw), slots)
    quant = quant_config_from_checkpoint(path, raw)
    # built as the loader builds it: the kernel plan of this device handed to the layers
    model, _ = build_model(
        DeepseekV3ForCausalLM, cfg, quant, dtype, device, dtype, DEFAULT_PLANNING, SINGLE
    )
    model.load_weights(iterate_tensors(checkpoint_files(path), progress=False))
    return model.eval()


def _close(got: torch.Tensor, ref: torch.Tensor, rel: float = 2e-2) -> None:
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= rel * ref.float().abs().max().item(), (err, ref.abs().max().item())


@pytest.mark.parametrize("fmt", ["fp8-block", "nvfp4-modelopt", "bf16"])
@torch.no_grad()
def test_slot_layer_matches_separate_mlp_and_cpu_loop(tmp_path, fmt):
    path = str(tmp_path / fmt)
    write_checkpoint(path, "deepseek-v3", fmt, shape=KERNEL_SHAPE, seed=3)
    slots = _model(path, "cuda", torch.bfloat16, True)
    separate = _model(path, "cuda", torch.bfloat16, False)
    cpu = _model(path, "cpu", torch.float32, True)
    layer = KERNEL_SHAPE.layers - 1
    moe, sep, ref = (m.model.layers[layer].mlp for m in (slots, separate, cpu))
    e, k = moe.cfg.n_routed_experts, moe.cfg.num_experts_per_tok
    assert moe.shared_slots == 1 and moe.shared_experts is None
    assert sep.shared_slots == 0 and sep.shared_experts is not None
    assert moe.experts.supports_cuda_graph  # a fused kernel serves the banks
    hidden = slots.config.hidden_size
    for rows in ROWS:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        w, ids = moe.route(x)  # the Triton route kernel
        assert ids.shape == (rows, k + 1) and (ids[:, k] == e).all() and (w[:, k] == 1).all()
        got = moe(x)
        _close(got, sep(x))
        # the fused kernel against the CPU expert loop on the same routing (fp32 weights)
        want = ref.experts(x.float().cpu(), w.cpu(), ids.long().cpu())
        _close(got.cpu(), want)
    # the layer replayed from a CUDA graph: slots (4 rows) and dense shared GEMMs (8 rows)
    assert moe.experts.runs_shared_slots(x[:4]) and not moe.experts.runs_shared_slots(x[:8])
    for rows in (4, 8):
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        eager = moe(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(x)
        for _ in range(2):
            out.fill_(float("nan"))
            graph.replay()
            torch.testing.assert_close(out, eager)
