"""HF checkpoint folder (config.json + safetensors, single or sharded) -> `LoadedModel`.

Formats: BF16/FP16/FP32, DeepSeek block-FP8, ModelOpt NVFP4 (W4A4 / W4A16) and
compressed-tensors NVFP4; the checkpoint's own description picks the quant config
(`layers/quant/parse.py`). Weights stay in their stored format; tensors stream from the
memory-mapped files one at a time. `load_format="dummy"` builds the same model in its
serving format from config.json alone, with random weights.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from moeserve.config import ConfigError, ModelConfig
from moeserve.errors import LoadError
from moeserve.layers.quant.base import QuantConfig
from moeserve.loader.base import LoadedModel, LoadRequest, build_model, resolve_kv_cache_dtype
from moeserve.loader.source import describe_source
from moeserve.models.registry import model_class
from moeserve.models.weights import finish_loading

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# dummy weights: std of random floats, and the amplitude they dequantize to
_DUMMY_STD = 0.02


def checkpoint_files(folder: str) -> list[str]:
    """The safetensors files of a checkpoint, from the index when there is one."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        raise LoadError(f"{folder} holds no .safetensors files")
    missing = [n for n in files if not os.path.exists(os.path.join(folder, n))]
    if missing:
        raise LoadError(f"{folder} lacks {missing[0]} (listed in {INDEX_FILE})")
    return [os.path.join(folder, n) for n in files]


@dataclass
class ReadStats:
    """Bytes this process read from checkpoint tensors (each rank reads only its slices)."""

    bytes_read: int = 0
    tensors: int = 0


class LazyTensor:
    """A checkpoint tensor not read yet: `narrow`, `select` and basic slicing stay lazy, and
    `materialize()` reads only the selected part from the file (safetensors `get_slice`)."""

    def __init__(
        self,
        handle: Any,
        name: str,
        shape: tuple[int, ...],
        stats: ReadStats,
        index: tuple[slice | int, ...] | None = None,
    ) -> None:
        self._handle = handle
        self._name = name
        self._full = shape
        self._index = index if index is not None else tuple(slice(0, n) for n in shape)
        self._stats = stats
        # the dims that survive the index (an int index drops its dim)
        self._dims = [i for i, ix in enumerate(self._index) if isinstance(ix, slice)]
        self.shape = torch.Size(
            self._index[i].stop - self._index[i].start
            for i in self._dims  # type: ignore[union-attr]
        )

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def _with(self, dim: int, ix: slice | int) -> LazyTensor:
        if dim < 0:
            dim += self.dim()
        src = self._dims[dim]
        cur = self._index[src]
        assert isinstance(cur, slice)
        if isinstance(ix, int):
            new: slice | int = cur.start + (ix if ix >= 0 else self.shape[dim] + ix)
        else:
            start, stop, step = ix.indices(self.shape[dim])
            if step != 1:
                raise ValueError("lazy checkpoint slices take unit steps only")
            new = slice(cur.start + start, cur.start + max(start, stop))
        index = list(self._index)
        index[src] = new
        return LazyTensor(self._handle, self._name, self._full, self._stats, tuple(index))

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        return self._with(dim, slice(start, start + length))

    def select(self, dim: int, index: int) -> LazyTensor:
        return self._with(dim, index)

    def __getitem__(self, key: Any) -> LazyTensor:
        key = key if isinstance(key, tuple) else (key,)
        out = self
        dim = 0
        for k in key:
            if k is Ellipsis:
                raise ValueError("lazy checkpoint slices do not take ...")
            out = out._with(dim, k)
            dim += isinstance(k, slice)
        return out

    def materialize(self) -> torch.Tensor:
        sl = self._handle.get_slice(self._name)
        # safetensors slices take slices only: read int-indexed dims as length 1, then drop
        key = tuple(slice(i, i + 1) if isinstance(i, int) else i for i in self._index)
        t = sl[key].reshape(self.shape)
        self._stats.bytes_read += t.numel() * t.element_size()
        self._stats.tensors += 1
        return t


def iterate_tensors(
    files: list[str], progress: bool = True, stats: ReadStats | None = None
) -> Iterator[tuple[str, LazyTensor]]:
    """(name, lazy tensor) for every tensor of every file, one file open at a time
    (memory-mapped); a tensor's bytes are read when a weight loader materializes its slice."""
    stats = stats if stats is not None else ReadStats()
    counts = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            counts.append(len(list(f.keys())))
    bar = tqdm(total=sum(counts), desc="Loading weights", unit="tensor", disable=not progress)
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                shape = tuple(f.get_slice(name).get_shape())
                yield name, LazyTensor(f, name, shape, stats)
                bar.update(1)
    bar.close()


def _dummy_fill(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights that dequantize to ~N(0, 0.02) whatever the stored format, generated in
    place where the parameters live (a full-size layer in seconds on a GPU, no full-size
    temporaries)."""
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = gens.get(p.device)
            if gen is None:
                gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            leaf = name.rsplit(".", 1)[-1]
            if p.dtype == torch.uint8:
                p.random_(0, 256, generator=gen)
            elif p.dtype == torch.float8_e4m3fn:
                if leaf == "weight":  # block-FP8 codes, scaled by weight_scale_inv below
                    for rows in _row_chunks(p):
                        rows.copy_(
                            torch.randn(rows.shape, generator=gen, device=p.device).clamp_(-4, 4)
                        )
                else:  # FP4 block scales
                    p.fill_(1.0)
            elif leaf in ("weight_scale_2", "input_scale"):
                p.fill_(_DUMMY_STD / 2)
            elif leaf in ("weight_global_scale", "input_global_scale"):
                p.fill_(2 / _DUMMY_STD)
            elif leaf == "weight_scale_inv":
                p.fill_(_DUMMY_STD)
            elif leaf == "kv_scale":
                p.fill_(1.0)
            elif "norm" in name:
                p.fill_(1.0)
            elif leaf == "e_score_correction_bias":
                p.zero_()
            else:
                p.normal_(0.0, _DUMMY_STD, generator=gen)


def _row_chunks(p: torch.Tensor, elements: int = 1 << 26) -> Iterator[torch.Tensor]:
    """Views of `p` along its first dim, each about `elements` large (bounded temporaries)."""
    flat = p.view(-1, p.shape[-1]) if p.dim() > 1 else p.view(1, -1)
    step = max(1, elements // max(1, flat.shape[1]))
    for start in range(0, flat.shape[0], step):
        yield flat[start : start + step]


def _describe(cfg: ModelConfig, quant: QuantConfig, dtype: torch.dtype, kv: torch.dtype) -> str:
    kind = "MoE" if cfg.moe is not None else "dense"
    return (
        f"{cfg.architecture} ({kind}, {cfg.num_hidden_layers} layers), weights {quant.name}, "
        f"compute {str(dtype).replace('torch.', '')}, kv cache {str(kv).replace('torch.', '')}"
    )


def load_safetensors_model(request: LoadRequest, stats: ReadStats | None = None) -> LoadedModel:
    """Build the model of an HF checkpoint folder on the request's device and load this rank's
    slices of its weights in their stored format (each slice read once, straight into its
    parameter; `stats` counts the bytes read)."""
    from moeserve.tokenizer.hf import load_hf_tokenizer

    path, dtype, load_format = request.path, request.dtype, request.load_format
    try:
        src = describe_source(path, request.kind)
    except ConfigError as e:
        raise LoadError(str(e)) from None
    cfg, quant = src.config, src.quant
    if request.mtp:
        try:
            cfg = cfg.with_mtp()
        except ConfigError as e:
            raise LoadError(str(e)) from None
    if request.num_layers is not None:
        cfg = cfg.with_layers(request.num_layers)
    kv_dtype = resolve_kv_cache_dtype(request.kv_cache_dtype, src.kv_cache_quant_algo, dtype)
    model, plan = build_model(
        model_class(cfg.architecture),
        cfg,
        quant,
        dtype,
        request.device,
        kv_dtype,
        request.planning,
        request.tp,
    )
    kv_dtype = plan.kv_cache_dtype
    if load_format == "dummy":
        _dummy_fill(model, request.seed)
        finish_loading(model)
    elif load_format in ("auto", "safetensors"):
        loaded = model.load_weights(iterate_tensors(checkpoint_files(path), stats=stats))
        missing = [
            n
            for n, p in model.named_parameters()
            if n not in loaded and not getattr(p, "optional", False)
        ]
        if missing:
            raise LoadError(f"checkpoint {path} lacks {len(missing)} weights, e.g. {missing[0]!r}")
    else:
        raise LoadError(f"unknown load format {load_format!r}; use auto or dummy")
    model = model.eval()
    tokenizer = load_hf_tokenizer(path)
    desc = _describe(cfg, quant, dtype, kv_dtype)
    return LoadedModel(model, tokenizer, cfg, kv_dtype, desc, plan, quant)
