"""Reading a Hugging Face MarianMTModel directory's files (``model.convert.marian`` maps them):
config.json and the other JSON files, the weights, the vocabularies.

The directory may come from anywhere: JSON nested past the recursion limit is refused by name, a
vocabulary by its size (``MAX_VOCABULARY``), shards only inside the directory, and a
pytorch_model.bin only from torch >= 2.6 (CVE-2025-32434) and, when it is a zip, with its members
uncompressed as torch.save writes them, so that none unpacks larger than the file.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.torch_version import TorchVersion

from model.convert.bounds import MAX_ARCHIVE_MEMBERS, MAX_VOCABULARY
from model.convert.errors import ConversionError
from model.directory import SOURCE_SPM, TARGET_SPM, WEIGHTS_FILE


def read_json(file: Path) -> Any:
    """``file`` parsed (``ConversionError`` naming it when it is not JSON we can read)."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConversionError(f"{file}: not readable JSON ({e})") from e


def read_object(file: Path) -> dict[str, Any]:
    """``file`` parsed, which must be a JSON object."""
    data = read_json(file)
    if not isinstance(data, dict):
        raise ConversionError(f"{file}: not a JSON object")
    return data


def read_weights(src: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by name, with MarianMTModel's ``model.`` prefix."""
    files = [src / WEIGHTS_FILE]
    index = src / "model.safetensors.index.json"
    if index.is_file():
        shards = read_object(index).get("weight_map", {})
        names = set(shards.values()) if isinstance(shards, dict) else {None}
        if not all(isinstance(n, str) and n == Path(n).name and n not in ("", ".", "..") for n in names):
            raise ConversionError(f"{index}: weight_map is not a map of names to files in {src}")
        files = sorted(src / str(n) for n in names)
    state: dict[str, torch.Tensor] = {}
    if all(f.is_file() for f in files):
        for file in files:
            try:
                state.update(load_file(str(file)))
            except (SafetensorError, OSError, ValueError) as e:
                raise ConversionError(f"{file}: cannot read the weights ({e})") from e
    elif (src / "pytorch_model.bin").is_file():
        file = src / "pytorch_model.bin"
        # pyproject.toml asks for torch >= 2.6, but an older one may be installed by hand.
        if TorchVersion(torch.__version__) < "2.6":
            raise ConversionError(
                f"{file}: torch {torch.__version__} can be made to run code by a crafted pickle even with "
                "weights_only (CVE-2025-32434): install torch >= 2.6, or give model.safetensors"
            )
        check_archive(file)
        try:  # weights_only: tensors and containers only, no code from the file runs
            loaded = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure of the restricted unpickler is a bad file
            raise ConversionError(f"{file}: cannot read the weights ({type(e).__name__}: {e})") from e
        if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise ConversionError(f"{file}: not a state dict of tensors")
        size = file.stat().st_size
        if any(v.untyped_storage().nbytes() > size for v in loaded.values()):
            raise ConversionError(f"{file}: a tensor's storage is larger than the file")
        state = dict(loaded)
    else:
        raise ConversionError(f"{src}: no weights ({WEIGHTS_FILE} or pytorch_model.bin)")
    if not any(k.startswith("model.") for k in state):  # a MarianModel's (no head): same names, unprefixed
        state = {
            k if k in ("lm_head.weight", "final_logits_bias") else f"model.{k}": v for k, v in state.items()
        }
    return {k: v.float() if v.dtype not in (torch.float16, torch.float32) else v for k, v in state.items()}


def check_archive(file: Path) -> None:
    """Refuse a torch.save archive (a zip) whose members would unpack larger than it: torch.save
    stores every member uncompressed, at most MAX_ARCHIVE_MEMBERS of them. (The older, non-zip
    format is left to torch.load, which checks each storage's size against the bytes it reads.)"""
    if not zipfile.is_zipfile(file):
        return
    try:
        with zipfile.ZipFile(file) as z:
            members = z.infolist()
    except (zipfile.BadZipFile, OSError) as e:
        raise ConversionError(f"{file}: cannot read the weights ({e})") from e
    if len(members) > MAX_ARCHIVE_MEMBERS:
        raise ConversionError(f"{file}: {len(members)} members (at most {MAX_ARCHIVE_MEMBERS})")
    for m in members:
        if m.compress_type != zipfile.ZIP_STORED or m.file_size != m.compress_size:
            raise ConversionError(
                f"{file}: member {m.filename} is compressed ({m.compress_size} bytes declared to unpack "
                f"to {m.file_size}): torch.save stores members as they are"
            )


def _vocabulary(file: Path) -> list[str]:
    """vocab.json (piece -> id) as the list of pieces in id order; its ids must be 0..V-1, at most
    MAX_VOCABULARY of them (counted by their separators before the file is parsed)."""
    if not file.is_file():
        raise ConversionError(f"{file}: missing")
    try:
        if file.read_bytes().count(b",") >= MAX_VOCABULARY:
            raise ConversionError(f"{file}: more than {MAX_VOCABULARY} pieces")
    except OSError as e:
        raise ConversionError(f"{file}: unreadable ({e})") from e
    data = read_json(file)
    if not isinstance(data, dict) or not all(isinstance(i, int) for i in data.values()):
        raise ConversionError(f"{file}: not a JSON object of pieces to ids")
    pieces = {i: p for p, i in data.items()}
    if len(pieces) != len(data) or set(pieces) != set(range(len(data))):
        raise ConversionError(f"{file}: its ids are not 0..{len(data) - 1}, each once")
    return [pieces[i] for i in range(len(data))]


def read_vocabularies(src: Path) -> tuple[list[str], list[str]]:
    """Source and target pieces in id order; the same list for a joint vocabulary. MarianTokenizer
    reads target_vocab.json only with ``separate_vocabs`` (tokenizer_config.json)."""
    for name in (SOURCE_SPM, TARGET_SPM):
        if not (src / name).is_file():
            raise ConversionError(f"{src / name}: missing")
    settings = src / "tokenizer_config.json"
    separate = (src / "target_vocab.json").is_file()
    if settings.is_file():
        separate = bool(read_object(settings).get("separate_vocabs", False))
    vocab = _vocabulary(src / "vocab.json")
    return vocab, (_vocabulary(src / "target_vocab.json") if separate else vocab)
