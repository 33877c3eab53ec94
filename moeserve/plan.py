"""`moeserve plan`: a deployment planned from a checkpoint's shapes, with no GPU present.

From config.json (+ hf_quant_config.json / `quantization_config`) it builds the model on the
meta device once per distinct rank, exactly as the engine would build it, and reads:

- weights per GPU: the bytes of that rank's parameters and buffers in their serving format
  (the max over ranks); a safetensors index's `total_size`, where there is one, is shown as
  a cross-check of the whole model;
- KV bytes per token: the model's own `kv_cache_bytes_per_token` (MLA: layers x
  (kv_lora_rank + qk_rope_head_dim) x dtype bytes; the latent is replicated on every rank);
- activations and CUDA graphs: estimates (`activation_estimate`), where the engine measures;
- KV pages for `--gpu-memory-utilization` of the GPU's memory and the max context, through
  the engine's own `plan_kv_pages` and printed as the engine's table;
- the kernels that would run and every fallback with its reason: the kernel plan
  (`moeserve.layers.kernel_plan`), the one object the engine resolves at start-up too;
- with several GPUs of one host, the all-reduce for both topologies (peer access between every
  pair, or not: `--p2p` picks the one the kernel plan assumes), the all-reduces of a decode step
  and their bytes, and a projected decode step for each: the bytes one GPU reads at batch 1 over
  its datasheet bandwidth plus the all-reduces at latencies measured elsewhere
  (`moeserve.hardware.ALL_REDUCE_FIGURES`, quoted with their source).

Exit code: 0 when the deployment fits, 1 when it does not (the plan then names the smallest
`-tp` that fits), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn

from moeserve.config import (
    ConfigError,
    EngineConfig,
    ModelConfig,
    add_config_arguments,
    config_from_args,
    parse_dtype,
)
from moeserve.engine.memory import GIB, MemoryPlan, format_memory_table, plan_kv_pages
from moeserve.hardware import (
    ALL_REDUCE_FIGURES,
    GPUS,
    GPUS_PER_HOST,
    MIB,
    GpuSpec,
    Interconnect,
    gpu_spec,
)
from moeserve.layers.kernel_plan import Hardware, KernelPlan, PlanSettings, resolve_kernel_plan
from moeserve.layers.quant.base import QuantConfig, UnquantizedLinearMethod
from moeserve.loader.source import ModelSource, describe_source, source_kind
from moeserve.models.registry import ARCHITECTURES

FP32_BYTES = 4
# estimates of memory outside the model (the engine measures it as "other" at start-up):
# CUDA context + cuBLAS/Triton workspaces, and communicator buffers with more than one rank
CUDA_CONTEXT_BYTES = 512 * MIB
COMM_BUFFER_BYTES = 512 * MIB
# the residual stream of one step: hidden, residual, normed input, attention output, MLP
# output, all-reduce buffer (each tokens x hidden)
HIDDEN_STREAM_BUFFERS = 6
# full-vocabulary fp32 copies of the logit rows besides this rank's slice: the gathered
# logits and the sampler's probabilities
LOGIT_COPIES = 2
# largest -tp tried when a deployment does not fit
MAX_SUGGESTED_TP = 256
# the cached context of the one sequence a projected decode step reads (tokens)
PROJECTED_CONTEXT = 4096
# all-reduces of a decode step besides two per decoder layer: the vocab-parallel embedding's
EMBEDDING_ALL_REDUCES = 1
US = 1e-6


# ---- weights per rank -----------------------------------------------------------------------
WEIGHT_PARTS = (
    "attention",
    "dense MLP",
    "router",
    "shared experts",
    "routed experts",
    "embedding + lm_head",
    "norms + buffers",
    "MTP draft layer",
    "EAGLE-3 draft head",
    "vision encoder",
)


def _part(name: str) -> str:
    if name.startswith("mtp."):  # the draft model of --speculative-config method mtp
        return "MTP draft layer"
    if name.startswith("vision."):  # Kimi-K2.5's tower and projector, on rank 0
        return "vision encoder"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.experts." in name:
        return "routed experts"
    if ".mlp.shared_experts." in name:
        return "shared experts"
    if ".mlp.gate." in name:
        return "router"
    if ".mlp." in name:
        return "dense MLP"
    if name.startswith(("model.embed_tokens.", "lm_head.")):
        return "embedding + lm_head"
    return "norms + buffers"


@dataclass(frozen=True)
class RankWeights:
    """Bytes one rank holds, by part of the model; `experts_per_rank`: routed experts of one
    MoE layer on this rank (0: a dense model)."""

    by_part: dict[str, int]
    experts_per_rank: int

    @property
    def total(self) -> int:
        return sum(self.by_part.values())


def _tp_group(rank: int, size: int, expert_parallel: bool) -> Any:
    from moeserve.parallel.groups import TPGroup

    if expert_parallel and "expert_parallel" not in {f.name for f in fields(TPGroup)}:
        raise ConfigError("this build's layers do not implement --enable-expert-parallel")
    kw = {"expert_parallel": True} if expert_parallel else {}
    return TPGroup(rank, size, None, **kw)


def meta_model(
    cfg: ModelConfig,
    quant: QuantConfig,
    dtype: torch.dtype,
    rank: int = 0,
    size: int = 1,
    expert_parallel: bool = False,
) -> nn.Module:
    """The model as the engine builds it for `rank` of `size`, on the meta device (shapes and
    dtypes only, no memory). A layout that does not split evenly is a ConfigError."""
    from moeserve.models.registry import model_class

    tp = _tp_group(rank, size, expert_parallel)
    try:
        with torch.device("meta"):
            return model_class(cfg.architecture)(cfg, quant, tp, dtype)
    except ValueError as e:
        if size > 1:
            raise ConfigError(f"-tp {size} does not split this model: {e}") from None
        raise ConfigError(f"the model cannot be built from its config: {e}") from None


def rank_weights(model: nn.Module) -> RankWeights:
    from moeserve.layers.moe import RoutedExperts

    parts = dict.fromkeys(WEIGHT_PARTS, 0)
    experts = 0
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in tensors:
        parts[_part(name)] += t.numel() * t.element_size()
    for m in model.modules():
        if not isinstance(m, RoutedExperts):
            continue
        layout = m.layout
        experts = experts or layout.num_local
        if layout.num_shared:  # shared experts as bank slots: every slot has the same bytes
            bank = sum(p.numel() * p.element_size() for p in m.parameters())
            shared = bank // layout.num_slots * layout.num_shared
            parts["routed experts"] -= shared
            parts["shared experts"] += shared
    return RankWeights(parts, experts)


def eagle3_meta_head(
    path: str, cfg: ModelConfig, dtype: torch.dtype, tp: int
) -> tuple[nn.Module, str]:
    """An EAGLE-3 draft head's folder built for the target `cfg` as rank 0 of `tp` holds it,
    on the meta device (its tensor headers say whether it brings its embedding / LM head),
    and what it is."""
    from moeserve.loader.eagle3 import describe_draft
    from moeserve.models.eagle3 import Eagle3DraftHead

    draft = describe_draft(path)
    head_cfg = draft.config
    with torch.device("meta"):
        head = Eagle3DraftHead(
            head_cfg,
            cfg.vocab_size,
            _tp_group(0, tp, False),
            dtype,
            own_embed=draft.own_embed,
            own_head=draft.own_head(cfg.vocab_size),
        )
    head.aux_layer_ids = head_cfg.aux_layers(cfg)
    return head, draft.describe()


def weights_per_gpu(
    cfg: ModelConfig, quant: QuantConfig, dtype: torch.dtype, tp: int, ep: bool
) -> tuple[RankWeights, nn.Module]:
    """The largest rank's weights, and rank 0's meta model. Ranks are identical unless
    expert parallelism leaves an uneven number of experts per rank; then every rank is
    built."""
    model = meta_model(cfg, quant, dtype, 0, tp, ep)
    best = rank_weights(model)
    if ep and cfg.moe is not None and cfg.moe.n_routed_experts % tp:
        for r in range(1, tp):
            w = rank_weights(meta_model(cfg, quant, dtype, r, tp, ep))
            best = w if w.total > best.total else best
    return best, model


# ---- activations and graphs (estimates; the engine measures) -------------------------------
def activation_estimate(
    cfg: ModelConfig,
    tp: int,
    tokens: int,
    logit_rows: int,
    context: int,
    act_bytes: int,
    expert_parallel: bool = False,
) -> int:
    """Peak bytes of one eager step of `tokens` tokens on one rank, `context` cached tokens
    attended (the engine profiles one prefill from position 0: context = tokens):

      residual stream  tokens x hidden x 6 buffers
      attention        tokens x (q + latent row) + context x (kv_b keys/values + full keys),
                       per-rank heads, + the scores heads/tp x tokens x context in fp32
                       (the bound of SDPA's math path)
      MLP              the larger of the dense MLP (tokens x 3 x intermediate/tp) and the MoE
                       (tokens x top_k x (2 x moe_intermediate/tp + hidden), plus the fp32
                       router scores tokens x experts x 2)
      logits           logit_rows x vocab x 4 B x (1/tp + 2): this rank's slice, the gathered
                       copy and the sampler's probabilities
    in the activation dtype except where fp32 is said. Long-context chunked prefill expands
    the whole cached context and is not covered (the engine's profile does not cover it
    either)."""
    h = cfg.hidden_size
    heads = cfg.num_attention_heads // tp
    hidden = HIDDEN_STREAM_BUFFERS * tokens * h * act_bytes
    if cfg.mla is not None:
        mla = cfg.mla
        per_token = heads * mla.qk_head_dim + mla.latent_dim
        per_ctx = heads * (mla.qk_nope_head_dim + mla.v_head_dim + mla.qk_head_dim)
    else:
        kv_heads = max(1, cfg.num_key_value_heads // tp)
        per_token = (heads + 2 * kv_heads) * cfg.head_dim
        per_ctx = 2 * heads * cfg.head_dim  # keys/values expanded to the query heads
    scores = heads * tokens * context * FP32_BYTES
    attention = (tokens * per_token + context * per_ctx) * act_bytes + scores
    mlp = 3 * tokens * (cfg.intermediate_size // tp) * act_bytes
    if cfg.moe is not None:
        moe = cfg.moe
        inter = moe.moe_intermediate_size if expert_parallel else moe.moe_intermediate_size // tp
        routed = tokens * moe.num_experts_per_tok * (2 * inter + h) * act_bytes
        router = 2 * tokens * moe.n_routed_experts * FP32_BYTES
        mlp = max(mlp, routed + router)
    logits = int(logit_rows * cfg.vocab_size * FP32_BYTES * (1 / tp + LOGIT_COPIES))
    return hidden + attention + mlp + logits


def largest_image_patches(cfg: ModelConfig, path: str | None) -> int:
    """Patches of the largest image the checkpoint's processor makes."""
    from moeserve.multimodal.kimi import MediaProcessorConfig, largest_image_grid

    assert cfg.vision is not None
    _, rows, cols = largest_image_grid(MediaProcessorConfig.for_model(cfg.vision, path))
    return rows * cols


def vision_activation_estimate(cfg: ModelConfig, patches: int, act_bytes: int) -> int:
    """Peak bytes of encoding one image of `patches` patches (rank 0): in a block, the
    residual stream and its norm (2 x D), q/k/v (3 D) with their fp32 roped copies (2 D x
    4 B), the attention output (D), the MLP's hidden and its activation (2 x intermediate);
    then the merged blocks (4 D) and the projector's hidden (4 D) and output (text hidden)
    per token."""
    v = cfg.vision
    assert v is not None
    d = v.hidden_size
    block = patches * ((2 + 3 + 1) * d + 2 * v.intermediate_size) * act_bytes
    block += patches * 2 * d * FP32_BYTES
    tokens = patches // v.merge_size
    merge = tokens * (2 * v.merge_size * d + v.text_hidden_size) * act_bytes
    return block + merge


def absorbed_weight_bytes(model: nn.Module, act_dtype: torch.dtype) -> int:
    """Decode's dense copy of kv_b_proj (MLA layers whose kv_b_proj is stored quantized or in
    another dtype), made once when CUDA graphs are prepared."""
    total = 0
    for layer in model.modules():
        kv_b = getattr(layer, "kv_b_proj", None)
        if kv_b is None:
            continue
        plain = isinstance(kv_b.method, UnquantizedLinearMethod)
        if plain and kv_b.weight.dtype == act_dtype:
            continue  # the weight itself is used
        total += kv_b.local_output * kv_b.local_input * act_dtype.itemsize
    return total


# ---- the plan ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    path: str
    gpu: GpuSpec
    num_gpus: int
    tp: int
    expert_parallel: bool
    model_cfg: ModelConfig
    quant: QuantConfig
    quant_name: str
    quant_source: str
    act_dtype: torch.dtype
    kv_dtype: torch.dtype
    weights: RankWeights
    memory: MemoryPlan
    max_model_len: int
    model_len: int
    kernel_plan: KernelPlan
    kv_need_tokens: int  # what the KV cache must hold for the deployment to fit
    index_total: int | None  # a safetensors index's total_size (all ranks, as stored)
    shared_slots: int = 0  # shared experts held as slots of the routed banks (layers/moe.py)
    interconnect: Interconnect = "nvlink"  # what the kernel plan assumed (--p2p)
    all_reduce: str = "auto"  # --all-reduce
    vision_activation: int = 0  # encoding the largest image (rank 0), counted in activations
    draft: str = ""  # an EAGLE-3 draft head: what it is (moeserve.loader.eagle3)
    draft_kv_bytes: int = 0  # its cache's bytes per token, within kv_bytes_per_token

    @property
    def hosts(self) -> int:
        return -(-self.tp // GPUS_PER_HOST)

    @property
    def fits(self) -> bool:
        return self.memory.budget_bytes >= self.kv_need_tokens * self.memory.kv_bytes_per_token


def _index_total(path: str) -> int | None:
    from moeserve.loader.safetensors import INDEX_FILE

    try:
        with open(os.path.join(path, INDEX_FILE)) as f:
            total = json.load(f).get("metadata", {}).get("total_size")
    except (OSError, ValueError, AttributeError):
        return None
    return int(total) if isinstance(total, int | float) else None


def describe_checkpoint(path: str) -> ModelSource:
    """The checkpoint folder's description (`moeserve plan` plans HF checkpoints)."""
    from moeserve.errors import LoadError

    if source_kind(path) != "hf":
        raise LoadError("moeserve plan reads an HF checkpoint folder; GGUF is not planned")
    return describe_source(path, "hf")


def planned_interconnect(gpu: GpuSpec, p2p: bool | None) -> Interconnect:
    """The interconnect planned for: the GPU table's (None), or with peer access between every
    pair (True) or without (False: the driver or the platform refuses it)."""
    if p2p is None:
        return gpu.interconnect
    if not p2p:
        return "pcie"
    return "nvlink" if gpu.interconnect == "nvlink" else "pcie-p2p"


def plan_deployment(
    path: str, gpu: GpuSpec, num_gpus: int, engine: EngineConfig, p2p: bool | None = None
) -> Plan:
    """The plan of serving the checkpoint at `path` with `engine`'s settings on `num_gpus`
    GPUs of kind `gpu` (tensor parallel size: engine.parallel.tensor_parallel_size); `p2p`:
    see planned_interconnect."""
    from moeserve.loader.base import resolve_kv_cache_dtype

    src = describe_checkpoint(path)
    cfg, quant, source, kv_algo = src.config, src.quant, src.quant_source, src.kv_cache_quant_algo
    spec = engine.speculative_config
    if spec is not None and spec.method == "mtp":  # the draft model's weights and cache too
        cfg = cfg.with_mtp()
    if engine.load.num_layers is not None:
        cfg = cfg.with_layers(engine.load.num_layers)
    tp = engine.parallel.tensor_parallel_size
    ep = engine.parallel.enable_expert_parallel
    if tp > num_gpus:
        raise ConfigError(f"-tp {tp} needs {tp} GPUs but --num-gpus is {num_gpus}")
    act_dtype = parse_dtype(engine.load.dtype, cfg.dtype, "cuda")
    weights, model = weights_per_gpu(cfg, quant, act_dtype, tp, ep)
    wanted = resolve_kv_cache_dtype(engine.cache.kv_cache_dtype, kv_algo, act_dtype)
    hosts = -(-tp // GPUS_PER_HOST)
    settings = PlanSettings(
        act_dtype=act_dtype,
        kv_cache_dtype=wanted,
        page_size=engine.cache.page_size,
        mla_decode_kernel=engine.cache.mla_decode_kernel,
        enforce_eager=engine.enforce_eager,
        pdl=engine.pdl,
        deterministic=engine.load.deterministic,
        cpu_kernels=engine.load.cpu_kernels,
        tp_size=tp,
        hosts=hosts,
        all_reduce=engine.parallel.all_reduce,
        interconnect=planned_interconnect(gpu, p2p),
    )
    kernel_plan = resolve_kernel_plan(cfg, quant, Hardware.planned_gpu(gpu.capability), settings)
    kv_dtype = kernel_plan.kv_cache_dtype
    layers = model.attention_layers()
    draft, draft_kv = "", 0
    if spec is not None and spec.method == "eagle3":  # the head, its aux buffer and its cache
        from moeserve.models.eagle3 import head_cache_dtype

        head, draft = eagle3_meta_head(spec.model, cfg, act_dtype, tp)
        head_kv = head_cache_dtype(head.config, kv_dtype, act_dtype)
        draft_kv = sum(a.kv_cache_bytes_per_token(head_kv) for a in head.attention_layers())
        rows = max(engine.scheduler.max_num_batched_tokens, engine.graph_max_batch("cuda"))
        aux = rows * len(head.aux_layer_ids) * cfg.hidden_size * act_dtype.itemsize
        parts = dict(weights.by_part)
        parts["EAGLE-3 draft head"] = rank_weights(head).total + aux
        weights = replace(weights, by_part=parts)
    per_token = draft_kv + sum(layer.kv_cache_bytes_per_token(kv_dtype) for layer in layers)
    sched = engine.scheduler
    tokens = sched.max_num_batched_tokens
    act = activation_estimate(
        cfg, tp, tokens, min(tokens, sched.max_num_seqs), tokens, act_dtype.itemsize, ep
    )
    vision_act = 0
    if cfg.vision is not None:  # rank 0 encodes images: the largest, and the output cache
        from moeserve.multimodal.cache import DEFAULT_ENCODER_CACHE_BYTES

        patches = largest_image_patches(cfg, path)
        vision_act = vision_activation_estimate(cfg, patches, act_dtype.itemsize)
        act += vision_act + DEFAULT_ENCODER_CACHE_BYTES
    graphs_on = kernel_plan.cuda_graphs
    graph = 0
    if graphs_on:
        batch = engine.graph_max_batch("cuda")
        graph = activation_estimate(cfg, tp, batch, batch, 0, act_dtype.itemsize, ep)
        graph += absorbed_weight_bytes(model, act_dtype)
    other = CUDA_CONTEXT_BYTES + (COMM_BUFFER_BYTES if tp > 1 else 0)
    total = gpu.memory_bytes
    util = engine.cache.gpu_memory_utilization
    model_len = cfg.context_len(sched.max_model_len)
    memory = plan_kv_pages(
        budget_bytes=int(total * util) - other - weights.total - act - graph,
        kv_bytes_per_token=per_token,
        page_size=engine.cache.page_size,
        want_tokens=sched.max_num_seqs * model_len,
        num_pages=engine.cache.num_pages,
        total_bytes=total,
        utilization=util,
        weights_bytes=weights.total,
        activation_bytes=act,
        graph_bytes=graph,
        other_bytes=other,
    )
    # fits: the KV cache holds the pages asked for, else one --max-model-len sequence (or
    # one page when the context is left to what fits)
    page = engine.cache.page_size
    if engine.cache.num_pages is not None:
        need = engine.cache.num_pages * page
    else:
        need = -(-(sched.max_model_len or page) // page) * page
    return Plan(
        path=path,
        gpu=gpu,
        num_gpus=num_gpus,
        tp=tp,
        expert_parallel=ep,
        model_cfg=cfg,
        quant=quant,
        quant_name=quant.name,
        quant_source=source,
        act_dtype=act_dtype,
        kv_dtype=kv_dtype,
        weights=weights,
        memory=memory,
        max_model_len=min(model_len, memory.kv_tokens),
        model_len=model_len,
        kernel_plan=kernel_plan,
        kv_need_tokens=need,
        index_total=_index_total(path),
        shared_slots=next(
            (m.shared_slots for m in model.modules() if hasattr(m, "shared_slots")), 0
        ),
        vision_activation=vision_act,
        interconnect=settings.interconnect,
        all_reduce=settings.all_reduce,
        draft=draft,
        draft_kv_bytes=draft_kv,
    )


def smallest_fitting_tp(path: str, gpu: GpuSpec, engine: EngineConfig) -> int | None:
    """The smallest tensor-parallel size above the engine's that fits (None: none up to
    MAX_SUGGESTED_TP). Sizes that do not split the model evenly are skipped."""
    heads = describe_checkpoint(path).config.num_attention_heads
    start = engine.parallel.tensor_parallel_size + 1
    for tp in range(start, MAX_SUGGESTED_TP + 1):
        if heads % tp:
            continue
        parallel = replace(engine.parallel, tensor_parallel_size=tp)
        try:
            plan = plan_deployment(path, gpu, tp, replace(engine, parallel=parallel))
        except ConfigError:
            continue
        if plan.fits:
            return tp
    return None


# ---- all-reduce by topology -------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeTraffic:
    """What one GPU moves in a decode step at batch 1: the all-reduces (count, and bytes per
    token of each) and the bytes it reads (weights the token touches + its cached context)."""

    all_reduces: int
    all_reduce_bytes_per_token: int
    read_bytes: int


def decode_traffic(plan: Plan, context: int = PROJECTED_CONTEXT) -> DecodeTraffic:
    """Two all-reduces per decoder layer (attention's and the MLP's partial sums, each fused
    with the next norm) and the embedding's, of hidden x the activation dtype per token; the
    logits are all-gathered, not counted. Bytes read at batch 1: every weight but the routed
    experts, of which the k routed of E (on average, any split), and the LM head's slice but not
    the embedding table (one row); the latent cache of `context` tokens. The MTP draft layer
    and the vision encoder are not counted."""
    cfg, parts = plan.model_cfg, plan.weights.by_part
    layers = cfg.num_hidden_layers - (1 if cfg.mtp_index >= 0 else 0)
    routed = parts.get("routed experts", 0)
    if cfg.moe is not None:
        routed = routed * cfg.moe.num_experts_per_tok // cfg.moe.n_routed_experts
    skipped = {"routed experts", "embedding + lm_head", "MTP draft layer", "vision encoder"}
    read = sum(v for k, v in parts.items() if k not in skipped) + routed
    read += parts.get("embedding + lm_head", 0) // 2  # the LM head's half
    read += plan.memory.kv_bytes_per_token * context
    return DecodeTraffic(
        2 * layers + EMBEDDING_ALL_REDUCES, cfg.hidden_size * plan.act_dtype.itemsize, read
    )


def all_reduce_lines(plan: Plan) -> list[str]:
    """The all-reduce for both topologies, the all-reduces of a decode step, and the projected
    decode step of each (module docstring)."""
    from moeserve.parallel.comm import choose_all_reduce, planned_topology

    traffic = decode_traffic(plan)
    cases = [("P2P between every pair", True), ("no P2P", False)]
    if plan.hosts > 1:
        cases = [(f"{plan.hosts} hosts", False)]
    floor_s = traffic.read_bytes / (plan.gpu.hbm_tb_s * 1e12)
    figures = ALL_REDUCE_FIGURES.get(plan.gpu.key)
    lines = [
        f"all-reduce by topology (-tp {plan.tp}): {traffic.all_reduces} per decode step (2 per "
        f"layer x {(traffic.all_reduces - EMBEDDING_ALL_REDUCES) // 2} + the embedding's), "
        f"{traffic.all_reduce_bytes_per_token:,} B per token each ({plan.model_cfg.hidden_size} "
        f"x {_dtype(plan.act_dtype)}); the logits are all-gathered once"
    ]
    steps = []
    for name, p2p in cases:
        ic = planned_interconnect(plan.gpu, p2p)
        choice = choose_all_reduce(plan.tp, planned_topology(ic, plan.hosts), plan.all_reduce)
        mine = " [this plan]" if ic == plan.interconnect else ""
        lines.append(f"  {name}: {choice.line()}{mine}")
        if figures is not None:
            one_shot = choice.kind == "one-shot"
            us = figures.one_shot_mid_us if one_shot else figures.nccl_us
            steps.append((name, us, "one-shot" if one_shot else "NCCL"))
    lines.append(
        f"projected decode step, batch 1, {PROJECTED_CONTEXT:,}-token context (estimate): "
        f"{traffic.read_bytes / 1e9:.2f} GB read per GPU, {floor_s * 1e3:.2f} ms at "
        f"{plan.gpu.hbm_tb_s:g} TB/s (datasheet)"
    )
    if figures is None:
        lines.append(f"  no all-reduce latency figure for {plan.gpu.key}: not projected")
        return lines
    for name, us, kind in steps:
        ar_s = traffic.all_reduces * us * US
        total = floor_s + ar_s
        lines.append(
            f"  {name}: + {traffic.all_reduces} x {us:g} us {kind} = {ar_s * 1e3:.2f} ms -> "
            f"{total * 1e3:.2f} ms per step, {1 / total:.0f} tok/s ({ar_s / total:.0%} all-reduce)"
        )
    lines.append(f"  all-reduce latencies: {figures.source}")
    if traffic.all_reduce_bytes_per_token > figures.max_bytes:
        lines.append(
            f"  a one-token all-reduce of {traffic.all_reduce_bytes_per_token:,} B is above the "
            f"{figures.max_bytes:,} B the latencies cover: taken as the same latency"
        )
    return lines


# ---- output -----------------------------------------------------------------------------------
def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _dtype(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def format_plan(plan: Plan, suggestion: int | None = None) -> str:
    cfg = plan.model_cfg
    kind = "MoE" if cfg.moe is not None else "dense"
    lines = [
        f"moeserve plan: {plan.path} on {plan.num_gpus} x {plan.gpu.key} ({plan.gpu.describe()})",
        f"model: {cfg.architecture}, {ARCHITECTURES.by_name(cfg.architecture).description} "
        f"({kind}, {cfg.num_hidden_layers} layers, vocab "
        f"{cfg.vocab_size:,}), weights {plan.quant_name} (quant config: {plan.quant_source}), "
        f"compute {_dtype(plan.act_dtype)}",
        f"parallel: -tp {plan.tp}"
        + (" --enable-expert-parallel" if plan.expert_parallel else "")
        + (f" over {plan.hosts} hosts of {GPUS_PER_HOST}" if plan.hosts > 1 else "")
        + (f" ({plan.num_gpus - plan.tp} GPUs unused)" if plan.num_gpus > plan.tp else ""),
    ]
    moe = cfg.moe
    if moe is not None:
        if plan.expert_parallel:
            how = "whole experts (expert parallel)"
        else:
            inter = moe.moe_intermediate_size // plan.tp
            how = f"each split to {inter} of {moe.moe_intermediate_size} intermediate rows"
        lines.append(
            f"routed experts per GPU: {plan.weights.experts_per_rank} of "
            f"{moe.n_routed_experts} per MoE layer, {how}"
        )
    if moe is not None and moe.n_shared_experts:
        where = (
            "slots of the fused MoE beside the routed experts"
            if plan.shared_slots
            else "a separate MLP (stored unlike the routed experts, or expert parallel)"
        )
        lines.append(f"shared experts: {moe.n_shared_experts} per MoE layer, {where}")
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in plan.weights.by_part.items() if v)
    lines.append(f"weights per GPU: {_gib(plan.weights.total)} ({parts})")
    if plan.index_total is not None:
        lines.append(
            f"safetensors index: {_gib(plan.index_total)} stored for all ranks (includes what "
            "the server skips: MTP layers)"
        )
    if cfg.vision is not None:
        from moeserve.multimodal.cache import DEFAULT_ENCODER_CACHE_BYTES

        v = cfg.vision
        patches = largest_image_patches(cfg, plan.path)
        lines.append(
            f"vision encoder (rank 0): MoonViT {v.num_hidden_layers} layers, width "
            f"{v.hidden_size}, {_gib(plan.weights.by_part.get('vision encoder', 0))}; the "
            f"largest image ({patches:,} patches, {patches // v.merge_size:,} tokens) peaks at "
            f"{_gib(plan.vision_activation)}, plus {_gib(DEFAULT_ENCODER_CACHE_BYTES)} of "
            "cached image embeddings (both counted in activations)"
        )
    layers = cfg.num_hidden_layers
    mtp = " + the MTP draft layer" if cfg.mtp_index >= 0 else ""
    if cfg.mla is not None:
        how = (
            f"({layers} layers{mtp}) x ({cfg.mla.kv_lora_rank} + {cfg.mla.qk_rope_head_dim}) x "
            f"{plan.kv_dtype.itemsize} B; the latent is replicated on every rank"
        )
    else:
        how = f"{layers} layers, K and V of this rank's KV heads"
    if plan.draft:
        how += f"; + {plan.draft_kv_bytes:,} B of the EAGLE-3 head's cache"
        lines.append(f"draft model: {plan.draft}")
    lines.append(
        f"KV cache: {_dtype(plan.kv_dtype)}, {plan.memory.kv_bytes_per_token:,} B/token per GPU "
        f"({how})"
    )
    memory = plan.memory if plan.fits else plan.memory.with_pages(0)
    max_len = plan.max_model_len if plan.fits else 0
    title = "memory plan per GPU (estimated, no GPU here)"
    lines.append(format_memory_table(memory, max_len, title=title))
    if plan.fits:
        full = memory.kv_tokens // max(1, plan.model_len)
        lines.append(
            f"max context: {max_len:,} tokens (the model's {plan.model_len:,}); the KV cache "
            f"holds {full:,} full-length sequence(s)"
        )
    lines.append(
        "estimates: activations = one prefill of --max-num-batched-tokens (residual stream, "
        "attention, MLP, logits; moeserve.plan.activation_estimate), CUDA graphs = one decode "
        f"step of the largest graph batch, other = {CUDA_CONTEXT_BYTES // MIB} MiB CUDA context"
        + (f" + {COMM_BUFFER_BYTES // MIB} MiB communication buffers" if plan.tp > 1 else "")
    )
    lines.append(f"kernels on {plan.gpu.key} ({plan.gpu.sm}):")
    lines += plan.kernel_plan.lines()
    lines.append(f"fallbacks: {plan.kernel_plan.fallbacks}")
    if plan.tp > 1:
        lines += all_reduce_lines(plan)
    if not plan.fits:
        m = plan.memory
        rest = m.activation_bytes + m.graph_bytes + m.other_bytes
        budget = int(m.total_bytes * m.utilization)
        lines.append(
            f"does not fit: weights {_gib(m.weights_bytes)} + activations, graphs and other "
            f"{_gib(rest)} of a budget of {_gib(budget)} per GPU ({m.utilization:.0%} of "
            f"{_gib(m.total_bytes)}) leave {_gib(budget - m.weights_bytes - rest)} for the KV "
            f"cache; it needs {_gib(plan.kv_need_tokens * m.kv_bytes_per_token)} "
            f"({plan.kv_need_tokens:,} tokens)"
        )
        if suggestion is None:
            lines.append(f"smallest that fits: none up to -tp {MAX_SUGGESTED_TP}")
        else:
            hosts = -(-suggestion // GPUS_PER_HOST)
            where = f", {hosts} hosts of {GPUS_PER_HOST}" if hosts > 1 else ""
            lines.append(f"smallest that fits: -tp {suggestion} --num-gpus {suggestion}{where}")
    return "\n".join(lines)


# ---- CLI ----------------------------------------------------------------------------------------
def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="an HF checkpoint folder: config.json (+ hf_quant_config.json, safetensors index); "
        "no weights needed",
    )
    parser.add_argument("--gpu", required=True, choices=sorted(GPUS), help="GPU kind to plan for")
    parser.add_argument(
        "--num-gpus", type=int, default=None, help="GPUs available (default: the -tp size)"
    )
    parser.add_argument(
        "--p2p",
        choices=("yes", "no"),
        default=None,
        help="whether every pair of GPUs has peer access (default: NVLink GPUs have it, PCIe "
        "cards are not assumed to); picks the all-reduce of the kernel plan",
    )
    add_config_arguments(parser, EngineConfig)
    # -tp defaults to --num-gpus here: the usual deployment uses every GPU
    parser.set_defaults(tensor_parallel_size=None)


def run_plan(args: argparse.Namespace) -> int:
    gpu = gpu_spec(args.gpu)
    if args.num_gpus is not None and args.num_gpus < 1:
        raise ConfigError(f"--num-gpus must be at least 1, got {args.num_gpus}")
    tp = args.tensor_parallel_size or args.num_gpus or 1
    num_gpus = args.num_gpus or tp
    flat = argparse.Namespace(**{**vars(args), "tensor_parallel_size": tp})
    engine = config_from_args(EngineConfig, flat)
    with quiet_logs():  # the plan itself says what the layers would log while being built
        p2p = None if args.p2p is None else args.p2p == "yes"
        plan = plan_deployment(args.model, gpu, num_gpus, engine, p2p)
        suggestion = None if plan.fits else smallest_fitting_tp(args.model, gpu, engine)
    print(format_plan(plan, suggestion))
    return 0 if plan.fits else 1


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    logger = logging.getLogger("moeserve")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
