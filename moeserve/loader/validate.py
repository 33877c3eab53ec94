"""Checks of checkpoint files before any loader touches them: safetensors headers, GGUF
headers and tensor infos, JSON config files.

Every read is bounded by the file's real size: a corrupt or hostile header that declares a
huge length, count or tensor is refused with one sentence naming the file and what is wrong,
never allocated. A file that passes is structurally sound (its tensors lie inside it with the
sizes their dtypes and shapes imply); whether the model wants those tensors is the loader's
business.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

from moeserve.errors import LoadError

# safetensors
_ST_MAX_HEADER = 100 << 20  # the format's own limit (the Rust reader refuses more)
_ST_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
# GGUF
_GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)
_GGUF_MAX_DIMS = 4
_GGUF_DEFAULT_ALIGNMENT = 32
# value types: fixed sizes; 8 = string, 9 = array
_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_JSON_FILES = (
    "config.json",
    "model.safetensors.index.json",
    "hf_quant_config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
)


def validate_folder(path: str, weights: bool = True) -> None:
    """Check an HF checkpoint folder's JSON files and (`weights`) its safetensors headers;
    raise `LoadError`."""
    folder = Path(path)
    for name in _JSON_FILES:
        if (folder / name).is_file():
            read_json(str(folder / name))
    if weights:
        for f in sorted(folder.glob("*.safetensors")):
            validate_safetensors(str(f))


def read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise LoadError(
            f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
        ) from None
    except UnicodeDecodeError:
        raise LoadError(f"{path} is not valid JSON: it is not UTF-8 text") from None
    except OSError as e:
        raise LoadError(f"cannot read {path}: {e.strerror or e}") from None


# ---- safetensors ------------------------------------------------------------------------------
def validate_safetensors(path: str) -> None:
    size = _size(path)
    if size < 8:
        raise LoadError(f"{path} is not a safetensors file: {size} bytes, too short for a header")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(size - 8, _ST_MAX_HEADER):
            raise LoadError(
                f"{path} is truncated or corrupt: its header declares {n} bytes but the file "
                f"has {size - 8} after the length field"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise LoadError(f"{path} is corrupt: its safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise LoadError(f"{path} is corrupt: its safetensors header is not a JSON object")
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        _check_st_tensor(path, name, info, data)


def _check_st_tensor(path: str, name: str, info: Any, data: int) -> None:
    def bad(what: str) -> LoadError:
        return LoadError(f"{path} is corrupt: tensor {name!r} {what}")

    if not isinstance(info, dict):
        raise bad("has no description")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _ST_ITEMSIZE:
        raise bad(f"has an unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_uint(d) for d in shape):
        raise bad(f"has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_uint(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise bad(f"has invalid data offsets {offsets!r}")
    if offsets[1] > data:
        raise LoadError(
            f"{path} is truncated: tensor {name!r} ends at byte {offsets[1]} of the data but "
            f"the file holds {data}"
        )
    want = math.prod(shape) * _ST_ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != want:
        raise bad(
            f"spans {offsets[1] - offsets[0]} bytes but its shape {shape} of {dtype} needs {want}"
        )


def _uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# ---- GGUF -------------------------------------------------------------------------------------
class _Reader:
    """Reads a file front to back, refusing any read past its end."""

    def __init__(self, f: BinaryIO, path: str, size: int) -> None:
        self.f, self.path, self.size = f, path, size
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise LoadError(
                f"{self.path} is truncated or corrupt: {what} at byte {self.pos} needs {n} "
                f"bytes but the file has {self.size}"
            )
        self.pos += n
        return self.f.read(n)

    def skip(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            self.take(n, what)  # raises
        self.pos += n
        self.f.seek(self.pos)

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(what)
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise LoadError(f"{self.path} is corrupt: {what} is not UTF-8 text") from None


def validate_gguf(path: str) -> None:
    """Header, metadata and tensor infos of a GGUF file; every tensor inside the file."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = _size(path)
    with open(path, "rb") as f:
        r = _Reader(f, path, size)
        if r.take(4, "the magic number") != _GGUF_MAGIC:
            raise LoadError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
        version = r.u32("the version")
        if version not in _GGUF_VERSIONS:
            raise LoadError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors = r.u64("the tensor count")
        n_kv = r.u64("the metadata count")
        # every entry takes well over one byte: a count beyond the file size is corrupt
        if n_tensors > size or n_kv > size:
            raise LoadError(
                f"{path} is corrupt: it declares {n_tensors} tensors and {n_kv} metadata "
                f"entries in a file of {size} bytes"
            )
        alignment = _GGUF_DEFAULT_ALIGNMENT
        for i in range(n_kv):
            key = r.string(f"metadata key {i}")
            value = _gguf_value(r, r.u32(f"the type of {key!r}"), key)
            if key == "general.alignment":
                alignment = value if isinstance(value, int) and value > 0 else 0
                if alignment == 0 or alignment & (alignment - 1):
                    raise LoadError(f"{path} is corrupt: general.alignment {value!r}")
        tensors = []
        for i in range(n_tensors):
            name = r.string(f"the name of tensor {i}")
            n_dims = r.u32(f"the rank of tensor {name!r}")
            if n_dims > _GGUF_MAX_DIMS:
                raise LoadError(f"{path} is corrupt: tensor {name!r} has {n_dims} dimensions")
            dims = [r.u64(f"the shape of tensor {name!r}") for _ in range(n_dims)]
            kind = r.u32(f"the type of tensor {name!r}")
            offset = r.u64(f"the offset of tensor {name!r}")
            tensors.append((name, dims, kind, offset))
        data = -(-r.pos // alignment) * alignment
    for name, dims, kind, offset in tensors:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise LoadError(f"{path} is corrupt: tensor {name!r} has unknown type {kind}") from None
        count = math.prod(dims)
        if dims and dims[0] % block:
            raise LoadError(
                f"{path} is corrupt: tensor {name!r} rows of {dims[0]} are not whole blocks "
                f"of {block}"
            )
        nbytes = count // block * type_size
        if data + offset + nbytes > size:
            raise LoadError(
                f"{path} is truncated: tensor {name!r} needs bytes up to {data + offset + nbytes} "
                f"but the file has {size}"
            )


def _gguf_value(r: _Reader, kind: int, key: str) -> Any:
    """One metadata value; arrays are walked (bounded) but not kept."""
    if kind in _GGUF_SCALAR:
        raw = r.take(_GGUF_SCALAR[kind], f"the value of {key!r}")
        return int.from_bytes(raw, "little") if kind in (4, 10) else None
    if kind == _GGUF_STRING:
        r.string(f"the value of {key!r}")
        return None
    if kind == _GGUF_ARRAY:
        item = r.u32(f"the item type of {key!r}")
        count = r.u64(f"the length of {key!r}")
        if item in _GGUF_SCALAR:
            r.skip(count * _GGUF_SCALAR[item], f"the items of {key!r}")
        elif item == _GGUF_STRING:
            if count * 8 > r.size - r.pos:
                raise LoadError(
                    f"{r.path} is corrupt: {key!r} declares {count} strings, more than the "
                    "file can hold"
                )
            for _ in range(count):
                r.skip(r.u64(f"an item of {key!r}"), f"an item of {key!r}")
        else:
            raise LoadError(f"{r.path} is corrupt: {key!r} is an array of unknown type {item}")
        return None
    raise LoadError(f"{r.path} is corrupt: {key!r} has unknown value type {kind}")


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError as e:
        raise LoadError(f"cannot read {path}: {e.strerror or e}") from None
