"""One kernel plan: what `moeserve plan` prints is what the engine's layers are handed and run.

For every checkpoint format the writer makes, pages of 16 and 64 tokens and bf16 / fp32
activations, with an H200's capability faked on the CPU (no probe can run here, in either
path): the plan `moeserve plan --gpu h200` prints equals the plan the loader resolves, and
every layer holds the choices that plan makes (the switches its forward reads). The
published 512 + 64 MLA layout is used, so the MLA kernels and the Gluon decode kernel are in
play; with pages of 64 the banner's MLA line names the Gluon kernel, which the layers then
hold (the banner once named the Triton kernel while the layers ran Gluon's)."""

from __future__ import annotations

import pytest
import torch

from moeserve.cli import main
from moeserve.layers.attention.mla import MLAAttention
from moeserve.layers.kernel_plan import Hardware, KernelPlan, PlanSettings
from moeserve.layers.linear import LinearBase
from moeserve.layers.moe import DeepseekMLP, RoutedExperts, Router
from moeserve.layers.norm import RMSNorm
from moeserve.loader import load_model
from moeserve.loader.base import Planning
from moeserve.testing.checkpoints import FORMATS, KERNEL_SHAPE, write_checkpoint

H200 = (9, 0)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("plans")
    return {
        fmt: write_checkpoint(str(root / fmt), "deepseek-v3", fmt, shape=KERNEL_SHAPE).path
        for fmt in FORMATS
    }


def _printed_plan(capsys, path: str, page_size: int, dtype: str) -> list[str]:
    """The kernel lines `moeserve plan` prints."""
    rc = main(["plan", path, "--gpu", "h200", "--page-size", str(page_size), "--dtype", dtype])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("kernels on"))
    body = []
    for ln in lines[start + 1 :]:
        if not ln.startswith("  "):
            break
        body.append(ln)
    return body


def _held(plan: KernelPlan, model: torch.nn.Module) -> list[str]:
    """Every layer whose switches disagree with the plan (empty: all hold its choices)."""
    wrong = []
    for name, m in model.named_modules():
        if isinstance(m, LinearBase):
            ok = m.gpu_kernels == (plan.quantized_linears == "triton")
            ok = ok and m.native_cpu == plan.cpu_native and m.batch_invariant == plan.invariant
            ok = ok and m.pdl == plan.pdl
        elif isinstance(m, RMSNorm):
            ok = m.kernels == plan.triton and m.pdl == plan.pdl
        elif isinstance(m, MLAAttention):
            gluon = {"gluon": "always", "gluon-prefer": "prefer"}.get(plan.mla_decode)
            ok = m.use_kernels == (plan.mla == "triton") and m._gluon == gluon
        elif isinstance(m, RoutedExperts):
            ok = m.fused == (plan.moe == "fused") and m.batch_invariant == plan.invariant
            ok = (
                ok
                and m.pdl == plan.pdl
                and (m._nvfp4_args is not None or m._elementwise_args is not None) == m.fused
            )
        elif isinstance(m, Router):
            ok = m.triton == plan.triton and m.fused == plan.router_fused
        elif isinstance(m, DeepseekMLP):
            ok = m.silu_kernel == plan.triton
        else:
            continue
        if not ok:
            wrong.append(name)
    return wrong


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("fmt", FORMATS)
def test_printed_plan_is_the_plan_the_layers_hold(checkpoints, capsys, fmt, page_size, dtype):
    printed = _printed_plan(capsys, checkpoints[fmt], page_size, dtype)
    planning = Planning(Hardware.planned_gpu(H200), PlanSettings(page_size=page_size))
    loaded = load_model(checkpoints[fmt], DTYPES[dtype], "cpu", planning=planning)
    plan = loaded.kernel_plan
    assert plan.lines() == printed
    assert _held(plan, loaded.model) == []
    mla = next(c for c in plan.choices if c.what == "MLA decode")
    if page_size == 64 and dtype == "bfloat16":
        assert mla.choice.startswith("Gluon"), mla
        assert plan.mla_decode == "gluon-prefer"
    else:  # pages of 16, or an fp32 cache
        assert mla.choice.startswith("Triton"), mla
        assert ("page size 16" if page_size == 16 else "BF16 cache") in mla.reason
        assert plan.mla_decode == "triton"
    experts = next(c for c in plan.choices if c.what == "routed experts")
    if dtype == "float32":  # the fused MoE takes bf16 activations: loop, no graphs
        assert plan.moe == "loop" and experts.fallback and not plan.cuda_graphs
    else:
        assert plan.moe == "fused" and plan.cuda_graphs


def test_the_cpu_plan_is_what_the_cpu_layers_hold(checkpoints):
    for kernels in ("auto", "torch"):
        planning = Planning(settings=PlanSettings(cpu_kernels=kernels))
        loaded = load_model(checkpoints["fp8-block"], torch.bfloat16, "cpu", planning=planning)
        plan = loaded.kernel_plan
        assert plan.hardware.name == "CPU" and not plan.triton
        assert plan.cpu_native == (kernels == "auto" and plan.hardware.native_cpu)
        assert _held(plan, loaded.model) == []


def test_deterministic_plan_names_its_schedules(checkpoints):
    settings = PlanSettings(deterministic=True, page_size=64)
    planning = Planning(Hardware.planned_gpu(H200), settings)
    loaded = load_model(checkpoints["nvfp4-modelopt"], torch.bfloat16, "cpu", planning=planning)
    plan = loaded.kernel_plan
    assert plan.invariant and plan.mla_decode == "prefill" and not plan.router_fused
    lines = "\n".join(plan.lines())
    assert "--deterministic" in lines and "Gluon" not in lines
    assert _held(plan, loaded.model) == []


@pytest.mark.parametrize(
    "gpu,asked,on", [(H200, "off", False), (H200, "on", True), ((8, 0), "on", False)]
)
def test_programmatic_dependent_launch_is_asked_for_and_needs_sm90(checkpoints, gpu, asked, on):
    """--pdl on reaches every norm, NVFP4 linear and fused MoE of the plan where the GPU has
    grid dependency control (sm_90+); an A100 plan states the fallback; off prints nothing."""
    planning = Planning(Hardware.planned_gpu(gpu), PlanSettings(pdl=asked))
    loaded = load_model(checkpoints["nvfp4-modelopt"], torch.bfloat16, "cpu", planning=planning)
    plan = loaded.kernel_plan
    assert plan.pdl == on
    assert _held(plan, loaded.model) == []
    launches = [c for c in plan.choices if c.what == "kernel launches"]
    assert len(launches) == (asked == "on")
    if launches:
        assert launches[0].fallback == (not on)
