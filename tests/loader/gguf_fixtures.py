"""GGUF files written by llama.cpp's own converter, for the deepseek2 loader tests.

The converter (`convert_hf_to_gguf.py`, its `conversion/` package and its own `gguf-py`) comes
from the llama-cpp-python source distribution on PyPI, pinned below, downloaded once with pip
into a cache folder (MOESERVE_TEST_CACHE, default ~/.cache/moeserve-tests). It runs in a
subprocess with one change: its pre-tokenizer detection (a hash of a reference text's tokens,
which a tiny test vocabulary cannot match) is told the name ("deepseek-v3", "kimi-k2"). For a
Kimi tiktoken folder, a stub stands in for Kimi's remote-code tokenizer class, showing the
converter the same two attributes it reads (ranks, special tokens). Tensors, vocabulary and
metadata go through llama.cpp's code untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LLAMA_CPP_PYTHON = "0.3.36"
_VENDOR = "vendor/llama.cpp/"
_NEEDED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
_PIP_TIMEOUT_S = 900

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    + USER
    + "{{ m['content'] }}{% else %}"
    + ASSISTANT
    + "{{ m['content'] }}"
    + EOS
    + "{% endif %}{% endfor %}{% if add_generation_prompt %}"
    + ASSISTANT
    + "{% endif %}"
)
# DeepSeek-V3's published tokenizer.json pre-tokenizer: these three splits, then byte-level
DSV3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)
_CORPUS = (
    "The quick brown fox jumps over the lazy dog, again and again! ",
    "Hello world, hello moeserve: 12345 67890 2025-01-01 3.14159. ",
    "def forward(self, x):\n    return self.proj(x) + 1\n\n",
    "我想在apple工作 こんにちは カタカナ 東京 ... !!! ??? (yes) [no] ",
)


def cache_dir() -> Path:
    root = os.environ.get("MOESERVE_TEST_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "moeserve-tests"
    )
    return Path(root)


def llama_cpp_converter() -> Path:
    """The folder holding llama.cpp's convert_hf_to_gguf.py, conversion/ and gguf-py/ of the
    pinned llama-cpp-python sdist (downloaded on first use; a failed download raises)."""
    dest = cache_dir() / f"llama.cpp-{LLAMA_CPP_PYTHON}"
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                "-d",
                tmp,
            ],
            check=True,
            timeout=_PIP_TIMEOUT_S,
        )
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        staging = Path(tmp) / "staging"
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                rel = member.name.split("/", 1)[-1]
                if not rel.startswith(_VENDOR) or not (member.isfile() or member.isdir()):
                    continue
                rel = rel[len(_VENDOR) :]
                if rel.startswith(_NEEDED):
                    member.name = rel
                    tar.extract(member, staging, filter="data")
        try:
            os.replace(staging, dest)  # atomic: a concurrent run finds all or nothing
        except OSError:
            if not (dest / "convert_hf_to_gguf.py").is_file():
                raise
    return dest


_WRAPPER = """
import base64
import json
import sys
from pathlib import Path
from types import SimpleNamespace

vendor = sys.argv[1]
sys.path[:0] = [vendor, vendor + "/gguf-py"]
import transformers

import conversion.base as base
import convert_hf_to_gguf as convert


class TikTokenStub:
    # what Kimi's remote-code tokenizer (TikTokenTokenizer) shows the converter: its tiktoken
    # ranks and special tokens; the remote code itself is not part of the test folder
    def __init__(self, folder):
        ranks = {}
        for line in (folder / "tiktoken.model").read_text().splitlines():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        self.model = SimpleNamespace(_mergeable_ranks=ranks)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        added = config["added_tokens_decoder"]
        self.special_tokens = {v["content"]: int(k) for k, v in added.items()}


from_pretrained = transformers.AutoTokenizer.from_pretrained


def load_tokenizer(path, *args, **kwargs):
    folder = Path(path)
    if (folder / "tiktoken.model").is_file():
        return TikTokenStub(folder)
    return from_pretrained(path, *args, **kwargs)


transformers.AutoTokenizer.from_pretrained = load_tokenizer


def keep_nextn():
    # deepseek2 files from this converter drop the MTP layers; this keeps them the way the
    # converter's own DeepSeek-V3.2 class does (blocks past num_hidden_layers, gguf-py's
    # NEXTN tensor names, the nextn_predict_layers key)
    import gguf
    from conversion.deepseek import DeepseekV2Model

    arch = gguf.MODEL_ARCH.DEEPSEEK2
    nextn = [t for t in gguf.MODEL_TENSOR if t.name.startswith("NEXTN_")]
    gguf.MODEL_TENSORS[arch] = [*gguf.MODEL_TENSORS[arch], *nextn]
    init, params = DeepseekV2Model.__init__, DeepseekV2Model.set_gguf_parameters

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.block_count += self.hparams.get("num_nextn_predict_layers", 0)
        self.tensor_map = gguf.get_tensor_name_map(self.model_arch, self.block_count)

    def set_gguf_parameters(self):
        params(self)
        self.gguf_writer.add_nextn_predict_layers(self.hparams.get("num_nextn_predict_layers", 0))

    DeepseekV2Model.skip_mtp = False
    DeepseekV2Model.__init__ = __init__
    DeepseekV2Model.set_gguf_parameters = set_gguf_parameters
    tensors = gguf.MODEL_TENSORS[arch][: -len(nextn)]

    def undo():
        gguf.MODEL_TENSORS[arch] = tensors
        DeepseekV2Model.skip_mtp = True
        DeepseekV2Model.__init__, DeepseekV2Model.set_gguf_parameters = init, params

    return undo


for pre, args, nextn in json.loads(sys.argv[2]):
    undo = keep_nextn() if nextn else None
    # the one change to the converter: a tiny test vocabulary has no registered
    # pre-tokenizer hash, so the pre-tokenizer is named
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer, pre=pre: pre
    sys.argv = ["convert_hf_to_gguf.py", *args]
    convert.main()
    if undo:
        undo()
"""


@dataclass(frozen=True)
class Job:
    folder: str  # HF checkpoint folder
    outtype: str  # f32 | f16 | bf16 | q8_0
    outfile: str
    pre: str = "deepseek-v3"  # tokenizer.ggml.pre to write
    extra: tuple[str, ...] = ()  # more converter arguments
    nextn: bool = False  # keep the MTP layers as nextn blocks (the converter drops them)


def convert(jobs: list[Job], workdir: str) -> None:
    """Run llama.cpp's converter once per job, all in one subprocess."""
    vendor = llama_cpp_converter()
    script = os.path.join(workdir, "convert_wrapper.py")
    with open(script, "w") as f:
        f.write(_WRAPPER)
    args = [
        [j.pre, [j.folder, "--outtype", j.outtype, "--outfile", j.outfile, *j.extra], j.nextn]
        for j in jobs
    ]
    proc = subprocess.run(
        [sys.executable, script, str(vendor), json.dumps(args)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp converter failed:\n{proc.stderr[-4000:]}")


_QUANTS = """
import json
import sys

import numpy as np

sys.path.insert(0, sys.argv[1] + "/gguf-py")
from gguf import GGMLQuantizationType, quants

ops = json.loads(sys.argv[2])
arrays = np.load(sys.argv[3])
out = {}
for i, (op, kind) in enumerate(ops):
    qtype, a = GGMLQuantizationType[kind], arrays[f"a{i}"]
    if op == "round":
        a = quants.dequantize(quants.quantize(a, qtype), qtype).reshape(a.shape)
    else:
        a = quants.dequantize(a, qtype)
    out[f"a{i}"] = a.astype(np.float32)
np.savez(sys.argv[4], **out)
"""


def llama_cpp_quants(jobs: list[tuple[str, str, np.ndarray]], workdir: str) -> list[np.ndarray]:
    """llama.cpp's own gguf-py (the pinned sdist's, in a subprocess: it cannot share a process
    with the installed `gguf`) on each (op, type, array): op "round" quantizes a float array
    and dequantizes it back; "dequantize" decodes raw blocks. Returns float32 arrays."""
    vendor = llama_cpp_converter()
    script = os.path.join(workdir, "llama_cpp_quants.py")
    with open(script, "w") as f:
        f.write(_QUANTS)
    src, dst = os.path.join(workdir, "quants_in.npz"), os.path.join(workdir, "quants_out.npz")
    np.savez(src, **{f"a{i}": a for i, (_, _, a) in enumerate(jobs)})
    ops = json.dumps([[op, kind] for op, kind, _ in jobs])
    proc = subprocess.run(
        [sys.executable, script, str(vendor), ops, src, dst], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp gguf-py failed:\n{proc.stderr[-4000:]}")
    with np.load(dst) as out:
        return [out[f"a{i}"] for i in range(len(jobs))]


def write_tokenizer(folder: str, vocab_size: int) -> None:
    """A byte-level BPE in DeepSeek-V3's layout: its merges are learnt with no pre-split (so
    some cross the DeepSeek split points: a wrong pre-tokenizer changes the ids), and the
    saved tokenizer carries DeepSeek-V3's pre-tokenizer, special tokens and a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[BOS, EOS, USER, ASSISTANT],
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 8, trainer)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in DSV3_SPLITS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, ensure_ascii=False)


def write_checkpoint(folder: str, model, vocab_size: int) -> None:
    """The HF model's save_pretrained folder plus the tokenizer; config.json without the
    derived `head_dim` transformers adds (published DeepSeek configs have none)."""
    model.save_pretrained(folder)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.pop("head_dim", None)
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    write_tokenizer(folder, vocab_size)
