"""Every Triton kernel the kernel plan chooses on Blackwell compiles for that GPU, here, on a CPU.

For `--gpu b200` (sm_100) and `--gpu rtx-pro-6000` (sm_120), `moeserve plan`'s kernel plan of
Kimi-K2.5 NVFP4 and DeepSeek-V3 block-FP8 at TP8 (benchmarks/configs; DeepSeek-V3 also with
`--kv-cache-dtype fp8`) names what serves each part of the model. Each choice is driven here
through the kernels' own Python entry points on meta tensors of the deployment's shapes (this
rank's heads, intermediate slices, expert banks), so the tile configs, constexprs and argument
types are the ones a real launch on that model would use. Launches are intercepted before they
run (`triton.knobs.runtime.jit_cache_hook`) and each kernel is compiled once per target, as its
first launch had it (Kimi-K2.5's first: its FP8 latent cache, decode-sized batches), with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", cap, 32))` down to a cubin by the
ptxas that ships in the triton wheel. The Triton interpreter that the rest of the suite runs
under cannot compile, so the compiling side runs as this file's `__main__` in a subprocess.

Hopper-only Gluon kernels (TMA + wgmma) must not be chosen on these targets: the plan states the
Triton kernel as the fallback, and the test checks that no Gluon launch is among the choices.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "benchmarks" / "configs"
TP = 8
# (checkpoint folder, EngineConfig settings): the reference deployment and the FP8 model, the
# latter also with the FP8 latent cache that the reference deployment needs
DEPLOYMENTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("kimi-k2.5-nvfp4", {}),
    ("deepseek-v3-fp8", {}),
    ("deepseek-v3-fp8", {"kv_cache_dtype": "fp8"}),
)
TARGETS = ("rtx-pro-6000", "b200")
# representative step sizes: one decode token, a small and a large decode batch, a prefill chunk
DECODE, SMALL_BATCH, MID_BATCH, PREFILL = 1, 8, 32, 256
CONTEXT = 4096  # cache capacity per sequence of the decode launches (tokens)
PAGE = 16
SUBPROCESS_TIMEOUT_S = 240
PLANNED_LAYERS = 4  # DeepSeek-V3's three dense layers and its first MoE layer


# ---- the compiling side (runs in a subprocess without TRITON_INTERPRET) ----------------------
@dataclass(frozen=True)
class Recipe:
    """One kernel-plan choice as launches: `what` (the plan's line), the kernels it must launch
    (a recipe that silently took a torch path fails), and the calls that launch them."""

    what: str
    kernels: tuple[str, ...]
    run: Callable[[], None]


def _recipes(plan: Any, fmt: str) -> list[Recipe]:
    """The launches of each Triton choice in `plan` (a moeserve.plan.Plan) at its shapes."""
    import torch

    from moeserve.kernels.attention import kv_cache, mla_absorb, mla_decode, mla_prefill
    from moeserve.kernels.comm import allreduce as ar
    from moeserve.kernels.configs import tile_config
    from moeserve.kernels.elementwise import activation, norm
    from moeserve.kernels.gemm import fp8_block_gemm as fg
    from moeserve.kernels.gemm import nvfp4_gate_up as gu
    from moeserve.kernels.gemm import nvfp4_gemm as ng
    from moeserve.kernels.gemm import w16_gemv as wg
    from moeserve.kernels.moe import fp8 as mf
    from moeserve.kernels.moe import nvfp4 as mn
    from moeserve.kernels.routing import router, router_fused

    class OnGpu(torch.Tensor):
        """A meta tensor that entry points take for a CUDA one (no memory, data_ptr 0: the
        16-byte alignment real allocations have)."""

        @property
        def is_cuda(self) -> bool:
            return True

    def t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device="meta").as_subclass(OnGpu)

    f32, i32, i64, u8, e4m3 = (
        torch.float32,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.float8_e4m3fn,
    )
    kp, cfg = plan.kernel_plan, plan.model_cfg
    h, heads = cfg.hidden_size, cfg.num_attention_heads // plan.tp
    mla, moe = cfg.mla, cfg.moe
    q_lora, lat, rope, nope, v = (
        mla.q_lora_rank, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim,
        mla.v_head_dim,
    )  # fmt: skip
    dense = cfg.intermediate_size // plan.tp
    inter = moe.moe_intermediate_size // plan.tp
    slots = moe.n_routed_experts + plan.shared_slots
    width = moe.num_experts_per_tok + plan.shared_slots
    out: list[Recipe] = []

    def add(what: str, kernels: tuple[str, ...]) -> Callable:
        def wrap(fn: Callable[[], None]) -> Callable[[], None]:
            out.append(Recipe(what, kernels, fn))
            return fn

        return wrap

    if kp.triton:

        @add(
            "norms, SiLU*up",
            ("norm._rms_norm_kernel", "norm._rms_norm_pair_kernel", "activation._silu_mul_kernel"),
        )
        def _() -> None:
            norm.rms_norm(t(DECODE, h), t(h), cfg.rms_norm_eps)
            norm.add_rmsnorm(t(DECODE, h), t(DECODE, h), t(h), cfg.rms_norm_eps)
            qkv = t(DECODE, q_lora + lat + rope)
            norm.rms_norm_pair(qkv, t(q_lora), t(lat), cfg.rms_norm_eps, cfg.rms_norm_eps, out=qkv)
            activation.silu_mul(t(DECODE, 2 * dense))

        @add("16-bit GEMV (+ the q_a / kv_a norms)",
             ("w16_gemv._w16_gemv_norm_kernel", "w16_gemv._w16_gemv_kernel"))  # fmt: skip
        def _() -> None:
            eps = cfg.rms_norm_eps
            segments = (wg.NormSegment(0, q_lora, t(q_lora), eps),
                        wg.NormSegment(q_lora, lat, t(lat), eps))  # fmt: skip
            wg.w16_gemv(t(DECODE, h), t(q_lora + lat + rope, h), norms=segments)
            # q_b_proj at the most rows (the lane-sum accumulators)
            wg.w16_gemv(t(wg.MAX_ROWS, q_lora), t(heads * (nope + rope), q_lora))

    if kp.triton and moe is not None:
        routing = dict(
            scoring_func=moe.scoring_func, topk_method=moe.topk_method, n_group=moe.n_group,
            topk_group=moe.topk_group, norm_topk_prob=moe.norm_topk_prob,
            routed_scaling_factor=moe.routed_scaling_factor, shared_slots=plan.shared_slots,
        )  # fmt: skip
        experts = moe.n_routed_experts

        @add("router", ("router._route_kernel",))
        def _() -> None:
            router.route(t(SMALL_BATCH, experts, dtype=f32), t(experts, dtype=f32),
                         moe.num_experts_per_tok, **routing)  # fmt: skip

        if kp.router.name == "fused":

            @add("router (one launch)", ("router_fused._router_fused_kernel",))
            def _() -> None:
                router_fused.route_fused(t(DECODE, h), t(experts, h), t(experts, dtype=f32),
                                         moe.num_experts_per_tok, **routing)  # fmt: skip

    if kp.linears.stored_format and fmt == "nvfp4":

        @add("NVFP4 linears", ("nvfp4_gemv._nvfp4_gemv_kernel",
                               "nvfp4_gemv_mma._nvfp4_gemv_mma_kernel",
                               "nvfp4_gemm._nvfp4_gemm_kernel",
                               "nvfp4_gemv._nvfp4_dequant_kernel",
                               "nvfp4_gate_up._gate_up_silu_gemv_kernel"))  # fmt: skip
        def _() -> None:
            n, k = 2 * dense, h  # the dense MLP's gate_up
            for kernel, m in (("gemv", DECODE), ("gemv_mma", SMALL_BATCH), ("mma", MID_BATCH),
                              ("dequant", PREFILL)):  # fmt: skip
                w, s = t(n, k // 2, dtype=u8), t(n, k // 16, dtype=e4m3)
                # the decode the start-up probe tries first (inline PTX)
                ng.nvfp4_gemm(t(m, k), w, s, t(1, dtype=f32), kernel=kernel, decode=ng.DECODE_ASM)
            # separate gate and up weights (own global scales) into SiLU * up, one launch
            gate = (t(dense, k // 2, dtype=u8), t(dense, k // 16, dtype=e4m3), t(1, dtype=f32))
            gu.nvfp4_gate_up_silu(t(DECODE, k), gate, gate, decode=ng.DECODE_ASM)

    if kp.linears.stored_format and fmt == "fp8-block":

        @add(
            "block-FP8 linears",
            ("fp8_block_gemm._fp8_block_gemv_kernel", "fp8_block_gemm._fp8_block_gemm_kernel"),
        )
        def _() -> None:
            n, k = heads * (nope + rope), q_lora  # q_b_proj
            for kernel, m in (("gemv", DECODE), ("mma", PREFILL)):
                w = t(n, k, dtype=e4m3)
                fg.fp8_block_gemm(
                    t(m, k), w, t(-(-n // 128), -(-k // 128), dtype=f32), kernel=kernel
                )

    if kp.experts.name == "fused-nvfp4" and fmt == "nvfp4":

        @add("routed experts", ("nvfp4._moe_gate_up_gemv_kernel", "nvfp4._moe_down_gemv_kernel",
                                "nvfp4._moe_align_kernel", "nvfp4.moe_combine_kernel",
                                "nvfp4._moe_gate_up_mma_kernel", "nvfp4._moe_down_mma_kernel",
                                "nvfp4._moe_gate_up_kernel", "nvfp4._moe_down_kernel"))  # fmt: skip
        def _() -> None:
            for kernel, m in (("gemv", DECODE), ("gemv", SMALL_BATCH), ("gemv_mma", MID_BATCH),
                              ("mma", PREFILL)):  # fmt: skip
                mn.fused_moe_nvfp4(
                    t(m, h), t(m, width, dtype=i32), t(m, width, dtype=f32),
                    t(slots, 2 * inter, h // 2, dtype=u8), t(slots, 2 * inter, h // 16, dtype=e4m3),
                    t(slots, dtype=f32), t(slots, h, inter // 2, dtype=u8),
                    t(slots, h, inter // 16, dtype=e4m3), t(slots, dtype=f32),
                    kernel=kernel, decode=ng.DECODE_ASM,
                )  # fmt: skip
            # one token with split-K (the config of an expert-parallel rank's few experts)
            split = dict(tile_config("moe_gemv", DECODE, f"48:{2 * inter}x{h}"),
                         SPLIT_K=4, DOWN_SPLIT_K=2)  # fmt: skip
            mn.fused_moe_nvfp4(
                t(DECODE, h), t(DECODE, width, dtype=i32), t(DECODE, width, dtype=f32),
                t(slots, 2 * inter, h // 2, dtype=u8), t(slots, 2 * inter, h // 16, dtype=e4m3),
                t(slots, dtype=f32), t(slots, h, inter // 2, dtype=u8),
                t(slots, h, inter // 16, dtype=e4m3), t(slots, dtype=f32),
                kernel="gemv", decode=ng.DECODE_ASM, gate_up_config=split,
            )  # fmt: skip

    if kp.experts.name == "fused-fp8" and fmt == "fp8-block":

        @add("routed experts", ("fp8._moe_gate_up_gemv_kernel", "fp8._moe_down_gemv_kernel",
                                "fp8._moe_gate_up_mma_kernel", "fp8._moe_down_mma_kernel",
                                "nvfp4._moe_align_kernel", "nvfp4.moe_combine_kernel"))  # fmt: skip
        def _() -> None:
            for kernel, m in (("gemv", DECODE), ("gemv", SMALL_BATCH), ("mma", PREFILL)):
                mf.fused_moe_fp8(
                    t(m, h), t(m, width, dtype=i32), t(m, width, dtype=f32),
                    t(slots, 2 * inter, h, dtype=e4m3),
                    t(slots, 2 * inter // 128, h // 128, dtype=f32),
                    t(slots, h, inter, dtype=e4m3), t(slots, h // 128, -(-inter // 128), dtype=f32),
                    kernel=kernel,
                )  # fmt: skip

    if kp.mla.capturable:  # the GPU MLA kernels (decode by Triton, Gluon or the prefill one)
        kv = kp.kv_cache_dtype
        scale = t(1, dtype=f32) if kv == e4m3 else None
        pages = CONTEXT // PAGE

        def cache() -> torch.Tensor:
            return t(pages * MID_BATCH, PAGE, lat + rope, dtype=kv)

        def write(tokens: int, q: torch.Tensor, q_abs: torch.Tensor) -> kv_cache.CacheWrite:
            row = t(tokens, lat + rope)
            table = t(cfg.max_position_embeddings, rope // 2, dtype=f32)
            roping = kv_cache.CacheRope(t(tokens, dtype=i64), table, table, q[..., nope:],
                                        q_abs[..., lat:])  # fmt: skip
            return kv_cache.CacheWrite(row[:, :lat], row[:, lat:], cache(), t(tokens, dtype=i64),
                                       scale, roping)  # fmt: skip

        @add(f"latent cache write ({kv})", ("kv_cache._write_mla_cache_kernel",))
        def _() -> None:
            q, q_abs = t(PREFILL, heads, nope + rope), t(PREFILL, heads, lat + rope)
            w = write(PREFILL, q, q_abs)
            kv_cache.write_mla_cache(w.c, w.k_pe, w.kv_cache, w.slot_mapping, scale, w.rope)

        @add(f"MLA prefill ({kv} cache)", ("mla_prefill._mla_prefill_kernel",))
        def _() -> None:
            mla_prefill.mla_prefill(
                t(PREFILL, heads, lat + rope), cache(), t(2, dtype=i32), t(1, dtype=i32),
                t(1, pages, dtype=i32), 0.1, t(PREFILL, heads, lat), kv_scale=scale,
                max_q_len=PREFILL,
            )  # fmt: skip

        kv_b = _stored_kv_b(plan, heads, nope, v, lat, t)
        if kv_b is not None and mla_absorb.absorb_max_rows("uk", kv_b[0], heads) >= DECODE:

            @add("absorbed W_UK (+ rope + cache write)", ("mla_absorb._absorb_uk_kernel",))
            def _() -> None:
                q, q_abs = t(DECODE, heads, nope + rope), t(DECODE, heads, lat + rope)
                mla_absorb.absorb_gemv(q[..., :nope], *kv_b, q_abs[..., :lat], "uk", nope,
                                       cache_write=write(DECODE, q, q_abs))  # fmt: skip

        if kv_b is not None and mla_absorb.absorb_max_rows("uv", kv_b[0], heads) >= DECODE:

            @add("absorbed W_UV", ("mla_absorb._absorb_uv_kernel",))
            def _() -> None:
                mla_absorb.absorb_gemv(
                    t(DECODE, heads, lat), *kv_b, t(DECODE, heads, v), "uv", nope
                )

    if kp.mla.name == "triton":

        @add(f"MLA decode ({kp.kv_cache_dtype} cache)",
             ("mla_decode._mla_decode_split_kernel",
              "mla_decode._mla_decode_merge_kernel"))  # fmt: skip
        def _() -> None:
            # the split kernel is compiled as first launched: its fused-merge build (a
            # superset of the default build's code); the default launches the merge kernel
            from dataclasses import replace

            for batch, fused in ((DECODE, True), (MID_BATCH, True), (MID_BATCH, False)):
                splits = mla_decode.default_num_splits(batch, heads, CONTEXT)
                ws = mla_decode.MLADecodeWorkspace.allocate(batch, heads, splits, "meta")
                config = mla_decode.default_config(heads, batch, CONTEXT)
                mla_decode.mla_decode(
                    t(batch, heads, lat + rope), cache(), t(batch, CONTEXT // PAGE, dtype=i32),
                    t(batch, dtype=i32), 0.1, t(batch, heads, lat), kv_scale=scale,
                    num_splits=splits, workspace=ws,
                    config=replace(config, fused_merge=fused),
                )  # fmt: skip

    if kp.mla.name == "triton-prefill":
        pass  # the prefill kernel above serves every row (--deterministic)
    if kp.mla.name.startswith("gluon"):  # Hopper only: must fail to compile elsewhere

        @add("MLA decode (Gluon)", ("mla_decode_gluon._mla_decode_gluon_kernel",))
        def _() -> None:
            from moeserve.kernels.attention import mla_decode_gluon

            mla_decode_gluon.mla_decode_gluon(
                t(DECODE, heads, lat + rope), cache(), t(DECODE, pages, dtype=i32),
                t(DECODE, dtype=i32), 0.1, t(DECODE, heads, lat),
            )  # fmt: skip

    if plan.tp > 1:

        @add("all-reduce (one-shot, P2P)", (f"allreduce._{_one_shot_protocol()}_kernel",))
        def _() -> None:
            rows, world = MID_BATCH, plan.tp
            protocol = _one_shot_protocol()
            n = ar.buffer_elements(protocol, rows, h, world)
            programs = ar.num_programs(rows)
            flags = tuple(t(programs * world, dtype=i64) for _ in range(world))
            bufs = ar.PeerBuffers(
                protocol, 0, world, tuple(t(n) for _ in range(world)),
                flags if protocol == "flag" else (), t(programs, 2, dtype=i64), t(1, dtype=i32),
                h, rows,
            )  # fmt: skip
            x = t(DECODE, h)
            ar.one_shot_all_reduce_add_rmsnorm(bufs, x, t(DECODE, h), t(h), cfg.rms_norm_eps,
                                               t(DECODE, h), t(DECODE, h))  # fmt: skip

    return out


def _one_shot_protocol() -> str:
    from moeserve.parallel.comm import DEFAULT_PROTOCOL

    return DEFAULT_PROTOCOL


def _stored_kv_b(plan: Any, heads: int, nope: int, v: int, lat: int, t: Callable) -> Any:
    """kv_b_proj of one rank as stored (what the absorbed-product kernels read), or None
    where they cannot read its format (then bmm on a dense copy serves)."""

    from moeserve.layers.attention.mla import MLAAttention
    from moeserve.layers.attention.mla_backends import TritonMLA
    from moeserve.plan import meta_model

    layer = meta_model(plan.model_cfg.with_layers(1), plan.quant, plan.act_dtype, 0, plan.tp)
    attn = next(m for m in layer.modules() if isinstance(m, MLAAttention))
    backend = TritonMLA(attn)
    backend.process_weights()  # what the GPU backend reads of kv_b_proj
    stored = backend.stored
    if stored is None:
        return None
    w, s = stored
    w = t(*w.shape, dtype=w.dtype)
    return w, (t(*s.shape, dtype=s.dtype) if s is not None else None)


def _plan(folder: str, gpu: str, settings: dict[str, Any]) -> Any:
    from moeserve.config import EngineConfig
    from moeserve.hardware import gpu_spec
    from moeserve.plan import plan_deployment, quiet_logs

    # the kernel plan does not depend on the layer count past the first MoE layer
    engine = EngineConfig.from_settings(
        tensor_parallel_size=TP, num_layers=PLANNED_LAYERS, **settings
    )
    with quiet_logs():
        return plan_deployment(str(CONFIGS / folder), gpu_spec(gpu), TP, engine)


def compile_chosen(gpu: str) -> dict[str, Any]:
    """Capture every launch of the plans' Triton choices for `gpu`, then compile each kernel once
    (as first launched) for its compute capability. Returns a JSON-able report."""
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.driver import driver

    from moeserve.hardware import gpu_spec
    from moeserve.layers.kernel_plan import quant_formats

    cap = gpu_spec(gpu).capability
    target = GPUTarget("cuda", cap[0] * 10 + cap[1], 32)

    class PlannedDriver:
        """The active Triton driver for a GPU that is not here: launches resolve to `target`."""

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return target

        def get_active_torch_device(self) -> torch.device:
            return torch.device("meta")

    driver.set_active(PlannedDriver())
    captured: dict[str, dict[str, Any]] = {}  # kernel -> its first launch
    launched: list[str] = []  # kernels the current recipe launched
    recipe: list[str] = [""]

    def intercept(*, fn: Any, compile: dict, **_: Any) -> bool:
        jit = fn.jit_function
        name = f"{jit.fn.__module__.rsplit('.', 1)[-1]}.{jit.fn.__qualname__}"
        launched.append(name)
        captured.setdefault(name, {"jit": jit, "c": compile, "recipe": recipe[0]})
        return True  # handled: neither compiled by the JIT nor launched

    knobs.runtime.jit_cache_hook = intercept
    report: dict[str, Any] = {"gpu": gpu, "arch": target.arch, "plans": {}, "recipes": []}
    start = time.perf_counter()
    for folder, settings in DEPLOYMENTS:
        plan = _plan(folder, gpu, settings)
        fmt = quant_formats(plan.quant)[0]
        name = folder + "".join(f" --{k.replace('_', '-')} {v}" for k, v in settings.items())
        report["plans"][name] = plan.kernel_plan.lines()
        for r in _recipes(plan, fmt):
            recipe[0] = f"{name}: {r.what}"
            launched.clear()
            error = None
            try:
                r.run()
            except Exception as e:  # noqa: BLE001 - reported per recipe
                error = f"{type(e).__name__}: {e}"
            missing = [k for k in r.kernels if k not in launched]
            report["recipes"].append({"what": recipe[0], "error": error, "missing": missing})
    knobs.runtime.jit_cache_hook = None
    options = ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion", "launch_cooperative_grid")
    report["capture_seconds"] = round(time.perf_counter() - start, 2)
    report["kernels"] = []
    for kernel, c in captured.items():
        start = time.perf_counter()
        entry: dict[str, Any] = {"kernel": kernel, "recipe": c["recipe"]}
        try:
            cc = c["c"]
            src = ASTSource(c["jit"], cc["signature"], cc["constants"], cc["configs"][0])
            compiled = triton.compile(src, target=target, options={k: cc[k] for k in options})
            ptx = compiled.asm.get("ptx", "")
            entry["ptx_target"] = next(
                (ln.split()[1] for ln in ptx.splitlines() if ln.startswith(".target")), ""
            )
            entry["cubin_bytes"] = len(compiled.asm.get("cubin", b""))
        except Exception as e:  # noqa: BLE001 - reported per kernel
            entry["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        entry["seconds"] = round(time.perf_counter() - start, 2)
        report["kernels"].append(entry)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", choices=TARGETS, required=True)
    args = parser.parse_args()
    print(json.dumps(compile_chosen(args.gpu)))


# ---- the tests ----------------------------------------------------------------------------
def _ptxas_for(arch: int) -> str | None:
    """The ptxas triton would run for `arch` (None: not there or not runnable here)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(arch).path
    except Exception:  # noqa: BLE001 - any failure to locate it means "absent"
        return None
    return path if path and os.access(path, os.X_OK) else None


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[str, Any]]:
    """Both targets compiled by concurrent subprocesses with an empty Triton cache (so ptxas
    really runs)."""
    for gpu in TARGETS:
        from moeserve.hardware import GPUS

        cap = GPUS[gpu].capability
        if _ptxas_for(cap[0] * 10 + cap[1]) is None:
            pytest.skip(f"no runnable ptxas for {GPUS[gpu].sm} in this triton wheel")
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        procs = {}
        for gpu in TARGETS:
            env_gpu = {**env, "TRITON_CACHE_DIR": os.path.join(cache, gpu)}
            procs[gpu] = subprocess.Popen(
                [sys.executable, __file__, "--gpu", gpu],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_gpu,
            )  # fmt: skip
        for gpu, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
            assert proc.returncode == 0, stderr[-4000:]
            out[gpu] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("gpu", TARGETS)
def test_every_chosen_kernel_compiles_for_the_target(reports, gpu):
    report = reports[gpu]
    for r in report["recipes"]:
        assert r["error"] is None, r
        assert not r["missing"], f"{r['what']}: no launch of {r['missing']} (another path ran)"
    arch = report["arch"]
    assert report["kernels"], "nothing was launched"
    for k in report["kernels"]:
        assert "error" not in k, f"{k['kernel']} ({k['recipe']}) on sm_{arch}: {k.get('error')}"
        assert k["ptx_target"].startswith(f"sm_{arch}"), k
        assert k["cubin_bytes"] > 0, k
    names = {k["kernel"] for k in report["kernels"]}
    # the reference deployment's blocker: MLA decode over an FP8 latent cache
    fp8_decode = [
        r["what"] for r in report["recipes"] if "MLA decode (torch.float8_e4m3fn" in r["what"]
    ]
    assert any(w.startswith("kimi-k2.5-nvfp4") for w in fp8_decode), report["recipes"]
    assert any("--kv-cache-dtype fp8" in w for w in fp8_decode), report["recipes"]
    assert {"mla_decode._mla_decode_split_kernel", "allreduce._lamport_kernel"} <= names
    assert not any("gluon" in n for n in names)


@pytest.mark.parametrize("gpu", TARGETS)
def test_plan_excludes_hopper_kernels_and_states_the_fp4_fallback(gpu):
    from moeserve.hardware import GPUS

    sm = GPUS[gpu].sm
    for folder, settings in DEPLOYMENTS:
        plan = _plan(folder, gpu, {**settings, "page_size": 64})  # Gluon's page multiple
        choices = {c.what: c for c in plan.kernel_plan.choices}
        decode = choices["MLA decode"]
        assert plan.kernel_plan.mla.name == "triton", decode
        assert decode.choice.startswith("Triton") and decode.fallback, decode
        assert "sm_90" in decode.reason and sm in decode.reason, decode
    kimi = {c.what: c for c in _plan("kimi-k2.5-nvfp4", gpu, {}).kernel_plan.choices}
    for what in ("NVFP4 linears", "routed experts"):
        c = kimi[what]
        assert c.fallback and "native FP4" in c.reason and "bf16" in c.reason, c


def test_native_fp4_is_chosen_nowhere_yet():
    from moeserve.hardware import GPUS
    from moeserve.layers.kernel_plan import native_fp4_kernel

    for g in GPUS.values():
        assert native_fp4_kernel(g.capability) is None, g.key


if __name__ == "__main__":
    main()
