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
import hashlib
import http.client
import importlib
import json
import os
import re
import shutil
import socket
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        """The model directory's name in the store (also the model's name for clients and metrics)."""
        kind, _, rest = self.name.partition(":")
        base = f"{kind}-{rest.replace('/', '--')}"
        return re.sub(r"[^\w.@\-]", "_", base)


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


def store_from_env() -> Path:
    return Path(os.environ.get(STORE_ENV) or DEFAULT_STORE)


def argos_index_from_env() -> str:
    return os.environ.get(ARGOS_INDEX_ENV) or DEFAULT_ARGOS_INDEX


def offline() -> bool:
    """HF_HUB_OFFLINE (huggingface_hub's own switch, read here at each call: the library reads it once
    at import) holds for the Argos index too."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


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

Log = Callable[[str], None]


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
            record = _fetch_hf(spec, staging, log)
        else:
            record = _fetch_argos(spec, staging, argos_index or argos_index_from_env(), log)
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


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 400 else text[:400] + "..."


def _convert(kind: str, src: Path, out: Path, name: ModelName, **languages: str | None) -> None:
    """Run ``model.convert.KIND.convert`` (imported by name: torch loads only when a conversion runs,
    never in a process that only reads records)."""
    converter = importlib.import_module(f"model.convert.{kind}")
    converter.convert(src, out, command=f"python -m model.fetch {name.name}", **languages)


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


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


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


def _fetch_hf(name: ModelName, staging: Path, log: Log) -> dict[str, Any]:
    """Download the Marian files of ``name.repo`` at one commit and convert them into staging/model."""
    from huggingface_hub import HfApi, hf_hub_download

    # Read here, not at huggingface_hub's import: a process may set them after importing it.
    endpoint = (os.environ.get("HF_ENDPOINT") or HUB).rstrip("/")
    cache_dir = os.environ.get("HF_HUB_CACHE") or None
    try:
        info = HfApi(endpoint=endpoint).model_info(name.repo, revision=name.revision, files_metadata=True)
        commit = info.sha
        if not commit:
            raise FetchError(f"{name.name}: {endpoint} gave no commit for {name.repo}")
        siblings = {s.rfilename: s for s in info.siblings or []}
        wanted = _marian_files(name, siblings)
        src = staging / name.repo.split("/")[-1]  # its name tells the converter the languages
        src.mkdir()
        downloaded: dict[str, str] = {}

        def download(file: str) -> Path:
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


def _fetch_argos(name: ModelName, staging: Path, index_url: str, log: Log) -> dict[str, Any]:
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


if __name__ == "__main__":
    sys.exit(main())
