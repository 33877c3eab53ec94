"""An EAGLE-3 draft head's folder (config.json + safetensors) -> its module, built for a loaded
target: the head's own kernel plan, its weights (BF16/FP16/FP32 as published; `dummy`: random,
from config.json alone), the target's embedding / LM head where the folder has none, and the
target layers whose hidden states it reads (moeserve/models/eagle3.py)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import torch

from moeserve.config import ConfigError
from moeserve.errors import LoadError
from moeserve.layers.kernel_plan import Hardware, apply_kernel_plan, resolve_kernel_plan
from moeserve.loader.base import DEFAULT_PLANNING, LoadedModel, Planning
from moeserve.loader.source import read_config_json
from moeserve.models.eagle3 import Eagle3Config, Eagle3DraftHead, head_cache_dtype
from moeserve.parallel.groups import SINGLE, TPGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftFolder:
    """What an EAGLE-3 folder holds, read without its weights (`moeserve check` / `plan`); a
    folder of config.json alone describes a head for dummy weights."""

    path: str
    config: Eagle3Config
    names: frozenset[str]  # its tensor names (empty: config.json only)
    quantized: bool

    @property
    def own_embed(self) -> bool:
        return any(n.endswith("embed_tokens.weight") for n in self.names)

    def own_head(self, target_vocab: int) -> bool:
        """Whether the head has its own LM head: stored, or (config only) needed because its
        vocabulary is not the target's."""
        if not self.names:
            return self.config.draft_vocab_size != target_vocab
        return "lm_head.weight" in self.names or "model.lm_head.weight" in self.names

    def describe(self) -> str:
        c = self.config
        kind = "MLA" if c.kind == "mla" else "Llama-style"
        ids = list(c.aux_layer_ids) if c.aux_layer_ids else "default (2, L // 2, L - 3)"
        owned = (("embedding", self.own_embed), ("lm_head", self.own_head(c.layer.vocab_size)))
        shared = [n for n, own in owned if not own]
        return (
            f"EAGLE-3 draft head ({kind}, hidden {c.hidden_size}, draft vocabulary "
            f"{c.draft_vocab_size}{', d2t' if 'd2t' in self.names else ''}), reads target layers "
            f"{ids}" + (f"; uses the target's {' and '.join(shared)}" if shared else "")
        )


def describe_draft(path: str) -> DraftFolder:
    """The folder's config and tensor names; one sentence on any problem."""
    from moeserve.loader.safetensors import checkpoint_files, iterate_tensors
    from moeserve.loader.validate import validate_folder

    if not os.path.isdir(path):
        raise LoadError(f"EAGLE-3 draft path {path} is not a folder")
    raw = read_config_json(path)
    try:
        cfg = Eagle3Config.from_hf(raw)
    except ConfigError as e:
        raise LoadError(f"{path}: {e}") from None
    names: frozenset[str] = frozenset()
    if any(n.endswith(".safetensors") for n in os.listdir(path)):
        validate_folder(path)
        names = frozenset(n for n, _ in iterate_tensors(checkpoint_files(path), progress=False))
    return DraftFolder(path, cfg, names, quantized=bool(raw.get("quantization_config")))


def load_eagle3_draft(
    path: str,
    target: LoadedModel,
    dtype: torch.dtype,
    device: str,
    tp: TPGroup = SINGLE,
    planning: Planning = DEFAULT_PLANNING,
    load_format: str = "auto",
) -> Eagle3DraftHead:
    """The head in `path`, built on `device` for `target` and loaded."""
    from moeserve.loader.safetensors import _dummy_fill, checkpoint_files, iterate_tensors

    dummy = load_format == "dummy"
    folder = describe_draft(path)
    if dummy:  # random weights: as a folder of config.json alone
        folder = replace(folder, names=frozenset())
    elif not folder.names:
        raise LoadError(
            f"EAGLE-3 head {path} holds no .safetensors files (serve it with --load-format dummy)"
        )
    if folder.quantized:
        raise LoadError(f"{path}: quantized EAGLE-3 heads are not supported (BF16/FP16 ones are)")
    cfg = folder.config
    try:
        aux = cfg.aux_layers(target.config)
        hardware = planning.hardware or Hardware.of(device)
        kv = head_cache_dtype(cfg, target.kv_cache_dtype, dtype)
        settings = replace(planning.settings, act_dtype=dtype, kv_cache_dtype=kv)
        plan = resolve_kernel_plan(cfg.layer, None, hardware, settings)
        vocab = target.config.vocab_size
        with torch.device(device):
            head = Eagle3DraftHead(
                cfg, vocab, tp, dtype, own_embed=folder.own_embed, own_head=folder.own_head(vocab)
            )
        head.share_target(target.model.model.embed_tokens, target.model.lm_head)
    except ConfigError as e:
        raise LoadError(f"{path}: {e}") from None
    apply_kernel_plan(head, plan)
    head.aux_layer_ids = aux
    head.kv_cache_dtype = plan.kv_cache_dtype
    if dummy:
        _dummy_fill(head)
        head.load_weights([])
    else:
        try:
            loaded = head.load_weights(iterate_tensors(checkpoint_files(path), progress=False))
        except (KeyError, ConfigError) as e:
            raise LoadError(f"{path}: {e}") from None
        missing = [
            n
            for n, p in head.named_parameters()
            if n not in loaded and not getattr(p, "optional", False)
        ]
        if missing:
            raise LoadError(
                f"EAGLE-3 head {path} lacks {len(missing)} weights, e.g. {missing[0]!r}"
            )
    log.info("speculative decoding: %s", folder.describe())
    return head.eval()
