"""Programmatic dependent launch in the decode chain's kernels, checked in their PTX (compiled for
sm_90 on the CPU, in a subprocess without the interpreter): each kernel lets its dependents
launch, then waits before it reads or writes anything another kernel writes. What may come
before the wait is only what no kernel writes (weights); everything else after it."""

import json
import os
import subprocess
import sys

import pytest

_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moeserve.kernels.elementwise import norm
from moeserve.kernels.gemm import nvfp4_gate_up as gu
from moeserve.kernels.moe import nvfp4 as moe

def ptx(fn, types, const, warps):
    # the signature in the kernel's argument order; defaulted constexprs left out keep theirs
    sig = {n: types.get(n, "constexpr") for n in fn.arg_names if n in types or n in const}
    names = list(sig)
    consts = {(names.index(k),): v for k, v in const.items()}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return out.asm["ptx"]

NORM = dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", ro_ptr="*bf16",
            stride_x="i32", stride_r="i32", stride_y="i32", stride_ro="i32", n_cols="i32",
            eps="fp32")
GATE_UP = dict(x_ptr="*bf16", wg_ptr="*i32", sg_ptr="*u8", gsg_ptr="*fp32", wu_ptr="*i32",
               su_ptr="*u8", gsu_ptr="*fp32", out_ptr="*bf16", ws_ptr="*fp32", lock_ptr="*i32",
               M="i32", N="i32", K="i32", stride_xm="i32", stride_om="i32")
MOE_GU = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", gs_ptr="*fp32", inter_ptr="*bf16",
              sorted_ptr="*i32", expert_ids_ptr="*i32", num_experts="i32", Mk="i32",
              INTER="i32", H="i32", stride_xm="i32", ws_ptr="*fp32", cnt_ptr="*i32")
MOE_DN = dict(a_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", gs_ptr="*fp32", y_ptr="*fp32",
              sorted_ptr="*i32", expert_ids_ptr="*i32", num_experts="i32", topk_w_ptr="*fp32",
              out_ptr="*bf16", counter_ptr="*i32", Mk="i32", H="i32", INTER="i32",
              ws_ptr="*fp32", cnt_ptr="*i32")
GEMV = dict(MP=1, BLOCK_K=256, DECODE=1, PREFETCH=1, STAGES=0, F16=1)
out = {}
for pdl in (0, 1):
    out[f"norm{pdl}"] = ptx(norm._rms_norm_kernel, NORM,
                           dict(HAS_RES=True, BLOCK=8192, PDL=pdl), 16)
    out[f"gate_up{pdl}"] = ptx(gu._gate_up_silu_gemv_kernel, GATE_UP,
                              dict(GEMV, BLOCK_N=16, SPLIT_K=4, K_ITERS=7, EVEN=1, PDL=pdl), 2)
    out[f"moe_gate_up{pdl}"] = ptx(moe._moe_gate_up_gemv_kernel, MOE_GU,
                                  dict(GEMV, TOPK=8, BLOCK_N=16, K_ITERS=7, DIRECT=1, EVEN=1,
                                       SPLIT_K=4, PDL=pdl), 2)
    out[f"moe_down{pdl}"] = ptx(moe._moe_down_gemv_kernel, MOE_DN,
                               dict(GEMV, BLOCK_N=32, K_ITERS=4, DIRECT=1, COMBINE=8,
                                    ACCUMULATE=1, EVEN=1, SPLIT_K=2, PDL=pdl), 2)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _split(code: str) -> tuple[str, str]:
    launch = code.index("griddepcontrol.launch_dependents")
    wait = code.index("griddepcontrol.wait")
    assert launch < wait and code.count("griddepcontrol.wait") == 1
    return code[:wait], code[wait:]


@pytest.mark.parametrize("name", ["norm", "gate_up", "moe_gate_up", "moe_down"])
def test_without_pdl_no_grid_dependency_control(ptx, name):
    assert "griddepcontrol" not in ptx[f"{name}0"]


@pytest.mark.parametrize(
    "name,weight_loads_before",
    [("norm", 1), ("gate_up", 2), ("moe_gate_up", 0), ("moe_down", 0)],
)
def test_only_weights_are_read_before_the_wait(ptx, name, weight_loads_before):
    """The RMSNorm weight, the gate/up GEMV's first weight tiles (word and scale loads); the
    MoE kernels learn their experts from the router's output, so they read nothing first."""
    before, after = _split(ptx[f"{name}1"])
    loads = before.count("ld.global")
    assert (loads >= weight_loads_before) if weight_loads_before else loads == 0
    assert "st.global" not in before and "atom." not in before and "red." not in before
    assert "ld.global" in after and "st.global" in after
