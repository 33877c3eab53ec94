"""DeepSeek-V3's MTP module (the draft model of `--speculative-config '{"method": "mtp"}'`)
against a reference built from transformers' DeepseekV3 modelling code and the published
MTP formula (fp32): at position i the module reads the target's final hidden state h_i and
the embedding of token i + 1 (zeroed at position 0),
    x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]),
runs one decoder block (a MoE layer, causal over its own cache), and its shared head (a norm,
then the main model's LM head) predicts token i + 2. The reference runs that block as the
only layer of a transformers DeepseekV3 model fed `inputs_embeds` = x, whose final norm is the
shared head's norm and whose LM head is the target's. Checkpoint names are the published
ones (`model.layers.{num_hidden_layers}.{enorm, hnorm, eh_proj, shared_head.norm, ...}`)."""

from __future__ import annotations

import torch

from moeserve.layers.attention.metadata import AttentionMetadata, ForwardContext
from moeserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from moeserve.models.registry import config_from_hf
from tests.models.helpers import build_hf_model, tiny_hf_config

TOL = 1e-3
LAYERS = 2
PAGE = 4


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _models():
    cfgd = tiny_hf_config(num_hidden_layers=LAYERS, num_nextn_predict_layers=1)
    target = build_hf_model(cfgd, seed=1)
    # the MTP block as the only layer of a second model (a MoE layer: no dense layers first)
    block = build_hf_model(dict(cfgd, num_hidden_layers=1, first_k_dense_replace=0), seed=2)
    h = cfgd["hidden_size"]
    g = torch.Generator().manual_seed(3)
    extras = {
        "enorm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
        "hnorm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
        "eh_proj.weight": 0.05 * torch.randn(h, 2 * h, generator=g),
    }
    with torch.no_grad():
        block.lm_head.weight.copy_(target.lm_head.weight)
    # the checkpoint: the target's tensors, then the MTP layer under its published names
    ckpt = dict(target.state_dict())
    mtp = f"model.layers.{LAYERS}."
    for name, t in block.state_dict().items():
        if name.startswith("model.layers.0."):
            ckpt[mtp + name[len("model.layers.0.") :]] = t
    ckpt.update({mtp + k: v for k, v in extras.items()})
    ckpt[mtp + "shared_head.norm.weight"] = block.model.norm.weight.detach().clone()
    ckpt[mtp + "shared_head.head.weight"] = target.lm_head.weight.detach().clone()
    ckpt[mtp + "embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
    ours = DeepseekV3ForCausalLM(config_from_hf(cfgd).with_mtp())
    loaded = ours.load_weights(ckpt.items())
    params = {n for n, p in ours.named_parameters() if not getattr(p, "optional", False)}
    assert params <= loaded, params - loaded
    return target, block, extras, ours


def _metadata(n: int) -> AttentionMetadata:
    pages = -(-n // PAGE)
    table = torch.tensor([list(reversed(range(pages)))], dtype=torch.int32)  # permuted
    slots = [int(table[0, t // PAGE]) * PAGE + t % PAGE for t in range(n)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=table,
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start=torch.tensor([0, n], dtype=torch.int32),
        page_size=PAGE,
        seq_lens_host=[n],
        query_lens_host=[n],
    )


@torch.no_grad()
def test_mtp_module_matches_the_reference():
    target, block, extras, ours = _models()
    tokens = torch.tensor([5, 17, 3, 99, 42, 7, 7, 120, 64, 33, 2, 250])
    n = len(tokens)
    # reference: target hidden states, then the MTP formula through transformers' block
    h_ref = target.model(tokens[None]).last_hidden_state[0]  # after the final norm
    nxt = tokens[1:]
    pos = torch.arange(n - 1)
    e = target.model.embed_tokens(nxt)
    e = torch.where((pos == 0)[:, None], 0.0, e)
    x = torch.cat([_rms(e, extras["enorm.weight"]), _rms(h_ref[:-1], extras["hnorm.weight"])], -1)
    x = x @ extras["eh_proj.weight"].T
    ref_logits = block(inputs_embeds=x[None]).logits[0]
    # ours: the target over its paged caches, then the MTP module over its own
    for layer in ours.attention_layers():
        layer.bind_kv_cache(16, PAGE, torch.float32, "cpu")
    h = ours(tokens, torch.arange(n), ForwardContext(_metadata(n)))
    assert (h - h_ref).abs().max() < TOL
    normed, _ = ours.forward_draft(nxt, pos, h[:-1], ForwardContext(_metadata(n - 1)))
    got = ours.compute_logits(normed)
    assert (got - ref_logits).abs().max() < TOL
    assert torch.equal(got.argmax(-1), ref_logits.argmax(-1))


def test_mtp_layer_is_skipped_without_mtp():
    """Without method mtp the checkpoint's MTP layer is not built (its tensors skipped)."""
    cfgd = tiny_hf_config(num_hidden_layers=LAYERS, num_nextn_predict_layers=1)
    model = DeepseekV3ForCausalLM(config_from_hf(cfgd))
    assert model.mtp is None and len(model.attention_layers()) == LAYERS
