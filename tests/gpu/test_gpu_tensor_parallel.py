"""`moeserve serve -tp 2` and `-tp 2 --enable-expert-parallel` on two GPUs of one host, CUDA
graphs on, over HTTP: the greedy tokens of one GPU for a tiny Kimi-K2.5 NVFP4 checkpoint
(the published 512 + 64 MLA layout, so the Triton MLA, fused-MoE and cache kernels and the
one-shot all-reduce run). Runs where >= 2 GPUs are:

    timeout 900 env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python3 -m pytest -q -s tests/gpu/test_gpu_tensor_parallel.py

The oracle is the one-GPU server on the same checkpoint. bf16 sums in another order can flip
a greedy choice only where the one-GPU run itself had a near tie, so a token that differs
must be the one-GPU run's runner-up within `TIE` nats, after which the two continuations are
not compared; everywhere else tokens must be equal and their logprobs within `LOGPROB_TOL`.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.parallel.comm import NO_MULTICAST_ENV
from moeserve.testing.checkpoints import KERNEL_SHAPE, write_checkpoint
from tests.e2e.conftest import CliServer, greedy_choice

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs of one host"
)

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(40, 90))]
MAX_TOKENS = 24
TIE = 0.1  # nats between the one-GPU run's best and the token TP chose instead
LOGPROB_TOL = 0.2  # bf16 noise on flat logits (CPU bf16 TP2+EP vs 1 process: 0.096)
START_TIMEOUT_S = 300.0


def _greedy(base_url: str) -> list[list[tuple[str, float, dict[str, float]]]]:
    """Per prompt, per step: (token, its logprob, the top-5 logprobs)."""
    out = []
    for prompt in PROMPTS:
        lp = greedy_choice(base_url, prompt, MAX_TOKENS, timeout=120, logprobs=5)["logprobs"]
        steps = zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
        out.append([(t, float(v), dict(top)) for t, v, top in steps])
    return out


def _agree(ref, got) -> tuple[int, float]:
    """Steps compared before a near tie ends the comparison, and the worst logprob gap."""
    n, worst = 0, 0.0
    for (t_ref, lp_ref, top_ref), (t_got, lp_got, _) in zip(ref, got, strict=True):
        if t_ref != t_got:
            assert t_got in top_ref and lp_ref - top_ref[t_got] <= TIE, (
                f"step {n}: {t_got!r} instead of {t_ref!r}, not a near tie of the one-GPU run "
                f"(its top-5: {top_ref})"
            )
            break
        worst = max(worst, abs(lp_ref - lp_got))
        n += 1
    return n, worst


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory, ckpt_env):
    path = str(tmp_path_factory.mktemp("tp-gpu") / "kimi")
    write_checkpoint(path, "kimi-k2.5", "nvfp4-modelopt", shape=KERNEL_SHAPE, seed=3)
    server = CliServer(path, "--max-model-len", "512", timeout=START_TIMEOUT_S)
    try:
        ref = _greedy(server.base_url)
    finally:
        out = server.close()
    assert "CUDA graphs on" in out, out[-3000:]
    return path, ref


@pytest.fixture(scope="module")
def ckpt_env():
    mp = pytest.MonkeyPatch()
    for k, v in NO_MULTICAST_ENV.items():
        mp.setenv(k, v)  # inherited by the servers and their ranks
    yield
    mp.undo()


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
def test_tp2_on_two_gpus_matches_one_gpu(one_gpu, ep):
    path, ref = one_gpu
    extra = ["--enable-expert-parallel"] if ep else []
    server = CliServer(path, "-tp", "2", *extra, "--max-model-len", "512", timeout=START_TIMEOUT_S)
    try:
        got = _greedy(server.base_url)
    finally:
        out = server.close()
    banner = [ln for ln in out.splitlines() if "rank" in ln or "graph" in ln or "all-reduce" in ln]
    print("\n".join(banner[:12]))
    assert "2 ranks" in out and ("expert parallel" in out) == ep, out[-3000:]
    assert "CUDA graphs on" in out, out[-3000:]
    compared = [_agree(r, g) for r, g in zip(ref, got, strict=True)]
    print(f"{'tp2-ep' if ep else 'tp2'}: steps equal per prompt {[n for n, _ in compared]} "
          f"of {MAX_TOKENS}; worst logprob gap {max(w for _, w in compared):.4f}")  # fmt: skip
    assert all(w <= LOGPROB_TOL for _, w in compared), compared
    assert sum(n for n, _ in compared) >= MAX_TOKENS, compared  # not a tie at every start
