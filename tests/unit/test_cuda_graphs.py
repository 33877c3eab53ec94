"""CUDA-graph decode pieces that need no GPU: capture sizes and padding, which models are
capturable, the replay plumbing (stand-in graphs), the MLA split-KV scratch and the shared
split-K workspace (kernels under the Triton interpreter), config and CLI flags."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch import nn

from moeserve.cli import _build_parser, engine_config
from moeserve.config import EngineConfig
from moeserve.engine.cuda_graphs import DecodeGraphs, capture_sizes, graph_blockers, padded_size
from moeserve.layers.attention.mha import PagedAttention
from moeserve.layers.attention.mla import MLADecodeScratch
from moeserve.layers.quant.scheme import shared_splitk_workspace, splitk_fits
from moeserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from moeserve.models.registry import config_from_hf
from tests.models.helpers import tiny_hf_config


# ---- sizes and padding ------------------------------------------------------------------------
def test_capture_sizes():
    assert capture_sizes(0) == []
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    big = capture_sizes(256)
    assert big[:5] == [1, 2, 4, 8, 16] and big[-1] == 256 and len(big) == 35
    assert all(b - a <= 8 for a, b in zip(big, big[1:], strict=False))


@pytest.mark.parametrize("max_batch", [1, 5, 8, 20, 64])
def test_padded_size_is_the_smallest_captured_fit(max_batch):
    sizes = capture_sizes(max_batch)
    for b in range(1, max_batch + 1):
        p = padded_size(b, sizes)
        assert p in sizes and p >= b
        assert all(s < b for s in sizes if s < p)
    assert padded_size(max_batch + 1, sizes) is None


# ---- which models are captured --------------------------------------------------------------
class _Capturable(nn.Module):
    supports_cuda_graph = True


def test_graph_blockers():
    assert graph_blockers(nn.Sequential(_Capturable(), nn.Linear(2, 2))) == []
    assert PagedAttention.supports_cuda_graph is False
    assert graph_blockers(nn.Sequential(_Capturable(), PagedAttention(2, 1, 8, 0.3))) == [
        "PagedAttention"
    ]
    # on a CPU (and for a non-512+64 latent) MLA runs the torch path, experts loop on the host
    model = DeepseekV3ForCausalLM(config_from_hf(tiny_hf_config()))
    assert graph_blockers(model) == ["MLAAttention", "RoutedExperts"]


def test_graph_max_batch():
    cfg = EngineConfig.from_settings("m", max_num_seqs=48)
    assert cfg.graph_max_batch("cuda") == 48  # capped by max_num_seqs
    assert EngineConfig.from_settings("m").graph_max_batch("cuda:1") == 64
    small = EngineConfig.from_settings("m", max_num_seqs=48, cuda_graph_max_bs=16)
    assert small.graph_max_batch("cuda") == 16
    assert EngineConfig.from_settings("m", enforce_eager=True).graph_max_batch("cuda") == 0
    assert EngineConfig.from_settings("m").graph_max_batch("cpu") == 0


def test_cli_flags():
    args = _build_parser().parse_args(["serve", "--enforce-eager", "--cuda-graph-max-bs", "16"])
    cfg = engine_config(args)
    assert cfg.enforce_eager is True and cfg.cuda_graph_max_bs == 16
    cfg = engine_config(_build_parser().parse_args(["serve"]))
    assert cfg.enforce_eager is False and cfg.cuda_graph_max_bs == 256
    with pytest.raises(SystemExit) as e:
        _build_parser().parse_args(["serve", "--cuda-graph-max-bs", "0"])
    assert e.value.code == 2


# ---- replay plumbing --------------------------------------------------------------------------
PAD_ROW = 99


def _echo(ids, positions, rows, seq_lens) -> torch.Tensor:
    """A 'forward' whose hidden row b is what column b of the static inputs holds."""
    return torch.stack([ids, positions, rows, seq_lens], dim=1)


class _StandInGraph:
    """Replays by running the forward again on the same static buffers (what a graph does)."""

    def __init__(self, graphs: DecodeGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        self.graphs.outputs[self.size].copy_(self.graphs._run_forward(self.size))


def test_replay_pads_to_the_next_size_and_resets_padding_columns():
    g = DecodeGraphs(_echo, nn.Module(), torch.device("cpu"), 8, PAD_ROW, 64)
    g.allocate_inputs()
    for size in g.sizes:
        g.outputs[size] = torch.zeros(size, 4, dtype=torch.long)
        g.graphs[size] = _StandInGraph(g, size)  # type: ignore[assignment]
    assert g.can_run(8) and not g.can_run(9)

    five = torch.tensor([[1, 2, 3, 4, 5], [9] * 5, [0, 1, 2, 3, 4], [10] * 5])
    out = g.run(five)
    assert out.tolist() == five.t().tolist()
    pad = g.outputs[8][5:]
    assert pad.tolist() == [[0, 0, PAD_ROW, 0]] * 3  # id 0, position 0, padding row, no cache

    # three sequences reuse columns that held real sequences: padded again, none left stale
    three = torch.tensor([[7, 8, 9], [4, 20, 3], [5, 6, 7], [5, 21, 4]])
    assert g.run(three).tolist() == three.t().tolist()
    assert g.outputs[4][3].tolist() == [0, 0, PAD_ROW, 0]
    assert g.replays == Counter({8: 1, 4: 1})


class _Prepared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.prepared: list[tuple] = []

    def prepare_cuda_graph(self, max_tokens: int, max_context: int, shared: dict) -> None:
        self.prepared.append((max_tokens, max_context, shared))


def test_capture_prepares_once_then_warms_up_and_captures_largest_first(monkeypatch):
    captured = []

    class FakeGraph:
        def replay(self) -> None: ...

    class FakeCapture:
        def __init__(self, graph: FakeGraph, pool: object = None, stream: object = None) -> None:
            captured.append(pool)

        def __enter__(self) -> None: ...

        def __exit__(self, *exc: object) -> None: ...

    pool = object()
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: pool)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    class FakeStream:
        def __init__(self, device: object = None) -> None: ...

        def wait_stream(self, other: object) -> None: ...

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    model = nn.Sequential(_Prepared())
    calls: list[tuple[int, list[int]]] = []

    def forward(ids, positions, rows, seq_lens):
        calls.append((ids.shape[0], rows.tolist()))
        assert not seq_lens.any()  # capture runs on padding columns: no cache read or write
        return _echo(ids, positions, rows, seq_lens)

    g = DecodeGraphs(forward, model, torch.device("cpu"), 8, PAD_ROW, 64)
    g.capture()
    assert [p[:2] for p in model[0].prepared] == [(8, 64)]
    assert [c[0] for c in calls] == [8, 8, 4, 4, 2, 2, 1, 1]  # warm-up, then capture, per size
    assert all(set(rows) == {PAD_ROW} for _, rows in calls)
    assert captured == [pool] * 4  # one shared pool
    assert sorted(g.graphs) == [1, 2, 4, 8] and g.outputs[4].shape == (4, 4)
    assert g.status().startswith("CUDA graphs on: 4 decode batch sizes (1-8)")


# ---- kernels' static scratch (Triton interpreter on a CPU) -----------------------------------
def _interpreted(fn) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    from tests.kernels.interpreter_shims import install_interpreter_shims

    if not isinstance(fn, InterpretedFunction):
        return False
    install_interpreter_shims()
    return True


def test_mla_scratch_views_match_the_kernel_default_and_padding_reads_nothing():
    import moeserve.kernels.attention.mla_decode as md
    from tests.kernels.mla_cases import make_case

    heads, ctx = 16, 1024
    scratch = MLADecodeScratch.allocate(4, heads, ctx, torch.bfloat16, "cpu", sm_count=132)
    for b in range(1, 5):
        kernel, ws, splits = scratch.workspace(b, ctx)
        assert kernel is md.mla_decode  # no Gluon on a CPU
        assert splits == md.default_num_splits(b, heads, ctx, sm_count=132)
        assert ws.partial_out.shape == (b, heads, splits, 512)
        assert ws.partial_lse.shape == (b, heads, splits)
    assert scratch.workspace(64, ctx) is None  # too big: the kernel allocates its own
    if not _interpreted(md._mla_decode_split_kernel):
        pytest.skip("the MLA kernel is compiled for a GPU here (tests/gpu cover it)")
    # a padding row (seq_len 0) between real ones, its page full of NaN: nothing is read
    q, cache, bt, seq, _ = make_case([37, 0, 5], heads, 16, torch.bfloat16, seed=3)
    _, ws, splits = scratch.workspace(3, ctx)
    assert splits > 1  # the partials and the merge are exercised
    out = torch.full((3, heads, 512), float("nan"), dtype=torch.bfloat16)
    small = md.MLADecodeConfig(
        block_h=16, block_n=16, num_warps=4, num_stages=1, min_split_tokens=16
    )
    md.mla_decode(q, cache, bt, seq, 0.13, out, num_splits=splits, workspace=ws, config=small)
    ref = torch.empty(3, heads, 512)
    md.mla_decode_ref(q, cache, bt, seq, 0.13, ref)
    assert not out[1].float().any()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_mla_scratch_sizes_for_the_gluon_kernel_where_it_is_preferred():
    # With the Gluon kernel available (decided once per cache), launches where it measured
    # faster take it with its own split count, and the scratch holds those partials too.
    import moeserve.kernels.attention.mla_decode as md
    import moeserve.kernels.attention.mla_decode_gluon as mg

    heads, ctx = 16, 32768
    scratch = MLADecodeScratch.allocate(
        8, heads, ctx, torch.bfloat16, "cpu", sm_count=132, gluon="prefer"
    )
    for b in (1, 8):
        kernel, ws, splits = scratch.workspace(b, ctx)
        assert kernel is mg.mla_decode_gluon
        assert splits == mg.gluon_default_num_splits(b, heads, ctx, 132)
        assert ws.partial_out.shape == (b, heads, splits, 512)
    # short capacity at batch 1 with few heads: the Triton kernel was faster
    short = MLADecodeScratch.allocate(1, heads, 1024, torch.bfloat16, "cpu", 132, "prefer")
    assert short.workspace(1, 1024)[0] is md.mla_decode
    # --mla-decode-kernel gluon: every launch
    always = MLADecodeScratch.allocate(1, heads, 1024, torch.bfloat16, "cpu", 132, "always")
    assert always.workspace(1, 1024)[0] is mg.mla_decode_gluon


@pytest.mark.parametrize(("m", "kernel"), [(3, "gemv"), (3, "mma"), (17, "mma")])
def test_shared_splitk_workspace_fits_the_kernels(m, kernel):
    import moeserve.kernels.gemm.nvfp4_format as fmt
    import moeserve.kernels.gemm.nvfp4_gemm as nv

    shared: dict = {}
    small = shared_splitk_workspace(shared, 4, 48, "cpu")
    assert shared_splitk_workspace(shared, 4, 32, "cpu") is small  # fits: shared
    big = shared_splitk_workspace(shared, 20, 48, "cpu")
    assert big is not small and splitk_fits(big, 20, 48) and splitk_fits(big, 4, 48)
    if not _interpreted(nv._nvfp4_gemm_kernel):
        pytest.skip("the NVFP4 kernels are compiled for a GPU here (tests/gpu cover them)")
    gen = torch.Generator().manual_seed(m)
    packed, scale, gs = fmt.quantize_nvfp4(torch.randn(48, 256, generator=gen))
    x = torch.randn(m, 256, generator=gen).to(torch.bfloat16)
    if kernel == "gemv":
        cfg = dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=1)
    else:
        cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=4, num_warps=4, num_stages=2)
    ws = shared_splitk_workspace({}, m, 48, "cpu")  # the bound the linears use: must fit
    for _ in range(2):  # the workspace is left zeroed, so it serves the next call too
        y = nv.nvfp4_gemm(x, packed, scale, gs, workspace=ws, config=cfg, kernel=kernel)
        assert not ws.partial.any() and not ws.locks.any()
        ref = nv.nvfp4_gemm_ref(x, packed, scale, gs)
        torch.testing.assert_close(y.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_mla_kernel_check_accepts_the_reference_and_rejects_wrong_or_failing_kernels():
    # the start-up probe's comparison (the Gluon kernel itself needs an sm_90 GPU: tests/gpu)
    import moeserve.kernels.attention.mla_decode as md
    import moeserve.kernels.attention.mla_decode_gluon as mg

    cpu = torch.device("cpu")

    def shifted(q, cache, bt, lens, scale, out, **kw):
        md.mla_decode_ref(q, cache, bt, lens, scale, out)
        out.add_(0.5)

    def failing(*args, **kw):
        raise RuntimeError("no such kernel here")

    assert mg.check_decode_kernel(md.mla_decode_ref, 16, cpu)
    assert not mg.check_decode_kernel(shifted, 16, cpu)
    assert not mg.check_decode_kernel(failing, 16, cpu)
    assert not mg.probe_gluon_mla(cpu, 16)  # no GPU: the Triton kernel serves
