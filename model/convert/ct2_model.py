"""Read a CTranslate2 model directory with our own code: ``model.bin``, config.json, vocabularies.

CTranslate2 is not imported: it is an optional dependency (the engine we measure against), and an
imported model must not depend on it. The binary layout is the one its ``ModelSpec._serialize``
writes and its C++ ``Model::load`` reads (little-endian, as written on every platform it ships for):

    u32 binary_version (1..6)
    version >= 2:  string spec_name, u32 spec_revision
    u32 num_variables, then each:
        string name, u8 rank, u32 dims[rank],
        version >= 4:  u8 dtype (float32, int8, int16, int32, float16, bfloat16), u32 num_bytes
        version <= 3:  u8 item_size (4 float32, 2 int16, 1 int8), u32 num_items
        num_bytes of data
    version >= 3:  u32 num_aliases, then each: string alias, string variable_name
    string = u16 length (counting a trailing NUL), then that many bytes

Quantized weights are dequantized here: CTranslate2 stores ``q = round(w * scale)`` with one scale
per output row (int8) or one per tensor (int16) in ``<name>_scale``, so ``w = q / scale``; an int16
weight saved without a scale (old models) used the global scale 1000. An alias also aliases its
``_scale`` (as the C++ loader does), since the spec aliased the float weight before quantizing it.

The file may be hostile (an Argos package from anywhere): every count it declares is bounded before
anything is allocated for it (variables and aliases by the bytes left to hold them, ranks by
``MAX_RANK``, each variable's bytes by its shape and the file, vocabularies by ``MAX_VOCABULARY``),
and a scale is used only when its shape is one of the two above, so that dequantizing never makes a
tensor larger than its weight (an ``[N, 1]`` scale would broadcast a ``[1, N]`` weight to N x N).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from model.convert.bounds import MAX_VOCABULARY
from model.convert.errors import ConversionError

BINARY_FILE = "model.bin"
CURRENT_BINARY_VERSION = 6  # the newest layout this reader knows (CTranslate2 4.x writes 6)
# The DataType enum of CTranslate2's include/ctranslate2/types.h, in order.
DTYPES = (torch.float32, torch.int8, torch.int16, torch.int32, torch.float16, torch.bfloat16)
_OLD_ITEM_SIZES = {4: torch.float32, 2: torch.int16, 1: torch.int8}  # binary versions 1-3
GLOBAL_INT16_SCALE = 1000.0  # ops::Quantize::global_int16_scale, for int16 weights saved without a scale
MAX_RANK = 4  # CTranslate2 writes scalars, vectors and matrices; anything past 4 dimensions is not its
# The fewest bytes a variable's record takes (name length, rank, dtype or item size, size) and an
# alias's (two string lengths): a count of either that the bytes left cannot hold is refused.
_MIN_VARIABLE_BYTES = 2 + 1 + 1 + 4
_MIN_ALIAS_BYTES = 2 + 2


@dataclass
class CT2Model:
    """A CTranslate2 model directory as plain data: float32 weights, scalars as 0-d tensors."""

    path: Path
    spec: str  # e.g. "TransformerSpec"; "" for binary version 1
    revision: int  # the spec's revision (layout of the variable names)
    binary_version: int
    variables: dict[str, torch.Tensor]  # aliases resolved, quantized weights dequantized to float32
    config: dict[str, Any] = field(default_factory=dict)  # config.json ({} when absent: old models)
    source_vocabulary: list[str] = field(default_factory=list)
    target_vocabulary: list[str] = field(default_factory=list)
    shared_vocabulary: bool = True  # one vocabulary file for both sides
    vocabulary_files: tuple[str, ...] = ()  # the files they came from, for messages


class _Reader:
    """Reads ``model.bin`` from memory, raising ``ConversionError`` at the first short read."""

    def __init__(self, path: Path, data: bytearray) -> None:
        self.path, self.data, self.pos = path, data, 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise ConversionError(
                f"{self.path}: truncated: {what} needs {n} bytes at offset {self.pos}, "
                f"the file has {len(self.data) - self.pos} left"
            )
        view = memoryview(self.data)[self.pos : self.pos + n]
        self.pos += n
        return view

    def unpack(self, fmt: str, what: str) -> int:
        return int(struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0])

    def count(self, what: str, min_bytes: int) -> int:
        """A u32 count of records of at least ``min_bytes`` each, refused if the rest of the file
        cannot hold that many (before anything is made for them)."""
        n = self.unpack("<I", what)
        left = len(self.data) - self.pos
        if n * min_bytes > left:
            raise ConversionError(
                f"{self.path}: {what} is {n}, more than the {left} bytes left in the file can hold"
            )
        return n

    def string(self, what: str) -> str:
        raw = bytes(self.take(self.unpack("<H", f"length of {what}"), what))
        try:
            return raw.split(b"\0", 1)[0].decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConversionError(f"{self.path}: {what} at offset {self.pos} is not UTF-8 ({e})") from e


def read_binary(path: Path) -> tuple[int, str, int, dict[str, torch.Tensor], list[tuple[str, str]]]:
    """(binary_version, spec, revision, raw variables in their stored dtypes, aliases) of ``path``."""
    try:
        data = bytearray(path.read_bytes())  # writable: torch.frombuffer shares it without a warning
    except OSError as e:
        raise ConversionError(f"{path}: cannot read ({e.strerror or e})") from e
    r = _Reader(path, data)
    version = r.unpack("<I", "the binary version")
    if not 1 <= version <= CURRENT_BINARY_VERSION:
        raise ConversionError(
            f"{path}: binary version {version} is not one this reader knows (1-{CURRENT_BINARY_VERSION}): "
            "not a CTranslate2 model, corrupted, or made by a newer CTranslate2"
        )
    spec, revision = ("", 1) if version < 2 else (r.string("the spec name"), r.unpack("<I", "the revision"))
    variables: dict[str, torch.Tensor] = {}
    for i in range(r.count("the number of variables", _MIN_VARIABLE_BYTES)):
        name = r.string(f"the name of variable {i}")
        if name in variables:
            raise ConversionError(f"{path}: variable {name} appears twice")
        rank = r.unpack("<B", f"the rank of {name}")
        if rank > MAX_RANK:
            raise ConversionError(f"{path}: variable {name} has rank {rank} (at most {MAX_RANK})")
        shape = [r.unpack("<I", f"a dimension of {name}") for _ in range(rank)]
        if 0 in shape:  # an empty weight could declare any other size: none is ever written
            raise ConversionError(f"{path}: variable {name} has an empty dimension (shape {shape})")
        if version >= 4:
            type_id = r.unpack("<B", f"the dtype of {name}")
            if type_id >= len(DTYPES):
                raise ConversionError(f"{path}: variable {name}: unknown dtype id {type_id}")
            dtype, num_bytes = DTYPES[type_id], r.unpack("<I", f"the size of {name}")
        else:
            item_size = r.unpack("<B", f"the item size of {name}")
            if item_size not in _OLD_ITEM_SIZES:
                raise ConversionError(f"{path}: variable {name}: unknown item size {item_size}")
            dtype, num_bytes = _OLD_ITEM_SIZES[item_size], item_size * r.unpack("<I", f"the size of {name}")
        count = 1
        for d in shape:
            count *= d
        expected = count * torch.empty((), dtype=dtype).element_size()
        if num_bytes != expected:
            raise ConversionError(
                f"{path}: variable {name}: shape {shape} of {dtype} needs {expected} bytes, "
                f"the file says {num_bytes}"
            )
        raw = r.take(num_bytes, f"the data of {name}")
        tensor = torch.frombuffer(raw, dtype=dtype) if num_bytes else torch.empty(0, dtype=dtype)
        variables[name] = tensor.reshape(shape).clone()  # clone: own memory, not the file's buffer
    aliases: list[tuple[str, str]] = []
    if version >= 3:
        for i in range(r.count("the number of aliases", _MIN_ALIAS_BYTES)):
            aliases.append((r.string(f"alias {i}"), r.string(f"the target of alias {i}")))
    if r.pos != len(data):  # CTranslate2 never writes anything after the aliases
        raise ConversionError(f"{path}: {len(data) - r.pos} unexpected bytes after the last variable")
    return version, spec, revision, variables, aliases


def _scale_of(path: Path, name: str, value: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``scale`` shaped to divide ``value`` in place of it: one value for the tensor (int16), or a
    vector of one value per row (int8); any other shape is refused before it is broadcast."""
    if scale.numel() == 1:
        per_row = scale.reshape([1] * value.dim())
    elif scale.dim() == 1 and value.dim() >= 1 and scale.shape[0] == value.shape[0]:
        per_row = scale.reshape(-1, *([1] * (value.dim() - 1)))
    else:
        raise ConversionError(
            f"{path}: {name}_scale has shape {list(scale.shape)}: a quantization scale is one value, or "
            f"a vector of one per row of {name} (shape {list(value.shape)})"
        )
    per_row = per_row.to(torch.float32)
    if not bool(torch.isfinite(per_row).all()) or bool((per_row == 0).any()):
        raise ConversionError(f"{path}: {name}_scale has a zero or non-finite value")
    return per_row


def _dequantize(path: Path, variables: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float32 copies of every variable except the quantization scales (folded into their weights)
    and scalars, which keep their dtype (flags and enums are int8, counts int16/int32)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in variables.items():
        if name.endswith("_scale") and name[: -len("_scale")] in variables:
            continue  # a weight's quantization scale
        if value.dtype in (torch.int8, torch.int16) and value.dim() > 0:
            scale = variables.get(f"{name}_scale")
            if scale is None:
                if value.dtype == torch.int8:
                    raise ConversionError(f"{path}: int8 variable {name} has no {name}_scale")
                scale = torch.tensor(GLOBAL_INT16_SCALE)
            out[name] = value.to(torch.float32) / _scale_of(path, name, value, scale)
        elif value.is_floating_point() and value.dim() > 0:
            out[name] = value.to(torch.float32)
        else:
            out[name] = value
    return out


def _read_vocabulary(path: Path) -> list[str]:
    """The tokens of a JSON list or a text file of one token a line, at most ``MAX_VOCABULARY``:
    counted in the raw bytes (separators, an upper bound) before any list is made of them."""
    try:
        data = path.read_bytes()
        json_list = path.suffix == ".json"
        # tokens <= separators + 1: commas, or line ends (\n, \r\n or \r, as text mode reads them)
        separators = (
            data.count(b",") if json_list else data.count(b"\n") + data.count(b"\r") - data.count(b"\r\n")
        )
        if separators >= MAX_VOCABULARY:
            raise ConversionError(f"{path}: more than {MAX_VOCABULARY} tokens")
        if json_list:
            tokens = json.loads(data.decode("utf-8"))
            if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
                raise ConversionError(f"{path}: not a JSON list of tokens")
            return tokens
        text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # as read_text() did
        lines = text.split("\n")  # one token a line
        return lines[:-1] if lines and lines[-1] == "" else lines
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConversionError(f"{path}: unreadable vocabulary ({e})") from e


def _find_vocabulary(directory: Path, name: str) -> Path | None:
    for suffix in (".json", ".txt"):  # CTranslate2 >= 3 writes JSON, older versions text
        if (directory / f"{name}{suffix}").is_file():
            return directory / f"{name}{suffix}"
    return None


def read_model(directory: str | Path) -> CT2Model:
    """The CTranslate2 model in ``directory`` (``ConversionError`` naming the file and the problem)."""
    directory = Path(directory)
    binary = directory / BINARY_FILE
    if not binary.is_file():
        raise ConversionError(f"{binary}: missing (is {directory} a CTranslate2 model?)")
    version, spec, revision, raw, aliases = read_binary(binary)
    for alias, name in aliases:
        if name not in raw:
            raise ConversionError(f"{binary}: alias {alias} names {name}, which is not a variable")
        if alias in raw:
            raise ConversionError(f"{binary}: alias {alias} is also the name of a variable")
    variables = _dequantize(binary, raw)
    # An alias is its variable's float tensor, not a float copy of its own: a package of a few
    # bytes per alias must not ask for a weight's memory per alias (as CTranslate2 shares them).
    for alias, name in aliases:
        variables[alias] = variables[name]

    config: dict[str, Any] = {}
    if (directory / "config.json").is_file():
        try:
            config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ConversionError(f"{directory / 'config.json'}: unreadable ({e})") from e
        if not isinstance(config, dict):
            raise ConversionError(f"{directory / 'config.json'}: not a JSON object")

    shared = _find_vocabulary(directory, "shared_vocabulary")
    if shared is not None:
        tokens = _read_vocabulary(shared)
        return CT2Model(
            directory, spec, revision, version, variables, config, tokens, tokens, True, (shared.name,)
        )
    source = _find_vocabulary(directory, "source_vocabulary")
    target = _find_vocabulary(directory, "target_vocabulary")
    if source is None or target is None:
        if _find_vocabulary(directory, "source_1_vocabulary") is not None:
            raise ConversionError(
                f"{directory}: several source vocabularies (source factors) are not supported"
            )
        raise ConversionError(
            f"{directory}: no vocabulary (shared_vocabulary.json/.txt, or source_vocabulary and "
            "target_vocabulary .json/.txt)"
        )
    return CT2Model(
        directory,
        spec,
        revision,
        version,
        variables,
        config,
        _read_vocabulary(source),
        _read_vocabulary(target),
        False,
        (source.name, target.name),
    )
