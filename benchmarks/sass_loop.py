"""Instructions in the main loop of the one-token NVFP4 MoE GEMV, compiled offline for sm_90a.

No GPU needed: Triton compiles `_moe_gate_up_gemv_kernel` (the F16 CUDA-core path, one token,
Kimi-K2.5 shapes) for compute capability 9.0 on the CPU, its bundled nvdisasm gives the SASS,
and this script counts the instructions between the K loop's label and its backward branch,
per opcode, per weight element (words per thread per tile x 8), with ptxas's register count.
Its counts chose what was cut from the loop (results/nvfp4_gemv_loop.md).

  python benchmarks/sass_loop.py [BLOCK_N,BLOCK_K,WARPS,STAGES ...] [--dump FILE]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moeserve.kernels.moe import nvfp4 as moe

HIDDEN = 7168  # Kimi-K2.5: the gate_up launch's K


def compile_gate_up(block_n: int, block_k: int, warps: int, stages: int, even: bool = True):
    """The shipped one-token gate_up GEMV (DIRECT blocks, F16, EVEN) for sm_90a."""
    sig = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", gs_ptr="*fp32", inter_ptr="*bf16",
               sorted_ptr="*i32", expert_ids_ptr="*i32", num_experts="i32", Mk="i32",
               INTER="i32", H="i32", stride_xm="i32", ws_ptr="*fp32", cnt_ptr="*i32")  # fmt: skip
    const = dict(TOPK=8, MP=1, BLOCK_N=block_n, BLOCK_K=block_k, K_ITERS=HIDDEN // block_k,
                 DECODE=1, PREFETCH=1, STAGES=stages, F16=1, DIRECT=1, EVEN=int(even), SPLIT_K=1,
                 PDL=0)  # fmt: skip
    sig.update(dict.fromkeys(const, "constexpr"))
    names = list(sig)
    aligned = ("x_ptr", "w_ptr", "s_ptr", "inter_ptr", "H", "INTER", "stride_xm")
    src = ASTSource(
        fn=moe._moe_gate_up_gemv_kernel,
        signature=sig,
        constexprs={(names.index(k),): v for k, v in const.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in aligned},
    )
    opts = {"num_warps": warps, "num_stages": 1}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def loop_lines(sass: str) -> list[str]:
    """The SASS lines of the longest loop: from after a label to the branch back to it."""
    lines = sass.splitlines()
    label_at = {m.group(1): i for i, x in enumerate(lines) if (m := re.match(r"^(\w+):", x))}
    best: list[str] = []
    for i, x in enumerate(lines):
        m = re.search(r"BRA (\w+)", x)
        if m and label_at.get(m.group(1), i) < i and i - label_at[m.group(1)] > len(best):
            best = lines[label_at[m.group(1)] + 1 : i + 1]
    return best


def loop_ops(sass: str) -> collections.Counter:
    """Opcode counts of the longest loop."""
    ops: collections.Counter = collections.Counter()
    for y in loop_lines(sass):
        op = re.match(r"\S+\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", y.strip())
        if op:
            ops[op.group(1)] += 1
    return ops


def registers(kernel) -> int:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    err = subprocess.run(
        [ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
        capture_output=True,
        text=True,
    ).stderr
    os.unlink(f.name)
    m = re.search(r"Used (\d+) registers", err)
    return int(m.group(1)) if m else -1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", default=["16,256,2,3"])
    ap.add_argument("--dump", default=None, help="write the first config's SASS here")
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    for n, spec in enumerate(args.configs):
        bn, bk, warps, stages = map(int, spec.split(","))
        k = compile_gate_up(bn, bk, warps, stages)
        sass = k.asm["sass"]
        if args.dump and n == 0:
            with open(args.dump, "w") as f:
                f.write(sass)
        ops = loop_ops(sass)
        total = sum(ops.values())
        weights = 2 * bn * (bk // 8) / (32 * warps) * 8  # per thread per tile
        top = ", ".join(f"{op} {c}" for op, c in ops.most_common(12))
        print(
            f"BLOCK_N {bn} BLOCK_K {bk} warps {warps} STAGES {stages}: {total} loop "
            f"instructions, {total / weights:.2f} per weight, {registers(k)} registers | {top}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
