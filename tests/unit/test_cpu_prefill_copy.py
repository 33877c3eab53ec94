"""CPU weight-only layers' bf16 prefill copy: the same weights the int4/int8 kernels apply
(the kernels are the oracle), used only for many rows and never in deterministic mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moeserve.layers.quant.cpu import PREFILL_ROWS, Int4WeightOnlyMethod, Int8WeightOnlyMethod


def _layer(method, k: int, n: int, seed: int):
    """A bf16 layer of `method` with random weights, processed as after loading."""
    torch.manual_seed(seed)
    m = method()
    layer = nn.Module()
    m.create_weights(layer, k, n, torch.bfloat16)
    layer.weight.data.normal_()
    m.process_weights_after_loading(layer)
    return m, layer


@pytest.mark.parametrize("method", [Int4WeightOnlyMethod, Int8WeightOnlyMethod])
def test_prefill_copy_applies_the_kernels_weights(method):
    m, layer = _layer(method, 96, 48, seed=0)
    x = torch.randn(PREFILL_ROWS + 3, 96).bfloat16()
    dense = m.apply(layer, x).float()
    layer.batch_invariant = True  # deterministic: the weight-only kernel for every row count
    kernel = m.apply(layer, x).float()
    assert not torch.equal(dense, kernel)  # really two paths
    assert (dense - kernel).abs().max() <= 0.01 * kernel.abs().max()
    layer.batch_invariant = False
    few = x[: PREFILL_ROWS - 1]  # decode-sized batches keep the kernel
    assert torch.equal(m.apply(layer, few), kernel[: PREFILL_ROWS - 1].bfloat16())


@pytest.mark.parametrize("rows", [PREFILL_ROWS, PREFILL_ROWS + 1, 3 * PREFILL_ROWS - 5])
def test_dense_rows_padded_to_whole_blocks_give_the_unpadded_product(rows):
    m, layer = _layer(Int8WeightOnlyMethod, 64, 32, seed=1)
    x = torch.randn(2, rows, 64).bfloat16()  # leading dims kept
    out = m.apply(layer, x)
    assert out.shape == (2, rows, 32)
    ref = x.float() @ layer.dense.float().T  # fp32 oracle of the same weights
    assert (out.float() - ref).abs().max() <= 0.02 * ref.abs().max()
