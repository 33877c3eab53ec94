"""Test helpers: tiny HF DeepseekV3 models and a paged-cache driver for our model contract."""

from __future__ import annotations

import random

import torch

from moeserve.layers.attention.metadata import AttentionMetadata, ForwardContext


def tiny_hf_config(**overrides) -> dict:
    """A tiny DeepseekV3 config.json dict (fp32)."""
    cfg = dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        n_group=4,
        topk_group=2,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        rope_scaling=None,
        tie_word_embeddings=False,
        hidden_act="silu",
        attention_bias=False,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="float32",
    )
    cfg.update(overrides)
    return cfg


YARN = {
    "type": "yarn",
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def build_hf_model(cfg: dict, seed: int = 0):
    """transformers' DeepseekV3ForCausalLM with random weights (incl. a random router bias)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    hf_cfg = DeepseekV3Config(
        **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    )
    hf_cfg._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "e_score_correction_bias" in name:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn_like(b))
    return model


class PagedRunner:
    """Drives a model through our contract with hand-built metadata (one sequence or more),
    a small page size and a permuted page table."""

    def __init__(
        self, model, page_size: int = 4, num_pages: int = 64, kv_dtype=torch.float32, seed=0
    ):
        self.model = model
        self.page_size = page_size
        for layer in model.attention_layers():
            layer.bind_kv_cache(num_pages, page_size, kv_dtype, "cpu")
        pages = list(range(num_pages))
        random.Random(seed).shuffle(pages)
        self.free = pages
        self.tables: list[list[int]] = []
        self.lens: list[int] = []

    def add_sequence(self) -> int:
        self.tables.append([])
        self.lens.append(0)
        return len(self.tables) - 1

    def _slots(self, seq: int, n: int) -> list[int]:
        out = []
        for t in range(self.lens[seq], self.lens[seq] + n):
            if t // self.page_size >= len(self.tables[seq]):
                self.tables[seq].append(self.free.pop())
            out.append(self.tables[seq][t // self.page_size] * self.page_size + t % self.page_size)
        return out

    @torch.no_grad()
    def step(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        """Feed token lists per sequence; returns logits of each sequence's last token [B, V]."""
        ids, pos, slots, qlens, seqs = [], [], [], [], list(chunks)
        for s in seqs:
            toks = chunks[s]
            slots += self._slots(s, len(toks))
            pos += list(range(self.lens[s], self.lens[s] + len(toks)))
            ids += toks
            qlens.append(len(toks))
            self.lens[s] += len(toks)
        width = max(len(self.tables[s]) for s in seqs)
        tables = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, s in enumerate(seqs):
            tables[i, : len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int32)
        qs = [0]
        for q in qlens:
            qs.append(qs[-1] + q)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=tables,
            seq_lens=torch.tensor([self.lens[s] for s in seqs], dtype=torch.int32),
            query_start=torch.tensor(qs, dtype=torch.int32),
            page_size=self.page_size,
            seq_lens_host=[self.lens[s] for s in seqs],
            query_lens_host=qlens,
        )
        h = self.model(torch.tensor(ids), torch.tensor(pos), ForwardContext(attn=md))
        last = torch.tensor(qs[1:]) - 1
        return self.model.compute_logits(h[last])

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        s = self.add_sequence()
        logits = self.step({s: prompt})
        out = []
        for _ in range(n):
            tok = int(logits[0].argmax())
            out.append(tok)
            logits = self.step({s: [tok]})
        return out


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        min_new_tokens=n,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def one_sequence(start: int, n: int, page: int, table: list[int] | None = None) -> ForwardContext:
    """Positions start .. start + n - 1 of one sequence over the paged cache, its pages
    `table` (default: pages 0, 1, ... in order)."""
    end = start + n
    if table is None:
        table = list(range(-(-end // page)))
    slots = [table[t // page] * page + t % page for t in range(start, end)]
    return ForwardContext(
        AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor([table], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            query_start=torch.tensor([0, n], dtype=torch.int32),
            page_size=page,
            seq_lens_host=[end],
            query_lens_host=[n],
        )
    )
