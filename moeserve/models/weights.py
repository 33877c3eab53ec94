"""Shared name-mapping for `load_weights`: checkpoint names -> (parameter, shard id)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

from moeserve.layers.contract import ProcessesWeights

log = logging.getLogger(__name__)

# (fused parameter name part, checkpoint name part, shard id)
StackedRule = tuple[str, str, str | int]


def load_weights_by_rules(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: list[StackedRule],
    rename: Callable[[str], str | None] = lambda n: n,
) -> set[str]:
    """Feed each checkpoint tensor to its parameter's `weight_loader`.

    `rename` maps a checkpoint name to the model's name space (None: skip the tensor).
    Returns the names of the parameters that received data; raises on an unknown name.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None:
            continue
        shard = None
        for fused, part, sid in stacked:
            if f".{part}." in name:
                name, shard = name.replace(f".{part}.", f".{fused}."), sid
                break
        param = params.get(name)
        if param is None:
            raise KeyError(f"checkpoint tensor {ckpt_name!r} matches no parameter ({name!r})")
        param.weight_loader(param, tensor, shard) if shard is not None else param.weight_loader(
            param, tensor
        )
        loaded.add(name)
    return loaded


def finish_loading(model: nn.Module) -> None:
    """Let every layer repack its weights for its kernels once all tensors are in."""
    for m in model.modules():
        if isinstance(m, ProcessesWeights) and m is not model:
            m.process_weights_after_loading()
