"""PTX that decodes one 32-bit word of 8 E2M1 codes (ModelOpt order: code j in bits 4j..4j+3,
sign in the top bit) into 4 registers of two 16-bit floats each, pair j = codes (j, j + 4).

A decoded half holds the code's sign at bit 15 and its three magnitude bits (e1 e0 m) as the
lowest exponent bits and the top mantissa bit, so it reads as the E2M1 value times a power of
two (2^-14 as f16, 2^-126 as bf16; e = 0 lands on a subnormal, exactly). The callers fold that
power into a scale.

The sign has to move 3 bits further than the magnitude (f16: it sits 6 above the magnitude's
lowest bit, in the code 3; bf16: 9 against 3), so one rotated copy t of the word supplies
the signs and a select merges them with the magnitudes of the word itself: with t = rotl(q,
d), the select (q & S) | (t & ~S) holds every code whose magnitude bits S keeps next to its
sign d bits higher. The moved sign of code j would land on the magnitude of code j + 1 (f16)
or j + 2 (bf16), so two selects are needed, each holding 4 codes (f16: the even and the odd
ones; bf16: 0, 1, 4, 5 and 2, 3, 6, 7). Each pair is then one shift of its select and one
AND: 1 + 2 + 4 * 2 = 11 instructions per word (the sequences before took 12 for f16 and 16
for bf16). A shift that must deliver wrapped bits (code 7's sign at bit 31, in bf16 code 6's
too) is a rotation; the others are plain left shifts (see _rotate).

`decode_pairs_ptx` writes the lines; `run_ptx` executes those lines on Python integers so a
CPU test can check the very text the kernels compile against the E2M1 table.
"""

from __future__ import annotations

from dataclasses import dataclass

WORD_MASK = 0xFFFFFFFF
SELECT_LUT = 0xE4  # lop3 truth table of (a & c) | (b & ~c)


@dataclass(frozen=True)
class PairTarget:
    """How codes become one 16-bit float format: the sign rotation of t, the two selects,
    (select, rotation) per pair j = 0..3, the mask of a pair's 8 bits, and the power of two
    the decoded value is the E2M1 value times."""

    sign_rot: int
    selects: tuple[int, int]
    pairs: tuple[tuple[int, int], ...]
    mask: int
    value_exp: int


TARGETS: dict[str, PairTarget] = {
    "f16": PairTarget(
        3, (0x07070707, 0x70707070), ((0, 9), (1, 5), (0, 1), (1, 29)), 0x8E008E00, -14
    ),
    "bf16": PairTarget(
        6, (0x00770077, 0x77007700), ((0, 6), (0, 2), (1, 30), (1, 26)), 0x81C081C0, -126
    ),
}  # fmt: skip


def _bits(v: int) -> list[int]:
    return [b for b in range(32) if v >> b & 1]


def _rotate(dst: str, src: str, k: int, wraps: bool) -> str:
    """dst = src rotated left by k; a plain shift where no wrapped bit is read afterwards,
    because ptxas can issue a constant left shift on the multiply-add pipe (IMAD.SHL) while
    a funnel shift and every logic op share the integer ALU pipe (half rate), which bounds
    these sequences (measured: the all-ALU form ran 2-7% slower than the older 12-op one)."""
    if wraps:
        return f"shf.l.wrap.b32 {dst}, {src}, {src}, {k};"
    return f"shl.b32 {dst}, {src}, {k};"


def decode_pairs_ptx(
    q: str, outs: tuple[str, str, str, str], target: str, tmp: tuple[str, str, str]
) -> str:
    """PTX lines: outs[j] = pair j (codes j, j + 4) of word register q as `target` ("f16" or
    "bf16") 16-bit pairs. tmp: three .b32 scratch registers (t and the two selects) the caller
    declared; q must not be one of them or of outs."""
    spec = TARGETS[target]
    t, *sel = tmp
    # which select bits the pairs read, and whether a rotation must wrap to deliver them
    read: list[set[int]] = [set(), set()]
    pair_wraps = []
    for src, rot in spec.pairs:
        read[src] |= {(p - rot) % 32 for p in _bits(spec.mask)}
        pair_wraps.append(any(p < rot for p in _bits(spec.mask)))
    t_wraps = any(
        b < spec.sign_rot for i, s in enumerate(spec.selects) for b in read[i] if not s >> b & 1
    )
    lines = [_rotate(t, q, spec.sign_rot, t_wraps)]
    for r, s in zip(sel, spec.selects, strict=True):
        lines.append(f"lop3.b32 {r}, {q}, {t}, {s:#010x}, {SELECT_LUT:#04x};")
    for out, (src, rot), wraps in zip(outs, spec.pairs, pair_wraps, strict=True):
        lines.append(_rotate(out, sel[src], rot, wraps))
        lines.append(f"and.b32 {out}, {out}, {spec.mask:#010x};")
    return "\n".join(lines) + "\n"


def _rotl(v: int, k: int) -> int:
    k %= 32
    return ((v << k) | (v >> (32 - k))) & WORD_MASK if k else v


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        idx = ((a >> bit) & 1) << 2 | ((b >> bit) & 1) << 1 | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def _operand(regs: dict[str, int], tok: str) -> int:
    tok = tok.strip()
    if tok in regs:
        return regs[tok]
    return int(tok, 0) & WORD_MASK


def run_ptx(lines: str, regs: dict[str, int]) -> dict[str, int]:
    """Execute the instructions decode_pairs_ptx emits (shl.b32, shf.l.wrap.b32, lop3.b32, and.b32)
    on 32-bit Python integers; regs maps register names to values and is updated."""
    for line in lines.strip().splitlines():
        op, rest = line.strip().rstrip(";").split(None, 1)
        dst, *args = [a.strip() for a in rest.split(",")]
        v = [_operand(regs, a) for a in args]
        if op == "shl.b32":
            regs[dst] = (v[0] << v[1]) & WORD_MASK
        elif op == "shf.l.wrap.b32":
            if v[0] != v[1]:
                raise ValueError("only rotations (both sources equal) are modelled")
            regs[dst] = _rotl(v[0], v[2])
        elif op == "lop3.b32":
            regs[dst] = _lop3(v[0], v[1], v[2], v[3])
        elif op == "and.b32":
            regs[dst] = v[0] & v[1]
        else:
            raise ValueError(f"unmodelled instruction {op}")
    return regs
