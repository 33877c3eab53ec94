import os

import pytest
import torch

from moeserve.loader import default_model_path


@pytest.fixture(scope="session")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def hf_llama(gguf_path):
    """HF transformers' own Llama, loaded from the same GGUF in fp32: the independent oracle."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    )
    model.generation_config.eos_token_id = None  # compare full 48-token continuations
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="session")
def llm(gguf_path):
    from moeserve.engine.offline import LLM

    return LLM(gguf_path, dtype="float32", max_model_len=2048)
