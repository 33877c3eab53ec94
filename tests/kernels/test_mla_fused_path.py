"""The MLA layer's kernel path (merged a-GEMM, paired a-norms, fused rope + cache write,
absorbed decode and prefill kernels) against its torch path, on a tiny model with the
published 512 + 64 latent layout, run under the Triton interpreter on a CPU.

The torch path is the oracle (tests/models check it against HF transformers). Batches mix
decodes and prefill chunks in the runner's order (single-token sequences first), and in the
other order too (still correct, only slower on a GPU). Tolerance: the kernels take q and the
probabilities in bf16 (measured error ~1e-3 of the logits' range here).
"""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import moeserve.kernels.attention.kv_cache as kv_mod  # noqa: E402
import moeserve.kernels.attention.mla_decode as dec_mod  # noqa: E402
import moeserve.kernels.attention.mla_prefill as pre_mod  # noqa: E402
import moeserve.kernels.elementwise.norm as norm_mod  # noqa: E402
from moeserve.layers.attention.metadata import AttentionMetadata  # noqa: E402
from moeserve.layers.attention.mla_backends import TorchMLA, TritonMLA  # noqa: E402
from moeserve.models.deepseek_v3 import DeepseekV3ForCausalLM  # noqa: E402
from moeserve.models.registry import config_from_hf
from tests.kernels.interpreter_shims import install_interpreter_shims  # noqa: E402
from tests.kernels.rounding_shim import install_bf16_rounding_shim  # noqa: E402
from tests.models.helpers import YARN, PagedRunner, tiny_hf_config  # noqa: E402

install_interpreter_shims()
install_bf16_rounding_shim()
for _mod, _kernel in (
    (kv_mod, "_write_mla_cache_kernel"),
    (dec_mod, "_mla_decode_split_kernel"),
    (pre_mod, "_mla_prefill_kernel"),
    (norm_mod, "_rms_norm_pair_kernel"),
):
    if not isinstance(getattr(_mod, _kernel), InterpretedFunction):
        importlib.reload(_mod)

CFG = tiny_hf_config(
    hidden_size=32,
    num_attention_heads=3,
    q_lora_rank=24,
    kv_lora_rank=512,
    qk_nope_head_dim=16,
    qk_rope_head_dim=64,
    v_head_dim=16,
    num_hidden_layers=2,
    vocab_size=64,
    n_routed_experts=4,
    n_group=2,
    topk_group=1,
    rope_scaling=YARN,
    max_position_embeddings=64 * 40,
)
REL_TOL = 0.01  # of the largest |logit|


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(config_from_hf(CFG))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    assert all(a.fused_qkv_a_proj is not None for a in m.attention_layers())
    return m


def _set_kernels(model, on: bool) -> None:
    """The Triton MLA backend (under the interpreter here) or the torch one."""
    for layer in model.attention_layers():
        layer.use_backend(TritonMLA if on else TorchMLA)


def _script(runner: PagedRunner, kernels: bool, calls: dict) -> list[torch.Tensor]:
    """Prefill two prompts, then mixed steps: decode + prefill chunk (runner order), a
    chunk over cached context, batched decode, and a prefill listed before a decode."""
    a, b, c = runner.add_sequence(), runner.add_sequence(), runner.add_sequence()
    out = [runner.step({a: [3, 9, 27, 17, 5, 40, 41]})]
    out.append(runner.step({a: [8], b: [11, 12, 13, 14, 15]}))  # decode first, then prefill
    out.append(runner.step({b: [16, 17, 18, 19]}))  # a chunk over 5 cached tokens
    out.append(runner.step({a: [30], b: [31]}))  # batched decode, different lengths
    out.append(runner.step({c: [50, 51, 52], a: [33]}))  # prefill before a decode
    return out


@torch.no_grad()
def test_kernel_path_matches_torch_path(model, monkeypatch):
    calls = {"decode": [], "prefill": [], "write": 0, "pair": 0}
    real_dec, real_pre = dec_mod.mla_decode, pre_mod.mla_prefill
    real_write, real_pair = kv_mod.write_mla_cache, norm_mod.rms_norm_pair

    def dec(q, *a, **k):
        calls["decode"].append(q.shape[0])
        return real_dec(q, *a, **k)

    def pre(q, kv, cu, *a, **k):
        calls["prefill"].append(cu.shape[0] - 1)
        return real_pre(q, kv, cu, *a, **k)

    def write(*a, **k):
        assert a[5] is not None  # the rope stage rides along
        calls["write"] += 1
        return real_write(*a, **k)

    def pair(*a, **k):
        calls["pair"] += 1
        return real_pair(*a, **k)

    monkeypatch.setattr(dec_mod, "mla_decode", dec)
    monkeypatch.setattr(pre_mod, "mla_prefill", pre)
    monkeypatch.setattr(kv_mod, "write_mla_cache", write)
    monkeypatch.setattr(norm_mod, "rms_norm_pair", pair)

    _set_kernels(model, False)
    ref = _script(PagedRunner(model, page_size=4, seed=1), False, calls)
    assert calls == {"decode": [], "prefill": [], "write": 0, "pair": 0}
    _set_kernels(model, True)
    try:
        got = _script(PagedRunner(model, page_size=4, seed=2), True, calls)
    finally:
        _set_kernels(model, False)
    # per layer: step 1 prefill; step 2 decode 1 + prefill 1; step 3 prefill; step 4 decode 2;
    # step 5 the leading run is empty (prefill first): all through the prefill kernel
    assert calls["decode"] == [1, 1, 2, 2]
    assert calls["prefill"] == [1, 1, 1, 1, 1, 1, 2, 2]
    assert calls["write"] == 10 and calls["pair"] == 10
    scale = max(float(r.abs().max()) for r in ref)
    worst = max(float((g - r).abs().max()) for g, r in zip(got, ref, strict=True))
    print(f"kernel vs torch path: max |logit diff| {worst:.2e} of max |logit| {scale:.2f}")
    assert worst < REL_TOL * scale


def test_metadata_decode_run():
    def md(qlens):
        z = torch.zeros(1)
        return AttentionMetadata(z, z, z, z, 4, [1] * len(qlens), qlens)

    assert md([1, 1, 5, 1]).num_decode_seqs == 2
    assert md([1, 1, 5, 1]).max_prefill_query_len == 5
    assert md([3, 1]).num_decode_seqs == 0
    assert md([1, 1]).num_decode_seqs == 2 and md([1, 1]).max_prefill_query_len == 0
