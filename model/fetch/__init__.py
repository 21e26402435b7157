"""Models by name: download, verify, convert and keep a model trained elsewhere.

    python -m model.fetch opus-mt:de-en argos:en-fr [--into models]

Names:

    opus-mt:SRC-TGT           Helsinki-NLP/opus-mt-SRC-TGT on the Hugging Face hub (OPUS-MT, CC-BY 4.0)
    hf:OWNER/REPO[@REVISION]  any MarianMTModel repository, at a branch, tag or commit (default main)
    argos:SRC-TGT             the newest package from SRC to TGT in the Argos package index

The hub is reached through ``huggingface_hub`` (it honours HF_ENDPOINT, HF_TOKEN and its cache,
HF_HUB_CACHE), the Argos index in its own format (a JSON list of packages, each with ``from_code``,
``to_code``, ``package_version`` and ``links``; its URL is ``NMT_ARGOS_INDEX``). Each name becomes
one model directory in the store (``NMT_MODEL_STORE``, default ``models/``) made by the converters
(``model.convert.marian``, ``model.convert.argos``), with a record, ``source.json``: the name, where
it came from, the exact commit or package version, each downloaded file's sha256 and each file of
the model directory's. A second fetch finds the directory, checks those sha256s and downloads
nothing: a changed or corrupt file is named, never served.

Everything is built in a hidden ``.NAME.HOST.PID.partial`` directory beside the target and renamed into
place when complete: a download or conversion cut in the middle leaves no model directory, and the
next fetch starts again. With ``HF_HUB_OFFLINE=1`` nothing is downloaded: a model fetched before is
served, one that is not gives one line naming it.

No torch at import: the HTTP front end (app/main.py) reads names and records with this module and
runs the downloads and conversions in a child process (``python -m model.fetch``), so that it never
loads torch itself; the converters are imported by name when a conversion runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from model.fetch.argos import fetch_argos
from model.fetch.hub import fetch_hf
from model.fetch.names import (
    ARGOS_INDEX_ENV,
    ARGOS_SEARCH,
    DEFAULT_ARGOS_INDEX,
    DEFAULT_STORE,
    OPUS_MT_SEARCH,
    SOURCE_RECORD,
    STORE_ENV,
    FetchError,
    Log,
    ModelName,
    _one_line,
    parse_name,
    parse_names,
    sha256,
)

__all__ = [
    "ARGOS_SEARCH",
    "DEFAULT_ARGOS_INDEX",
    "DEFAULT_STORE",
    "OPUS_MT_SEARCH",
    "SOURCE_RECORD",
    "FetchError",
    "ModelName",
    "fetch",
    "fetch_all",
    "find_fetched",
    "main",
    "parse_name",
    "parse_names",
    "verify",
]


def store_from_env() -> Path:
    return Path(os.environ.get(STORE_ENV) or DEFAULT_STORE)


def argos_index_from_env() -> str:
    return os.environ.get(ARGOS_INDEX_ENV) or DEFAULT_ARGOS_INDEX


def offline() -> bool:
    """HF_HUB_OFFLINE (huggingface_hub's own switch, read here at each call: the library reads it once
    at import) holds for the Argos index too."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


# -- the store: records, and their verification (no network, no torch) ----------------------------


def verify(model_dir: Path) -> dict[str, Any]:
    """The record of ``model_dir`` after checking every file it lists against its sha256;
    ``FetchError`` naming the first file missing or changed."""
    record_file = model_dir / SOURCE_RECORD
    try:
        record = json.loads(record_file.read_text(encoding="utf-8"))
        files = record["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("no files listed")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FetchError(
            f"{record_file}: not a readable fetch record ({e}); delete {model_dir} to fetch it again"
        ) from e
    for rel, expected in sorted(files.items()):
        file = model_dir / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise FetchError(f"{record_file}: lists {rel!r}, outside the model directory")
        if not file.is_file():
            raise FetchError(
                f"{file}: missing (listed in {SOURCE_RECORD}); delete {model_dir} to fetch it again"
            )
        got = sha256(file)
        if got != expected:
            raise FetchError(
                f"{file}: sha256 {got[:16]}... is not the {str(expected)[:16]}... recorded when "
                f"{record.get('name', model_dir.name)} was fetched (changed or corrupt); "
                f"delete {model_dir} to fetch it again"
            )
    return dict(record)


def find_fetched(name: ModelName, store: Path) -> Path | None:
    """The verified model directory an earlier fetch of ``name`` made in ``store``, or None."""
    target = store / name.dirname
    if not (target / SOURCE_RECORD).is_file():
        if target.exists():
            raise FetchError(
                f"{name.name}: {target} exists but was not made by model.fetch (no {SOURCE_RECORD}): "
                "move it away, or serve it with NMT_MODEL_DIR"
            )
        return None
    verify(target)
    return target


def _record_files(model_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(model_dir)): sha256(p)
        for p in sorted(model_dir.rglob("*"))
        if p.is_file() and p.name != SOURCE_RECORD
    }


def _clear_leftovers(store: Path, name: ModelName) -> None:
    """Remove the partial directories of earlier fetches of ``name`` whose process is gone (killed
    mid-download: nothing else would ever remove them); only this machine's, whose processes it sees."""
    for partial in store.glob(f".{name.dirname}.{_host()}.*.partial"):
        pid = partial.name.removesuffix(".partial").rsplit(".", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)


def _host() -> str:
    """This machine's name: a store shared by containers (a volume) sees their process ids collide."""
    return re.sub(r"[^\w\-]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


# -- fetching --------------------------------------------------------------------------------------


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def fetch(
    name: ModelName | str,
    store: Path | None = None,
    *,
    argos_index: str | None = None,
    log: Log = _stderr,
) -> Path:
    """The model directory of ``name`` in ``store``: the one fetched before (verified), else
    downloaded and converted now. ``FetchError`` (one line) for anything that stops it."""
    spec = parse_name(name) if isinstance(name, str) else name
    store = Path(store or store_from_env())
    found = find_fetched(spec, store)
    if found is not None:
        log(f"{spec.name}: {found} (fetched before, verified)")
        return found
    if offline():
        raise FetchError(
            f"{spec.name}: not fetched yet into {store}, and HF_HUB_OFFLINE is set: fetch it where the "
            f"network is reachable (python -m model.fetch {spec.name} --into {store}) and bring the directory"
        )
    store.mkdir(parents=True, exist_ok=True)
    _clear_leftovers(store, spec)
    staging = store / f".{spec.dirname}.{_host()}.{os.getpid()}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    target = store / spec.dirname
    try:
        if spec.kind == "hf":
            record = fetch_hf(spec, staging, log)
        else:
            record = fetch_argos(spec, staging, argos_index or argos_index_from_env(), log)
        model = staging / "model"
        _append_provenance(model, record)
        record["files"] = _record_files(model)
        (model / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        try:
            model.rename(target)
        except OSError:
            if find_fetched(spec, store) is None:  # not another process's fetch of the same name
                raise
    except FetchError:
        raise
    except Exception as e:  # noqa: BLE001 - a download or conversion failed: one line, never a traceback
        raise FetchError(f"{spec.name}: {_one_line(e)}") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"{spec.name}: {target}")
    return target


def fetch_all(
    names: Sequence[str], store: Path | None = None, *, argos_index: str | None = None, log: Log = _stderr
) -> list[Path]:
    return [fetch(n, store, argos_index=argos_index, log=log) for n in parse_names(names)]


def _append_provenance(model: Path, record: dict[str, Any]) -> None:
    """Add where the weights came from to the model card the converter wrote (which keeps their
    licence and attribution)."""
    card = model / "README.md"
    text = card.read_text(encoding="utf-8") if card.is_file() else ""
    lines = [
        "",
        "## Fetched",
        "",
        f"- Name: `{record['name']}`",
        f"- From: {record['url']}",
        f"- Revision: {record.get('commit') or record.get('package_version')}",
        f"- Fetched: {record['fetched_at']} (sha256 of every file in `{SOURCE_RECORD}`)",
    ]
    card.write_text(text.rstrip("\n") + "\n" + "\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m model.fetch", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "names", nargs="+", metavar="NAME", help="opus-mt:SRC-TGT, hf:OWNER/REPO[@REV], argos:SRC-TGT"
    )
    ap.add_argument(
        "--into", type=Path, default=None, help=f"the store (default ${STORE_ENV} or {DEFAULT_STORE})"
    )
    ap.add_argument("--argos-index", default=None, help=f"the Argos index URL (default ${ARGOS_INDEX_ENV})")
    args = ap.parse_args(argv)
    try:
        paths = fetch_all(args.names, args.into, argos_index=args.argos_index)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
