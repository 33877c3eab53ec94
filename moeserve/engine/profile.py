"""`--profile-decode N`: where a decode step's time goes, by model component.

Two measurements of the same decode batch:
1. N steps exactly as they are served (CUDA graphs where captured): the wall time of each
   engine step and, on a GPU, the kernels that ran (a kernel-only torch.profiler trace:
   CUPTI sees the kernels inside graph replays, and no CPU op is traced, so the steps keep
   their speed); GPU idle = wall - kernel time (host work and launch gaps the GPU waited
   for). On a CPU the forward's wall time in the executor stands for the kernel time.
2. One more eager forward of the last step (it recomputes the same cache rows: idempotent)
   with every model component in a labelled scope, which attributes each kernel (GPU) or op
   (CPU) to a component and counts kernels per decoder layer.
The table shows the served steps' kernel time split in the eager pass's proportions, so its
rows add up to the served step time; the eager kernel total is printed beside it.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

LABEL = "moeserve::"
# component -> module class names whose forward is that component (innermost scope wins)
MODULE_COMPONENTS = {
    "norms": ("RMSNorm",),
    "attention": ("MLAAttention", "LlamaAttention", "PagedAttention"),
    "router": ("DeepseekMoE",),
    "MoE experts": ("RoutedExperts",),
    "dense MLP": ("DeepseekMLP", "LlamaMLP"),
    "LM head": ("ParallelLMHead",),
}
# (module class, method) -> component, for work a component runs outside its forward: the
# shared-expert slots' dense GEMMs (layers/moe.py) at the batch sizes where they leave the
# fused kernel
METHOD_COMPONENTS = {("RoutedExperts", "shared_dense"): "shared expert"}
COMPONENTS = (
    "attention GEMMs",
    "MLA decode",
    "router",
    "MoE experts",  # with shared experts run as slots of the banks (layers/moe.py), theirs too
    "shared expert",  # a separate shared-expert MLP
    "dense MLP",
    "norms",
    "all-reduce",
    "LM head",
    "other kernels",
)
_ALL_REDUCE_NAMES = (
    "nccl",
    "allreduce",
    "all_reduce",
    "one_shot",
    "_lamport_kernel",
    "_flag_kernel",
)
_DECODE_NAMES = ("mla_decode",)


def component_of(scope: str | None, kernel: str, parent_scope: str | None) -> str:
    """The table row of one kernel (or CPU op) from its innermost labelled scope."""
    k = kernel.lower()
    if any(n in k for n in _ALL_REDUCE_NAMES):
        return "all-reduce"
    if scope == "attention":
        return "MLA decode" if any(n in k for n in _DECODE_NAMES) else "attention GEMMs"
    if scope == "dense MLP" and parent_scope == "router":
        return "shared expert"  # the MLP inside a MoE block
    if scope in COMPONENTS:
        return scope
    return "other kernels"


@contextlib.contextmanager
def labelled(model: nn.Module) -> Iterator[None]:
    """Wrap the forward of every component module in a `moeserve::<component>` scope, and
    each decoder layer in `moeserve::layer.<i>`."""
    wrapped: list[nn.Module] = []
    for name, m in model.named_modules():
        cls = type(m).__name__
        label = next((c for c, names in MODULE_COMPONENTS.items() if cls in names), None)
        if label is None and name.rsplit(".", 2)[-2:-1] == ["layers"]:
            label = f"layer.{name.rsplit('.', 1)[-1]}"
        if label is None:
            continue
        for attr in ("forward", "compute_logits"):
            orig = m.__dict__.get(attr) or getattr(m, attr, None)
            if orig is None or attr in m.__dict__:
                continue
            m.__dict__[attr] = _scoped(orig, LABEL + label)
        for (owner, attr), component in METHOD_COMPONENTS.items():
            if cls == owner and attr not in m.__dict__:
                m.__dict__[attr] = _scoped(getattr(m, attr), LABEL + component)
        wrapped.append(m)
    try:
        yield
    finally:
        for m in wrapped:
            for attr in ("forward", "compute_logits", *(a for _, a in METHOD_COMPONENTS)):
                m.__dict__.pop(attr, None)


def _scoped(fn: Callable, label: str) -> Callable:
    def run(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)

    return run


@dataclass
class DecodeProfile:
    batch: int
    steps: int
    device: str
    step_ms: float  # wall per served step
    kernel_ms: float  # kernel (GPU) or op (CPU) time per served step
    eager_ms: float  # the labelled eager pass's total
    components_ms: dict[str, float] = field(default_factory=dict)  # served, per step
    kernels_per_step: int = 0
    kernels_per_layer: dict[str, int] = field(default_factory=dict)  # layer index -> kernels
    between_ms: float | None = None  # GPU idle between steps (GPU only)
    # speculative decoding, per step: host ms drafting, host ms accepting (verify + rollback),
    # draft tokens verified, tokens emitted (None: not speculating)
    spec: dict[str, float] | None = None

    @property
    def idle_ms(self) -> float:
        return max(0.0, self.step_ms - self.kernel_ms)

    def rows(self) -> list[tuple[str, float]]:
        comps = [(c, self.components_ms.get(c, 0.0)) for c in COMPONENTS]
        # speculative host work sits inside the step's idle time: its own rows, taken out
        # of the idle row that holds it
        spec_host = 0.0
        if self.spec is not None:
            spec_host = self.spec["draft_ms"] + self.spec["accept_ms"]
            comps += [
                ("speculative: draft (host)", self.spec["draft_ms"]),
                ("speculative: accept (host)", self.spec["accept_ms"]),
            ]
        idle = max(0.0, self.idle_ms - spec_host)
        if self.device != "cuda":
            return comps + [("host (outside the forward)", idle)]
        if self.between_ms is None:
            return comps + [("GPU idle (host gaps)", idle)]
        between = min(self.between_ms, idle)
        return comps + [
            ("GPU idle between steps", between),
            ("GPU idle inside steps", idle - between),
        ]

    def table(self) -> str:
        unit = "kernels" if self.device == "cuda" else "ops"
        lines = [
            f"moeserve: decode profile: batch {self.batch}, {self.steps} steps, "
            f"{self.step_ms:.3f} ms/step ({1000 / max(self.step_ms, 1e-9):.1f} steps/s)",
        ]
        for name, ms in self.rows():
            share = ms / self.step_ms if self.step_ms else 0.0
            lines.append(f"  {name:<28} {ms * 1000:10.1f} us  {share:6.1%}")
        if self.spec is not None:
            lines.append(
                f"  speculative: verify {self.spec['draft_tokens']:.2f} draft tokens per step "
                f"(in the forward above), {self.spec['tokens']:.2f} tokens emitted per step"
            )
        layers = sorted(self.kernels_per_layer.items(), key=lambda kv: int(kv[0]))
        if layers:
            counts = Counter(n for _, n in layers)
            per_layer = ", ".join(f"{n} x{c}" for n, c in sorted(counts.items()))
            lines.append(f"  {unit} per decoder layer: {per_layer}")
        lines.append(
            f"  {unit} per step: {self.kernels_per_step}; served {unit} "
            f"{self.kernel_ms:.3f} ms/step, eager labelled pass {self.eager_ms:.3f} ms"
        )
        return "\n".join(lines)

    def prometheus(self) -> str:
        out = [
            "# HELP moeserve_decode_profile_seconds Time per decode step by component "
            "(last --profile-decode window).",
            "# TYPE moeserve_decode_profile_seconds gauge",
        ]
        for name, ms in self.rows():
            out.append(f'moeserve_decode_profile_seconds{{component="{name}"}} {ms / 1000:.9f}')
        out.append("# TYPE moeserve_decode_profile_step_seconds gauge")
        out.append(f"moeserve_decode_profile_step_seconds {self.step_ms / 1000:.9f}")
        out.append("# TYPE moeserve_decode_profile_kernels_per_step gauge")
        out.append(f"moeserve_decode_profile_kernels_per_step {self.kernels_per_step}")
        return "\n".join(out) + "\n"


def _activities(device: torch.device) -> list[ProfilerActivity]:
    acts = [ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    return acts


def _scope_chain(e) -> list[str]:
    """Labels of the moeserve scopes enclosing a profiler event, innermost first."""
    out = []
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith(LABEL):
            out.append(p.name[len(LABEL) :])
        p = p.cpu_parent
    return out


@dataclass(frozen=True)
class Span:
    """A labelled scope (host clock, ns)."""

    label: str
    start: int
    end: int


@dataclass(frozen=True)
class Kernel:
    """A GPU kernel: its name, duration (us) and when the host launched it (host clock, ns)."""

    name: str
    us: float
    launched: int


def attribute_kernels(
    spans: list[Span], kernels: list[Kernel]
) -> tuple[dict[str, float], int, dict[str, int]]:
    """(time by component in ms, kernels, kernels per decoder layer): each kernel belongs to
    the scopes open when the host launched it (innermost first). Works for every launcher
    (torch ops, cuBLAS, Triton's own C launcher), unlike op-to-kernel links."""
    spans = sorted(spans, key=lambda s: s.start)
    comp: dict[str, float] = {}
    layers: Counter[str] = Counter()
    count = 0
    for k in kernels:
        chain = [s.label for s in spans if s.start <= k.launched <= s.end]
        if not chain:
            continue  # launched outside the forward
        chain.reverse()  # sorted by start: the innermost opened last
        comps = [c for c in chain if not c.startswith("layer.")]
        scope = comps[0] if comps else None
        parent = comps[1] if len(comps) > 1 else None
        c = component_of(scope, k.name, parent)
        comp[c] = comp.get(c, 0.0) + k.us / 1000
        count += 1
        layer = next((s for s in chain if s.startswith("layer.")), None)
        if layer is not None:
            layers[layer[len("layer.") :]] += 1
    return comp, count, dict(layers)


_LAUNCHES = ("LaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "LaunchCooperativeKernel")


def kineto_spans_and_kernels(prof: profile) -> tuple[list[Span], list[Kernel]]:
    """Labelled scopes and GPU kernels (with their host launch times) of a CUDA trace,
    joined through the launch call's correlation id."""
    events = prof.profiler.kineto_results.events()
    launched: dict[int, int] = {}
    spans: list[Span] = []
    gpu = []
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            gpu.append(e)
        elif e.name().startswith(LABEL):
            spans.append(Span(e.name()[len(LABEL) :], e.start_ns(), e.end_ns()))
        elif any(n in e.name() for n in _LAUNCHES):
            launched[e.correlation_id()] = e.start_ns()
    kernels = []
    for e in gpu:
        name = e.name()
        if name.startswith(("Memcpy", "Memset")) or "memcpy" in name.lower():
            continue
        t = launched.get(e.correlation_id(), launched.get(e.linked_correlation_id()))
        if t is not None:
            kernels.append(Kernel(name, e.duration_ns() / 1000, t))
    return spans, kernels


def _self_time_us(e) -> float:
    return float(e.self_cpu_time_total)


def attribute(prof: profile, cuda: bool) -> tuple[dict[str, float], int, dict[str, int]]:
    """(time by component in ms, kernels or ops, kernels or ops per decoder layer) of a
    labelled pass: GPU kernels by the scopes open at their launch; CPU ops by their own
    self time in the scopes enclosing them."""
    if cuda:
        return attribute_kernels(*kineto_spans_and_kernels(prof))
    comp: dict[str, float] = {}
    layers: Counter[str] = Counter()
    count = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or e.name.startswith(LABEL):
            continue
        t = _self_time_us(e)
        if t <= 0:
            continue
        chain = _scope_chain(e)
        if not chain:
            continue  # outside the forward (e.g. the copy of the step's inputs)
        comps = [c for c in chain if not c.startswith("layer.")]
        scope = comps[0] if comps else None
        parent = comps[1] if len(comps) > 1 else None
        c = component_of(scope, e.name, parent)
        comp[c] = comp.get(c, 0.0) + t / 1000
        count += 1
        layer = next((s for s in chain if s.startswith("layer.")), None)
        if layer is not None:
            layers[layer[len("layer.") :]] += 1
    return comp, count, dict(layers)


def served_kernel_ms(prof: profile, steps: int) -> tuple[float, int, float | None]:
    """GPU time, kernels per served step, and the GPU's idle time between steps (a
    kernel-only trace; steps end with the copy of their sampled ids to the host, so the
    gap from each such copy to the next device activity is idle between steps)."""
    events = sorted(
        (e.start_ns(), e.end_ns(), e.name())
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == torch.autograd.DeviceType.CUDA
    )
    total = sum(end - start for start, end, _ in events) / 1e6
    kernels = sum(1 for *_, n in events if not n.startswith(("Memcpy", "Memset")))
    gaps = [
        max(0, events[i + 1][0] - end) / 1e6
        for i, (_, end, name) in enumerate(events[:-1])
        if "DtoH" in name
    ]
    between = sum(gaps) / len(gaps) if gaps else None
    return total / steps, kernels // max(steps, 1), between


class DecodeProfiler:
    """The engine's `--profile-decode N` window: `record` each served decode step until N
    were timed, then `finish` with the last step's eager labelled pass."""

    def __init__(self, steps: int, device: torch.device) -> None:
        self.steps = steps
        self.device = device
        self.timed: list[float] = []
        self.forward: list[float] = []
        self.batch = 0
        self.result: DecodeProfile | None = None
        self._prof: profile | None = None
        self._spec: list[tuple[float, float, int, int]] = []
        self._next_spec: tuple[float, float, int, int] | None = None

    @property
    def active(self) -> bool:
        return self.result is None and self.steps > 0

    def record(self, batch: int, seconds: float, forward_seconds: float) -> None:
        """One served decode step of `batch` sequences took `seconds` (it syncs: its sampled
        ids came back to the host), `forward_seconds` of it in the executor. On a GPU the
        first call starts a kernel-only profiler (no CPU op tracing: the served steps keep
        their speed), so every counted step runs inside it."""
        if self.device.type == "cuda" and self._prof is None:
            self._prof = profile(activities=[ProfilerActivity.CUDA])
            self._prof.__enter__()
            return
        self.batch = batch
        self.timed.append(seconds * 1000)
        self.forward.append(forward_seconds * 1000)
        if self._next_spec is not None:
            self._spec.append(self._next_spec)
            self._next_spec = None

    def record_spec(
        self, draft_seconds: float, accept_seconds: float, draft_tokens: int, tokens: int
    ) -> None:
        """The speculative parts of the step `record` is called for next: host time drafting
        and accepting, the draft tokens it verified and the tokens it emitted."""
        self._next_spec = (draft_seconds * 1000, accept_seconds * 1000, draft_tokens, tokens)

    def done_timing(self) -> bool:
        return len(self.timed) >= self.steps

    def finish(self, model: nn.Module, rerun: Callable[[], object]) -> DecodeProfile:
        """Stop the served window; run `rerun` (the last step, eagerly) labelled."""
        cuda = self.device.type == "cuda"
        steps = len(self.timed)
        if cuda:
            assert self._prof is not None
            self._prof.__exit__(None, None, None)
            kernel_ms, per_step, between = served_kernel_ms(self._prof, steps)
        else:  # the forward is the ops: its wall time in the executor
            kernel_ms, per_step, between = sum(self.forward) / steps, 0, None
        with labelled(model), profile(activities=_activities(self.device)) as eager:
            with record_function(LABEL + "forward"):
                rerun()
            if cuda:
                torch.cuda.synchronize(self.device)
        comp, count, layers = attribute(eager, cuda)
        eager_total = sum(comp.values())
        scale = kernel_ms / eager_total if eager_total else 0.0
        self.result = DecodeProfile(
            batch=self.batch,
            steps=steps,
            device=self.device.type,
            step_ms=sum(self.timed) / steps,
            kernel_ms=kernel_ms,
            eager_ms=eager_total,
            components_ms={c: ms * scale for c, ms in comp.items()},
            kernels_per_step=per_step or count,
            kernels_per_layer=layers,
            between_ms=between,
            spec=self._spec_summary(),
        )
        return self.result

    def _spec_summary(self) -> dict[str, float] | None:
        if not self._spec:
            return None
        n = len(self._spec)
        cols = list(zip(*self._spec, strict=True))
        keys = ("draft_ms", "accept_ms", "draft_tokens", "tokens")
        return {k: sum(col) / n for k, col in zip(keys, cols, strict=True)}
