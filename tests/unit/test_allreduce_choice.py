"""The all-reduce chosen by topology: a pure function of a faked topology (NVLink, PCIe with peer
access, PCIe without, several hosts), nvml's link answer through a stand-in nvml module, and
`moeserve plan --p2p yes|no` for Kimi-K2.5 NVFP4 on 8 RTX PRO 6000, checked against counts
and products worked out by hand from the published config and the quoted latencies."""

from __future__ import annotations

import contextlib
import io
import re
import sys
import types
from pathlib import Path

import pytest

from moeserve.cli import main
from moeserve.parallel import comm as cm

KIMI = str(Path(__file__).resolve().parents[2] / "benchmarks/configs/kimi-k2.5-nvfp4")
NVLINK = cm.Topology(True, True, "every pair P2P-accessible; NVLink", "nvlink")
PCIE_P2P = cm.Topology(True, True, "every pair P2P-accessible; PCIe", "pcie")
PCIE = cm.Topology(True, False, "cuda:0 cannot access cuda:3 (PCIe without P2P); PCIe", "pcie")
HOSTS = cm.Topology(False, False, "ranks span hosts")
KIB, MIB = 1 << 10, 1 << 20
# Kimi-K2.5 (config.json text_config): 61 layers, hidden 7168, bf16 activations
LAYERS, HIDDEN, BF16 = 61, 7168, 2
ALL_REDUCES = 2 * LAYERS + 1  # attention + MLP per layer, and the vocab-parallel embedding
# the quoted 8 x RTX PRO 6000 figures: one-shot 7.5-9 us, NCCL ~24 us
ONE_SHOT_US, NCCL_US = (7.5 + 9.0) / 2, 24.0


@pytest.mark.parametrize(
    ("topology", "kind", "max_bytes", "env"),
    [
        (NVLINK, "one-shot", MIB, {}),  # 8 ranks over NVLink: the measured-elsewhere 1 MiB
        (PCIE_P2P, "one-shot", 128 * KIB, {}),  # peer access over PCIe still takes one-shot
        (PCIE, "torch", 128 * KIB, {"NCCL_PROTO": "LL,Simple"}),
        (HOSTS, "torch", MIB, {}),  # NCCL across hosts, its own defaults
    ],
)
def test_choice_follows_the_faked_topology(topology, kind, max_bytes, env):
    c = cm.choose_all_reduce(8, topology)
    assert (c.kind, c.one_shot_max_bytes, c.nccl_env) == (kind, max_bytes, env)
    line = c.line()
    if kind == "one-shot":
        assert line.startswith(f"one-shot over peer memory up to {max_bytes // KIB} KiB")
        assert topology.detail in line  # the banner says why
    else:
        assert line.startswith("NCCL") and ("NCCL_PROTO=LL,Simple" in line) == bool(env)


def test_two_ranks_over_nvlink_keep_their_measured_threshold():
    assert cm.choose_all_reduce(2, NVLINK).one_shot_max_bytes == 4 * MIB
    assert cm.choose_all_reduce(2, PCIE_P2P).one_shot_max_bytes == 128 * KIB


def test_settings_and_probes_can_turn_one_shot_down():
    assert cm.choose_all_reduce(8, NVLINK, prefer="nccl").kind == "torch"
    assert cm.choose_all_reduce(8, PCIE, prefer="one-shot").kind == "torch"  # no peer memory
    c = cm.choose_all_reduce(8, PCIE_P2P, symm_mem_reason="this torch has no symmetric memory")
    assert (c.kind, c.why, c.nccl_env) == ("torch", "this torch has no symmetric memory", {})
    assert cm.choose_all_reduce(8, PCIE_P2P, rows=0).kind == "torch"
    assert cm.choose_all_reduce(1, NVLINK).kind == "single"


def test_planned_topology_matches_the_probed_kinds():
    for interconnect, want in (("nvlink", NVLINK), ("pcie-p2p", PCIE_P2P)):
        got = cm.planned_topology(interconnect)
        assert (got.same_host, got.p2p, got.link) == (True, True, want.link)
    assert not cm.planned_topology("pcie").p2p
    assert not cm.planned_topology("nvlink", hosts=2).same_host


def _fake_nvml(monkeypatch, nvlinked: set[frozenset[str]] | None) -> None:
    """A stand-in for nvidia-ml-py: `nvlinked` pairs of uuids report NVLink P2P (None: the
    module is missing)."""
    if nvlinked is None:
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
        return
    m = types.ModuleType("pynvml")
    m.NVML_P2P_STATUS_OK, m.NVML_P2P_CAPS_INDEX_NVLINK = 0, 3
    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetHandleByUUID = lambda u: u

    def status(a: str, b: str, index: int) -> int:
        assert index == m.NVML_P2P_CAPS_INDEX_NVLINK
        return 0 if frozenset((a, b)) in nvlinked else 4  # 4: NVML_P2P_STATUS_NOT_SUPPORTED

    m.nvmlDeviceGetP2PStatus = status
    monkeypatch.setitem(sys.modules, "pynvml", m)


def test_link_kind_from_nvml(monkeypatch):
    uuids = ["GPU-a", "GPU-b", "GPU-c"]
    pairs = {frozenset(p) for p in (("GPU-a", "GPU-b"), ("GPU-a", "GPU-c"), ("GPU-b", "GPU-c"))}
    _fake_nvml(monkeypatch, pairs)
    assert cm._nvml_links(uuids) == "nvlink"
    _fake_nvml(monkeypatch, pairs - {frozenset(("GPU-b", "GPU-c"))})
    assert cm._nvml_links(uuids) == "pcie"  # one pair without NVLink
    _fake_nvml(monkeypatch, None)
    assert cm._nvml_links(uuids) == "unknown"


# ---- moeserve plan --gpu rtx-pro-6000 --p2p yes|no ------------------------------------------
@pytest.fixture(scope="module")
def rtx_plans() -> dict[str, tuple[int, str]]:
    out = {}
    for p2p in ("yes", "no"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(["plan", KIMI, "--gpu", "rtx-pro-6000", "--num-gpus", "8", "--p2p", p2p])
        out[p2p] = (rc, buf.getvalue())
    return out


def _line(out: str, start: str) -> str:
    return next(ln.strip() for ln in out.splitlines() if ln.lstrip().startswith(start))


@pytest.mark.parametrize("p2p", ["yes", "no"])
def test_plan_states_both_topologies(rtx_plans, p2p):
    rc, out = rtx_plans[p2p]
    assert rc == 0, out  # fits 8 x 96 GB
    assert "max context: 262,144 tokens" in out
    head = _line(out, "all-reduce by topology")
    assert f"{ALL_REDUCES} per decode step" in head and f"{HIDDEN * BF16:,} B per token" in head
    yes, no = _line(out, "P2P between every pair:"), _line(out, "no P2P:")
    assert yes.startswith("P2P between every pair: one-shot over peer memory up to 128 KiB")
    assert no.startswith("no P2P: NCCL with NCCL_PROTO=LL,Simple")
    assert ("[this plan]" in yes) == (p2p == "yes") and ("[this plan]" in no) == (p2p == "no")
    kernel = _line(out, "all-reduce ")
    if p2p == "yes":
        assert "one-shot over peer memory" in kernel and "fallback" not in kernel
    else:
        assert re.search(r"all-reduce\s+NCCL \(fallback: the GPUs cannot read", kernel)
        assert "NCCL_PROTO=LL,Simple" in kernel


def test_plan_projects_the_decode_step_for_both(rtx_plans):
    _, out = rtx_plans["yes"]
    floor = re.search(r"([\d.]+) GB read per GPU, ([\d.]+) ms at 1\.792 TB/s", out)
    assert floor is not None, out
    gb, floor_ms = float(floor[1]), float(floor[2])
    assert floor_ms == pytest.approx(gb / 1.792, abs=0.01)
    for case, us, kind in (("P2P between every pair", ONE_SHOT_US, "one-shot"),
                           ("no P2P", NCCL_US, "NCCL")):  # fmt: skip
        ar_ms = ALL_REDUCES * us / 1000
        lines = [ln for ln in out.splitlines() if ln.strip().startswith(f"{case}: + ")]
        assert len(lines) == 1, out
        m = re.search(
            r"\+ (\d+) x ([\d.]+) us (\S+) = ([\d.]+) ms -> ([\d.]+) ms per step", lines[0]
        )
        assert m is not None, lines[0]
        assert (int(m[1]), float(m[2]), m[3]) == (ALL_REDUCES, us, kind)
        assert float(m[4]) == pytest.approx(ar_ms, abs=0.01)
        assert float(m[5]) == pytest.approx(floor_ms + ar_ms, abs=0.02)
    assert "8 RTX PRO 6000" in out and "not measured here" in out
    assert "14,336 B is above the 8,192 B" in out  # Kimi's one-token message vs the figures
