"""`moeserve check MODEL`: what a checkpoint is and whether it loads, without reading weights.

An HF folder is read through its config.json, its quant description (hf_quant_config.json or
`quantization_config`) and its safetensors headers only (`safe_open(...).keys()`,
`get_slice(name).get_shape()/get_dtype()`). Every tensor is then routed exactly as the
loader routes it: through the model's own name mapping (`DeepseekV3ForCausalLM._route`,
Llama's stacked rules) into the weight loaders of the model built on the meta device, fed
meta tensors of the stored shape and dtype. So a shape the loader would reject, a tensor that
matches no parameter, a parameter nothing fills (an expert missing too) and a quantized
tensor where the quant config expects a float one are found without a byte of weight data.
A .gguf file is read through its header and tensor infos.

`run_check` prints the report on stdout and one line per problem on stderr; exit code 0 when
the checkpoint loads, 2 otherwise. A folder that cannot be read at all (invalid config.json,
a corrupt or truncated safetensors file, a shard the index lists but the folder lacks) is a
`LoadError`: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moeserve.config import ConfigError
from moeserve.errors import LoadError
from moeserve.layers.quant.base import QuantConfig, UnquantizedLinearMethod
from moeserve.models.registry import ARCHITECTURES

# safetensors header dtype names -> torch
_ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
EXAMPLES = 3  # names quoted per problem
_VISION = ("vision_tower", "mm_projector", "multi_modal_projector")
_MTP = re.compile(r"\b(enorm|hnorm|eh_proj|shared_head)\b")
_MOE_PARTS = ("experts", "shared_experts", "gate")


@dataclass
class CheckReport:
    lines: list[str] = field(default_factory=list)  # what the checkpoint is
    problems: list[str] = field(default_factory=list)  # why it would not load
    # (component, layer) stored quantized, e.g. ("mlp.experts", 1), ("self_attn", 0)
    quantized: set[tuple[str, int]] = field(default_factory=set)

    @property
    def loadable(self) -> bool:
        return not self.problems

    def collapsed_problems(self) -> list[str]:
        """One line per kind of problem: lines that differ only in numbers (layer, expert,
        shape) are counted on the first of them."""
        first: dict[str, str] = {}
        count: Counter = Counter()
        for p in self.problems:
            key = re.sub(r"\d+", "#", p)
            first.setdefault(key, p)
            count[key] += 1
        return [
            first[k] + (f" (and {count[k] - 1} more like it)" if count[k] > 1 else "")
            for k in first
        ]


@dataclass(frozen=True)
class StoredTensor:
    name: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None  # None: a dtype torch has no name for

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * (self.dtype.itemsize if self.dtype is not None else 0)

    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype or torch.uint8, device="meta")


# ---- reading the folder ---------------------------------------------------------------------
def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"{path} is not valid JSON ({e})") from None


def read_headers(folder: str) -> tuple[list[StoredTensor], list[str], dict[str, str] | None]:
    """Every tensor's name, file, shape and dtype from the safetensors headers; the files;
    the index's weight map (None without an index)."""
    from safetensors import SafetensorError, safe_open

    from moeserve.loader.safetensors import INDEX_FILE

    index_path = os.path.join(folder, INDEX_FILE)
    weight_map: dict[str, str] | None = None
    if os.path.exists(index_path):
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise LoadError(f"{index_path} has no weight_map")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(folder, name)):
                raise LoadError(f"{folder} lacks {name}, which {INDEX_FILE} lists")
    else:
        files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        raise LoadError(
            f"{folder} holds no .safetensors files (a config-only folder: serve it with "
            "--load-format dummy, or plan it with moeserve plan)"
        )
    tensors: list[StoredTensor] = []
    for name in files:
        path = os.path.join(folder, name)
        try:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    shape = tuple(int(d) for d in sl.get_shape())
                    tensors.append(StoredTensor(key, name, shape, _ST_DTYPES.get(sl.get_dtype())))
        except (SafetensorError, OSError) as e:
            msg = str(e).replace("Error while deserializing header: ", "")
            raise LoadError(f"{path} is not a readable safetensors file ({msg})") from None
    return tensors, files, weight_map


# ---- the report --------------------------------------------------------------------------------
def _ranges(nums: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: list[str] = []
    nums = sorted(set(nums))
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ", ".join(out)


def _component(module_name: str) -> tuple[str, int | None]:
    """'model.layers.3.mlp.shared_experts.gate_proj' -> ('mlp.shared_experts.gate_proj', 3)."""
    m = _LAYER.search(module_name)
    if m is None:
        return module_name, None
    return module_name[m.end() :], int(m.group(1))


def _summarize(entries: Iterable[tuple[str, int | None]]) -> str:
    """Components with the layers they occur in, grouped by their first two name parts."""
    groups: dict[str, set[int]] = defaultdict(set)
    flat: set[str] = set()
    for comp, layer in entries:
        key = _group(comp)
        if layer is None:
            flat.add(key)
        else:
            groups[key].add(layer)
    parts = [f"{k} (layers {_ranges(v)})" for k, v in sorted(groups.items())]
    return ", ".join(parts + sorted(flat)) or "nothing"


def _group(component: str) -> str:
    """'mlp.experts.w13' -> 'mlp.experts', 'mlp.gate_proj' -> 'mlp', 'self_attn.o_proj' ->
    'self_attn'."""
    head = component.split(".")
    if head[0] == "mlp" and len(head) > 1 and head[1] in _MOE_PARTS:
        return ".".join(head[:2])
    return head[0]


def _quantizable_modules(model: nn.Module, quant: QuantConfig) -> list[tuple[str, bool]]:
    """(module name, stored quantized?) for every linear and expert bank of the model, and
    the LM head (always BF16 here). Shared experts that run as slots of the expert banks are
    listed by their checkpoint linears all the same: this describes the checkpoint."""
    out: list[tuple[str, bool]] = []
    for name, m in model.named_modules():
        method = getattr(m, "method", None)
        if hasattr(m, "prefix") and method is not None:
            out.append((name, not isinstance(method, UnquantizedLinearMethod)))
        elif name.endswith(".mlp.experts"):
            out.append((name, quant.moe_method(name) is not None))
            if getattr(getattr(m, "layout", None), "num_shared", 0):
                shared = name.removesuffix("experts") + "shared_experts"
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    linear = quant.linear_method(f"{shared}.{proj}")
                    out.append(
                        (f"{shared}.{proj}", not isinstance(linear, UnquantizedLinearMethod))
                    )
        elif name == "lm_head" or name.endswith(".mlp.gate"):
            out.append((name, False))  # the LM head and the router are kept in float here
    return out


def _pattern_matcher(quant: QuantConfig, pattern: str) -> QuantConfig | None:
    """A quant config of the same kind that excludes only `pattern` (to see what it hits)."""
    from moeserve.layers.quant.fp8_block import Fp8BlockConfig
    from moeserve.layers.quant.nvfp4 import CompressedTensorsNvfp4Config, ModelOptNvfp4Config

    if isinstance(quant, ModelOptNvfp4Config):
        return ModelOptNvfp4Config("W4A16_NVFP4", (pattern,), quant.aliases)
    if isinstance(quant, CompressedTensorsNvfp4Config):
        return CompressedTensorsNvfp4Config(False, (pattern,), quant.aliases)
    if isinstance(quant, Fp8BlockConfig):
        return Fp8BlockConfig((quant.scheme.block, quant.scheme.block), (pattern,))
    return None


def _unserved(pattern: str, num_layers: int) -> str:
    """What a pattern that hits no module of the text model is about."""
    if any(v in pattern for v in _VISION):
        return "the vision tower and projector (kept in BF16)"
    layers = [int(n) for n in re.findall(r"layers\.(\d+)", pattern)]
    if _MTP.search(pattern) or any(n >= num_layers for n in layers):
        return "MTP layers (served only as the draft model: --speculative-config method mtp)"
    return "matches no module of this model"


def _patterns(quant: QuantConfig) -> tuple[str, ...]:
    return tuple(getattr(quant, "patterns", None) or getattr(quant, "ignored", None) or ())


def _excluded_by(matcher: QuantConfig, module: str) -> bool:
    if module.endswith(".mlp.experts"):
        return matcher.moe_method(module) is None
    return isinstance(matcher.linear_method(module), UnquantizedLinearMethod)


def _describe_format(method: str, d: dict[str, Any], quant: QuantConfig, dtypes: Counter) -> str:
    if method == "modelopt":
        algo = str(d.get("quant_algo", "")).upper()
        kind = "W4A4" if algo == "NVFP4" else "W4A16"
        return f"nvfp4 ModelOpt {kind} (quant_algo {algo}, group {d.get('group_size', 16)})"
    if method == "compressed-tensors":
        kind = "W4A4" if getattr(quant.scheme, "activations", False) else "W4A16"
        return f"compressed-tensors nvfp4 {kind} (format {d.get('format')}, group 16)"
    if method == "fp8":
        block = d.get("weight_block_size")
        return f"fp8-block {block[0]}x{block[1]} (e4m3 weights, fp32 weight_scale_inv)"
    floats = {str(k).replace("torch.", ""): v for k, v in dtypes.items() if k in _FLOATS}
    main = max(floats, key=floats.get) if floats else "unknown"
    return f"{main} (unquantized)"


def _quant_source(folder: str, raw: dict[str, Any], method: str) -> list[str]:
    from moeserve.layers.quant.parse import MODELOPT_FILE

    qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if method == "none":
        return ["quant config: none"]
    if not os.path.exists(os.path.join(folder, MODELOPT_FILE)):
        return ["quant config: config.json quantization_config"]
    lines = [f"quant config: {MODELOPT_FILE}"]
    if isinstance(qc, dict):
        hf = _read_json(os.path.join(folder, MODELOPT_FILE)).get("quantization", {})
        a = set(hf.get("exclude_modules") or [])
        b = set(qc.get("ignore") or qc.get("exclude_modules") or [])
        if a == b and qc.get("quant_algo", hf.get("quant_algo")) == hf.get("quant_algo"):
            lines.append("  config.json quantization_config: present, agrees")
        else:
            lines.append(
                f"  config.json quantization_config: differs ({len(a ^ b)} exclude patterns "
                f"not in both); the loader reads {MODELOPT_FILE}"
            )
    return lines


def _expert_shard(shard: Any) -> tuple[int | None, int] | None:
    """A weight loader's shard id as (expert or None for all, part); None: not an expert."""
    if isinstance(shard, tuple) and len(shard) == 2:
        return shard
    if isinstance(shard, int):
        return shard, 0
    return None


def _dtype_problem(stored: StoredTensor, param: torch.Tensor) -> str | None:
    want, have = param.dtype, stored.dtype
    if have is None:
        return f"{stored.name} has a dtype torch cannot read"
    if want in _FLOATS:
        if have in _FLOATS:
            return None
        return (
            f"{stored.name} is stored as {str(have)[6:]} but the model expects a float tensor "
            "there: the quant config does not quantize this layer"
        )
    if have != want:
        return f"{stored.name} is stored as {str(have)[6:]}, the model expects {str(want)[6:]}"
    return None


def _route_one(model: nn.Module, name: str, t: torch.Tensor, skipped: dict[str, int]) -> list:
    """(param name, tensor, shard id) the loader makes of one checkpoint tensor."""
    route = getattr(model, "_route", None)
    if route is not None:
        return list(route([(name, t)], skipped))
    # Llama: names as they are, q/k/v and gate/up into their fused parameters (the rules of
    # LlamaForCausalLM.load_weights)
    if "rotary_emb.inv_freq" in name:
        skipped["other"] += 1
        return []
    if model.config.tie_word_embeddings and name == "lm_head.weight":
        return [(name, t, _TIED)]
    for fused, part, sid in getattr(model, "STACKED", []):
        if f".{part}." in name:
            return [(name.replace(f".{part}.", f".{fused}."), t, sid)]
    return [(name, t, None)]


_TIED = "tied"  # a tied LM head: the embedding's tensor, nothing to load
# what a weight loader raises for a tensor it cannot take
_LOADER_ERRORS = (ValueError, RuntimeError, IndexError, KeyError, TypeError)


class _LoadSimulation:
    """The loader's pass over a checkpoint, on the meta model: every stored tensor goes
    through the model's name mapping into its parameter's weight loader as a meta tensor."""

    def __init__(self, model: nn.Module, report: CheckReport) -> None:
        self.model = model
        self.report = report
        self.params = dict(model.named_parameters())
        self.loaded: dict[str, set] = defaultdict(set)  # param -> shard ids filled
        self.skipped: dict[str, int] = defaultdict(int)  # the model's own skip counters
        self.unused: list[str] = []  # names outside the text model

    def feed(self, stored: StoredTensor) -> None:
        before = self.skipped["other"]
        try:
            routed = _route_one(self.model, stored.name, stored.meta(), self.skipped)
        except _LOADER_ERRORS as e:
            self.report.problems.append(f"the loader cannot map {stored.name} ({e})")
            return
        if not routed and self.skipped["other"] > before:
            self.unused.append(stored.name)
        for pname, t, shard in routed:
            if shard != _TIED:
                self._load(stored, pname, t, shard)

    def _load(self, stored: StoredTensor, pname: str, t: torch.Tensor, shard: Any) -> None:
        problems = self.report.problems
        param = self.params.get(pname)
        if param is None:
            problems.append(f"{stored.name} matches no parameter of the model{self._why(pname)}")
            return
        problem = _dtype_problem(stored, param)
        if problem:
            problems.append(problem)
            return
        if shard is None and t.numel() != param.numel():
            problems.append(
                f"{stored.name} has shape {list(stored.shape)}, the model expects "
                f"{list(param.shape)}"
            )
            return
        try:
            if shard is None:
                param.weight_loader(param, t)
            else:
                param.weight_loader(param, t, shard)
        except _LOADER_ERRORS as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            problems.append(f"{stored.name} (shape {list(stored.shape)}) does not load: {msg}")
            return
        self.loaded[pname].add(shard)

    def _why(self, pname: str) -> str:
        """For a tensor with no parameter: how the quant config built the layer it names."""
        owner = pname.rsplit(".", 1)[0]
        try:
            method = getattr(self.model.get_submodule(owner), "method", None)
        except AttributeError:
            return ""
        if method is None:
            return ""
        kind = "unquantized" if isinstance(method, UnquantizedLinearMethod) else "quantized"
        return f" (the quant config makes {owner} {kind})"

    def missing(self) -> list[str]:
        """Parameters (and experts of stacked banks, parts of fused linears) that no
        checkpoint tensor fills."""
        out: list[str] = []
        for pname, p in self.params.items():
            shards = self.loaded.get(pname)
            optional = getattr(p, "optional", False)
            if not shards:
                if not optional:
                    out.append(pname)
                continue
            if None in shards or optional:
                continue  # a plain tensor, or one stacking every shard
            owner = self.model.get_submodule(pname.rsplit(".", 1)[0])
            if ".mlp.experts." not in pname:  # a fused linear: every part must be filled
                n_parts = len(getattr(owner, "output_sizes", ())) or 1
                if len(shards) < n_parts:
                    out.append(f"{pname} ({len(shards)} of {n_parts} fused parts)")
                continue
            experts = [_expert_shard(s) for s in shards]
            if any(e is None or e[0] is None for e in experts):
                continue  # a stacked [E, ...] checkpoint tensor fills every expert
            parts = getattr(owner, "parts", 1)
            want = {(e, part) for e in range(p.shape[0]) for part in range(parts)}
            lacking = sorted(want - set(experts))
            routed = owner.layout.num_experts  # later slots: the shared experts (moe.py)
            if any(e < routed for e, _ in lacking):
                ids = _ranges(e for e, _ in lacking if e < routed)
                out.append(f"{pname} (experts {ids})")
            if any(e >= routed for e, _ in lacking):
                shared = pname.split(".mlp.experts.")[0] + ".mlp.shared_experts"
                ids = _ranges(e for e, _ in lacking if e >= routed)
                out.append(f"{shared} (held as {pname} experts {ids})")
        return out


def check_folder(folder: str) -> CheckReport:
    from moeserve.layers.quant.parse import read_checkpoint_quant
    from moeserve.loader.source import describe_source
    from moeserve.plan import meta_model

    report = CheckReport()
    src = describe_source(folder, "hf")
    raw, cfg, quant, kv_algo = src.raw, src.config, src.quant, src.kv_cache_quant_algo
    tensors, files, weight_map = read_headers(folder)
    ckq = read_checkpoint_quant(folder, raw)

    total = sum(t.nbytes for t in tensors)
    report.lines.append(
        f"checkpoint: {folder}: {len(tensors):,} tensors in {len(files)} safetensors file(s)"
        + (" with an index" if weight_map is not None else "")
        + f", {total / (1 << 30):.2f} GiB"
    )
    archs = raw.get("architectures") or [raw.get("model_type")]
    kind = "MoE" if cfg.moe is not None else "dense"
    what = ARCHITECTURES.by_name(cfg.architecture).description
    desc = (
        f"architecture: {archs[0]} -> {cfg.architecture}, {what} ({kind}, "
        f"{cfg.num_hidden_layers} layers"
    )
    if cfg.moe is not None:
        dense = sum(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        desc += (
            f": {dense} dense + {cfg.num_hidden_layers - dense} MoE, {cfg.moe.n_routed_experts} "
            f"routed experts, top-{cfg.moe.num_experts_per_tok}"
        )
    desc += ")" + (f", text weights under {cfg.weight_prefix}" if cfg.weight_prefix else "")
    report.lines.append(desc)
    dtypes = Counter()
    for t in tensors:
        dtypes[t.dtype] += t.nbytes
    report.lines.append("format: " + _describe_format(ckq.method, ckq.description, quant, dtypes))
    report.lines += _quant_source(folder, raw, ckq.method)

    model = meta_model(cfg, quant, cfg.dtype)
    modules = _quantizable_modules(model, quant)
    quantized = [_component(n) for n, q in modules if q]
    report.quantized = {(_group(c), layer) for c, layer in quantized if layer is not None}
    plain = [_component(n) for n, q in modules if not q]
    report.lines.append(f"stored quantized: {_summarize(quantized)}")
    report.lines.append(f"stored unquantized: {_summarize(plain)}")
    for pattern in _patterns(quant):
        matcher = _pattern_matcher(quant, pattern)
        hits = [_component(n) for n, _ in modules if matcher and _excluded_by(matcher, n)]
        target = _summarize(hits) if hits else _unserved(pattern, cfg.num_hidden_layers)
        report.lines.append(f"  excluded {pattern!r}: {target}")

    # route every stored tensor through the loader's own mapping and weight loaders
    sim = _LoadSimulation(model, report)
    seen: dict[str, str] = {}
    for t in tensors:
        if t.name in seen:
            report.problems.append(f"{t.name} is stored twice ({seen[t.name]} and {t.file})")
            continue
        seen[t.name] = t.file
        sim.feed(t)
    if weight_map is not None:
        wrong = [n for n, f in weight_map.items() if seen.get(n) != f]
        if wrong:
            report.problems.append(
                f"the index lists {len(wrong)} tensor(s) in files that do not hold them, e.g. "
                f"{wrong[0]} in {weight_map[wrong[0]]}"
            )
    missing = sim.missing()
    vision_line, no_vision = _vision_report(cfg, sim, tensors)
    if no_vision:  # a vision config without its tensors: served as text only
        missing = [m for m in missing if not m.startswith("vision.")]
    if vision_line:
        report.lines.append(vision_line)
    if missing:
        report.problems.append(
            f"{len(missing)} tensor(s) the model needs are missing, e.g. "
            + "; ".join(missing[:EXAMPLES])
        )
    skipped, unused = sim.skipped, sim.unused
    used = len(tensors) - len(unused) - sum(v for k, v in skipped.items() if k != "other")
    notes = []
    if skipped.get("vision"):
        notes.append(f"{skipped['vision']} vision tower / projector (skipped)")
    if skipped.get("layers"):
        notes.append(
            f"{skipped['layers']} of layers >= {cfg.num_hidden_layers} (MTP, skipped; the draft "
            "model of --speculative-config method mtp)"
        )
    if unused:
        notes.append(f"{len(unused)} outside the text model (unused), e.g. {unused[0]}")
    report.lines.append(f"tensors: {used:,} used" + "".join(f", {n}" for n in notes))
    report.lines.append("KV cache: " + _kv_scheme(model, kv_algo, sim.loaded))
    return report


def _vision_report(cfg: Any, sim: _LoadSimulation, tensors: list) -> tuple[str, bool]:
    """The line about Kimi-K2.5's vision encoder, and whether its tensors are all absent."""
    if cfg.vision is None:
        return "", False
    v = cfg.vision
    params = [n for n in sim.params if n.startswith("vision.")]
    filled = [n for n in params if sim.loaded.get(n)]
    stored = sum(1 for t in tensors if t.name.startswith(_VISION))
    what = (
        f"MoonViT {v.num_hidden_layers} layers, width {v.hidden_size}, patch {v.patch_size}, "
        f"{v.merge_kernel_size[0]}x{v.merge_kernel_size[1]} merge -> {v.text_hidden_size}"
    )
    if not filled:
        return f"vision: {what}; no vision tensors stored, served as text only", True
    n = sum(sim.params[p].numel() for p in params)
    return (
        f"vision: {what}; {stored} tensors ({n / 1e6:.1f}M parameters) fill {len(filled)} of "
        f"{len(params)} encoder parameters; image input served",
        False,
    )


def _kv_scheme(model: nn.Module, algo: str | None, loaded: dict[str, set]) -> str:
    layers = [n for n, _ in model.named_parameters() if n.endswith(".self_attn.kv_scale")]
    scaled = sum(1 for n in layers if loaded.get(n))
    if algo == "FP8":
        if scaled:
            return f"FP8 (kv_cache_quant_algo FP8), k/v scales for {scaled} of {len(layers)} layers"
        return "FP8 (kv_cache_quant_algo FP8) without scales (1.0 is used)"
    if scaled:
        return (
            f"none declared; k/v scales for {scaled} layers are present (used with "
            "--kv-cache-dtype fp8)"
        )
    return "none declared (the cache follows --kv-cache-dtype; auto: the model dtype)"


# ---- GGUF -------------------------------------------------------------------------------------
def check_gguf(path: str) -> CheckReport:
    from moeserve.loader.gguf import SUPPORTED_TYPES
    from moeserve.loader.source import describe_source

    src = describe_source(path, "gguf")
    arch = src.gguf_arch
    report = CheckReport()
    types = Counter(t.type_name for t in src.gguf_tensors)
    total = sum(t.n_bytes for t in src.gguf_tensors)
    report.lines.append(
        f"checkpoint: {path}: GGUF, {len(src.gguf_tensors):,} tensors, {total / (1 << 30):.2f} GiB"
    )
    served = ""
    try:
        entry = ARCHITECTURES.lookup_gguf(arch)
        served = f" -> {entry.name}, {entry.description}"
    except ConfigError as e:
        report.problems.append(str(e))
    name = src.raw.get("general.name") or "unnamed"
    report.lines.append(f"architecture: {arch} ({name}){served}")
    report.lines.append("format: GGUF " + ", ".join(f"{k} x{v}" for k, v in sorted(types.items())))
    bad = sorted(k for k in types if k not in SUPPORTED_TYPES)
    if bad:
        report.problems.append(f"quant type(s) {', '.join(bad)} are not supported")
    blocks = src.raw.get(f"{arch}.block_count")
    if isinstance(blocks, int):
        present = {
            int(m.group(1)) for t in src.gguf_tensors if (m := re.match(r"blk\.(\d+)\.", t.name))
        }
        lacking = sorted(set(range(blocks)) - present)
        if lacking:
            report.problems.append(
                f"{arch}.block_count is {blocks} but layers {_ranges(lacking)} have no tensors"
            )
    if arch == "deepseek2":
        nextn = src.raw.get("deepseek2.nextn_predict_layers", 0)
        report.lines.append(
            f"MTP: {nextn} nextn block(s) (the draft model of --speculative-config method mtp)"
            if nextn
            else "MTP: none (llama.cpp's deepseek2 converter drops DeepSeek-V3's MTP layer)"
        )
    report.lines.append("tensor names: header-level check only for GGUF")
    return report


def check_checkpoint(path: str) -> CheckReport:
    """The report for a folder (HF safetensors, or one holding a single .gguf) or a .gguf."""
    from moeserve.loader import resolve_model_path
    from moeserve.loader.source import source_kind

    resolved = resolve_model_path(path)
    try:
        return _CHECKS[source_kind(resolved)](resolved)
    except ConfigError as e:
        raise LoadError(f"{path}: {e}") from None


def _check_hf(folder: str) -> CheckReport:
    """A checkpoint folder: a served model's, or an EAGLE-3 draft head's."""
    from moeserve.models.eagle3 import is_eagle3_config

    if is_eagle3_config(_read_json(os.path.join(folder, "config.json"))):
        return check_eagle3_folder(folder)
    return check_folder(folder)


def check_eagle3_folder(folder: str) -> CheckReport:
    """An EAGLE-3 draft head's folder: what it is, and every stored tensor routed to the
    head's parameters (shapes compared; merged q/k/v, q_a + kv_a and gate + up by name)."""
    from moeserve.loader.eagle3 import describe_draft
    from moeserve.models.eagle3 import Eagle3DraftHead

    tensors, files, _ = read_headers(folder)
    draft = describe_draft(folder)
    cfg = draft.config
    report = CheckReport()
    total = sum(t.nbytes for t in tensors)
    report.lines += [
        f"{folder}: {draft.describe()}",
        f"{len(tensors)} tensors in {len(files)} file(s), {total / 2**20:.1f} MiB; a draft "
        "model: serve it beside its target with --speculative-config "
        f'{{"method": "eagle3", "model": "{folder}"}}',
    ]
    if draft.quantized:
        report.problems.append("quantized EAGLE-3 heads are not supported (BF16/FP16 ones are)")
    with torch.device("meta"):
        head = Eagle3DraftHead(
            cfg,
            cfg.layer.vocab_size,
            own_embed=draft.own_embed,
            own_head=draft.own_head(cfg.layer.vocab_size),
        )
    params = dict(head.named_parameters())
    merged = ("qkv_proj", "fused_qkv_a_proj", "gate_up_proj")
    parts = {"q_proj", "k_proj", "v_proj", "q_a_proj", "kv_a_proj_with_mqa"}
    parts |= {"gate_proj", "up_proj"}
    seen: set[str] = set()
    for t in tensors:
        name = head.checkpoint_name(t.name)
        if name is None or name == "d2t":
            continue
        part = next((p for p in parts if f".{p}." in name), None)
        if part is not None:
            fused = next(
                (name.replace(f".{part}.", f".{m}.") for m in merged
                 if name.replace(f".{part}.", f".{m}.") in params),
                None,
            )  # fmt: skip
            if fused is not None:
                seen.add(fused)
                continue
        param = params.get(name)
        if param is None:
            report.problems.append(f"tensor {t.name} matches no parameter of the head")
        elif tuple(param.shape) != t.shape:
            report.problems.append(
                f"tensor {t.name} is {list(t.shape)}, the head's config gives {list(param.shape)}"
            )
        else:
            seen.add(name)
    for name, p in params.items():
        if name not in seen and not getattr(p, "optional", False):
            report.problems.append(f"the folder lacks {name}")
    return report


# ---- CLI ----------------------------------------------------------------------------------------
def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="an HF checkpoint folder or a .gguf file")


def run_check(args: argparse.Namespace) -> int:
    import sys

    from moeserve.plan import quiet_logs

    with quiet_logs():
        report = check_checkpoint(args.model)
    print("\n".join(report.lines))
    for p in report.collapsed_problems():
        print(f"moeserve: problem: {p}", file=sys.stderr)
    print("loadable: yes" if report.loadable else f"loadable: no ({len(report.problems)} problems)")
    return 0 if report.loadable else 2


# the report of each kind of model path (moeserve.loader.source.source_kind)
_CHECKS = {"gguf": check_gguf, "hf": _check_hf}
