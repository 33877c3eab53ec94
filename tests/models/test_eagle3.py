"""EAGLE-3 draft heads (moeserve/models/eagle3.py) against torch references written here from
the published modelling code (vLLM's llama_eagle3.py / deepseek_eagle3.py, SGLang's
kimi_k25_eagle3.py), with transformers' LlamaAttention / DeepseekV3Attention (built 2H wide, as
those files build theirs) as the attention blocks, fp32:

    hidden = fc([h_a | h_b | h_c])                  (the target's hidden states entering layers
                                                      a, b, c: transformers' hidden_states[i])
    x = attn([input_layernorm(embed(t_{i+1})) | hidden_norm(hidden)]) + hidden
    out = mlp(post_attention_layernorm(x)) + x     (the pre-norm output chained steps read)
    logits over target ids: lm_head(norm(out)) at d + d2t[d], -inf elsewhere

The heads are written by `moeserve make-checkpoint` in the published layouts (SpecForge's
`midlayer.*` for the Llama-style head, `layers.0.*` with its own embedding for the MLA head)
and read by the reference under those names, independently of the loader. Also: the published
configs parse to the layouts they describe, and the default target layers are vLLM's."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from moeserve.config import ConfigError
from moeserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from moeserve.models.eagle3 import (
    Eagle3Config,
    Eagle3DraftHead,
    capture_aux_hidden,
    default_aux_layers,
)
from moeserve.models.registry import config_from_hf
from moeserve.testing.checkpoints import KIMI_K25_EAGLE3_MLA_CONFIG, write_eagle3_checkpoint
from tests.models.helpers import YARN, build_hf_model, one_sequence, tiny_hf_config

TOL = 2e-4
LAYERS = 4
LIKES = ("kimi-k2.5-eagle3", "kimi-k2.5-eagle3-mla")
TOKENS = [5, 17, 3, 99, 42, 7, 7, 120, 64, 33, 2, 250, 18]
PAGE, PAGES = 4, 16
TABLE = list(reversed(range(PAGES)))  # a permuted page table, the same for every step

# published config.json files (values as published; only the fields the layout reads matter)
PUBLISHED_MLA = KIMI_K25_EAGLE3_MLA_CONFIG  # a Kimi-K2.5 MLA EAGLE-3 head
PUBLISHED_LLAMA = {  # SpecForge's DeepSeek-V3 EAGLE-3 head (LlamaForCausalLMEagle3)
    "architectures": ["LlamaForCausalLMEagle3"],
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True},
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 40960,
    "max_position_embeddings": 163840,
    "model_type": "llama",
    "num_attention_heads": 56,
    "num_key_value_heads": 8,
    "num_hidden_layers": 1,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "vocab_size": 129280,
    "draft_vocab_size": 32000,
}


def test_published_configs_parse_to_their_layouts():
    mla = Eagle3Config.from_hf(PUBLISHED_MLA)
    assert mla.kind == "mla" and mla.aux_layer_ids == (2, 30, 58) and mla.num_aux == 3
    lc = mla.layer
    assert (
        lc.mla.q_lora_rank,
        lc.mla.kv_lora_rank,
        lc.mla.qk_rope_head_dim,
        lc.mla.v_head_dim,
    ) == (
        1536,
        512,
        64,
        128,
    )
    assert lc.moe is None and lc.rope_scaling.type == "yarn"
    llama = Eagle3Config.from_hf(PUBLISHED_LLAMA)
    assert llama.kind == "llama" and llama.draft_vocab_size == 32000
    assert (llama.layer.head_dim, llama.layer.num_key_value_heads) == (128, 8)
    # without the field: vLLM's and SGLang's default, the states entering 2, L // 2, L - 3
    assert default_aux_layers(61) == (2, 30, 58)
    no_ids = dict(PUBLISHED_LLAMA, eagle_config={"use_aux_hidden_state": True})
    target = config_from_hf(
        tiny_hf_config(num_hidden_layers=61, hidden_size=7168, vocab_size=129280)
    )
    assert Eagle3Config.from_hf(no_ids).aux_layers(target) == (2, 30, 58)
    with pytest.raises(ConfigError, match="do not fit"):  # a layer the target does not have
        Eagle3Config.from_hf(PUBLISHED_MLA).aux_layers(
            config_from_hf(tiny_hf_config(num_hidden_layers=8, hidden_size=7168, vocab_size=163840))
        )
    with pytest.raises(ConfigError, match="vocabulary"):  # another model's head
        Eagle3Config.from_hf(PUBLISHED_LLAMA).aux_layers(replace(target, vocab_size=163840))


# ---- the reference ---------------------------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _causal(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


class _Reference:
    """The published head from its files, by its published names (fp32)."""

    def __init__(self, folder: str, target_embed: torch.Tensor) -> None:
        with open(os.path.join(folder, "config.json")) as f:
            self.cfg = c = json.load(f)
        w = {
            k: v.float() if v.is_floating_point() else v
            for k, v in load_file(os.path.join(folder, "model.safetensors")).items()
        }
        self.w = w
        self.mla = c["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
        p = "layers.0." if self.mla else "midlayer."
        self.p = p
        self.embed = w.get("embed_tokens.weight", target_embed)
        self.eps = c["rms_norm_eps"]
        h, heads = c["hidden_size"], c["num_attention_heads"]
        if self.mla:
            from transformers import DeepseekV3Config
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
                DeepseekV3Attention,
                DeepseekV3RotaryEmbedding,
            )

            hc = DeepseekV3Config(
                hidden_size=2 * h,  # the published heads' q_a / kv_a read [embed | hidden]
                num_attention_heads=heads,
                num_key_value_heads=heads,
                q_lora_rank=c["q_lora_rank"],
                kv_lora_rank=c["kv_lora_rank"],
                qk_nope_head_dim=c["qk_nope_head_dim"],
                qk_rope_head_dim=c["qk_rope_head_dim"],
                v_head_dim=c["v_head_dim"],
                rope_theta=c["rope_theta"],
                rope_scaling=c["rope_scaling"],
                max_position_embeddings=c["max_position_embeddings"],
                rms_norm_eps=self.eps,
                attention_bias=False,
            )
            hc._attn_implementation = "eager"
            attn = DeepseekV3Attention(hc, 0)
            attn.o_proj = torch.nn.Linear(heads * c["v_head_dim"], h, bias=False)
            names = ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa"]
            names += ["kv_a_layernorm", "kv_b_proj", "o_proj"]
            rotary = DeepseekV3RotaryEmbedding(hc)
        else:
            from transformers import LlamaConfig
            from transformers.models.llama.modeling_llama import (
                LlamaAttention,
                LlamaRotaryEmbedding,
            )

            hc = LlamaConfig(
                hidden_size=2 * h,
                num_attention_heads=heads,
                num_key_value_heads=c["num_key_value_heads"],
                head_dim=h // heads,
                rope_theta=c["rope_theta"],
                max_position_embeddings=c["max_position_embeddings"],
            )
            hc._attn_implementation = "eager"
            attn = LlamaAttention(hc, 0)
            attn.o_proj = torch.nn.Linear(heads * (h // heads), h, bias=False)
            names = ["q_proj", "k_proj", "v_proj", "o_proj"]
            rotary = LlamaRotaryEmbedding(hc)
        with torch.no_grad():
            for n in names:
                getattr(attn, n).weight.copy_(w[f"{p}self_attn.{n}.weight"])
        self.attn, self.rotary = attn.eval(), rotary
        self.d2t = w["d2t"]

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return aux @ self.w["fc.weight"].T

    @torch.no_grad()
    def run(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor):
        """(logits over target ids [T, V], pre-norm outputs [T, H]) of one causal pass."""
        w, p, eps = self.w, self.p, self.eps
        residual = hidden
        x = torch.cat(
            [
                _rms(F.embedding(ids, self.embed), w[f"{p}input_layernorm.weight"], eps),
                _rms(hidden, w[f"{p}hidden_norm.weight"], eps),
            ],
            dim=-1,
        )[None]
        cos_sin = self.rotary(x, positions[None])
        x = self.attn(x, cos_sin, _causal(len(ids)))[0][0] + residual
        m = _rms(x, w[f"{p}post_attention_layernorm.weight"], eps)
        m = F.silu(m @ w[f"{p}mlp.gate_proj.weight"].T) * (m @ w[f"{p}mlp.up_proj.weight"].T)
        out = m @ w[f"{p}mlp.down_proj.weight"].T + x
        draft = _rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T
        logits = torch.full((len(ids), self.embed.shape[0]), float("-inf"))
        logits[:, torch.arange(len(self.d2t)) + self.d2t] = draft
        return logits, out


# ---- the heads against it ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """transformers' DeepseekV3 (the oracle of the hidden states) and ours from its weights, and
    its config.json (what make-checkpoint sizes a head by)."""
    cfgd = tiny_hf_config(num_hidden_layers=LAYERS, rope_scaling=YARN)
    hf = build_hf_model(cfgd, seed=1)
    ours = DeepseekV3ForCausalLM(config_from_hf(cfgd))
    ours.load_weights(hf.state_dict().items())
    folder = tmp_path_factory.mktemp("target")
    with open(folder / "config.json", "w") as f:
        json.dump(cfgd, f)
    return hf, ours, str(folder)


def _head(folder: str, model: DeepseekV3ForCausalLM) -> Eagle3DraftHead:
    """Our head from the folder through its own loading code (names as published)."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = Eagle3Config.from_hf(json.load(f))
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    head = Eagle3DraftHead(
        cfg,
        model.config.vocab_size,
        own_embed="embed_tokens.weight" in tensors,
        own_head="lm_head.weight" in tensors,
    )
    head.share_target(model.model.embed_tokens, model.lm_head)
    loaded = head.load_weights(tensors.items())
    assert {n for n, p in head.named_parameters() if not getattr(p, "optional", False)} <= loaded
    head.aux_layer_ids = cfg.aux_layers(model.config)
    for layer in head.attention_layers():
        layer.bind_kv_cache(PAGES, PAGE, torch.float32, "cpu")
    return head


@pytest.mark.parametrize("like", LIKES)
@torch.no_grad()
def test_head_matches_the_reference(target, tmp_path, like):
    hf, ours, target_folder = target
    folder = write_eagle3_checkpoint(str(tmp_path / like), like, target_folder, seed=7).path
    head = _head(folder, ours)
    ref = _Reference(folder, hf.model.embed_tokens.weight.detach())
    n = len(TOKENS)
    tokens = torch.tensor(TOKENS)
    # the target's hidden states entering the head's layers, captured by the decoder loop
    ids = head.aux_layer_ids
    aux = torch.zeros(n, len(ids) * ours.config.hidden_size)
    capture_aux_hidden(ours, ids, aux)
    for layer in ours.attention_layers():
        layer.bind_kv_cache(PAGES, PAGE, torch.float32, "cpu")
    ours(tokens, torch.arange(n), one_sequence(0, n, PAGE, TABLE))
    states = hf.model(tokens[None], output_hidden_states=True).hidden_states
    want_aux = torch.cat([states[i][0] for i in ids], dim=-1)
    assert (aux - want_aux).abs().max() < TOL
    # one pass over positions 0 .. n-2 (token i + 1 at position i), then two chained steps
    pos = torch.arange(n - 1)
    want, want_out = ref.run(tokens[1:], pos, ref.fuse(want_aux[:-1]))
    normed, carried = head.forward_draft(
        tokens[1:], pos, head.fuse_target_hidden(aux[:-1]), one_sequence(0, n - 1, PAGE, TABLE)
    )
    got = head.compute_logits(normed)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    assert (got[finite] - want[finite]).abs().max() < TOL
    assert (carried - want_out).abs().max() < TOL
    chain_ids, chain_hidden = list(tokens[1:].tolist()), list(ref.fuse(want_aux[:-1]))
    out = carried
    for j in range(2):
        nxt = int(got[-1].argmax())
        p = n - 1 + j
        normed, out = head.forward_draft(
            torch.tensor([nxt]), torch.tensor([p]), out[-1:], one_sequence(p, 1, PAGE, TABLE)
        )
        got = head.compute_logits(normed)
        chain_ids.append(nxt)
        chain_hidden.append(want_out[-1])
        want, want_out = ref.run(
            torch.tensor(chain_ids), torch.arange(p + 1), torch.stack(chain_hidden)
        )
        assert (got[0][finite[0]] - want[-1][finite[0]]).abs().max() < TOL
        assert torch.equal(got.argmax(-1), want[-1:].argmax(-1))


# ---- moeserve plan and moeserve check ------------------------------------------------------------
def test_plan_counts_the_published_mla_head(tmp_path):
    """`moeserve plan` with the published Kimi-K2.5 MLA head (config.json alone: its embedding
    and its full-vocabulary LM head are the target's) on 8 H200s: each GPU holds the head's
    TP8 slice, its rotary tables, d2t and the aux hidden-state buffer, and the head's latent
    cache is one more layer's."""
    from pathlib import Path

    from moeserve import plan
    from moeserve.config import EngineConfig
    from moeserve.hardware import GPUS

    kimi = str(Path(__file__).resolve().parents[2] / "benchmarks/configs/kimi-k2.5-nvfp4")
    head = tmp_path / "head"
    head.mkdir()
    cfg = dict(PUBLISHED_MLA, eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 30, 58]})
    (head / "config.json").write_text(json.dumps(cfg))

    def deploy(**kw):
        eng = EngineConfig.from_settings(tensor_parallel_size=8, **kw)
        return eng, plan.plan_deployment(kimi, GPUS["h200"], 8, eng)

    _, base = deploy()
    eng, with_head = deploy(speculative_config={"method": "eagle3", "model": str(head)})
    h, tp, bf16 = 7168, 8, 2
    heads = 64 // tp
    q_lora, kv_lora, rope, nope, v = 1536, 512, 64, 128, 128
    inter = 18432 // tp
    params = (
        3 * h * h  # fc
        + 4 * h
        + q_lora
        + kv_lora  # input / hidden / post-attention / final norms, a-norms
        + 2 * h * (q_lora + kv_lora + rope)  # q_a and kv_a over [embed | hidden]
        + q_lora * heads * (nope + rope)  # q_b
        + kv_lora * heads * (nope + v)  # kv_b
        + heads * v * h  # o_proj
        + 3 * h * inter  # gate, up, down
    ) * bf16
    kv_scale = 4  # one fp32 scale of the latent cache
    positions = 4096 * 64  # YaRN: original positions x factor
    buffers = 2 * positions * (rope // 2) * 4 + 163840 * 8  # cos / sin tables, draft ids
    rows = max(eng.scheduler.max_num_batched_tokens, eng.graph_max_batch("cuda"))
    aux = rows * 3 * h * bf16
    assert with_head.weights.by_part["EAGLE-3 draft head"] == params + kv_scale + buffers + aux
    assert with_head.weights.total == base.weights.total + params + kv_scale + buffers + aux
    n = base.model_cfg.num_hidden_layers
    assert with_head.memory.kv_bytes_per_token * n == base.memory.kv_bytes_per_token * (n + 1)


@pytest.mark.parametrize("like", LIKES)
def test_check_says_what_a_head_folder_is(target, tmp_path, like):
    from moeserve.check import check_checkpoint

    folder = write_eagle3_checkpoint(str(tmp_path / like), like, target[2], seed=3).path
    report = check_checkpoint(folder)
    assert report.loadable, report.problems
    kind = "MLA" if like.endswith("-mla") else "Llama-style"
    assert f"EAGLE-3 draft head ({kind}" in report.lines[0], report.lines
    # a head whose config does not match its tensors
    cfg = json.loads((tmp_path / like / "config.json").read_text())
    cfg["intermediate_size"] += 16
    (tmp_path / like / "config.json").write_text(json.dumps(cfg))
    report = check_checkpoint(folder)
    assert not report.loadable and any("mlp" in p for p in report.problems), report.problems
