"""Corrupt checkpoints through the real CLI: every case ends with one line on stderr, exit
code 2, no traceback, and bounded memory (a header that declares a huge size is refused,
never allocated).

GGUF cases mutate the SmolLM2 default file (truncated, fields overwritten with huge values);
safetensors cases mutate a tiny DeepSeek-V3 checkpoint (length field, header JSON, offsets,
a shape that no longer matches the model, missing shard, invalid config.json).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from moeserve.loader import default_model_path
from moeserve.testing.checkpoints import write_checkpoint

# the process never allocates what a corrupt header declares (the GGUF cases copy a 100 MB
# file; nothing of the declared 2^60-byte sizes is ever allocated)
MAX_RSS_GROWTH_KB = 1 << 20
TIMEOUT_S = 240


def _gguf_cases(src: str, root: Path) -> dict[str, Path]:
    size = os.path.getsize(src)
    with open(src, "rb") as f:
        head = f.read(1 << 16)
    cases: dict[str, bytes | tuple[int, bytes]] = {
        "gguf-truncated-in-metadata": ("cut", 1000),
        "gguf-truncated-in-data": ("cut", size * 9 // 10),
        "gguf-bad-magic": ("put", 0, b"GGUX"),
        "gguf-bad-version": ("put", 4, struct.pack("<I", 0xFFFFFFFF)),
        "gguf-huge-tensor-count": ("put", 8, struct.pack("<Q", 2**60)),
        "gguf-huge-key-length": ("put", 24, struct.pack("<Q", 2**62)),
    }
    out = {}
    for name, spec in cases.items():
        path = root / f"{name}.gguf"
        if spec[0] == "cut":
            with open(src, "rb") as f, open(path, "wb") as g:
                g.write(f.read(spec[1]))
        else:
            shutil.copyfile(src, path)
            with open(path, "r+b") as g:
                g.seek(spec[1])
                g.write(spec[2])
        out[name] = path
    assert head[:4] == b"GGUF"
    return out


def _st_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), n


def _st_rewrite(path: Path, header: dict, n: int) -> None:
    """Same tensor data under a new header JSON."""
    raw = json.dumps(header).encode()
    with open(path, "rb") as f:
        f.seek(8 + n)
        data = f.read()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _st_cases(root: Path) -> dict[str, Path]:
    base = root / "st-base"
    write_checkpoint(str(base), "deepseek-v3", "bf16", shards=1)
    shard = "model.safetensors"
    out = {}

    def variant(name: str) -> Path:
        d = root / name
        shutil.copytree(base, d)
        out[name] = d
        return d

    with open(variant("st-huge-header-length") / shard, "r+b") as f:
        f.write(struct.pack("<Q", 2**63))
    with open(variant("st-garbage-header") / shard, "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xfe{{garbage")
    d = variant("st-truncated-data")
    size = os.path.getsize(d / shard)
    os.truncate(d / shard, size - 10)
    d = variant("st-offsets-beyond-file")
    header, n = _st_header(d / shard)
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [0, 2**60]
    _st_rewrite(d / shard, header, n)
    d = variant("st-shape-mismatch")  # a sound file whose tensor no longer fits the model
    header, n = _st_header(d / shard)
    name = next(k for k, v in header.items() if k.endswith("embed_tokens.weight"))
    a, b = header[name]["shape"]
    header[name]["shape"] = [b, a]
    _st_rewrite(d / shard, header, n)
    d = variant("st-missing-shard")
    weights = _st_header(d / shard)[0]
    index = {"weight_map": {k: "model-00002-of-00002.safetensors" for k in weights if k[0] != "_"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    d = variant("st-invalid-config-json")
    (d / "config.json").write_text('{"model_type": "deepseek_v3", "hidden_size": 64,,}')
    return out


SERVE_FLAGS = ["--port", "0", "--max-model-len", "64", "--num-pages", "8", "--threads", "1"]


# a tqdm bar's tail: "n/N [elapsed<left, rate]", the rate in tensor/s or s/tensor
_PROGRESS = re.compile(r"\d+/\d+ \[[^\]]*(tensor/s|s/tensor)\]\s*$")


def _error_lines(err: str) -> list[str]:
    """stderr without the INFO log lines and progress bars a normal start also prints (a
    bar left unfinished by the failure may share the error's line: cut it off)."""
    out = []
    for part in err.replace("\r", "\n").splitlines():
        if "moeserve: " in part:
            part = part[part.index("moeserve: ") :]
        elif part.startswith("INFO ") or _PROGRESS.search(part) or not part.strip():
            continue
        out.append(part)
    return out


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz")
    return {**_gguf_cases(default_model_path(), root), **_st_cases(root)}


def test_every_corrupt_checkpoint_gives_one_line_and_exit_2(corrupt, capfd, monkeypatch):
    """`moeserve serve CORRUPT` through the CLI's own entry point (in this process, so the
    cases stay fast; a separate process runs the same entry point below)."""
    import resource

    from moeserve import cli
    from moeserve.server import api

    def served(*args, **kwargs):
        raise AssertionError("a corrupt checkpoint was loaded and served")

    monkeypatch.setattr(api, "run_server", served)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    failures, messages = [], {}
    for name, path in corrupt.items():
        code = cli.main(["serve", str(path), *SERVE_FLAGS])
        err = capfd.readouterr().err
        lines = _error_lines(err)
        messages[name] = err
        if not (
            code == 2
            and "Traceback" not in err
            and len(lines) == 1
            and lines[0].startswith("moeserve: error: ")
            and "\n" not in lines[0].strip()
        ):
            failures.append(f"{name}: exit {code}, stderr:\n{err}")
    assert not failures, "\n\n".join(failures)
    # the message names the file at fault and what is wrong with it
    assert "model-00002-of-00002.safetensors" in messages["st-missing-shard"]
    assert "config.json is not valid JSON" in messages["st-invalid-config-json"]
    assert "truncated" in messages["gguf-truncated-in-data"]
    assert (
        "2305843009213693952" in messages["st-offsets-beyond-file"]
        or "truncated" in (messages["st-offsets-beyond-file"])
    )
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grown < MAX_RSS_GROWTH_KB, f"peak RSS grew by {grown} KB"


def test_debug_log_level_shows_the_traceback(corrupt):
    path = corrupt["st-shape-mismatch"]
    """A real child process: one line and exit 2 by default, the traceback with debug logs."""
    path = corrupt["st-shape-mismatch"]
    cmd = [sys.executable, "-m", "moeserve.cli", "serve", str(path), *SERVE_FLAGS]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    plain = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert len(_error_lines(plain.stderr)) == 1
    debug = subprocess.run(
        [*cmd, "--log-level", "debug"], capture_output=True, text=True, timeout=TIMEOUT_S, env=env
    )
    assert debug.returncode == 2 and "Traceback" in debug.stderr
    assert _error_lines(debug.stderr)[-1].startswith("moeserve: error: ")
