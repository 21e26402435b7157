"""The init container of deployment.yaml: put the models to serve into the pod's `models` volume,
with the service's own fetcher (model/fetch/) and the service's own model directory checks
(model/directory.py), so that the translator serves them with no network and no surprise.

Environment (the nmt-model ConfigMap and deployment.yaml):
  NMT_MODELS       model names, comma-separated, as the service takes them (opus-mt:SRC-TGT,
                   hf:OWNER/REPO[@REVISION], argos:SRC-TGT): downloaded, converted and recorded
                   (source.json: the exact commit, each file's sha256) by model.fetch, each into
                   NMT_MODEL_STORE/<its directory name> (opus-mt:de-en -> opus-mt-de-en). Run again
                   in the same pod (the container restarted), a name fetched before is verified
                   against its record and not downloaded again.
  MODEL_URL        a .tar.gz (or .tar) of a model directory, by http://, https:// or file://: any
                   directory our trainer or converters write (config.json, model.safetensors and its
                   tokenizer: sentencepiece.model, or source.spm and target.spm with their vocabulary
                   files), at the top of the archive or in one folder. That folder's name (files at
                   the top: the archive's file name less .tar.gz) names the model.
  MODEL_SHA256     the archive's SHA-256, checked when given (set it for anything fetched over HTTP).
  NMT_MODEL_STORE  the volume's folder (/models) that the translator serves whole (NMT_MODEL_DIR)
                   and in which it finds and verifies NMT_MODELS again (offline).
  HF_ENDPOINT, HF_TOKEN, HF_HOME, HF_HUB_CACHE, NMT_ARGOS_INDEX: as for the service
                   (docs/models.md). A hub cache or HF_HOME inside the store is removed once every
                   name is fetched: the converted directories are all that is served.
Neither names nor a URL: the model shipped in the image (BUILTIN_MODEL).

A failure exits non-zero with one line naming the problem (progress goes to stdout); the kubelet
then runs the init container again, with backoff, and the pod never serves a missing or partial
model.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

# The project is installed in the image's virtual environment (Dockerfile: /opt/venv, the code in
# /app): the fetcher and the format are the service's own, not copies that could drift from it.
from model.directory import CONFIG_FILE, WEIGHTS_FILE, ModelDirError, read_info_and_tokenizer
from model.fetch import FetchError, parse_names
from model.fetch import fetch_all as fetch_names

__all__ = ["BUILTIN_MODEL", "REQUIRED", "FetchError", "check_model_dir", "fill", "main"]

BUILTIN_MODEL = Path("/app/artifacts/multi30k-de-en")  # COPY'd into the image (Dockerfile)
DEFAULT_STORE = Path("/models")
# The files every model directory holds, from the format itself (model/directory.py); its tokenizer
# files depend on the model (one joint sentencepiece.model, or source.spm + target.spm and their
# vocabularies): check_model_dir asks model.directory, as the translator's start does.
REQUIRED = (CONFIG_FILE, WEIGHTS_FILE)
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
MODEL_NAME = re.compile(r"^[\w@\-][\w.@\-]*$")  # a folder the translator lists (hidden ones are not)
CHUNK = 1 << 20
TIMEOUT_S = 60.0  # per network operation, not for the whole download


def _say(message: str) -> None:
    print(f"fetch-model: {message}", flush=True)


def download(url: str, into: Path, sha256: str) -> Path:
    """The archive at ``url``, saved in ``into`` and checked against ``sha256`` when given."""
    if urllib.parse.urlsplit(url).scheme not in ("http", "https", "file"):
        raise FetchError(f"MODEL_URL must be http://, https:// or file://, not {url!r}")
    archive = into / "model.tar"
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, archive.open("wb") as out:
            while chunk := response.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)
    except OSError as e:  # URLError, HTTPError and socket errors are OSErrors
        raise FetchError(f"cannot download {url}: {e}") from None
    if sha256 and digest.hexdigest() != sha256.lower():
        raise FetchError(f"{url}: SHA-256 is {digest.hexdigest()}, expected {sha256}")
    return archive


def extract(archive: Path, into: Path) -> Path:
    """Unpack ``archive`` into ``into``; the folder of the model's files."""
    try:
        with tarfile.open(archive) as tar:
            # "data": no absolute paths, no "..", no links out of the folder, no devices.
            tar.extractall(into, filter="data")
    except (tarfile.TarError, OSError) as e:
        raise FetchError(f"cannot unpack the model archive: {e}") from None
    return model_root(into)


def model_root(folder: Path) -> Path:
    """``folder`` itself if it holds a model directory's config.json, else its only subfolder that
    does (as the translator finds model directories: app.models.served.find_model_dirs)."""
    if (folder / CONFIG_FILE).is_file():
        return folder
    found = [d for d in folder.iterdir() if d.is_dir() and (d / CONFIG_FILE).is_file()]
    if len(found) != 1:
        raise FetchError(f"the archive has no single folder with {CONFIG_FILE} ({len(found)} found)")
    return found[0]


def check_model_dir(root: Path, what: str) -> None:
    """Refuse ``root`` unless the translator would load it: its config, the tokenizer files that
    config needs and their vocabulary against the weights' shape, as app.models.served.ServedModel.open
    reads them (model.directory.read_info_and_tokenizer), and the weights the workers load. Here,
    so that a broken archive stops the init container with the file named, not every translator
    start."""
    missing = [name for name in REQUIRED if not (root / name).is_file()]
    if missing:
        raise FetchError(f"{what}: the model directory lacks {', '.join(missing)}")
    try:
        read_info_and_tokenizer(root)
    except ModelDirError as e:
        # Its paths are in a temporary folder: named relative to the model directory instead.
        raise FetchError(f"{what}: {str(e).replace(f'{root}{os.sep}', '')}") from None


def archive_name(url: str, root: Path, unpacked: Path) -> str:
    """The model's directory name in the store: the archive's folder, else its file's name."""
    if root != unpacked:
        name = root.name
    else:
        name = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).name
        for suffix in ARCHIVE_SUFFIXES:
            if name.endswith(suffix):
                name = name.removesuffix(suffix)
                break
    return name if MODEL_NAME.match(name) else "model"


def place(root: Path, staging: Path, dest: Path) -> Path:
    """Copy ``root`` to ``dest`` through ``staging`` (in the same volume), renamed into place, so
    that a run cut short (the container restarted) never leaves a partial model at ``dest``."""
    shutil.copytree(root, staging)
    if dest.exists():  # from an earlier run of this init container in the same pod
        shutil.rmtree(dest)
    staging.rename(dest)
    return dest


def fetch_archive(url: str, sha256: str, store: Path, taken: set[str]) -> Path:
    """The model directory of the archive at ``url``, in ``store``; ``taken``: the directory names
    of the named models, which it must not replace."""
    with tempfile.TemporaryDirectory(dir=store, prefix=".fetch-") as work:
        unpacked = Path(work) / "unpacked"
        unpacked.mkdir()
        root = extract(download(url, Path(work), sha256), unpacked)
        check_model_dir(root, url)
        name = archive_name(url, root, unpacked)
        if name in taken:
            raise FetchError(f"{url}: its model's name {name!r} is that of a model in NMT_MODELS: rename it")
        return place(root, Path(work) / "model", store / name)


def fill(
    names: Sequence[str], url: str, sha256: str, store: Path, builtin: Path = BUILTIN_MODEL
) -> list[Path]:
    """Put into ``store`` the models named (model.fetch), the archive at ``url``, or, with neither,
    the ``builtin`` model; the model directories, each checked."""
    store.mkdir(parents=True, exist_ok=True)
    # What a run killed mid-way left (the kubelet restarted the container): one init container runs
    # at a time in a pod, so every .fetch- folder is a dead run's, taking the volume's room.
    for leftover in store.glob(".fetch-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    served: list[Path] = []
    if names:
        # model.fetch checks the names, downloads into huggingface_hub's cache, converts in a hidden
        # .partial directory renamed into place, and verifies what an earlier run fetched.
        served += fetch_names(names, store, log=_say)
        _drop_hub_cache(store)
    if url:
        served.append(fetch_archive(url, sha256, store, {d.name for d in served}))
    if not served:
        if not builtin.is_dir():
            raise FetchError(f"NMT_MODELS and MODEL_URL are empty and the image has no model in {builtin}")
        check_model_dir(builtin, str(builtin))
        with tempfile.TemporaryDirectory(dir=store, prefix=".fetch-") as work:
            served.append(place(builtin, Path(work) / "model", store / builtin.name))
    return served


def _drop_hub_cache(store: Path) -> None:
    """The hub's downloads, once converted, only take the volume's room: removed when they are in
    it (never a cache elsewhere, which may be someone's)."""
    for variable in ("HF_HUB_CACHE", "HF_HOME"):
        folder = Path(os.environ.get(variable) or "/nonexistent")
        if folder.is_dir() and folder.resolve().is_relative_to(store.resolve()):
            shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    names = [n.strip() for n in os.environ.get("NMT_MODELS", "").split(",") if n.strip()]
    url = os.environ.get("MODEL_URL", "").strip()
    store = Path(os.environ.get("NMT_MODEL_STORE") or DEFAULT_STORE)
    try:
        parse_names(names)  # a misspelt name stops before anything is downloaded
        served = fill(names, url, os.environ.get("MODEL_SHA256", "").strip(), store)
    except (FetchError, OSError) as e:
        sys.exit(f"fetch-model: {' '.join(str(e).split())}")
    for path in served:
        _say(f"serving {path}")


if __name__ == "__main__":
    main()
