"""Models from the Argos package index (``argos:`` names): the index in its own format (a JSON list of
packages), the newest package of the pair downloaded from its links in order, then converted."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

from model.fetch.names import (
    ARGOS_INDEX_ENV,
    ARGOS_SEARCH,
    CHUNK,
    DEADLINE_ENV,
    DOWNLOAD_DEADLINE_S,
    INSECURE_ENV,
    MAX_BYTES_ENV,
    MAX_DOWNLOAD_BYTES,
    MAX_INDEX_BYTES,
    TIMEOUT_S,
    FetchError,
    Log,
    ModelName,
    _convert,
    _now,
    _one_line,
    env_number,
    printable,
)

# -- the Argos package index --------------------------------------------------------------------------


def _open(url: str) -> Any:
    """``url`` opened: https: only, unless NMT_FETCH_INSECURE allows http: and file: too (an index
    names its packages' links: a hostile one would name file:///dev/zero, or a host inside the
    network)."""
    insecure = os.environ.get(INSECURE_ENV, "").strip().lower() in ("1", "true", "yes")
    schemes = ("https://", "http://", "file:") if insecure else ("https://",)
    if not url.startswith(schemes):
        allowed = "https, http and file" if insecure else f"https (http and file with {INSECURE_ENV}=1)"
        raise FetchError(f"{printable(url)}: only {allowed} URLs are fetched")
    request = urllib.request.Request(url, headers={"User-Agent": "nmt-service model.fetch"})
    return urllib.request.urlopen(request, timeout=TIMEOUT_S)  # noqa: S310 - scheme checked above


def _read(response: Any, limit: int, what: str) -> bytes:
    """The whole body, at most ``limit`` bytes (``FetchError`` past it, before reading the rest)."""
    data = response.read(limit + 1)
    if len(data) > limit:
        raise FetchError(f"{what} is larger than {limit} bytes")
    return bytes(data)


def _argos_package(name: ModelName, index_url: str) -> dict[str, Any]:
    """The index's newest translation package from ``name.source`` to ``name.target``."""
    try:
        with _open(index_url) as response:
            index = json.loads(_read(response, MAX_INDEX_BYTES, "the index"))
    except (OSError, ValueError, FetchError) as e:
        raise FetchError(
            f"{name.name}: not fetched yet, and the Argos index {printable(index_url)} cannot be read "
            f"({_one_line(e)}); its URL is {ARGOS_INDEX_ENV}"
        ) from e
    if not isinstance(index, list):
        raise FetchError(f"{name.name}: {index_url} is not an Argos package index (a JSON list of packages)")
    packages = [p for p in index if isinstance(p, dict) and p.get("type", "translate") == "translate"]
    found = [p for p in packages if (p.get("from_code"), p.get("to_code")) == (name.source, name.target)]
    if not found:
        pairs = sorted(printable(f"{p.get('from_code')}-{p.get('to_code')}", 40) for p in packages)
        near = [p for p in pairs if name.source in p.split("-")][:20]
        raise FetchError(
            f"{name.name}: no package from {name.source} to {name.target} in the Argos index {index_url}"
            f"{' (pairs with ' + name.source + ': ' + ', '.join(near) + ')' if near else ''}; "
            f"find names with {ARGOS_SEARCH}"
        )
    return max(found, key=lambda p: _version(str(p.get("package_version", ""))))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", text))


def _download(url: str, file: Path) -> str:
    """``url`` into ``file``; its sha256. A body shorter than its Content-Length is an error, and so
    is one past NMT_FETCH_MAX_BYTES, or still coming NMT_FETCH_TIMEOUT_S after the request."""
    limit = int(env_number(MAX_BYTES_ENV, MAX_DOWNLOAD_BYTES))
    deadline = time.monotonic() + env_number(DEADLINE_ENV, DOWNLOAD_DEADLINE_S)
    digest, size = hashlib.sha256(), 0
    with _open(url) as response, file.open("wb") as f:
        declared = response.headers.get("Content-Length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise FetchError(f"the package is {declared} bytes, more than {limit} ({MAX_BYTES_ENV})")
        while chunk := response.read(CHUNK):
            size += len(chunk)
            if size > limit:
                raise FetchError(f"the download passed {limit} bytes ({MAX_BYTES_ENV})")
            if time.monotonic() > deadline:
                raise FetchError(f"the download took longer than its {DEADLINE_ENV} ({size} bytes in)")
            digest.update(chunk)
            f.write(chunk)
    if declared is not None and declared.strip().isdigit() and int(declared) != size:
        raise FetchError(f"the download stopped at {size} of {declared} bytes")
    return digest.hexdigest()


def fetch_argos(name: ModelName, staging: Path, index_url: str, log: Log) -> dict[str, Any]:
    package = _argos_package(name, index_url)
    links = [u for u in package.get("links", []) if isinstance(u, str)]
    if not links:
        raise FetchError(
            f"{name.name}: the index's package {printable(package.get('code'), 80)} has no links"
        )
    file = staging / "package.argosmodel"
    errors = []
    for url in links:  # mirrors, in the index's order
        code, version = printable(package.get("code"), 80), printable(package.get("package_version"), 40)
        log(f"{name.name}: {code} {version} from {printable(url)}")
        try:
            digest = _download(url, file)
            break
        except (OSError, FetchError, http.client.HTTPException) as e:
            errors.append(f"{printable(url)}: {_one_line(e)}")
    else:
        raise FetchError(f"{name.name}: no link of the package could be downloaded ({'; '.join(errors)})")
    _convert("argos", file, staging / "model", name)
    return {
        "name": name.name,
        "kind": "argos",
        "index": index_url,
        "code": package.get("code"),
        "package_version": package.get("package_version"),
        "url": url,
        "downloaded": {file.name: digest},
        "fetched_at": _now(),
    }
