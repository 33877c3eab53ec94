"""A tiny Kimi-K2.5 NVFP4 checkpoint through the GPU kernels (NVFP4 GEMM, fused MoE, MLA cache
write and decode) against the CPU reference path. Runs where a GPU is."""

import pytest
import torch

from moeserve.engine.offline import LLM
from moeserve.layers.attention.mla import MLAAttention
from moeserve.layers.attention.mla_backends import GluonPreferMLA
from moeserve.sampling import SamplingParams
from moeserve.testing.checkpoints import KERNEL_SHAPE, write_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPE = KERNEL_SHAPE  # the published 512 + 64 MLA layout: the Triton kernels apply
STEPS = 32


def _count_calls(monkeypatch, module: str, name: str) -> list[int]:
    import importlib

    mod = importlib.import_module(module)
    real, calls = getattr(mod, name), [0]

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(mod, name, counted)
    return calls


def _forced(llm: LLM, prompt: list[int], tokens: list[int], k: int = 5) -> list[dict[int, float]]:
    """Top-k logprobs at each decode step with the reference's tokens fed back in (teacher
    forcing through the decode path): every step is compared, even after a near-tie."""
    eng = llm.engine
    rid = f"forced-{len(eng.live)}-{id(tokens)}"
    eng.add_request(
        rid,
        prompt,
        SamplingParams(max_tokens=len(tokens), temperature=0, ignore_eos=True, logprobs=k),
    )
    req = eng.live[rid].req
    steps: list[dict[int, float]] = []
    while eng.has_unfinished():
        for out in eng.step():
            steps += [dict(e.top) for e in out.logprobs or []]
        if req.output_ids and not req.finished:
            req.output_ids[-1] = tokens[len(req.output_ids) - 1]
    return steps


def _compare(prompts, ref, engine: LLM) -> tuple[float, float, list[int]]:
    """Worst |logprob| difference against the fp32 reference in prefill and in teacher-forced
    decode, and per prompt how many free-running greedy steps agree (checked to end only at
    a near-tie of the reference)."""
    params = SamplingParams(
        max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=0
    )
    got = engine.generate(prompts, params)
    pre, dec, equal = 0.0, 0.0, []
    for prompt, r, g in zip(prompts, ref, got, strict=True):
        lp_r = torch.tensor([e.logprob for e in r.prompt_logprobs[1:]])
        lp_g = torch.tensor([e.logprob for e in g.prompt_logprobs[1:]])
        pre = max(pre, float((lp_r - lp_g).abs().max()))
        for step, (e, top_g) in enumerate(
            zip(r.logprobs, _forced(engine, prompt, r.token_ids), strict=True)
        ):
            top_r = dict(e.top)
            shared = set(top_r) & set(top_g)
            assert shared, f"step {step}: no common top-5 token"
            dec = max(dec, max(abs(top_r[t] - top_g[t]) for t in shared))
        n = 0
        while n < STEPS and g.token_ids[n] == r.token_ids[n]:
            n += 1
        equal.append(n)
    return pre, dec, equal


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_gpu_kernels_match_cpu_reference(tmp_path, monkeypatch, kv):
    path = str(tmp_path / "kimi")
    write_checkpoint(path, "kimi-k2.5", "nvfp4-modelopt", shape=SHAPE, seed=1)
    calls = {
        n: _count_calls(monkeypatch, m, n)
        for m, n in [
            ("moeserve.kernels.gemm.nvfp4_gemm", "nvfp4_gemm"),
            ("moeserve.kernels.moe.nvfp4", "fused_moe_nvfp4"),
            ("moeserve.kernels.attention.mla_decode", "mla_decode"),
            ("moeserve.kernels.attention.kv_cache", "write_mla_cache"),
        ]
    }
    kw = dict(max_model_len=256, kv_cache_dtype=kv)
    cpu = LLM(path, device="cpu", dtype="float32", **kw)
    tok = cpu.tokenizer
    prompts = [
        tok.encode(t, add_special_tokens=False)
        for t in ("Hello there, how are you today?", "abc", "The quick brown fox jumps over")
    ]
    ref = cpu.generate(
        prompts,
        SamplingParams(
            max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=0
        ),
    )
    # the bf16 noise floor: the same torch reference path, run in bf16 on the CPU (torch's CPU
    # kernels: the bf16 rounding of that path, not the native kernels' own arithmetic)
    floor = _compare(
        prompts, ref, LLM(path, device="cpu", dtype="bfloat16", cpu_kernels="torch", **kw)
    )
    gpu = _compare(prompts, ref, LLM(path, device="cuda", dtype="bfloat16", **kw))
    used = {n: c[0] for n, c in calls.items()}
    print(
        f"kv={kv} kernel calls {used}\n  cpu-bf16 vs fp32: prefill {floor[0]:.4f} decode "
        f"{floor[1]:.4f} greedy-equal {floor[2]}\n  gpu-bf16 vs fp32: prefill {gpu[0]:.4f} "
        f"decode {gpu[1]:.4f} greedy-equal {gpu[2]}"
    )
    assert all(used[n] > 0 for n in ("fused_moe_nvfp4", "mla_decode", "write_mla_cache"))
    # within bf16 tolerance: the largest deviation bf16 rounding causes on the reference path
    # itself (this random model's logits are flat, so that is well above a real model's)
    tol = 2 * max(floor[0], floor[1]) + 0.02
    assert gpu[0] <= tol and gpu[1] <= tol
    # greedy: the GPU agrees with the fp32 reference at least as long as bf16 torch does
    assert min(gpu[2]) >= min(min(floor[2]), STEPS // 2) or min(gpu[2]) == STEPS


def test_gpu_fp8_block_linears_match_cpu_reference(tmp_path, monkeypatch):
    """DeepSeek block-FP8: the linear layers run the Triton FP8 GEMM on the stored weights."""
    path = str(tmp_path / "dsv3")
    write_checkpoint(path, "deepseek-v3", "fp8-block", seed=2)
    calls = _count_calls(monkeypatch, "moeserve.kernels.gemm.fp8_block_gemm", "fp8_block_gemm")
    kw = dict(max_model_len=256)
    cpu = LLM(path, device="cpu", dtype="float32", **kw)
    prompts = [cpu.tokenizer.encode(t, add_special_tokens=False) for t in ("Hello there", "abc")]
    ref = cpu.generate(
        prompts,
        SamplingParams(
            max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=0
        ),
    )
    floor = _compare(
        prompts, ref, LLM(path, device="cpu", dtype="bfloat16", cpu_kernels="torch", **kw)
    )
    gpu = _compare(prompts, ref, LLM(path, device="cuda", dtype="bfloat16", **kw))
    print(f"fp8-block: {calls[0]} fp8_block_gemm calls; cpu-bf16 {floor}; gpu-bf16 {gpu}")
    assert calls[0] > 0
    tol = 2 * max(floor[0], floor[1]) + 0.02
    assert gpu[0] <= tol and gpu[1] <= tol


def _graphs_follow_cpu_reference(path: str, max_model_len: int = 256, **gpu_settings) -> LLM:
    """A GPU engine on the checkpoint at `path` (settings `gpu_settings`) decodes in CUDA
    graphs and follows the fp32 CPU reference: logprobs within twice the CPU bf16 path's own
    deviation, greedy tokens as long as that path's (or to the end). Returns the engine."""
    kw = dict(max_model_len=max_model_len)
    cpu = LLM(path, device="cpu", dtype="float32", **kw)
    prompts = [cpu.tokenizer.encode(t, add_special_tokens=False) for t in ("Hello there", "abc")]
    ref = cpu.generate(
        prompts,
        SamplingParams(
            max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=0
        ),
    )
    floor = _compare(
        prompts, ref, LLM(path, device="cpu", dtype="bfloat16", cpu_kernels="torch", **kw)
    )
    gpu_llm = LLM(path, device="cuda", dtype="bfloat16", **kw, **gpu_settings)
    assert gpu_llm.engine.runner.graphs is not None, gpu_llm.engine.runner.graph_status
    gpu = _compare(prompts, ref, gpu_llm)
    print(f"{path}: cpu-bf16 {floor}; gpu-bf16 {gpu}")
    tol = 2 * max(floor[0], floor[1]) + 0.02
    assert gpu[0] <= tol and gpu[1] <= tol
    assert min(gpu[2]) >= min(min(floor[2]), STEPS // 2) or min(gpu[2]) == STEPS
    return gpu_llm


def test_gpu_fp8_block_moe_in_graphs_matches_cpu_reference(tmp_path, monkeypatch):
    """DeepSeek block-FP8 at the kernel shape (intermediate 128): the fused block-FP8 MoE runs,
    decode is captured in CUDA graphs, and the tokens follow the fp32 CPU reference."""
    path = str(tmp_path / "dsv3k")
    write_checkpoint(path, "deepseek-v3", "fp8-block", shape=SHAPE, seed=3)
    calls = _count_calls(monkeypatch, "moeserve.kernels.moe.fp8", "fused_moe_fp8")
    _graphs_follow_cpu_reference(path)
    assert calls[0] > 0


def test_gpu_fp8_absorbed_decode_carries_the_cache_write(tmp_path, monkeypatch):
    """DeepSeek block-FP8 with 128-wide nope and value heads (whole 128-row scale blocks of
    kv_b_proj): at decode the absorbed W_UK kernel reads the stored FP8 weight and carries
    the rope + cache write (no write launch of its own), in CUDA graphs; the tokens follow
    the fp32 CPU reference."""
    import dataclasses

    shape = dataclasses.replace(SHAPE, nope=128, v_dim=128)
    path = str(tmp_path / "dsv3a")
    write_checkpoint(path, "deepseek-v3", "fp8-block", shape=shape, seed=4)
    absorb = _count_calls(monkeypatch, "moeserve.kernels.attention.mla_absorb", "absorb_gemv")
    _graphs_follow_cpu_reference(path)
    assert absorb[0] > 0


def test_gpu_gluon_mla_decode_serves_in_graphs(tmp_path, monkeypatch):
    """The Gluon MLA decode kernel inside the engine: 64-token pages and a 4096-token
    capacity make `--mla-decode-kernel auto` choose it (prefer_gluon) for the captured
    decode graphs; the tokens follow the fp32 CPU reference as the Triton kernel's do."""
    import moeserve.kernels.attention.mla_decode_gluon as mg

    path = str(tmp_path / "kimig")  # Kimi's YaRN factor gives the 4096 positions
    write_checkpoint(path, "kimi-k2.5", "bf16", shape=SHAPE, seed=5)
    gluon = _count_calls(
        monkeypatch, "moeserve.kernels.attention.mla_decode_gluon", "mla_decode_gluon"
    )
    gpu_llm = _graphs_follow_cpu_reference(path, max_model_len=4096, page_size=64)
    scratch = next(
        m.backend.scratch
        for m in gpu_llm.engine.runner.model.modules()
        if isinstance(m, MLAAttention) and getattr(m.backend, "scratch", None) is not None
    )
    assert scratch.gluon == "prefer"  # the start-up probe passed
    # what the banner and `moeserve plan` print is what serves
    plan = gpu_llm.engine.loaded.kernel_plan
    assert plan.mla is GluonPreferMLA
    assert any(ln.strip().startswith("MLA decode") and "Gluon" in ln for ln in plan.lines())
    assert all(scratch.workspace(b, 4096)[0] is mg.mla_decode_gluon for b in (1, 2))
    assert gluon[0] > 0  # the probe's and the captures' calls
