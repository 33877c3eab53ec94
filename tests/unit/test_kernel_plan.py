"""One kernel plan: what `moeserve plan` prints is what the engine's layers are handed and run.

For every checkpoint format the writer makes, pages of 16 and 64 tokens and bf16 / fp32
activations, with an H200's capability faked on the CPU (no probe can run here, in either
path): the plan `moeserve plan --gpu h200` prints equals the plan the loader resolves, every
layer holds the backend that plan chose (its class, built from the plan, and the switches its
forward reads), each backend is the one the printed line of its part names, and the plan's
`cuda_graphs` is exactly whether the built model has no module that cannot be captured (what
the engine's capture used to ask the model). The published 512 + 64 MLA layout is used, so
the MLA kernels and the Gluon decode kernel are in play; with pages of 64 the banner's MLA
line names the Gluon kernel, which the layers then hold (the banner once named the Triton
kernel while the layers ran Gluon's)."""

from __future__ import annotations

import re

import pytest
import torch

from moeserve.cli import main
from moeserve.engine.cuda_graphs import graph_blockers
from moeserve.layers.attention import mha_backends, mla_backends
from moeserve.layers.attention.mha import PagedAttention
from moeserve.layers.attention.mla import MLAAttention
from moeserve.layers.kernel_plan import Hardware, KernelPlan, PlanSettings
from moeserve.layers.linear import LinearBase
from moeserve.layers.moe import DeepseekMLP, RoutedExperts, Router
from moeserve.layers.moe_backends import EXPERTS, ROUTERS, FusedExperts, FusedRouter
from moeserve.layers.norm import RMSNorm
from moeserve.loader import load_model
from moeserve.loader.base import Planning
from moeserve.testing.checkpoints import FORMATS, KERNEL_SHAPE, write_checkpoint

H200 = (9, 0)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
COMBOS = [(f, p, d) for f in FORMATS for p in (16, 64) for d in DTYPES]
# the layer kinds that hold a backend: the plan's field, the registry, the printed line
PARTS = {
    MLAAttention: ("mla", mla_backends.BACKENDS, "MLA decode"),
    PagedAttention: ("mha", mha_backends.BACKENDS, "attention"),
    RoutedExperts: ("experts", EXPERTS, "routed experts"),
    Router: ("router", ROUTERS, "router"),
}


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
    """Every layer whose backend or switches disagree with the plan (empty: all hold its
    choices)."""
    wrong = []
    for name, m in model.named_modules():
        if isinstance(m, LinearBase):
            ok = m.kernels == plan.linears
        elif isinstance(m, RMSNorm):
            ok = m.kernels == plan.triton and m.pdl == plan.pdl
        elif type(m) in PARTS:
            field, registry, _ = PARTS[type(m)]
            cls = getattr(plan, field)
            ok = type(m.backend) is cls and registry[cls.name] is cls
            if isinstance(m, RoutedExperts):
                ok = ok and m.batch_invariant == plan.invariant and m.pdl == plan.pdl
                # the fused kernels' arguments were taken from the loaded banks
                ok = ok and (not isinstance(m.backend, FusedExperts) or bool(m.backend.args))
        elif isinstance(m, DeepseekMLP):
            ok = m.silu_kernel == plan.triton
        else:
            continue
        if not ok:
            wrong.append(name)
    return wrong


def _named_in_print(printed: list[str], model: torch.nn.Module) -> list[str]:
    """Every layer whose backend is not what the printed line of its part names."""
    wrong = []
    for name, m in model.named_modules():
        if type(m) not in PARTS:
            continue
        what, label = PARTS[type(m)][2], m.backend.label
        line = re.compile(rf"^  {re.escape(what)}\s+{re.escape(label)} \(")
        if not any(line.match(ln) for ln in printed):
            wrong.append(f"{name}: {type(m.backend).__name__} ({label!r})")
    return wrong


@pytest.fixture(scope="module")
def loaded_h200(checkpoints):
    """(printed lines, loaded model) per format, page size and dtype, resolved once."""
    cache: dict = {}

    def get(capsys, fmt: str, page_size: int, dtype: str):
        key = (fmt, page_size, dtype)
        if key not in cache:
            printed = _printed_plan(capsys, checkpoints[fmt], page_size, dtype)
            planning = Planning(Hardware.planned_gpu(H200), PlanSettings(page_size=page_size))
            loaded = load_model(checkpoints[fmt], DTYPES[dtype], "cpu", planning=planning)
            cache[key] = (printed, loaded)
        return cache[key]

    return get


@pytest.mark.parametrize(("fmt", "page_size", "dtype"), COMBOS)
def test_printed_plan_is_the_plan_the_layers_hold(loaded_h200, capsys, fmt, page_size, dtype):
    printed, loaded = loaded_h200(capsys, fmt, page_size, dtype)
    plan = loaded.kernel_plan
    assert plan.lines() == printed
    assert _held(plan, loaded.model) == []
    mla = next(c for c in plan.choices if c.what == "MLA decode")
    if page_size == 64 and dtype == "bfloat16":
        assert mla.choice.startswith("Gluon"), mla
        assert plan.mla is mla_backends.GluonPreferMLA
    else:  # pages of 16, or an fp32 cache
        assert mla.choice.startswith("Triton"), mla
        assert ("page size 16" if page_size == 16 else "BF16 cache") in mla.reason
        assert plan.mla is mla_backends.TritonMLA
    experts = next(c for c in plan.choices if c.what == "routed experts")
    if dtype == "float32":  # the fused MoE takes bf16 activations: loop, no graphs
        assert plan.experts is EXPERTS["loop"] and experts.fallback and not plan.cuda_graphs
    else:
        assert issubclass(plan.experts, FusedExperts) and plan.cuda_graphs


@pytest.mark.parametrize(("fmt", "page_size", "dtype"), COMBOS)
def test_every_layer_runs_the_backend_its_printed_line_names(
    loaded_h200, capsys, fmt, page_size, dtype
):
    """Each layer's backend object is of the class the plan chose and the one the printed
    line of its part (`moeserve plan`'s output, parsed) names; the plan names every family it
    chose by a registry name."""
    printed, loaded = loaded_h200(capsys, fmt, page_size, dtype)
    model = loaded.model
    assert _named_in_print(printed, model) == []
    kinds = {type(m) for m in model.modules() if type(m) in PARTS}
    assert kinds == {MLAAttention, RoutedExperts, Router}  # the walk saw every family here
    assert set(loaded.kernel_plan.backend_names()) == {"linears", "mla", "experts", "router"}


@pytest.mark.parametrize(("fmt", "page_size", "dtype"), COMBOS)
def test_cuda_graphs_is_exactly_whether_the_model_is_capturable(
    loaded_h200, capsys, fmt, page_size, dtype
):
    """The plan's `cuda_graphs` (what `moeserve plan` and the engine read) equals what the
    built model's modules declare: no module that cannot be captured."""
    _, loaded = loaded_h200(capsys, fmt, page_size, dtype)
    blockers = graph_blockers(loaded.model)
    assert loaded.kernel_plan.cuda_graphs == (not blockers), blockers


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
    assert plan.invariant and plan.mla is mla_backends.TritonPrefillMLA
    assert plan.router is not FusedRouter
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
