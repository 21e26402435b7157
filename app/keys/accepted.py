"""The API keys the service accepts, each with a name and its limits.

Keys come from ``NMT_API_KEYS`` (limits from the ``NMT_KEY_*`` settings) and from the TOML file
``NMT_API_KEYS_FILE``, where each key has a name of its own and may set any of its limits (those it
leaves out are the ``NMT_KEY_*`` ones)::

    [[keys]]
    name = "acme"                  # in metrics and logs; the key itself never is
    sha256 = "9f86d081884c7d65..."  # of the key (printf %s KEY | sha256sum), or key = "..." itself
    requests_per_minute = 120
    chars_per_day = 2_000_000
    min_confidence = 0.5           # its requests' default threshold (docs/confidence.md)

The file is read once, at start; anything wrong in it stops the service with one line naming the
entry and the field (never a key).

A key's name is its identity: the owner of its stored glossaries, memory and jobs, the row of its
usage counts, its metrics' label. A key of the file is named by its ``name``; one of
``NMT_API_KEYS`` by its own digest, ``sha256-`` and the first 16 hex digits of the key's SHA-256
(``owner_name``; ``python -m app.keys.accepted owner`` prints it for a key read on stdin). Never by its
position in a list: removing one key must not hand its data to the key after it. So a key of the
file keeps its data when its ``key`` or ``sha256`` changes (rotation) as long as its ``name``
stays, and a key of ``NMT_API_KEYS`` moved into the file keeps its data when named as it was.

Keys are looked up by their SHA-256: a dictionary lookup, not a comparison of the key itself, so
the time an answer takes says nothing about how much of a key a guess got right.
"""

from __future__ import annotations

import hashlib
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.config import Settings
from app.keys.usage import KeyLimits

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
OWNER_PREFIX = "sha256-"
OWNER_HEX_DIGITS = 16  # 64 bits: no two keys of one service share it by chance
Limit = Annotated[int, Field(ge=0)]


class KeysError(ValueError):
    """The keys configured are unusable; the message says where and why, in one line."""


@dataclass(frozen=True)
class ApiKey:
    name: str  # its identity: owner of its stored data, its usage, its metrics' label
    limits: KeyLimits
    # Its requests' confidence threshold when they give none (else NMT_MIN_CONFIDENCE's).
    min_confidence: float | None = None


class KeyEntry(BaseModel):
    """One ``[[keys]]`` table of the keys file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN)
    key: str | None = Field(None, min_length=1)
    sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    requests_per_minute: Limit | None = None
    requests_per_day: Limit | None = None
    chars_per_minute: Limit | None = None
    chars_per_day: Limit | None = None
    max_concurrent: Limit | None = None
    char_limit: Limit | None = None
    min_confidence: float | None = Field(None, ge=0, le=1)

    @model_validator(mode="after")
    def _one_key(self) -> KeyEntry:
        if (self.key is None) == (self.sha256 is None):
            raise ValueError("give either key or sha256 (of the key), not both or neither")
        return self

    def digest(self) -> bytes:
        return bytes.fromhex(self.sha256) if self.sha256 is not None else sha256(self.key or "")

    def limits(self, defaults: KeyLimits) -> KeyLimits:
        own = {name: getattr(self, name) for name in KeyLimits.names() if getattr(self, name) is not None}
        return KeyLimits(**{**defaults.__dict__, **own})


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: list[KeyEntry] = Field(min_length=1)


def sha256(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def owner_name(key: str) -> str:
    """The name of a key of ``NMT_API_KEYS``, derived from the key alone: ``sha256-`` and the first
    16 hex digits of its SHA-256: it names the key without showing it (a long random key cannot be
    found from it; a short guessable one could be, by trying guesses against it)."""
    return OWNER_PREFIX + sha256(key).hex()[:OWNER_HEX_DIGITS]


class Keys:
    """The accepted keys, found by their SHA-256."""

    def __init__(self, keys: dict[bytes, ApiKey]) -> None:
        self._by_digest = keys

    def __len__(self) -> int:
        return len(self._by_digest)

    def __iter__(self) -> Iterator[ApiKey]:
        return iter(self._by_digest.values())

    def find(self, given: str) -> ApiKey | None:
        return self._by_digest.get(sha256(given))

    @property
    def counted(self) -> bool:
        """Whether any key has a limit that is counted (and so needs the usage store)."""
        return any(key.limits.counted for key in self)


def default_limits(settings: Settings) -> KeyLimits:
    return KeyLimits(**{name: getattr(settings, f"key_{name}") for name in KeyLimits.names()})


def describe_entry_error(error: ValidationError) -> str:
    """``keys[2].requests_per_minute: Input should be greater than or equal to 0 (got -1)``: the
    entry and field of each problem, echoing numbers only (never a key)."""
    parts = []
    for err in error.errors(include_url=False):
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        got = err.get("input")
        shown = f" (got {got!r})" if isinstance(got, int) and not isinstance(got, bool) else ""
        parts.append(f"{where or 'file'}: {err['msg']}{shown}")
    return "; ".join(parts)


def read_keys_file(path: Path) -> KeysFile:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise KeysError(f"cannot read it: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise KeysError(f"not valid TOML: {e}") from None
    try:
        return KeysFile.model_validate(data)
    except ValidationError as e:
        raise KeysError(describe_entry_error(e)) from None


def load_keys(settings: Settings) -> Keys:
    """Every key of ``NMT_API_KEYS`` and ``NMT_API_KEYS_FILE`` (``KeysError`` for a file that cannot be
    read, an entry that is wrong, or a key or name given twice)."""
    defaults = default_limits(settings)
    keys: dict[bytes, ApiKey] = {}
    for key in dict.fromkeys(settings.api_keys):  # a key listed twice is one key
        keys[sha256(key)] = ApiKey(owner_name(key), defaults)
    env_names = {key.name for key in keys.values()}
    if settings.api_keys_file is None:
        return Keys(keys)
    where = f"NMT_API_KEYS_FILE ({settings.api_keys_file})"
    try:
        entries = read_keys_file(settings.api_keys_file).keys
    except KeysError as e:
        raise KeysError(f"{where}: {e}") from None
    names: dict[str, int] = {}
    for i, entry in enumerate(entries):
        if entry.name in names:
            raise KeysError(
                f"{where}: keys[{i}]: the name {entry.name!r} is also keys[{names[entry.name]}]'s"
            )
        if entry.name in env_names:
            raise KeysError(f"{where}: keys[{i}]: the name {entry.name!r} is that of a key of NMT_API_KEYS")
        names[entry.name] = i
        digest = entry.digest()
        if digest in keys:
            other = keys[digest].name
            raise KeysError(f"{where}: keys[{i}] ({entry.name!r}) is the same key as {other!r}")
        keys[digest] = ApiKey(entry.name, entry.limits(defaults), entry.min_confidence)
    return Keys(keys)


def main(argv: list[str]) -> int:
    """``python -m app.keys.accepted owner``: the name a key of ``NMT_API_KEYS`` has (its data's owner), for
    the key read on stdin (one line): what to name it in the keys file to keep its data."""
    if argv != ["owner"]:
        print("usage: python -m app.keys.accepted owner < file-holding-the-key", file=sys.stderr)
        return 2
    key = sys.stdin.readline().strip()  # as NMT_API_KEYS is read: surrounding whitespace dropped
    if not key:
        print("no key on stdin", file=sys.stderr)
        return 1
    print(owner_name(key))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
