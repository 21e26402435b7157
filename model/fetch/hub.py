"""Models from the Hugging Face hub (``opus-mt:`` and ``hf:`` names), through ``huggingface_hub``:
the exact commit resolved, only the files the Marian converter reads downloaded, then converted.

Every answer huggingface_hub reads here is capped as the Argos downloads are, whatever its headers
and the hub's metadata declare (``model.fetch.capped``): in bytes (NMT_FETCH_MAX_BYTES) and in time from
the request to its last byte (NMT_FETCH_TIMEOUT_S). huggingface_hub's own timeout is per read: a
server that sends a byte every few seconds, or without end, would hold a start-up for ever.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from model.fetch.names import (
    COMMIT,
    HUB,
    MARIAN_OPTIONAL,
    MARIAN_REQUIRED,
    MAX_BYTES_ENV,
    MAX_DOWNLOAD_BYTES,
    OPUS_MT_SEARCH,
    PYTORCH_BIN,
    SAFETENSORS,
    SHARD_INDEX,
    FetchError,
    Log,
    ModelName,
    _convert,
    _now,
    _one_line,
    env_number,
    printable,
    sha256,
)

# -- the Hugging Face hub ----------------------------------------------------------------------------


def _hub_errors(name: ModelName, endpoint: str, e: Exception) -> FetchError | None:
    """A one-line FetchError for the hub's failures that a user can act on; None for the others."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(e, GatedRepoError):
        return FetchError(
            f"{name.name}: {name.repo} is gated on {endpoint}: accept its terms and set HF_TOKEN"
        )
    if isinstance(e, RevisionNotFoundError):
        return FetchError(f"{name.name}: {name.repo} has no revision {name.revision!r} on {endpoint}")
    if isinstance(e, RepositoryNotFoundError):
        return FetchError(
            f"{name.name}: no repository {name.repo} on {endpoint} (or it is private: set HF_TOKEN); "
            f"OPUS-MT's names: {OPUS_MT_SEARCH}"
        )
    unreachable = httpx2.ConnectError | httpx2.ConnectTimeout | OfflineModeIsEnabled | LocalEntryNotFoundError
    if isinstance(e, httpx2.TransportError) and not isinstance(e, unreachable):
        return FetchError(
            f"{name.name}: the download from {endpoint} broke off ({_one_line(e)}); nothing was kept: "
            "the next fetch starts again"
        )
    if isinstance(e, unreachable):
        return FetchError(
            f"{name.name}: not fetched yet, and {endpoint} cannot be reached ({_one_line(e)}): fetch it "
            "where the network is reachable (python -m model.fetch), or set HF_ENDPOINT to a mirror"
        )
    if isinstance(e, HfHubHTTPError):
        return FetchError(f"{name.name}: {endpoint}: {_one_line(e)}")
    return None


def fetch_hf(name: ModelName, staging: Path, log: Log) -> dict[str, Any]:
    """Download the Marian files of ``name.repo`` at one commit and convert them into staging/model."""
    from huggingface_hub import HfApi, hf_hub_download, set_client_factory

    from model.fetch.capped import capped_client

    set_client_factory(capped_client)
    # Read here, not at huggingface_hub's import: a process may set them after importing it.
    endpoint = (os.environ.get("HF_ENDPOINT") or HUB).rstrip("/")
    cache_dir = os.environ.get("HF_HUB_CACHE") or None
    try:
        info = HfApi(endpoint=endpoint).model_info(name.repo, revision=name.revision, files_metadata=True)
        commit = info.sha
        if not isinstance(commit, str) or not COMMIT.fullmatch(commit):
            # It names the cache's directories (snapshots/<commit>): only a commit id, never a path.
            given = printable(commit, 60)
            raise FetchError(
                f"{name.name}: {endpoint} gave {given!r} as {name.repo}'s commit, not a commit id"
            )
        siblings = {s.rfilename: s for s in info.siblings or []}
        wanted = _marian_files(name, siblings)
        src = staging / name.repo.split("/")[-1]  # its name tells the converter the languages
        src.mkdir()
        downloaded: dict[str, str] = {}

        limit = int(env_number(MAX_BYTES_ENV, MAX_DOWNLOAD_BYTES))

        def download(file: str) -> Path:
            declared_size = getattr(siblings.get(file), "size", None)
            if isinstance(declared_size, int) and declared_size > limit:
                raise FetchError(
                    f"{name.name}: {file} is {declared_size} bytes, more than {limit} ({MAX_BYTES_ENV})"
                )
            path = Path(
                hf_hub_download(name.repo, file, revision=commit, endpoint=endpoint, cache_dir=cache_dir)
            )
            digest = sha256(path)
            lfs = getattr(siblings.get(file), "lfs", None)
            declared = getattr(lfs, "sha256", None) if lfs is not None else None
            if declared and declared != digest:
                raise FetchError(
                    f"{name.name}: {file}: sha256 {digest[:16]}... is not the {declared[:16]}... "
                    "the hub declares"
                )
            try:  # the converter reads the cache's copy, which stays the cache's
                (src / file).symlink_to(path.resolve())
            except OSError:  # no symlinks here
                shutil.copyfile(path, src / file)
            downloaded[file] = digest
            return src / file

        log(f"{name.name}: {name.repo} at {commit[:12]} from {endpoint}: {', '.join(wanted)}")
        for file in wanted:
            got = download(file)
            if file == SHARD_INDEX:
                for shard in _shards(name, got, siblings):
                    download(shard)
    except FetchError:
        raise
    except Exception as e:  # noqa: BLE001 - mapped to one line where the user can act on it
        mapped = _hub_errors(name, endpoint, e)
        if mapped is None:
            raise
        raise mapped from e
    _convert("marian", src, staging / "model", name)
    return {
        "name": name.name,
        "kind": "huggingface",
        "repo": name.repo,
        "revision": name.revision or "main",
        "commit": commit,
        "url": f"{endpoint}/{name.repo}/tree/{commit}",
        "downloaded": downloaded,
        "fetched_at": _now(),
    }


def _marian_files(name: ModelName, siblings: dict[str, Any]) -> list[str]:
    missing = [f for f in MARIAN_REQUIRED if f not in siblings]
    if missing:
        raise FetchError(
            f"{name.name}: {name.repo} is not a MarianMTModel repository (no {', '.join(missing)}); "
            f"OPUS-MT's names: {OPUS_MT_SEARCH}"
        )
    weights = next((f for f in (SAFETENSORS, SHARD_INDEX, PYTORCH_BIN) if f in siblings), None)
    if weights is None:
        raise FetchError(f"{name.name}: {name.repo} has no {SAFETENSORS}, {SHARD_INDEX} or {PYTORCH_BIN}")
    return [*MARIAN_REQUIRED, *(f for f in MARIAN_OPTIONAL if f in siblings), weights]


def _shards(name: ModelName, index: Path, siblings: dict[str, Any]) -> list[str]:
    try:
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise FetchError(f"{name.name}: {SHARD_INDEX} is unreadable ({e})") from e
    bad = [s for s in shards if not isinstance(s, str) or s not in siblings or "/" in s]
    if bad:
        raise FetchError(f"{name.name}: {SHARD_INDEX} names shards the repository lacks: {bad[:3]}")
    return shards
