"""The architecture table is the one place a model family is added: a module written here (not
shipped) registers Qwen2 (a Llama decoder with q/k/v biases) through `register` alone, and the
engine serves a transformers-written Qwen2 checkpoint with transformers' own greedy tokens.
The table's other contracts: unknown architectures are one-sentence errors, every GGUF loader
belongs to an entry, and every `make-checkpoint --like` layout is an entry's."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch

from moeserve.config import ConfigError
from moeserve.models.registry import ARCHITECTURES, BUILTIN, config_from_hf

TOY_MODULE = '''
from dataclasses import replace

from moeserve.config import llama_config
from moeserve.models.llama import LlamaForCausalLM
from moeserve.models.registry import Architecture


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama's decoder with biases on the q, k and v projections (none on o)."""


def parse(raw, architecture):
    return replace(llama_config(raw, architecture), attention_bias=True)


QWEN2 = Architecture(
    name="toy_qwen2",
    hf_names=("Qwen2ForCausalLM", "qwen2"),
    parse_hf=parse,
    model=lambda: Qwen2ForCausalLM,
    description="Qwen2 (a Llama decoder with q/k/v biases)",
)
'''
PROMPTS = [[5, 17, 42, 99, 3, 64], [7, 7, 7, 120, 33], [250, 1, 88, 14, 200, 6, 9, 31]]
STEPS = 12


@pytest.fixture
def toy_architecture(tmp_path):
    (tmp_path / "toy_qwen2_arch.py").write_text(textwrap.dedent(TOY_MODULE))
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module("toy_qwen2_arch")
        ARCHITECTURES.register(module.QWEN2)
        yield module.QWEN2
    finally:
        ARCHITECTURES.unregister("toy_qwen2")
        sys.path.remove(str(tmp_path))
        sys.modules.pop("toy_qwen2_arch", None)


@pytest.fixture
def qwen2_folder(tmp_path):
    """A tiny random Qwen2 written by transformers, with a byte-level BPE tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from moeserve.testing.checkpoints import write_deepseek_tokenizer

    out = tmp_path / "qwen2"
    out.mkdir()
    vocab = write_deepseek_tokenizer(str(out), merges=64)
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            rope_theta=10000.0,
        )
    ).eval()
    with torch.no_grad():  # biases of a fresh model are zero: make them count
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    hf.save_pretrained(str(out), safe_serialization=True)
    return str(out), hf


def test_a_toy_architecture_added_through_the_table_serves_as_transformers(
    toy_architecture, qwen2_folder
):
    from moeserve.engine.offline import LLM
    from moeserve.sampling import SamplingParams

    path, hf = qwen2_folder
    llm = LLM(path, dtype="float32", max_model_len=128)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None
            )
        assert out.token_ids == ref[0, len(prompt) :].tolist()


def test_the_toy_architecture_is_gone_once_unregistered(qwen2_folder):
    from moeserve.errors import LoadError
    from moeserve.loader import load_model

    path, _ = qwen2_folder
    with pytest.raises(LoadError, match="unsupported model architecture 'Qwen2ForCausalLM'"):
        load_model(path, torch.float32)


def test_an_unknown_architecture_is_one_sentence():
    with pytest.raises(ConfigError, match="unsupported model architecture 'FooForCausalLM'") as e:
        config_from_hf({"architectures": ["FooForCausalLM"], "model_type": "foo"})
    assert "\n" not in str(e.value) and "LlamaForCausalLM" in str(e.value)
    with pytest.raises(ConfigError, match="GGUF architecture 'qwen2' is not supported"):
        ARCHITECTURES.lookup_gguf("qwen2")


def test_every_gguf_loader_and_checkpoint_layout_belongs_to_an_entry():
    from moeserve.loader.gguf import _LOADERS
    from moeserve.testing.checkpoints import LIKES

    assert set(_LOADERS) == {a.gguf_arch for a in BUILTIN if a.gguf_arch}
    assert sorted(LIKES) == sorted(like for a in BUILTIN for like in a.checkpoint_likes)
    for a in BUILTIN:
        assert isinstance(a.model_class(), type) and a.description
    names = [n for a in BUILTIN for n in a.hf_names]
    assert len(names) == len(set(names)), "an HF name served by two entries"


def test_entry_point_architectures_are_read(monkeypatch, toy_architecture):
    """An installed package's `moeserve.architectures` entry point lands in the table."""
    from moeserve.models import registry

    class EP:
        value = "toy_qwen2_arch:QWEN2"

        def load(self):
            return toy_architecture

    table = registry.ArchitectureTable(BUILTIN)
    monkeypatch.setattr(registry, "entry_points", lambda group: [EP()])
    cfg = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 8}
    assert table.lookup_hf(cfg) is toy_architecture
