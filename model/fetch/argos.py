"""Models from the Argos package index (``argos:`` names): the index in its own format (a JSON list of
packages), the newest package of the pair downloaded from its links in order, then converted."""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

from model.fetch.names import (
    ARGOS_INDEX_ENV,
    ARGOS_SEARCH,
    CHUNK,
    TIMEOUT_S,
    FetchError,
    Log,
    ModelName,
    _convert,
    _now,
    _one_line,
)

# -- the Argos package index --------------------------------------------------------------------------


def _open(url: str) -> Any:
    if not url.startswith(("https://", "http://", "file:")):
        raise FetchError(f"{url}: only http(s) and file URLs are fetched")
    request = urllib.request.Request(url, headers={"User-Agent": "nmt-service model.fetch"})
    return urllib.request.urlopen(request, timeout=TIMEOUT_S)  # noqa: S310 - scheme checked above


def _argos_package(name: ModelName, index_url: str) -> dict[str, Any]:
    """The index's newest translation package from ``name.source`` to ``name.target``."""
    try:
        with _open(index_url) as response:
            index = json.loads(response.read())
    except (OSError, ValueError) as e:
        raise FetchError(
            f"{name.name}: not fetched yet, and the Argos index {index_url} cannot be read ({_one_line(e)}); "
            f"its URL is {ARGOS_INDEX_ENV}"
        ) from e
    if not isinstance(index, list):
        raise FetchError(f"{name.name}: {index_url} is not an Argos package index (a JSON list of packages)")
    packages = [p for p in index if isinstance(p, dict) and p.get("type", "translate") == "translate"]
    found = [p for p in packages if (p.get("from_code"), p.get("to_code")) == (name.source, name.target)]
    if not found:
        pairs = sorted(f"{p.get('from_code')}-{p.get('to_code')}" for p in packages)
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
    """``url`` into ``file``; its sha256. A body shorter than its Content-Length is an error."""
    digest, size = hashlib.sha256(), 0
    with _open(url) as response, file.open("wb") as f:
        declared = response.headers.get("Content-Length")
        while chunk := response.read(CHUNK):
            digest.update(chunk)
            f.write(chunk)
            size += len(chunk)
    if declared is not None and int(declared) != size:
        raise FetchError(f"the download stopped at {size} of {declared} bytes")
    return digest.hexdigest()


def fetch_argos(name: ModelName, staging: Path, index_url: str, log: Log) -> dict[str, Any]:
    package = _argos_package(name, index_url)
    links = [u for u in package.get("links", []) if isinstance(u, str)]
    if not links:
        raise FetchError(f"{name.name}: the index's package {package.get('code')} has no links")
    file = staging / "package.argosmodel"
    errors = []
    for url in links:  # mirrors, in the index's order
        log(f"{name.name}: {package.get('code')} {package.get('package_version')} from {url}")
        try:
            digest = _download(url, file)
            break
        except (OSError, FetchError, http.client.HTTPException) as e:
            errors.append(f"{url}: {_one_line(e)}")
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
