"""Attribution of a decode step's kernels to model components (no GPU: synthetic traces and
a CPU run of the labelled forward)."""

from __future__ import annotations

import torch

from moeserve.engine.profile import Kernel, Span, attribute_kernels, component_of, labelled
from moeserve.testing.checkpoints import write_checkpoint


def test_kernels_belong_to_the_scopes_open_at_their_launch():
    spans = [
        Span("forward", 0, 1000),
        Span("layer.0", 10, 400),
        Span("attention", 20, 200),
        Span("norms", 30, 40),
        Span("layer.1", 410, 900),
        Span("router", 420, 800),  # DeepseekMoE
        Span("dense MLP", 500, 600),  # its shared expert
        Span("MoE experts", 650, 790),
    ]
    kernels = [
        Kernel("cutlass_gemm", 5.0, 25),  # attention GEMM
        Kernel("_rms_norm_pair_kernel", 1.0, 35),  # inside the attention's norm
        Kernel("_mla_decode_split_kernel", 3.0, 100),
        Kernel("gemv_bf16", 2.0, 550),  # shared expert
        Kernel("_route_kernel", 1.5, 450),
        Kernel("_moe_gate_up_gemv_kernel", 9.0, 700),
        Kernel("one_shot_lamport_all_reduce", 4.0, 850),  # all-reduce wherever it runs
        Kernel("embedding_kernel", 0.5, 5),  # in the forward, in no component
        Kernel("sampler_argmax", 0.5, 2000),  # outside the forward: not counted
    ]
    comp, count, layers = attribute_kernels(spans, kernels)
    ms = {k: round(v * 1000, 3) for k, v in comp.items()}
    assert ms == {
        "attention GEMMs": 5.0,
        "norms": 1.0,
        "MLA decode": 3.0,
        "shared expert": 2.0,
        "router": 1.5,
        "MoE experts": 9.0,
        "all-reduce": 4.0,
        "other kernels": 0.5,
    }
    assert count == 8 and layers == {"0": 3, "1": 4}


def test_component_rules():
    assert component_of("dense MLP", "gemv", None) == "dense MLP"  # layer 0's MLP
    assert component_of("dense MLP", "gemv", "router") == "shared expert"
    assert component_of("attention", "nccl_allreduce", None) == "all-reduce"
    assert component_of(None, "anything", None) == "other kernels"


def test_every_one_shot_all_reduce_kernel_counts_as_all_reduce():
    from moeserve.kernels.comm import allreduce as ar

    for kernel in (ar._flag_kernel, ar._lamport_kernel):  # the names CUPTI reports
        assert component_of("router", kernel.fn.__name__, None) == "all-reduce"


def test_labelled_scopes_cover_the_model_and_are_removed(tmp_path):
    from moeserve.loader import load_model

    wc = write_checkpoint(str(tmp_path / "k"), "kimi-k2.5", "nvfp4-modelopt", seed=1)
    model = load_model(wc.path, torch.float32).model
    before = {id(m): m.forward for m in model.modules()}
    with labelled(model):
        wrapped = [m for m in model.modules() if "forward" in m.__dict__]
        kinds = {type(m).__name__ for m in wrapped}
        assert {"MLAAttention", "RMSNorm", "DeepseekMoE", "RoutedExperts"} <= kinds
        assert any(type(m).__name__ == "DeepseekV3DecoderLayer" for m in wrapped)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert {id(m): m.forward for m in model.modules()}.keys() == before.keys()


def test_shared_slot_gemms_are_labelled_shared_expert(tmp_path, monkeypatch):
    # outside the fused kernel's batch sizes the shared slots run as dense GEMMs called from
    # the MoE block (whose scope is "router"): their own scope puts them on the shared row
    from moeserve.layers.moe import RoutedExperts
    from moeserve.loader import load_model

    # the GPU GEMMs themselves are not the point here: a CPU stand-in with the same name
    monkeypatch.setattr(RoutedExperts, "shared_dense", lambda self, x: x * 2)
    wc = write_checkpoint(str(tmp_path / "k"), "deepseek-v3", "fp8-block", seed=1)
    model = load_model(wc.path, torch.float32).model
    experts = next(m for m in model.modules() if isinstance(m, RoutedExperts))
    assert experts.layout.num_shared == 1
    with labelled(model), torch.profiler.profile() as prof:
        assert torch.equal(experts.shared_dense(torch.ones(1, 4)), torch.full((1, 4), 2.0))
    assert "moeserve::shared expert" in {e.name for e in prof.events()}
    assert "shared_dense" not in experts.__dict__
    assert component_of("shared expert", "fp8_block_gemm", "router") == "shared expert"
