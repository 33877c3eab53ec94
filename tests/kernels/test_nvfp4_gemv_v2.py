"""NVFP4 GEMV v2 on the CPU: the load-time repack and the torch reference against the format's
own dequantizer, and a bit-level model of the kernel's inline-PTX decode against the E2M1
table. The kernel itself (Gluon + inline PTX) cannot run under the interpreter; the GPU tests
are tests/gpu/test_gpu_nvfp4_gemv_v2.py."""

from __future__ import annotations

import struct

import pytest
import torch

from moeserve.kernels import nvfp4_format as fmt
from moeserve.kernels import nvfp4_gemv_v2 as v2

F16_PAIR_BITS = 16
DECODE_SCALE = 2.0**14  # the decode yields E2M1 value * 2^-14


def _f16(bits: int) -> float:
    return struct.unpack("<e", struct.pack("<H", bits))[0]


@pytest.mark.parametrize("n,k", [(1, 16), (64, 512), (100, 1040), (37, 2064), (128, 7168)])
def test_repack_dequantizes_to_the_original(n, k):
    torch.manual_seed(n + k)
    packed, scale, gs = fmt.quantize_nvfp4(torch.randn(n, k) * 0.1)
    words, scales, g = v2.repack_for_gemv_v2(packed, scale, gs)
    assert words.dtype == torch.int32 and scales.dtype == torch.uint8
    assert words.shape[0] % v2.ROW_PAD == 0 and (words.shape[1] * 8) % v2.K_PAD == 0
    ref = fmt.dequantize_nvfp4(packed, scale, gs, dtype=torch.float32)
    got = v2.dequantize_gemv_v2(words, scales, g, n, k)
    assert torch.equal(got, ref)


def test_every_code_in_every_position():
    """All 16 codes at all 32 positions of a vector survive repack + unpack."""
    n, k = 16, 512
    codes = (torch.arange(n * k) % 16).view(n, k).to(torch.uint8)
    codes = codes[:, torch.randperm(k)]
    packed = fmt.pack_e2m1_codes(codes)
    scale = torch.ones(n, k // 16).to(torch.float8_e4m3fn)
    words, _, _ = v2.repack_for_gemv_v2(packed, scale, 1.0)
    assert torch.equal(v2.unpack_gemv_v2_codes(words)[:n, :k], codes)


def test_reference_matches_fp32_matmul():
    torch.manual_seed(1)
    n, k = 50, 1040
    packed, scale, gs = fmt.quantize_nvfp4(torch.randn(n, k) * 0.05)
    x = torch.randn(3, k)
    want = x @ fmt.dequantize_nvfp4(packed, scale, gs, dtype=torch.float32).t()
    got = v2.nvfp4_gemv_v2_ref(x, *v2.repack_for_gemv_v2(packed, scale, gs), n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_model_yields_the_e2m1_values():
    """Word bits placed by the repack, decoded by the PTX's instruction sequence (modelled in
    Python), give each code's E2M1 value * 2^-14 in the right half of the right pair, for
    random words: the pairs hold nothing but those codes."""
    table = fmt.e2m1_table().tolist()
    gen = torch.Generator().manual_seed(0)
    for q in torch.randint(0, 1 << 32, (200,), generator=gen, dtype=torch.int64).tolist():
        pairs = v2.decode_word_model(q)
        for j, pair in enumerate(pairs):
            for h in range(2):
                code = 0
                for x, (pj, ph, b) in enumerate(v2._WORD_BIT_MAP):
                    if (pj, ph) == (j, h):
                        code |= ((q >> x) & 1) << b
                half = (pair >> (F16_PAIR_BITS * h)) & 0xFFFF
                assert _f16(half) * DECODE_SCALE == table[code]


def test_decode_asm_is_nine_instructions_per_word():
    """The decode part of the generated PTX: 9 integer instructions per 8-code word."""
    asm = v2._vector_dot_asm(1)
    ops = [ln.split()[0] for ln in asm.splitlines() if ln and not ln.startswith((".", "{", "}"))]
    decode = [op for op in ops if op.startswith(("shf", "lop3", "and"))]
    assert len(decode) == 9 * v2.VECTOR_WORDS
    assert sum(op.startswith(("fma.rn.f16x2", "mul.rn.f16x2")) for op in ops) == 16 + 1


@pytest.mark.parametrize(
    "m,n,k",
    [(1, 4096, 7168), (2, 7168, 2048), (4, 12288, 1536), (8, 7168, 8192), (1, 7168, 8192)]
    + [(1, 7168, 2048), (1, 12288, 1536), (1, 4096, 1040), (1, 4096, 3072), (1, 4096, 4096)],
)
def test_default_configs_are_valid(m, n, k):
    cfg = v2.default_config(m, n, k, torch.device("cpu"))
    ranges, split, groups, rows = v2.launch_geometry(m, 4096, -(-k // v2.K_PAD) * v2.K_PAD, cfg)
    assert ranges * rows >= 4096 and rows % (2 * cfg["RB"]) == 0
    assert groups * v2.rows_per_pass(m) >= m and split >= 1
