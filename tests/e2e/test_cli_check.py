"""`moeserve check`: every `make-checkpoint` layout is recognised and loadable, what it stores
quantized agrees with what the writer quantized, and broken folders give one line and exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve.check import check_checkpoint
from moeserve.cli import main
from moeserve.testing.checkpoints import FORMATS, LIKES, write_checkpoint

FORMAT_LINE = {
    "bf16": "format: bfloat16 (unquantized)",
    "fp8-block": "format: fp8-block 128x128",
    "nvfp4-modelopt": "format: nvfp4 ModelOpt W4A4 (quant_algo NVFP4",
    "nvfp4-ct": "format: compressed-tensors nvfp4 W4A4 (format nvfp4-pack-quantized",
}
SOURCE_LINE = {
    "bf16": "quant config: none",
    "fp8-block": "quant config: config.json quantization_config",
    "nvfp4-modelopt": "quant config: hf_quant_config.json",
    "nvfp4-ct": "quant config: config.json quantization_config",
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Every layout, written once: {(like, fmt): WrittenCheckpoint}."""
    root = tmp_path_factory.mktemp("ckpts")
    return {
        (like, fmt): write_checkpoint(str(root / f"{like}-{fmt}"), like, fmt)
        for like in LIKES
        for fmt in FORMATS
    }


def _writer_components(quantized: set[str]) -> set[tuple[str, int]]:
    """The writer's quantized module names ('model.layers.1.mlp.experts.3.up_proj') as
    (component, layer), written out independently of the checker."""
    out = set()
    for name in quantized:
        parts = name.split(".")
        layer, rest = int(parts[2]), parts[3:]
        if rest[0] == "self_attn":
            out.add(("self_attn", layer))
        elif rest[1] in ("experts", "shared_experts"):
            out.add((f"mlp.{rest[1]}", layer))
        else:
            out.add(("mlp", layer))
    return out


@pytest.mark.parametrize("like", LIKES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_written_layout_is_recognised(written, like, fmt):
    wc = written[like, fmt]
    report = check_checkpoint(wc.path)
    assert report.loadable, report.problems
    text = "\n".join(report.lines)
    assert FORMAT_LINE[fmt] in text
    assert SOURCE_LINE[fmt] in text
    assert report.quantized == _writer_components(wc.quantized)
    if like == "kimi-k2.5":
        assert "text weights under language_model." in text
        assert "vision: MoonViT 2 layers, width 32, patch 14, 2x2 merge -> 64; 35 tensors" in text
        assert "image input served" in text
    if like == "deepseek-v3":
        assert "(MTP, skipped; the draft model of --speculative-config method mtp)" in text


def test_weight_only_and_fp8_cache(tmp_path):
    wc = write_checkpoint(
        str(tmp_path / "k"), "kimi-k2.5", "nvfp4-modelopt", w4a4=False, kv_fp8=True
    )
    report = check_checkpoint(wc.path)
    assert report.loadable, report.problems
    text = "\n".join(report.lines)
    assert "nvfp4 ModelOpt W4A16 (quant_algo W4A16_NVFP4" in text
    assert "KV cache: FP8 (kv_cache_quant_algo FP8), k/v scales for 2 of 2 layers" in text
    assert "config.json quantization_config: present, agrees" in text


def test_cli_reports_and_exits_0(written, capsys):
    rc = main(["check", written["kimi-k2.5", "nvfp4-modelopt"].path])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "loadable: yes" in out.out and "stored quantized: mlp.experts (layers 1)" in out.out
    assert "excluded '*.shared_experts*': mlp.shared_experts (layers 1)" in out.out
    assert out.err == ""


# ---- broken folders -------------------------------------------------------------------------
def _copy(wc, tmp_path, name: str) -> str:
    dst = tmp_path / name
    shutil.copytree(wc.path, dst)
    return str(dst)


def _shard(folder: str) -> str:
    return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))[1]


def _cli_error(capsys, folder: str) -> str:
    rc = main(["check", folder])
    out = capsys.readouterr()
    assert rc == 2
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeserve: error: "), out.err
    return lines[0]


def test_truncated_shard(written, tmp_path, capsys):
    folder = _copy(written["deepseek-v3", "fp8-block"], tmp_path, "t")
    path = os.path.join(folder, _shard(folder))
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    assert "is not a readable safetensors file" in _cli_error(capsys, folder)


def test_garbage_header(written, tmp_path, capsys):
    folder = _copy(written["moonlight", "nvfp4-ct"], tmp_path, "g")
    path = os.path.join(folder, _shard(folder))
    open(path, "wb").write((32).to_bytes(8, "little") + b"this is not a json header at all")
    assert "invalid JSON in header" in _cli_error(capsys, folder)


def test_missing_shard_listed_in_the_index(written, tmp_path, capsys):
    folder = _copy(written["kimi-k2.5", "bf16"], tmp_path, "m")
    shard = _shard(folder)
    os.remove(os.path.join(folder, shard))
    assert f"lacks {shard}, which model.safetensors.index.json lists" in _cli_error(capsys, folder)


def test_invalid_config_json(written, tmp_path, capsys):
    folder = _copy(written["kimi-k2.5", "bf16"], tmp_path, "c")
    open(os.path.join(folder, "config.json"), "w").write('{"architectures": [')
    assert "config.json is not valid JSON" in _cli_error(capsys, folder)


def test_corrupt_folder_in_a_real_process_has_no_traceback(written, tmp_path):
    folder = _copy(written["deepseek-v3", "bf16"], tmp_path, "p")
    path = os.path.join(folder, _shard(folder))
    open(path, "wb").write(b"\x00" * 4)
    r = subprocess.run(
        [sys.executable, "-m", "moeserve.cli", "check", folder],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("moeserve: error: ")


def _problems(capsys, folder: str) -> str:
    rc = main(["check", folder])
    out = capsys.readouterr()
    assert rc == 2, out.out
    assert "loadable: no" in out.out
    return out.err


def test_quant_config_edited_by_hand(written, tmp_path, capsys):
    # the shared experts are stored in BF16, but the exclude list no longer says so
    folder = _copy(written["kimi-k2.5", "nvfp4-modelopt"], tmp_path, "q")
    path = os.path.join(folder, "hf_quant_config.json")
    q = json.load(open(path))
    q["quantization"]["exclude_modules"].remove("*.shared_experts*")
    json.dump(q, open(path, "w"))
    err = _problems(capsys, folder)
    assert "shared_experts.down_proj.weight is stored as bfloat16, the model expects uint8" in err
    assert "the model needs are missing, e.g. model.layers.1.mlp.shared_experts" in err


def test_missing_expert_and_unknown_tensor(written, tmp_path, capsys):
    folder = _copy(written["kimi-k2.5", "nvfp4-modelopt"], tmp_path, "e")
    index_path = os.path.join(folder, "model.safetensors.index.json")
    index = json.load(open(index_path))
    victim = next(n for n in index["weight_map"] if ".experts.3.up_proj.weight_scale" in n)
    shard = os.path.join(folder, index["weight_map"][victim])
    tensors = load_file(shard)
    del tensors[victim]
    extra = "language_model.layers.0.self_attn.q_a_proj.input_scale"
    tensors[extra] = torch.tensor(1.0)
    save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"][extra] = index["weight_map"].pop(victim)
    json.dump(index, open(index_path, "w"))
    err = _problems(capsys, folder)
    assert "mlp.experts" in err and "(experts 3)" in err
    assert f"{extra} matches no parameter of the model" in err


def test_index_pointing_at_the_wrong_file(written, tmp_path, capsys):
    folder = _copy(written["moonlight", "bf16"], tmp_path, "i")
    index_path = os.path.join(folder, "model.safetensors.index.json")
    index = json.load(open(index_path))
    files = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][name] = files[1]
    json.dump(index, open(index_path, "w"))
    assert "the index lists 1 tensor(s) in files that do not hold them" in _problems(capsys, folder)


# ---- GGUF -------------------------------------------------------------------------------------
def _tiny_gguf(path, block_count: int) -> None:
    """A llama GGUF written by the `gguf` package (llama.cpp's writer): embedding, norms and a
    Q8_0 attention weight for layers 0 and 1."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(block_count)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(32, dtype=np.float32))
        q8 = quants.quantize(np.ones((32, 32), dtype=np.float32), GGMLQuantizationType.Q8_0)
        w.add_tensor(f"blk.{i}.attn_q.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_header_missing_layers_and_truncated_file(tmp_path, capsys):
    good = tmp_path / "tiny.gguf"
    _tiny_gguf(good, block_count=2)
    report = check_checkpoint(str(good))
    assert report.loadable, report.problems
    text = "\n".join(report.lines)
    assert "architecture: llama (tiny)" in text and "format: GGUF F32 x3, Q8_0 x2" in text
    short = tmp_path / "short.gguf"
    _tiny_gguf(short, block_count=3)
    assert "block_count is 3 but layers 2 have no tensors" in _problems(capsys, str(short))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-100])
    assert "is not a readable GGUF file" in _cli_error(capsys, str(cut))
