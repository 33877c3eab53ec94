"""The 11-instruction E2M1 word decode (e2m1_ptx.py): the emitted PTX, executed instruction by
instruction on Python integers, against the OCP E2M1 values typed in below, for every code at
every position of a word; and every NVFP4 kernel's inline asm carries that exact text."""

import random

import pytest
import torch

from moeserve.kernels.gemm import e2m1_ptx, nvfp4_gemm, nvfp4_gemv, nvfp4_gemv_mma

# OCP MX spec, code -> value with the sign in bit 3, written out instead of derived.
E2M1_BY_CODE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1_BY_CODE += [-v for v in E2M1_BY_CODE]
HALF_DTYPE = {"f16": torch.float16, "bf16": torch.bfloat16}
OUTS = ("o0", "o1", "o2", "o3")
TMP = ("et", "ea", "eb")


def _words() -> list[int]:
    rng = random.Random(0)
    words = [rng.getrandbits(32) for _ in range(500)] + [0, 0xFFFFFFFF, 0x88888888]
    for pos in range(8):  # every code at every position, the other codes random
        for code in range(16):
            words.append((rng.getrandbits(32) & ~(0xF << (4 * pos))) | (code << (4 * pos)))
    return words


def _halves(regs: dict[str, int], dtype: torch.dtype) -> torch.Tensor:
    """[4 pairs, 2 halves] of the decoded registers, read as 16-bit floats."""
    bits = [(regs[o] >> (16 * h)) & 0xFFFF for o in OUTS for h in (0, 1)]
    signed = torch.tensor([b - 0x10000 if b >= 0x8000 else b for b in bits], dtype=torch.int16)
    return signed.view(dtype).float().view(4, 2)


@pytest.mark.parametrize("target", sorted(e2m1_ptx.TARGETS))
def test_decode_pairs_give_e2m1_values(target):
    ptx = e2m1_ptx.decode_pairs_ptx("q", OUTS, target, TMP)
    assert len(ptx.strip().splitlines()) == 11
    power = 2.0 ** -e2m1_ptx.TARGETS[target].value_exp
    for word in _words():
        got = _halves(e2m1_ptx.run_ptx(ptx, {"q": word}), HALF_DTYPE[target]) * power
        want = torch.tensor(
            [[E2M1_BY_CODE[(word >> (4 * c)) & 0xF] for c in (j, j + 4)] for j in range(4)]
        )
        assert torch.equal(got, want), f"{target} word {word:#010x}"


def test_a_wrong_rotation_is_caught():
    """The oracle can fail: pair 3 rotated one bit short misplaces code 7."""
    ptx = e2m1_ptx.decode_pairs_ptx("q", OUTS, "f16", TMP)
    broken = ptx.replace("eb, eb, 29;", "eb, eb, 28;")
    assert broken != ptx
    word = 0xF0000000  # code 7 = -6, the others 0
    got = _halves(e2m1_ptx.run_ptx(broken, {"q": word}), torch.float16) * 2.0**14
    assert got[3, 1].item() != E2M1_BY_CODE[(word >> 28) & 0xF]


@pytest.mark.parametrize(
    ("asm", "target", "q"),
    [
        (nvfp4_gemv._E2M1_F32_ASM, "f16", "$8"),
        (nvfp4_gemv._E2M1_F16X2_DOT_ASM, "f16", "$1"),
        (nvfp4_gemv._E2M1_F16X2_DOT_ASM, "f16", "$2"),
        (nvfp4_gemm._E2M1_ASM, "bf16", "$8"),
        (nvfp4_gemv_mma._MMA_ASM, "bf16", "$8"),
        (nvfp4_gemv_mma._MMA_ASM, "bf16", "$9"),
    ],
)
def test_kernels_carry_the_checked_decode(asm, target, q):
    text = asm.value if hasattr(asm, "value") else asm
    outs = ("w0", "w1", "w2", "w3") if asm is nvfp4_gemv_mma._MMA_ASM else ("r0", "r1", "r2", "r3")
    assert e2m1_ptx.decode_pairs_ptx(q, outs, target, TMP) in text
