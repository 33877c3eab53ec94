"""DeepseekV3ForCausalLM against HF transformers (fp32): prefill, absorbed decode over a paged
cache with a permuted page table, batched mixed steps, greedy generation, FP8 latent cache."""

from __future__ import annotations

import pytest
import torch

from moeserve.layers.routing import select_experts
from moeserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from moeserve.models.registry import config_from_hf
from tests.models.helpers import YARN, PagedRunner, build_hf_model, hf_greedy, tiny_hf_config

TOL = 1e-3

CONFIGS = {
    # DeepSeek-V3-like: 4 groups keep 2, one leading dense layer, YaRN with both mscales
    "v3_groups_yarn": tiny_hf_config(rope_scaling=YARN, max_position_embeddings=64 * 40),
    # Kimi-like: one group, YaRN factor 64, rope_theta 50000, routed scale 2.827
    "kimi_one_group": tiny_hf_config(
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        rope_theta=50000.0,
        rope_scaling={**YARN, "factor": 64.0},
        max_position_embeddings=64 * 64,
        num_experts_per_tok=3,
    ),
    # Moonlight-like: no q LoRA, no RoPE scaling, two dense layers, 2 shared experts
    "no_q_lora_dense2": tiny_hf_config(
        q_lora_rank=None,
        first_k_dense_replace=2,
        num_hidden_layers=4,
        n_group=2,
        topk_group=1,
        n_shared_experts=2,
    ),
}


def _pair(name: str):
    cfgd = CONFIGS[name]
    hf = build_hf_model(cfgd, seed=1)
    model = DeepseekV3ForCausalLM(config_from_hf(cfgd))
    loaded = model.load_weights(hf.state_dict().items())
    params = {n for n, p in model.named_parameters() if not getattr(p, "optional", False)}
    assert params <= loaded, params - loaded
    return hf, model


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request):
    return _pair(request.param)


@torch.no_grad()
def test_prefill_and_absorbed_decode_match_hf(pair):
    hf, model = pair
    runner = PagedRunner(model, page_size=4)
    prompt = [5, 17, 3, 99, 42, 7, 8, 200, 31, 64, 12]
    seq = runner.add_sequence()
    ours = runner.step({seq: prompt})[0]
    ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert ref.abs().max() > 0.1  # logits are not trivially small
    assert (ours - ref).abs().max() < TOL
    tokens = list(prompt)
    for t in [3, 250, 17, 17, 90, 1, 2, 128]:  # decode: absorbed form over the paged cache
        tokens.append(t)
        ours = runner.step({seq: [t]})[0]
        ref = hf(torch.tensor([tokens])).logits[0, -1]
        assert (ours - ref).abs().max() < TOL


@torch.no_grad()
def test_batched_mixed_steps_match_hf(pair):
    """Two sequences: a prefill chunk next to a decode, then chunked prefill with context."""
    hf, model = pair
    runner = PagedRunner(model, page_size=4, seed=3)
    a, b = runner.add_sequence(), runner.add_sequence()
    pa, pb = [11, 12, 13, 14, 15, 16, 17], [40, 41, 42]
    runner.step({a: pa})
    out = runner.step({b: pb, a: [18]})  # b prefill, a decode, in one step
    assert (out[0] - hf(torch.tensor([pb])).logits[0, -1]).abs().max() < TOL
    assert (out[1] - hf(torch.tensor([pa + [18]])).logits[0, -1]).abs().max() < TOL
    out = runner.step({b: [43, 44, 45, 46, 47]})  # second prefill chunk over cached context
    ref = hf(torch.tensor([pb + [43, 44, 45, 46, 47]])).logits[0, -1]
    assert (out[0] - ref).abs().max() < TOL
    out = runner.step({a: [19], b: [48]})  # batched absorbed decode, different lengths
    assert (out[0] - hf(torch.tensor([pa + [18, 19]])).logits[0, -1]).abs().max() < TOL
    assert (
        out[1] - hf(torch.tensor([pb + [43, 44, 45, 46, 47, 48]])).logits[0, -1]
    ).abs().max() < TOL


def test_greedy_32_tokens_identical(pair):
    hf, model = pair
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert PagedRunner(model, page_size=4).greedy(prompt, 32) == hf_greedy(hf, prompt, 32)


@torch.no_grad()
def test_fp8_latent_cache_close_to_full_precision():
    """FP8-E4M3 latent cache (scale 1.0, as when a checkpoint gives none) against the fp32
    cache: max abs logit difference below 5% of the largest logit (measured 0.043 of 1.16)."""
    _, model = _pair("v3_groups_yarn")
    prompt, steps = list(range(20, 40)), [7, 77, 177]

    def run(kv_dtype):
        runner = PagedRunner(model, kv_dtype=kv_dtype)  # rebinds the layers' caches
        s = runner.add_sequence()
        return [runner.step({s: prompt})] + [runner.step({s: [t]}) for t in steps]

    ref = run(torch.float32)
    fp8 = run(torch.float8_e4m3fn)
    worst = max(float((a - b).abs().max()) for a, b in zip(ref, fp8, strict=True))
    scale = max(float(a.abs().max()) for a in ref)
    assert model.attention_layers()[0].kv_cache.dtype == torch.float8_e4m3fn
    print(f"fp8 latent cache: max |logit diff| = {worst:.4f} (max |logit| {scale:.2f})")
    # e4m3 keeps 3 mantissa bits (relative step 1/16): allow 5% of the largest logit
    assert 0 < worst < 0.05 * scale, (worst, scale)
    # the error is the cache's rounding: a BF16 cache (5 more mantissa bits) is ~32x closer
    bf16 = run(torch.bfloat16)
    bf16_worst = max(float((a - b).abs().max()) for a, b in zip(ref, bf16, strict=True))
    assert bf16_worst < worst / 8, (bf16_worst, worst)


def _naive_route(logits, k, *, scoring, method, bias, n_group, topk_group, norm, scale):
    """Per-token loop reference of DeepSeek routing (V2 greedy / group-limited, V3 noaux_tc)."""
    out_w, out_i = [], []
    for row in logits.float():
        s = row.sigmoid() if scoring == "sigmoid" else row.softmax(-1)
        choice = s + bias if bias is not None else s.clone()
        size = len(row) // n_group
        if n_group > 1:
            groups = []
            for g in range(n_group):
                part = choice[g * size : (g + 1) * size]
                score = (
                    part.sort(descending=True).values[:2].sum()
                    if method == "noaux_tc"
                    else part.max()
                )
                groups.append((float(score), g))
            keep = {g for _, g in sorted(groups, reverse=True)[:topk_group]}
            for g in range(n_group):
                if g not in keep:
                    choice[g * size : (g + 1) * size] = float("-inf")
        idx = sorted(range(len(row)), key=lambda e: -float(choice[e]))[:k]
        w = torch.stack([s[e] for e in idx])
        if method == "noaux_tc":
            w = (w / w.sum() if norm else w) * scale
        else:
            w = w / w.sum() if (norm and k > 1) else w * scale
        out_w.append(w)
        out_i.append(torch.tensor(idx))
    return torch.stack(out_w), torch.stack(out_i)


@pytest.mark.parametrize(
    "scoring,method,n_group,topk_group,norm",
    [
        ("softmax", "greedy", 1, 1, False),
        ("softmax", "greedy", 1, 1, True),
        ("softmax", "group_limited_greedy", 4, 2, False),
        ("sigmoid", "noaux_tc", 4, 2, True),
        ("sigmoid", "noaux_tc", 1, 1, True),
    ],
)
def test_select_experts_against_naive_reference(scoring, method, n_group, topk_group, norm):
    torch.manual_seed(0)
    logits = torch.randn(9, 16)
    bias = 0.1 * torch.randn(16) if method == "noaux_tc" else None
    kw = dict(n_group=n_group, topk_group=topk_group)
    w, i = select_experts(
        logits,
        3,
        scoring_func=scoring,
        topk_method=method,
        correction_bias=bias,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
        **kw,
    )
    rw, ri = _naive_route(
        logits, 3, scoring=scoring, method=method, bias=bias, norm=norm, scale=2.5, **kw
    )
    order = i.sort(-1)
    rorder = ri.sort(-1)
    assert torch.equal(order.values, rorder.values)
    assert torch.allclose(w.gather(1, order.indices), rw.gather(1, rorder.indices), atol=1e-6)
