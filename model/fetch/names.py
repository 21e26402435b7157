"""Model names (``opus-mt:de-en``, ``hf:OWNER/REPO[@REV]``, ``argos:en-fr``), the one-line error, and
what the sources (``model.fetch.hub``, ``model.fetch.argos``) share. No torch, no network."""

from __future__ import annotations

import hashlib
import importlib
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

SOURCE_RECORD = "source.json"
STORE_ENV, ARGOS_INDEX_ENV = "NMT_MODEL_STORE", "NMT_ARGOS_INDEX"
DEFAULT_STORE = Path("models")
# argostranslate's own default (its settings.remote_package_index).
DEFAULT_ARGOS_INDEX = "https://raw.githubusercontent.com/argosopentech/argospm-index/main/index.json"
HUB = "https://huggingface.co"
# Where a reader finds names that exist.
OPUS_MT_SEARCH = "https://huggingface.co/models?search=Helsinki-NLP/opus-mt-"
ARGOS_SEARCH = "`argospm search` (pip install argostranslate), or the index itself"
# What model.convert.marian reads (model/convert/marian_files.py): the rest of a repository (its
# TensorFlow and Rust weights, a second copy in pytorch_model.bin) is never downloaded.
MARIAN_REQUIRED = ("config.json", "source.spm", "target.spm", "vocab.json")
MARIAN_OPTIONAL = ("target_vocab.json", "tokenizer_config.json", "README.md")
SAFETENSORS, SHARD_INDEX, PYTORCH_BIN = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
)
CHUNK = 1 << 20
TIMEOUT_S = 60.0  # a stalled index or package download: the read that waits longest
# What a model source may send, whatever it says: every download is capped in bytes
# (NMT_FETCH_MAX_BYTES; an OPUS-MT big model is ~1 GB) and in time from its first byte to its
# last (NMT_FETCH_TIMEOUT_S: a server that drips bytes stalls no start-up for ever), an Argos index
# in bytes. Links are https: only, unless NMT_FETCH_INSECURE is set (http: and file:, for a mirror on
# a private network, and tests).
MAX_BYTES_ENV, DEADLINE_ENV, INSECURE_ENV = "NMT_FETCH_MAX_BYTES", "NMT_FETCH_TIMEOUT_S", "NMT_FETCH_INSECURE"
MAX_DOWNLOAD_BYTES = 4 << 30
DOWNLOAD_DEADLINE_S = 1800.0
MAX_INDEX_BYTES = 32 << 20
COMMIT = re.compile(r"[0-9a-f]{40}")  # a git commit id, as the hub names a revision's
NAME = re.compile(r"^(?P<kind>opus-mt|hf|argos):(?P<rest>[^@\s]+)(?:@(?P<revision>[\w.\-/]+))?$")
PAIR = re.compile(r"^([A-Za-z_]+)-([A-Za-z_]+)$")
REPO = re.compile(r"^[\w.\-]+/[\w.\-]+$")


class FetchError(Exception):
    """One line naming the model and what went wrong; nothing half-written is left in the store."""


@dataclass(frozen=True)
class ModelName:
    """A parsed name: ``kind`` "hf" (``repo`` OWNER/REPO at ``revision``) or "argos" (``source`` to
    ``target``)."""

    name: str  # as given, e.g. "opus-mt:de-en"
    kind: str  # "hf" or "argos"
    repo: str = ""
    revision: str | None = None
    source: str = ""
    target: str = ""

    @property
    def dirname(self) -> str:
        r"""The model directory's name in the store (also the model's name for clients and metrics):
        ``/`` as ``--``, which names that hold no ``--`` and no other character outside
        ``[\w.@-]`` map back from. Any other name (``hf:o/m@release--v1`` beside
        ``hf:o/m@release/v1``) gets its own digest appended, so that two names never share one."""
        kind, _, rest = self.name.partition(":")
        base = f"{kind}-{rest.replace('/', '--')}"
        if "--" not in rest and re.fullmatch(r"[\w.@\-/]*", rest):
            return base
        digest = hashlib.sha256(self.name.encode()).hexdigest()[:12]
        safe = re.sub(r"[^\w.@\-]", "_", base)
        return f"{safe}+{digest}"  # ("+": never in a name mapped without a digest)


def parse_name(name: str) -> ModelName:
    """``name`` parsed; ``FetchError`` saying which forms exist."""
    name = name.strip()
    m = NAME.match(name)
    forms = "opus-mt:SRC-TGT, hf:OWNER/REPO[@REVISION] or argos:SRC-TGT"
    if not m:
        raise FetchError(f"{name!r}: not a model name ({forms})")
    kind, rest, revision = m.group("kind"), m.group("rest"), m.group("revision")
    if kind == "opus-mt":
        if not re.fullmatch(r"[\w\-]+", rest) or "-" not in rest:
            raise FetchError(
                f"{name!r}: opus-mt:SRC-TGT names Helsinki-NLP/opus-mt-SRC-TGT (e.g. opus-mt:de-en)"
            )
        return ModelName(name, "hf", repo=f"Helsinki-NLP/opus-mt-{rest}", revision=revision)
    if kind == "hf":
        if not REPO.match(rest):
            raise FetchError(f"{name!r}: hf:OWNER/REPO[@REVISION] (e.g. hf:Helsinki-NLP/opus-mt-de-en)")
        return ModelName(name, "hf", repo=rest, revision=revision)
    pair = PAIR.match(rest)
    if not pair or revision:
        raise FetchError(f"{name!r}: argos:SRC-TGT with the index's language codes (e.g. argos:en-fr)")
    return ModelName(name, "argos", source=pair.group(1), target=pair.group(2))


def parse_names(names: Sequence[str]) -> list[ModelName]:
    """Each of ``names`` parsed, each model once (in the order given)."""
    parsed = {n.dirname: n for n in map(parse_name, names)}
    return list(parsed.values())


Log = Callable[[str], None]


def _one_line(e: BaseException) -> str:
    text = printable(" ".join(str(e).split())) or type(e).__name__
    return text if len(text) <= 400 else text[:400] + "..."


def printable(text: object, limit: int = 200) -> str:
    """A string from a model source (an index's package code, a link), as a log line may hold it:
    control characters escaped (a newline cannot start a line of its own), at most ``limit``."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return out if len(out) <= limit else out[:limit] + "..."


def env_number(name: str, default: float) -> float:
    import os

    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise FetchError(f"{name}={value!r} is not a number") from None


def _convert(kind: str, src: Path, out: Path, name: ModelName, **languages: str | None) -> None:
    """Run ``model.convert.KIND.convert`` (imported by name: torch loads only when a conversion runs,
    never in a process that only reads records)."""
    converter = importlib.import_module(f"model.convert.{kind}")
    converter.convert(src, out, command=f"python -m model.fetch {name.name}", **languages)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
