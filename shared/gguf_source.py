"""Where a model folder's GGUF is: the record `kestrel fetch-model` writes, read by the config
builder (to refuse `--quantization gguf` before any process starts) and the worker's GGUF
loader (services/worker/gguf_loader.py).

The record is `<folder>/kestrel_gguf.json`: {"gguf_file": "<path>"}, the path relative to the
folder (fetch-model writes "../.gguf/SmolLM2-135M-Instruct.Q4_1.gguf": the folder and the kept
GGUF move together, as in compose.yaml's ./models mount) or absolute. A folder converted
elsewhere can be given one by hand. No `gguf` reader here: the config builder runs in every
process, and the `gguf` package's reader parses every metadata array field by field (7 s for
SmolLM2's tokenizer on the loaded 2-core VM): `read_header` walks the header (GGUF v2/v3,
ggml-org/ggml docs/gguf.md) and returns the scalar metadata and the tensor table in ~0.1 s;
`gguf_architecture` stops after the first keys (the config builder's check). `tensor_bytes`
takes the block sizes from the `gguf` package's type table (`gguf.constants`, imported when
it is called); with it `require_gguf(folder, data=True)` also checks that every tensor's data
lies inside the file (`kestrel serve` runs it before any process starts, so a truncated
download is refused in a second, not after the worker's imports; the worker's loader checks
the same).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass, field

POINTER_FILE = "kestrel_gguf.json"
MAGIC = b"GGUF"
ARCHITECTURES = ("llama",)  # what the GGUF loader maps (services/worker/gguf_names.py)
_ALTERNATIVES = ("or use --quantization int4 or int8 (quantized at load from the folder's "
                 "safetensors) or none")

# GGUF metadata value types -> struct format of one value (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32  # of the tensor data, unless general.alignment says otherwise


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file's table: name, dims (ggml's ne order: ne[0], the contiguous
    row length, first), ggml type id (gguf.GGMLQuantizationType), offset of its data in the
    file (bytes, absolute)."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass
class GGUFHeader:
    """A GGUF file's header: its scalar and string metadata (arrays are skipped: the
    tokenizer's, which fetch-model reads with the `gguf` package), and the tensor table."""

    version: int
    metadata: dict[str, object] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)

    def integer(self, key: str, default: int | None = None) -> int:
        """The integer metadata value `key` (default when absent). Raises ValueError when it
        is absent without a default, or not an integer."""
        v = self.metadata.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"GGUF metadata {key}: an integer expected, got {v!r}")
        return v


class _Cursor:
    """Little-endian reads from a byte buffer, raising ValueError past its end."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"{self.path}: the GGUF header is cut short")
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out

    def string(self) -> str:
        (n,) = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: the GGUF header is cut short")
        out = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return out

    def value(self, vtype: int):
        """The value of a metadata type; None (skipped) for an array."""
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.take("<" + _SCALARS[vtype])[0]
        if vtype == _ARRAY:
            etype, count = self.take("<IQ")
            if etype in _SCALARS:
                self.pos += count * struct.calcsize("<" + _SCALARS[etype])
            else:
                for _ in range(count):
                    self.value(etype)
            return None
        raise ValueError(f"{self.path}: unknown GGUF metadata type {vtype}")


def read_header(path: str, max_keys: int | None = None, tensors: bool = True) -> GGUFHeader:
    """Parse a GGUF file's header (ggml-org/ggml docs/gguf.md, v2/v3, little-endian): the
    metadata (the first `max_keys` keys, all by default) and, with `tensors`, the tensor table
    with absolute data offsets (aligned to general.alignment, default 32). Reads the file
    through a memory map: about 0.1 s for SmolLM2's header, whose tokenizer arrays the
    `gguf` package's reader parses field by field (7 s on the loaded 2-core VM).
    Raises ValueError for a file that is not a GGUF (magic), an unsupported version or a
    header cut short."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise ValueError(f"{path} is not a GGUF file (too short)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            c = _Cursor(mm, path)
            if c.take("4s")[0] != MAGIC:
                raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
            (version,) = c.take("<I")
            if version not in (2, 3):
                raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
            n_tensors, kv_count = c.take("<QQ")
            head = GGUFHeader(version)
            for _ in range(kv_count if max_keys is None else min(kv_count, max_keys)):
                key = c.string()
                (vtype,) = c.take("<I")
                head.metadata[key] = c.value(vtype)
            if not tensors or (max_keys is not None and max_keys < kv_count):
                return head
            table = []
            for _ in range(n_tensors):
                name = c.string()
                (n_dims,) = c.take("<I")
                dims = c.take(f"<{n_dims}Q")
                ggml_type, offset = c.take("<IQ")
                table.append((name, tuple(int(d) for d in dims), ggml_type, offset))
            align = head.integer("general.alignment", DEFAULT_ALIGNMENT)
            if align <= 0 or align & (align - 1):
                raise ValueError(f"{path}: general.alignment {align} is not a power of two")
            start = -(-c.pos // align) * align
            head.tensors = [TensorInfo(n, d, t, start + o) for n, d, t, o in table]
            return head


def tensor_bytes(t: TensorInfo, path: str) -> int:
    """Bytes of tensor `t`'s data: its values (the product of its dims) in blocks of its GGML
    type (`gguf.constants.GGML_QUANT_SIZES`: values and bytes per block). Raises ValueError
    naming the tensor and the file `path` for an unknown type, or rows (ne[0]) that are not
    whole blocks."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        gtype = GGMLQuantizationType(t.ggml_type)
    except ValueError:
        raise ValueError(f"tensor {t.name} in {path}: unknown GGML type {t.ggml_type}") from None
    per_block, block_bytes = GGML_QUANT_SIZES[gtype]
    if not t.dims or t.dims[0] % per_block:
        raise ValueError(f"tensor {t.name} in {path}: {gtype.name} rows of {t.dims[0] if t.dims else 0} "
                         f"values are not whole blocks of {per_block}")
    n = 1
    for d in t.dims:
        n *= d
    return n // per_block * block_bytes


def check_tensor_data(head: GGUFHeader, path: str, size: int) -> None:
    """Check that every tensor of `head` (read from `path`, `size` bytes) has its data inside
    the file (`tensor_bytes`). Raises ValueError naming the file: a type or row length as
    `tensor_bytes` does, or a file cut short (the first tensor whose data runs past its end,
    and the bytes the file would need)."""
    need, last = 0, None
    for t in head.tensors:
        end = t.offset + tensor_bytes(t, path)
        if end > size and end > need:
            need, last = end, t.name
    if last is not None:
        raise ValueError(f"{path} is cut short: {size} bytes, and its tensor table needs {need} "
                         f"(tensor {last}'s data runs past the end; an interrupted download or copy?)")


def gguf_architecture(path: str, max_keys: int = 64) -> str | None:
    """`general.architecture` of a GGUF file, from the header's first `max_keys` metadata
    keys (writers put it first), None when it is not among them. Raises ValueError as
    `read_header`."""
    arch = read_header(path, max_keys=max_keys, tensors=False).metadata.get("general.architecture")
    return arch if isinstance(arch, str) else None


def write_pointer(folder: str, gguf_path: str, relative_to: str | None = None) -> str:
    """Write `<folder>/kestrel_gguf.json` naming gguf_path, relative to `relative_to` (the
    folder's final place when it is built elsewhere; default folder). Returns the record's path."""
    rel = os.path.relpath(os.path.abspath(gguf_path), os.path.abspath(relative_to or folder))
    path = os.path.join(folder, POINTER_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"gguf_file": rel}, f, indent=2)
        f.write("\n")
    return path


def gguf_file_of(folder: str) -> str | None:
    """The GGUF path a model folder records (resolved against the folder, normalised), or None
    when it has no record. Raises ValueError for a record that is not {"gguf_file": str}."""
    path = os.path.join(folder, POINTER_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a GGUF record ({e})") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("gguf_file"), str):
        raise ValueError(f'{path}: a GGUF record is {{"gguf_file": "<path>"}}, got {rec!r}')
    return os.path.normpath(os.path.join(folder, rec["gguf_file"]))


def require_gguf(folder: str, data: bool = False) -> str:
    """The GGUF file `--quantization gguf` loads for a model folder: recorded
    (`gguf_file_of`), a file (not missing, not a folder), a GGUF, of an architecture in
    ARCHITECTURES; with `data`, also its whole header read and every tensor's data inside the
    file (`check_tensor_data`: ~0.1 s for SmolLM2's; the config builder leaves it out).
    Raises ValueError naming the setting, `kestrel fetch-model` and the alternatives."""
    head = "setting quantization: 'gguf' loads the linear weights from the quantized blocks of the GGUF"
    try:
        path = gguf_file_of(folder)
    except ValueError as e:
        raise ValueError(f"{head} the model folder records, and {e}; run `kestrel fetch-model`, "
                         f"{_ALTERNATIVES}") from None
    if path is None:
        raise ValueError(f"{head} the model folder was converted from, and {folder!r} records none (no "
                         f"{POINTER_FILE}): run `kestrel fetch-model` (it keeps the default model's GGUF "
                         f"under models/.gguf/ and records it in the folder), {_ALTERNATIVES}")
    if os.path.isdir(path):
        raise ValueError(f"{head} the model folder records, {path!r}, which is a folder, not a file: "
                         f"its {POINTER_FILE} must name the .gguf file itself; run `kestrel fetch-model "
                         f"--force` to record it again, {_ALTERNATIVES}")
    if not os.path.isfile(path):
        raise ValueError(f"{head} the model folder records, {path!r}, which is missing: run `kestrel "
                         f"fetch-model` to fetch it again (--force also rebuilds the folder), {_ALTERNATIVES}")
    try:
        if data:
            header = read_header(path)
            check_tensor_data(header, path, os.path.getsize(path))
            arch = header.metadata.get("general.architecture")
            arch = arch if isinstance(arch, str) else None
        else:
            arch = gguf_architecture(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{head} the model folder records, and {e}; run `kestrel fetch-model --force`, "
                         f"{_ALTERNATIVES}") from None
    if arch is not None and arch not in ARCHITECTURES:
        raise ValueError(f"{head} {path!r}: its architecture {arch!r} is not mapped (only "
                         f"{', '.join(ARCHITECTURES)}); {_ALTERNATIVES}")
    return path
