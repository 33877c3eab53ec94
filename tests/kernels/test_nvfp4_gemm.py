"""NVFP4 helpers and the W4A16 Triton GEMM (CPU interpreter) against independent oracles."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import re  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from moeserve.kernels.gemm import nvfp4_format as fmt  # noqa: E402
from moeserve.kernels.gemm import nvfp4_gemm as nv  # noqa: E402
from moeserve.kernels.gemm import splitk  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# Hand-written E2M1 table (OCP MX spec): code -> value, sign in bit 3.
E2M1 = {
    0: 0.0,
    1: 0.5,
    2: 1.0,
    3: 1.5,
    4: 2.0,
    5: 3.0,
    6: 4.0,
    7: 6.0,
    8: -0.0,
    9: -0.5,
    10: -1.0,
    11: -1.5,
    12: -2.0,
    13: -3.0,
    14: -4.0,
    15: -6.0,
}
GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_oracle(v: float) -> int:
    """Nearest grid point by brute force, ties to the even index, saturating at 6."""
    a = min(abs(v), 6.0)
    d = [abs(a - g) for g in GRID]
    best = min(d)
    idx = [i for i, di in enumerate(d) if di == best]
    i = idx[0] if len(idx) == 1 else next(j for j in idx if j % 2 == 0)
    return i | (8 if v < 0 and i else 0)


def test_table_and_unpack_order():
    assert fmt.e2m1_table().tolist() == [E2M1[c] for c in range(16)]
    # byte 0x9A: low nibble 0xA (-1.0) is element 0, high nibble 0x9 (-0.5) element 1
    packed = torch.tensor([[0x9A, 0x07]], dtype=torch.uint8).repeat(1, 4)
    scale = torch.full((1, 1), 2.0).to(torch.float8_e4m3fn)
    w = fmt.dequantize_nvfp4(packed, scale, 0.5, torch.float32)
    assert w[0, :4].tolist() == [-1.0, -0.5, 6.0, 0.0]


def test_quantizer_rounding_matches_oracle():
    torch.manual_seed(0)
    w = torch.randn(8, 64)
    w[0, :16] = torch.tensor(
        [
            0.25,
            0.75,
            1.25,
            1.75,
            2.5,
            3.5,
            5.0,
            6.0,
            -0.25,
            -0.75,
            -1.25,
            -1.75,
            -2.5,
            -3.5,
            -5.0,
            0.1,
        ]
    )
    packed, scale, gs = fmt.quantize_nvfp4(w)
    assert gs.item() == pytest.approx(w.abs().max().item() / (6 * 448))
    codes = fmt.unpack_e2m1_codes(packed)
    bmax = w.abs().unflatten(1, (-1, 16)).amax(-1)
    want_scale = (bmax / (6 * gs)).to(torch.float8_e4m3fn).float()
    assert torch.equal(scale.float(), want_scale)
    for n in range(w.shape[0]):
        for k in range(w.shape[1]):
            q = (w[n, k] / (scale[n, k // 16].float() * gs)).item()  # fp32, as the spec computes
            assert codes[n, k].item() == e2m1_oracle(q), (n, k, q)


def test_quantizer_tie_rounding_exact():
    # Row whose block amax is 6 so that block scale*global = 1: the ties are exact.
    ties = torch.tensor(
        [
            0.25,
            0.75,
            1.25,
            1.75,
            2.5,
            3.5,
            5.0,
            6.0,
            -0.25,
            -0.75,
            -1.25,
            -1.75,
            -2.5,
            -3.5,
            -5.0,
            -6.0,
        ]
    )
    packed, scale, gs = fmt.quantize_nvfp4(ties[None, :])
    assert scale.float().item() * gs.item() == pytest.approx(1.0, rel=1e-6)
    deq = fmt.dequantize_nvfp4(packed, scale, gs, torch.float32)[0]
    want = torch.tensor(
        [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0, -6.0]
    )
    torch.testing.assert_close(deq, want, rtol=1e-6, atol=1e-6)


def test_round_trip_exact_on_grid():
    torch.manual_seed(1)
    codes = torch.randint(0, 16, (6, 32), dtype=torch.uint8)
    codes[:, 0] = 7  # every block holds a 6 so the block amax pins the scale
    codes[:, 16] = 15
    block = torch.tensor([1.0, 0.5, 2.0, 0.25, 4.0, 1.0])[:, None].repeat(1, 2)
    w = fmt.e2m1_table()[codes.long()] * block.repeat_interleave(16, 1)
    packed, scale, gs = fmt.quantize_nvfp4(w)
    torch.testing.assert_close(
        fmt.dequantize_nvfp4(packed, scale, gs, torch.float32), w, rtol=1e-6, atol=0
    )


def test_zero_tensor_and_zero_block():
    w = torch.zeros(2, 32)
    w[1, 20] = 3.0
    packed, scale, gs = fmt.quantize_nvfp4(w)
    assert torch.isfinite(gs) and gs.item() > 0
    assert scale.float()[0].tolist() == [1.0, 1.0]
    torch.testing.assert_close(fmt.dequantize_nvfp4(packed, scale, gs, torch.float32), w)


def _case(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    return x, *fmt.quantize_nvfp4(w)


def _assert_matches_ref(y, x, packed, scale, gs):
    ref = nv.nvfp4_gemm_ref(x, packed, scale, gs).float()
    torch.testing.assert_close(y.float(), ref, rtol=1.6e-2, atol=1e-2 * ref.abs().max().item())


SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=2)


@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (1, 40, 96, None),  # tiles.json config, N and K not tile multiples, split-K auto
        (
            3,
            70,
            160,
            dict(SMALL, BLOCK_N=32, BLOCK_K=64, SPLIT_K=2),
        ),  # split-K with a ragged last split
        (20, 33, 48, SMALL),  # M spans two tiles, N ragged
        (5, 24, 528, dict(SMALL, SPLIT_K=5)),  # K = 33 groups of 16
    ],
)
@pytest.mark.parametrize("decode", [nv.DECODE_ARITH, nv.DECODE_BITS])
def test_triton_gemm_matches_reference(m, n, k, cfg, decode):
    # DECODE_BITS runs the packed-word bit moves of the GPU decode (minus the PTX) and the
    # code-order permutation; DECODE_ARITH decodes each element independently.
    x, packed, scale, gs = _case(m, n, k)
    y = nv.nvfp4_gemm(x, packed, scale, gs, config=cfg, decode=decode, kernel="mma")
    _assert_matches_ref(y, x, packed, scale, gs)


GEMV = dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=0, num_warps=4, num_stages=1)


@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (1, 40, 96, None),  # tiles.json config; K shorter than one tile
        (2, 64, 512, GEMV),  # 2 rows per program, split-K auto
        (3, 70, 160, dict(GEMV, BLOCK_N=16, BLOCK_K=64, SPLIT_K=2)),  # ragged N, K, last split
        (4, 33, 528, dict(GEMV, BLOCK_N=16, BLOCK_K=64, SPLIT_K=3)),  # 33 groups of 16
        (7, 24, 256, dict(GEMV, SPLIT_K=1)),  # 4 rows per program, second block half empty
        (1, 48, 800, dict(GEMV, BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, STAGES=3)),  # pipelined loop
        (4, 33, 528, dict(GEMV, BLOCK_N=16, BLOCK_K=64, SPLIT_K=1, STAGES=2)),
        # tiles divide N and K (EVEN: unmasked loads, the scales requested a tile ahead)
        (1, 64, 512, dict(GEMV, BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, STAGES=3)),
        (1, 64, 512, dict(GEMV, BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, STAGES=3, F16=1)),
        (2, 64, 512, dict(GEMV, BLOCK_N=16, BLOCK_K=64, SPLIT_K=2)),  # EVEN, register prefetch
        (1, 64, 512, dict(GEMV, BLOCK_N=16, BLOCK_K=64, SPLIT_K=1, PREFETCH=2, F16=1)),
    ],
)
@pytest.mark.parametrize("decode", [nv.DECODE_ARITH, nv.DECODE_BITS])
def test_gemv_matches_reference(m, n, k, cfg, decode):
    # The CUDA-core path: natural-order decode, 16-element group sums, 1/2/4 rows per program.
    x, packed, scale, gs = _case(m, n, k, seed=m)
    y = nv.nvfp4_gemm(x, packed, scale, gs, config=cfg, decode=decode, kernel="gemv")
    _assert_matches_ref(y, x, packed, scale, gs)


def test_gemv_is_the_default_for_one_row(monkeypatch):
    from moeserve.kernels.gemm import nvfp4_gemv

    calls = []
    monkeypatch.setattr(nvfp4_gemv, "nvfp4_gemv", lambda *a: calls.append(a) or a[4])
    x, packed, scale, gs = _case(1, 16, 32)
    nv.nvfp4_gemm(x, packed, scale, gs)
    assert len(calls) == 1
    nv.nvfp4_gemm(torch.cat([x] * 16), packed, scale, gs)  # 16 rows: tensor-core path
    assert len(calls) == 1


def test_splitk_workspace_left_zero_and_reusable():
    x, packed, scale, gs = _case(2, 48, 256, seed=3)
    ws = splitk.SplitKWorkspace.create(2 * 48, 64, "cpu")
    cfg = dict(SMALL, SPLIT_K=4)
    out = torch.empty(2, 48, dtype=torch.bfloat16)
    y1 = nv.nvfp4_gemm(x, packed, scale, gs, out=out, workspace=ws, config=cfg).clone()
    assert not ws.partial.any() and not ws.locks.any()
    y2 = nv.nvfp4_gemm(x, packed, scale, gs, out=out, workspace=ws, config=cfg)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    _assert_matches_ref(y2, x, packed, scale, gs)


def test_bad_shapes_rejected():
    x, packed, scale, gs = _case(1, 16, 32)
    with pytest.raises(ValueError):
        nv.nvfp4_gemm(x[:, :16], packed, scale, gs)
    with pytest.raises(ValueError):
        nv.nvfp4_gemm(x, packed, scale[:, :1].contiguous(), gs)


@pytest.mark.parametrize("decode", [nv.DECODE_ARITH, nv.DECODE_BITS])
def test_probe_case_is_exact(decode):
    # The GPU start-up probe demands bit-exact equality on this case; it must hold for the
    # decodes that run here, and the case must exercise every code and word position.
    x, packed, scale, gs = nv._probe_case(torch.device("cpu"))
    cfg = dict(SMALL, BLOCK_N=64, BLOCK_K=128)
    ref = nv.nvfp4_gemm_ref(x, packed, scale, gs)
    y = nv.nvfp4_gemm(x, packed, scale, gs, config=cfg, decode=decode, kernel="mma")
    assert torch.equal(y, ref)
    assert torch.equal(nv.nvfp4_gemm(x, packed, scale, gs, decode=decode, kernel="gemv"), ref)
    cols = x.float().argmax(1)
    assert set((cols % 8).tolist()) == set(range(8))
    assert set(fmt.unpack_e2m1_codes(packed)[:, cols].flatten().tolist()) == set(range(16))
    assert nv.default_decode(torch.device("cpu")) == nv.DECODE_ARITH


@pytest.mark.parametrize("m,n,k", [(3, 40, 96), (50, 70, 528)])
def test_dequant_matmul_matches_reference(m, n, k, monkeypatch):
    # The prefill path: bf16 weight chunks (forced small, so several chunks run) + a matmul.
    from moeserve.kernels.gemm import nvfp4_gemv

    monkeypatch.setattr(nvfp4_gemv, "DEQUANT_CHUNK_ELEMS", 32 * k)
    x, packed, scale, gs = _case(m, n, k, seed=7)
    cfg = dict(BLOCK_N=16, BLOCK_K=64, num_warps=4)
    y = nv.nvfp4_gemm(x, packed, scale, gs, config=cfg, decode=nv.DECODE_BITS, kernel="dequant")
    _assert_matches_ref(y, x, packed, scale, gs)


def test_default_kernel_by_rows(monkeypatch):
    # tiles.json's row ranges decide the path; the MMA GEMV only where the probe passed and
    # the shape has whole 256-wide K steps and row tiles.
    x, packed, scale, gs = _case(1, 128, 512)
    choice = nv._default_kernel
    assert choice(1, "128x512", packed, torch.device("cpu")) == "gemv"
    assert choice(4, "128x512", packed, torch.device("cpu")) == "gemv"  # no probe on a CPU
    assert choice(20, "128x512", packed, torch.device("cpu")) == "mma"
    assert choice(64, "128x512", packed, torch.device("cpu")) == "dequant"
    monkeypatch.setattr(nv, "gemv_mma_enabled", lambda device: True)
    assert choice(1, "128x512", packed, torch.device("cpu")) == "gemv"
    assert choice(4, "128x512", packed, torch.device("cpu")) == "gemv_mma"
    assert choice(16, "128x512", packed, torch.device("cpu")) == "gemv_mma"
    assert choice(20, "128x512", packed, torch.device("cpu")) == "mma"
    _, odd, _, _ = _case(1, 96, 512)  # 96 rows: not a multiple of the MMA GEMV's 64-row tile
    assert choice(4, "96x512", odd, torch.device("cpu")) == "gemv"


_PDL_PTX = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moeserve.kernels.gemm import nvfp4_gemv as g

def ptx(pdl):
    sig = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", gs_ptr="*fp32", out_ptr="*bf16",
               ws_ptr="*fp32", lock_ptr="*i32", M="i32", N="i32", K="i32", stride_xm="i32",
               stride_om="i32")
    const = dict(MP=1, BLOCK_N=16, BLOCK_K=256, SPLIT_K=1, K_ITERS=28, DECODE=1, PREFETCH=2,
                 PDL=pdl, STAGES=0)
    sig.update({k: "constexpr" for k in const})
    names = list(sig)
    src = ASTSource(fn=g._nvfp4_gemv_kernel, signature=sig,
                    constexprs={(names.index(k),): v for k, v in const.items()})
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return out.asm["ptx"]

print(json.dumps({"pdl": ptx(1), "plain": ptx(0)}))
"""


def test_pdl_gemv_reads_only_weights_before_its_wait():
    """Compiled for sm_90 on the CPU: with PDL the kernel lets its dependents launch, issues
    its first weight tiles, then waits; x, the output and the workspace come after the wait.
    Without PDL no grid dependency control is emitted."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _PDL_PTX], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "griddepcontrol" not in ptx["plain"]
    code = ptx["pdl"]
    launch, wait = code.index("griddepcontrol.launch_dependents"), code.index("griddepcontrol.wait")
    assert launch < wait and code.count("griddepcontrol.wait") == 1
    before, after = code[:wait], code[wait:]
    assert before.count("ld.global") >= 2  # weight words and scales of the first tiles
    assert "st.global" not in before and "atom." not in before  # nothing written before it
    assert "ld.global" in after  # x is read after the wait


_EVEN_SASS = r"""
import json, sys
sys.path.insert(0, "benchmarks")
import sass_loop

def loop(even):
    return sass_loop.loop_lines(sass_loop.compile_gate_up(16, 256, 2, 3, even=even).asm["sass"])

print(json.dumps({"even": loop(True), "masked": loop(False)}))
"""


def test_even_tiles_load_without_masks():
    """Compiled for sm_90 on the CPU (benchmarks/sass_loop.py): the one-token MoE GEMV's K
    loop predicates its weight and scale loads when the tiles may overrun the weight, and with
    EVEN (tiles divide it) issues them unpredicated, in fewer instructions."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _EVEN_SASS],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loops = json.loads(proc.stdout.strip().splitlines()[-1])

    def predicated_loads(lines):
        return [x for x in lines if re.search(r"@!?P\d+\s+(LDG|LDGSTS)", x)]

    assert loops["masked"] and loops["even"]
    assert predicated_loads(loops["masked"])
    assert not predicated_loads(loops["even"])
    assert len(loops["even"]) < len(loops["masked"])
