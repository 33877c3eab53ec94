"""deepseek2 GGUF files, written by llama.cpp's own converter from tiny HF DeepseekV3
checkpoints, load into DeepseekV3ForCausalLM: config and logits against HF transformers on the
same weights, the tokenizer against the checkpoint's own HF tokenizer (and a Kimi-K2
vocabulary against the tiktoken Kimi tokenizer), tensor parallelism over 2 gloo processes
against one process, and K-quant dequantization against llama.cpp's own gguf-py.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeserve.errors import LoadError
from moeserve.loader import load_model
from moeserve.loader.gguf import dequantize
from moeserve.loader.gguf_deepseek import deepseek2_hf_config
from moeserve.models.registry import config_from_hf
from moeserve.parallel.groups import TPGroup
from moeserve.testing.checkpoints import write_kimi_tokenizer
from tests.loader.gguf_fixtures import (
    ASSISTANT,
    USER,
    Job,
    convert,
    llama_cpp_quants,
    write_checkpoint,
)
from tests.models.helpers import YARN, PagedRunner, build_hf_model, hf_greedy, tiny_hf_config

VOCAB = 384
# DeepSeek-V3-like: q LoRA, 4 groups keep 2, YaRN; every row length a multiple of 32 so that
# the Q8_0 file quantizes every matrix (attn_k_b's rows are qk_nope long)
CFG_V3 = tiny_hf_config(
    vocab_size=VOCAB,
    q_lora_rank=64,
    qk_nope_head_dim=32,
    rope_scaling=YARN,
    max_position_embeddings=64 * 40,
)
# Moonlight-like: no q LoRA, two dense layers, 2 shared experts, one group, no RoPE scaling
CFG_MOON = tiny_hf_config(
    vocab_size=VOCAB,
    q_lora_rank=None,
    qk_nope_head_dim=32,
    num_hidden_layers=3,
    first_k_dense_replace=2,
    n_shared_experts=2,
    n_group=1,
    topk_group=1,
)
PROMPT = [5, 17, 3, 99, 42, 7, 8, 200, 31, 64, 12]
DECODE = [3, 250, 17, 1]
STEPS = 8
TOL = 1e-3
TOL_ROUNDED = 1e-4


@dataclass(frozen=True)
class Files:
    hf: dict  # name -> HF model
    paths: dict  # (name, outtype) -> .gguf path
    folders: dict  # name -> HF checkpoint folder


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Files:
    root = tmp_path_factory.mktemp("gguf_deepseek")
    hf = {"v3": build_hf_model(CFG_V3, seed=1), "moon": build_hf_model(CFG_MOON, seed=2)}
    folders = {name: str(root / name) for name in hf}
    for name, model in hf.items():
        write_checkpoint(folders[name], model, VOCAB)
    # a Kimi tiktoken vocabulary on the same config: converted for its vocabulary only
    folders["kimi"] = str(root / "kimi")
    os.makedirs(folders["kimi"])
    kimi_vocab = write_kimi_tokenizer(folders["kimi"], merges=300)
    with open(os.path.join(folders["v3"], "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folders["kimi"], "config.json"), "w") as f:
        json.dump({**config, "vocab_size": kimi_vocab}, f)
    paths = {
        ("kimi", "vocab"): str(root / "kimi-vocab.gguf"),
        ("v3", "f32"): str(root / "v3-f32.gguf"),
        ("v3", "q8_0"): str(root / "v3-q8_0.gguf"),
        ("moon", "f16"): str(root / "moon-f16.gguf"),
    }
    jobs = [
        Job(folders["v3"], "f32", paths["v3", "f32"]),
        Job(folders["v3"], "q8_0", paths["v3", "q8_0"]),
        Job(folders["moon"], "f16", paths["moon", "f16"]),
        Job(folders["kimi"], "f32", paths["kimi", "vocab"], "kimi-k2", ("--vocab-only",)),
    ]
    convert(jobs, str(root))
    return Files(hf, paths, folders)


def _tensor_kinds(path: str) -> set[str]:
    from gguf import GGUFReader

    return {f"{t.name}:{t.tensor_type.name}" for t in GGUFReader(path).tensors}


def test_files_are_what_the_tests_assume(files):
    """The converter wrote split MLA tensors, stacked experts, Q8_0 and F16 matrices."""
    v3, q8, moon = (
        _tensor_kinds(files.paths[k]) for k in [("v3", "f32"), ("v3", "q8_0"), ("moon", "f16")]
    )
    assert {"blk.0.attn_k_b.weight:F32", "blk.0.attn_v_b.weight:F32"} <= v3
    assert "blk.1.ffn_gate_exps.weight:F32" in v3 and "blk.1.exp_probs_b.bias:F32" in v3
    assert not any(k.startswith("blk.0.attn_kv_b") for k in v3)
    for name in ("attn_k_b", "attn_v_b", "attn_q_b", "ffn_down_exps", "attn_kv_a_mqa"):
        assert f"blk.1.{name}.weight:Q8_0" in q8
    assert "blk.2.ffn_up_exps.weight:F16" in moon and "blk.0.attn_q.weight:F16" in moon


@pytest.mark.parametrize("name,outtype", [("v3", "f32"), ("v3", "q8_0"), ("moon", "f16")])
def test_config_from_gguf_metadata_equals_hf(files, name, outtype):
    cfg = {"v3": CFG_V3, "moon": CFG_MOON}[name]
    lm = load_model(files.paths[name, outtype], torch.float32)
    assert lm.config == config_from_hf(cfg)


def _rounded_like_the_file(hf, cfg: dict, outtype: str, workdir: str):
    """A copy of the HF model whose weights went through the same rounding as the file's:
    every matrix the converter stores as F16 / Q8_0 (not norms, not the router), rounded by
    llama.cpp's own gguf-py along the rows it writes; kv_b_proj as the converter splits it
    (per head: k_b = its nope rows transposed, v_b = its v rows)."""
    import copy

    model = copy.deepcopy(hf)
    heads, nope, kind = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], outtype.upper()
    params = [
        (name, p)
        for name, p in model.named_parameters()
        if p.dim() >= 2 and not name.endswith(("norm.weight", "mlp.gate.weight"))
    ]
    jobs = []
    for name, p in params:
        w = p.detach()
        if name.endswith("kv_b_proj.weight"):
            kv = w.view(heads, -1, cfg["kv_lora_rank"])
            parts = [kv[:, :nope].transpose(1, 2), kv[:, nope:]]
        else:
            parts = [w]
        jobs += [("round", kind, part.contiguous().numpy()) for part in parts]
    rounded = iter(torch.from_numpy(a) for a in llama_cpp_quants(jobs, workdir))
    with torch.no_grad():
        for name, p in params:
            if name.endswith("kv_b_proj.weight"):
                k_b, v_b = next(rounded), next(rounded)
                p.copy_(torch.cat([k_b.transpose(1, 2), v_b], 1).reshape(p.shape))
            else:
                p.copy_(next(rounded))
    return model


@torch.no_grad()
@pytest.mark.parametrize("name,outtype", [("v3", "f32"), ("v3", "q8_0"), ("moon", "f16")])
def test_logits_match_hf(files, name, outtype, tmp_path):
    """F32: HF on the checkpoint's weights; F16 / Q8_0: HF on the same weights rounded as the
    file rounds them (the rounding alone moves these logits by ~1e-3 (F16) to ~3e-2 (Q8_0))."""
    hf = files.hf[name]
    tol = TOL
    if outtype != "f32":
        cfg = {"v3": CFG_V3, "moon": CFG_MOON}[name]
        hf, tol = _rounded_like_the_file(hf, cfg, outtype, str(tmp_path)), TOL_ROUNDED
    lm = load_model(files.paths[name, outtype], torch.float32)
    runner = PagedRunner(lm.model, page_size=4)
    seq = runner.add_sequence()
    tokens, ours = list(PROMPT), runner.step({seq: PROMPT})[0]
    for t in [None, *DECODE]:  # prefill, then absorbed decode over the paged cache
        if t is not None:
            tokens.append(t)
            ours = runner.step({seq: [t]})[0]
        ref = hf(torch.tensor([tokens])).logits[0, -1]
        assert ref.abs().max() > 0.1
        assert (ours - ref).abs().max() < tol
    if outtype != "f32":  # the file really is rounded: the unrounded model is further away
        unrounded = files.hf[name](torch.tensor([tokens])).logits[0, -1]
        assert (ours - unrounded).abs().max() > 3 * TOL_ROUNDED


def test_f32_greedy_matches_hf(files):
    lm = load_model(files.paths["v3", "f32"], torch.float32)
    ours = PagedRunner(lm.model).greedy(PROMPT, STEPS)
    assert ours == hf_greedy(files.hf["v3"], PROMPT, STEPS)


TEXTS = [
    "Hello world, hello moeserve!",
    "12345 67890 2025-01-01 3.14159",
    "def forward(self, x):\n    return self.proj(x) + 1\n\n\n",
    "我想在apple工作 こんにちは カタカナ",
    "  leading spaces...   and !!! ??? (yes) [no]\ttab",
    f"{USER}What is 2+2?{ASSISTANT}4",
]


def test_tokenizer_matches_hf(files):
    from tokenizers import Regex, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import AutoTokenizer

    folder = files.folders["v3"]
    ref = RawTokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    tok = load_model(files.paths["v3", "q8_0"], torch.float32).tokenizer
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1
    for text in TEXTS:
        ids = ref.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, add_special_tokens=False) == ids, text
        assert tok.encode(text) == [0, *ids]  # add_bos_token from tokenizer_config.json
        assert tok.decode(ids, skip_special_tokens=False) == text
    # the texts do tell pre-tokenizers apart: GPT-2's split gives other ids for some of them
    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(gpt2), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    assert any(ref.encode(t, add_special_tokens=False).ids != tok.encode(t, False) for t in TEXTS)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    hf_text = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert tok.apply_chat_template(messages) == hf_text


def test_kimi_k2_vocabulary_matches_kimi_tokenizer(files):
    """llama.cpp turns Kimi's tiktoken ranks into a byte-level vocabulary + merges with
    pre-tokenizer "kimi-k2"; our tokenizer over them equals the tiktoken one."""
    from gguf import GGUFReader

    from moeserve.loader.gguf import read_metadata
    from moeserve.testing.checkpoints import SAMPLE_TEXT
    from moeserve.tokenizer.gguf_vocab import build_gguf_tokenizer
    from moeserve.tokenizer.kimi import KimiTokenizer

    meta = read_metadata(GGUFReader(files.paths["kimi", "vocab"]))
    assert meta["tokenizer.ggml.pre"] == "kimi-k2"
    ours, ref = build_gguf_tokenizer(meta), KimiTokenizer(files.folders["kimi"])
    texts = [
        SAMPLE_TEXT[:400],
        "Hello WORLD我想在apple工作 12345 don't!!\n\n  x",
        "<|im_user|>user<|im_middle|>What's 2+2?<|im_end|><|im_assistant|>",
    ]
    for text in texts:
        ids = ref.encode(text)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text


def _tp_worker(rank: int, world: int, store: str, path: str, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.models.helpers import PagedRunner

    torch.set_num_threads(1)
    # a file store: no port to race for between picking it and binding it
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    lm = load_model(path, torch.float32, tp=TPGroup(rank, world, dist.group.WORLD))
    tokens = PagedRunner(lm.model).greedy(PROMPT, STEPS)
    if rank == 0:
        torch.save(tokens, out)
    dist.barrier()  # both ranks are done with every collective
    # leave without tearing gloo down (its teardown in a spawned process may abort)
    os._exit(0)


def test_tp2_matches_single_process(files, tmp_path):
    path = files.paths["v3", "q8_0"]
    single = PagedRunner(load_model(path, torch.float32).model).greedy(PROMPT, STEPS)
    out, store = str(tmp_path / "tokens.pt"), str(tmp_path / "gloo_store")
    mp.spawn(_tp_worker, args=(2, store, path, out), nprocs=2, join=True)
    assert torch.load(out) == single


def test_num_layers_and_user_errors(files):
    path = files.paths["v3", "f32"]
    lm = load_model(path, torch.float32, num_layers=2)
    assert len(lm.model.model.layers) == 2 and lm.config.num_hidden_layers == 2
    with pytest.raises(LoadError, match="quantization int8"):
        load_model(path, torch.float32, quantize="int8")
    with pytest.raises(LoadError, match="load format"):
        load_model(path, torch.float32, load_format="dummy")


def test_metadata_of_older_converters():
    """Files written before llama.cpp split attn_kv_b: key/value_length are the per-head sizes,
    no *_mla keys; before expert_gating_func existed: softmax routing (DeepSeek-V2)."""
    meta = {
        "block_count": 2,
        "embedding_length": 64,
        "feed_forward_length": 96,
        "attention.head_count": 4,
        "attention.head_count_kv": 4,
        "attention.key_length": 24,
        "attention.value_length": 16,
        "attention.kv_lora_rank": 32,
        "attention.layer_norm_rms_epsilon": np.float32(1e-6),
        "rope.dimension_count": 8,
        "expert_count": 8,
        "expert_used_count": 2,
        "expert_shared_count": 1,
        "expert_feed_forward_length": 32,
        "leading_dense_block_count": 1,
        "expert_weights_scale": np.float32(16.0),
    }
    cfg = deepseek2_hf_config(meta, {"output.weight", "blk.0.attn_q.weight"}, 256)
    assert (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]) == (16, 8, 16)
    assert cfg["q_lora_rank"] is None and cfg["rms_norm_eps"] == 1e-6
    assert (cfg["scoring_func"], cfg["topk_method"], cfg["norm_topk_prob"]) == (
        "softmax",
        "greedy",
        False,
    )
    assert cfg["routed_scaling_factor"] == 16.0 and cfg["rope_scaling"] is None


# ---- dequantization against llama.cpp's own gguf-py ----------------------------------------
# (type, block bytes, byte offsets of the block's fp16 scales); every other byte is random
_BLOCKS = {
    "Q8_0": (34, (0,)),
    "Q2_K": (84, (80, 82)),
    "Q3_K": (110, (108,)),
    "Q4_K": (144, (0, 2)),
    "Q5_K": (176, (0, 2)),
    "Q6_K": (210, (208,)),
}


def _random_blocks(kind: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    size, offsets = _BLOCKS[kind]
    assert size == block_bytes
    n_blocks = shape[-1] // block_elems
    raw = rng.integers(0, 256, (*shape[:-1], n_blocks, block_bytes), dtype=np.uint8)
    for off in offsets:  # finite, modest scales
        scales = (rng.standard_normal((*shape[:-1], n_blocks)) * 0.01).astype(np.float16)
        raw[..., off : off + 2] = scales[..., None].view(np.uint8)
    return raw.reshape(*shape[:-1], n_blocks * block_bytes)


def test_dequantize_matches_llama_cpp_reference(tmp_path):
    """Our dequantization (whole tensors, and one expert of a stacked [E, out, in] tensor) of a
    file written by the `gguf` package equals llama.cpp's own gguf-py decoding the bytes."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

    rng = np.random.default_rng(0)
    path = str(tmp_path / "q.gguf")
    writer = GGUFWriter(path, "deepseek2")
    data = {}
    for kind in [*_BLOCKS, "F16", "BF16"]:
        qtype = GGMLQuantizationType[kind]
        for name, shape in {"w2d": (3, 512), "w3d": (2, 3, 256)}.items():
            if kind in _BLOCKS:
                raw = _random_blocks(kind, shape, rng)
            else:
                raw = quants.quantize(rng.standard_normal(shape).astype(np.float32), qtype)
            data[f"{kind}.{name}"] = raw
            writer.add_tensor(f"{kind}.{name}", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    jobs = [("dequantize", name.split(".")[0], raw) for name, raw in data.items()]
    wants = llama_cpp_quants(jobs, str(tmp_path))
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    for name, want in zip(data, wants, strict=True):
        want = torch.from_numpy(want)
        assert torch.isfinite(want).all() and want.abs().max() > 0, name
        got = dequantize(tensors[name])
        assert got.shape == want.shape and torch.equal(got, want), name
        if want.dim() == 3:
            for e in range(want.shape[0]):
                assert torch.equal(dequantize(tensors[name], e), want[e]), name


def test_missing_k_b_half_is_an_error():
    from moeserve.loader.gguf_deepseek import iter_deepseek2_weights

    class T:
        name, shape = "blk.0.attn_k_b.weight", np.array([2, 2, 1])

    class R:
        tensors = [T()]

    cfg = config_from_hf(CFG_V3)
    cfg = replace(cfg, moe=replace(cfg.moe, topk_method="greedy"))
    with pytest.raises(LoadError, match="attn_k_b"):
        list(iter_deepseek2_weights(R(), cfg, lambda t, i: torch.zeros(1, 2, 2)))
