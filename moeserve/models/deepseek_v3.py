"""DeepSeek-V3 / R1, Kimi-K2 / K2.5 (text) and Moonlight: MLA attention + routed experts.

Checkpoint names handled by `load_weights`:
- the text model under `cfg.weight_prefix` (Kimi-K2.5: `language_model.`), with or without
  the `.model.` level (NVIDIA's NVFP4 export drops it);
- `vision_tower.*` / `mm_projector.*` (Kimi-K2.5) -> the vision encoder `vision`
  (models/kimi_vision.py) on the rank that holds it (rank 0), skipped elsewhere; MTP layers
  (index >= num_hidden_layers) are skipped, with one log line;
- per-expert tensors `mlp.experts.{e}.{proj}.{suffix}` -> the stacked banks
  `mlp.experts.w13` (gate, up: parts 0, 1) / `mlp.experts.w2` (down) with shard id
  (e, part), and transformers-5 stacked ones (`mlp.experts.gate_up_proj`,
  `mlp.experts.down_proj`) with shard id (None, part);
- shared experts `mlp.shared_experts.{proj}.{suffix}`, where the layer runs them as slots of
  the banks (`DeepseekMoE.shared_slots` = n > 0), -> the same banks with shard id (E + j,
  part), the tensor of all n shared experts cut into expert j's rows (gate/up) or columns
  (down) first (`ExpertBank.split_shared`); elsewhere to the layer's own `shared_experts`;
- FP8-cache scales `self_attn.*.{k,v}_scale` -> the layer's `kv_scale`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from moeserve.config import ModelConfig
from moeserve.layers.attention.metadata import ForwardContext
from moeserve.layers.attention.mla import MLAAttention
from moeserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from moeserve.layers.linear import ReplicatedLinear
from moeserve.layers.moe import DeepseekMLP, DeepseekMoE
from moeserve.layers.norm import RMSNorm
from moeserve.layers.quant.base import QuantConfig
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.models.decoder import PreNormDecoderLayer, reduce_add_norm
from moeserve.models.kimi_vision import KimiVisionModel
from moeserve.models.weights import finish_loading
from moeserve.parallel.groups import SINGLE, TPGroup

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
_SHARED = re.compile(r"\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.(.+)$")
# a dense or shared MLP's gate_proj / up_proj -> shards 0 / 1 of its gate_up_proj (when merged)
_GATE_UP = re.compile(r"\.mlp\.(shared_experts\.)?(gate_proj|up_proj)\.")
_GATE_UP_SHARD = {"gate_proj": 0, "up_proj": 1}
_KV_SCALE = re.compile(r"\.self_attn\..*\b[kv]_scale$")
# q_a_proj / kv_a_proj_with_mqa -> shards 0 / 1 of self_attn.fused_qkv_a_proj (when merged)
_QKV_A = re.compile(r"\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.")
_QKV_A_SHARD = {"q_a_proj": 0, "kv_a_proj_with_mqa": 1}
# per-expert projection -> (stacked bank, part within it)
_EXPERT_PARTS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
_SKIPPED_TOWERS = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
_VISION = ("vision_tower.", "mm_projector.")  # Kimi-K2.5's, loaded where the model has them


class DeepseekV3DecoderLayer(PreNormDecoderLayer):
    def __init__(
        self,
        cfg: ModelConfig,
        idx: int,
        rotary: RotaryEmbedding,
        quant: QuantConfig | None,
        tp: TPGroup,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{idx}"
        self.tp = tp
        self.partial_outputs = True  # o_proj and the MLP/MoE leave their sums to the norms
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MLAAttention(cfg, f"{prefix}.self_attn", rotary, quant, tp, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.is_moe_layer(idx):
            self.mlp: nn.Module = DeepseekMoE(cfg, f"{prefix}.mlp", quant, tp, dtype)
        else:
            self.mlp = DeepseekMLP(
                cfg.hidden_size,
                cfg.intermediate_size,
                f"{prefix}.mlp",
                quant,
                tp,
                dtype,
                reduce_output=False,
            )


class DeepseekMTPLayer(DeepseekV3DecoderLayer):
    """DeepSeek-V3's multi-token prediction module, served as a draft model: at position i it
    reads the target's final hidden state h_i and the embedding of token i + 1 and predicts
    token i + 2. Its decoder block is a MoE layer like the others (checkpoint layer
    `cfg.mtp_index`); the embedding and output head are the main model's (DeepSeek shares
    them; copies in the checkpoint are skipped)."""

    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        quant: QuantConfig | None,
        tp: TPGroup,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(cfg, cfg.mtp_index, rotary, quant, tp, dtype)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        # BF16 in the published checkpoints (outside the FP8 quantization)
        self.eh_proj = ReplicatedLinear(
            2 * h, h, prefix=f"model.layers.{cfg.mtp_index}.eh_proj", tp=tp, dtype=dtype
        )
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)

    def predict(
        self,
        embedded: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed output for the LM head, un-normed output for the next draft step)."""
        # the token embedding at position 0 is not used by the module (as in vLLM)
        embedded = torch.where((positions == 0)[:, None], 0.0, embedded)
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        x, residual = self(positions, x, None, ctx)
        return reduce_add_norm(self.shared_head.norm, x, residual, self.tp, partial=True)


class DeepseekV3Model(nn.Module):
    def __init__(
        self, cfg: ModelConfig, quant: QuantConfig | None, tp: TPGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        # one RoPE table for all layers (YaRN tables cover factor * original positions)
        self.rotary = RotaryEmbedding(
            cfg.mla.qk_rope_head_dim,
            cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling,
            interleaved=True,
        )
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(cfg, i, self.rotary, quant, tp, dtype)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if any(isinstance(m.mlp, DeepseekMoE) and m.mlp.shared_slots for m in self.layers):
            log.info(
                "shared experts: experts %d.. of the routed banks (run with the routed experts)",
                cfg.moe.n_routed_experts,
            )

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(ids), None
        if embeds is not None:  # (rows, values): image embeddings replace the placeholders'
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        x, _ = reduce_add_norm(self.norm, x, residual, self.tp, partial=True)
        return x


class DeepseekV3ForCausalLM(nn.Module):
    """Implements the model contract of `moeserve.models.llama.LlamaForCausalLM`."""

    def __init__(
        self,
        cfg: ModelConfig,
        quant: QuantConfig | None = None,
        tp: TPGroup = SINGLE,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.model = DeepseekV3Model(cfg, quant, tp, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = (
            DeepseekMTPLayer(cfg, self.model.rotary, quant, tp, dtype)
            if cfg.mtp_index >= 0
            else None
        )
        # Kimi-K2.5's vision encoder, on rank 0 only: it encodes each image once and the
        # step hands every rank the embeddings (engine/runner.py)
        self.vision = (
            KimiVisionModel(cfg.vision, dtype) if cfg.vision is not None and tp.rank == 0 else None
        )

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`embeds`: (token rows, [rows, hidden] values) that replace those rows' token
        embeddings (images)."""
        return self.model(ids, positions, ctx, embeds)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden, out)

    def forward_draft(
        self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP module on tokens `ids` (token i + 1 at position i) and the hidden states
        `hidden` (the target's at position i, or the module's own previous output): (hidden
        for the LM head, hidden for the next draft step)."""
        assert self.mtp is not None
        return self.mtp.predict(self.model.embed_tokens(ids), positions, hidden, ctx)

    def attention_layers(self) -> list[MLAAttention]:
        layers = [layer.self_attn for layer in self.model.layers]
        if self.mtp is not None:  # the draft module's latent cache, on the same pages
            layers.append(self.mtp.self_attn)
        return layers

    # ---- weights -------------------------------------------------------------------------------
    def checkpoint_name_to_model(self, name: str) -> str | None:
        """A checkpoint tensor name in this model's name space (None: not a text-model tensor)."""
        prefix = self.config.weight_prefix
        if prefix:
            if not name.startswith(prefix):
                return None
            name = name[len(prefix) :]
        if not name.startswith(("model.", "lm_head.")):
            name = "model." + name  # Kimi-K2.5 NVFP4 export: language_model.layers.N...
        return name

    def _route(
        self, weights: Iterable[tuple[str, torch.Tensor]], skipped: dict[str, int]
    ) -> Iterator[tuple[str, torch.Tensor, int | None]]:
        """(model param name, tensor, shard id) for every tensor this model takes."""
        n_layers = self.config.num_hidden_layers
        for ckpt_name, tensor in weights:
            if self.vision is not None and ckpt_name.startswith(_VISION):
                yield "vision." + ckpt_name, tensor, None
                continue
            if ckpt_name.startswith(_SKIPPED_TOWERS) or "rotary_emb.inv_freq" in ckpt_name:
                skipped["vision"] += ckpt_name.startswith(_SKIPPED_TOWERS)
                continue
            name = self.checkpoint_name_to_model(ckpt_name)
            if name is None:
                skipped["other"] += 1
                continue
            m = _LAYER.match(name)
            layer = self.model.layers[int(m.group(1))] if m and int(m.group(1)) < n_layers else None
            if m and layer is None:
                if int(m.group(1)) != self.config.mtp_index or self.mtp is None:
                    skipped["layers"] += 1  # MTP layers, or layers cut by --num-layers
                    continue
                if name.endswith((".embed_tokens.weight", ".shared_head.head.weight")):
                    skipped["layers"] += 1  # the main model's (shared), stored again
                    continue
                name, layer = "mtp." + name[m.end() :], self.mtp
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            if _KV_SCALE.search(name):
                yield name[: name.index(".self_attn.")] + ".self_attn.kv_scale", tensor, None
                continue
            e = _EXPERT.search(name)
            if e:
                base = _EXPERT.sub(".mlp.experts.", name)
                proj, suffix = base.rsplit(".mlp.experts.", 1)[1].split(".", 1)
                bank, part = _EXPERT_PARTS[proj]
                yield (
                    f"{name[: e.start()]}.mlp.experts.{bank}.{suffix}",
                    tensor,
                    (
                        int(e.group(1)),
                        part,
                    ),
                )
                continue
            shared = _SHARED.search(name)
            moe = layer.mlp if shared and layer is not None else None
            if isinstance(moe, DeepseekMoE) and moe.shared_slots:
                yield from self._shared_slot_shards(name, shared, moe, tensor)
                continue
            g = _GATE_UP.search(name)
            if g and layer is not None and self._merged_mlp(layer, bool(g.group(1))):
                merged = name.replace(g.group(0), g.group(0).replace(g.group(2), "gate_up_proj"))
                yield merged, tensor, _GATE_UP_SHARD[g.group(2)]
                continue
            if name.endswith(".mlp.experts.gate_up_proj"):
                half = tensor.shape[1] // 2
                w13 = name.replace("gate_up_proj", "w13.weight")
                yield w13, tensor[:, :half], (None, 0)
                yield w13, tensor[:, half:], (None, 1)
                continue
            if name.endswith(".mlp.experts.down_proj"):
                yield name.replace("down_proj", "w2.weight"), tensor, (None, 0)
                continue
            a = _QKV_A.search(name)
            if a and layer is not None and layer.self_attn.fused_qkv_a_proj is not None:
                fused = name.replace(a.group(0), ".self_attn.fused_qkv_a_proj.")
                yield fused, tensor, _QKV_A_SHARD[a.group(1)]
                continue
            yield name, tensor, None

    @staticmethod
    def _merged_mlp(layer: nn.Module, shared: bool) -> bool:
        """Whether `layer`'s dense MLP (or its separate shared-expert MLP) holds gate and up
        as one `gate_up_proj`."""
        mlp = layer.mlp
        if shared:
            mlp = mlp.shared_experts if isinstance(mlp, DeepseekMoE) else None
        return isinstance(mlp, DeepseekMLP) and mlp.gate_up_proj is not None

    def _shared_slot_shards(
        self, name: str, match: re.Match, moe: DeepseekMoE, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor, tuple[int, int]]]:
        """A shared-experts tensor of a layer running them as bank slots -> for each shared
        expert j its piece, into the bank with shard id (E + j, part)."""
        proj, suffix = match.group(1), match.group(2)
        bank_name, part = _EXPERT_PARTS[proj]
        bank = getattr(moe.experts, bank_name)
        target = f"{name[: match.start()]}.mlp.experts.{bank_name}.{suffix}"
        first = self.config.moe.n_routed_experts
        for j, piece in enumerate(bank.split_shared(suffix, tensor, moe.shared_slots)):
            yield target, piece, (first + j, part)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        skipped = {"vision": 0, "layers": 0, "other": 0}
        loaded: set[str] = set()
        for name, tensor, shard in self._route(weights, skipped):
            param = params.get(name)
            if param is None:
                raise KeyError(f"checkpoint tensor {name!r} matches no parameter")
            if shard is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
            loaded.add(name)
        if skipped["vision"]:
            log.info("skipped %d vision-tower / projector tensors", skipped["vision"])
        if self.vision is not None and not any(n.startswith("vision.") for n in loaded):
            log.info("the checkpoint holds no vision tensors: served as text only")
            self.vision = None
        if skipped["layers"]:
            log.info(
                "skipped %d tensors of layers >= %d (MTP / cut layers)",
                skipped["layers"],
                self.config.num_hidden_layers,
            )
        finish_loading(self)
        return loaded
