"""The init container of deployment.yaml: put the model directory to serve into the pod's volume.

Environment (from the nmt-model ConfigMap):
  MODEL_URL     a .tar.gz (or .tar) of a model directory, by http://, https:// or file://; its files
                (config.json, model.safetensors, sentencepiece.model) at the top of the archive or
                in one folder. Empty: the model shipped in the image (BUILTIN_MODEL).
  MODEL_SHA256  the archive's SHA-256, checked when given (set it for anything fetched over HTTP).
  MODEL_DEST    the directory to create, in the volume the translator mounts (NMT_MODEL_DIR).

Python's standard library only, so that it runs in the service's own image. A failure exits
non-zero with one line naming the problem; the kubelet then runs the init container again, with
backoff, and the pod never starts serving a missing or partial model.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

BUILTIN_MODEL = Path("/app/artifacts/multi30k-de-en")  # COPY'd into the image (Dockerfile)
# What a model directory must hold (model/checkpoint.py: CONFIG_FILE, WEIGHTS_FILE, SPM_FILE).
REQUIRED = ("config.json", "model.safetensors", "sentencepiece.model")
CHUNK = 1 << 20
TIMEOUT_S = 60.0  # per network operation, not for the whole download


class FetchError(Exception):
    """A problem with the archive or its source, said in one line."""


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
    """``folder`` itself if it holds the model's files, else its only subfolder that does."""
    if (folder / REQUIRED[0]).is_file():
        root = folder
    else:
        found = [d for d in folder.iterdir() if d.is_dir() and (d / REQUIRED[0]).is_file()]
        if len(found) != 1:
            raise FetchError(f"the archive has no single folder with {REQUIRED[0]} ({len(found)} found)")
        root = found[0]
    missing = [name for name in REQUIRED if not (root / name).is_file()]
    if missing:
        raise FetchError(f"the model directory lacks {', '.join(missing)}")
    return root


def fetch(url: str, sha256: str, dest: Path, builtin: Path = BUILTIN_MODEL) -> None:
    """Make ``dest`` the model directory: built in the same volume, then renamed into place, so
    that a run cut short (the container restarted) never leaves a partial model at ``dest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as work:
        staging = Path(work) / "model"
        if url:
            unpacked = Path(work) / "unpacked"
            unpacked.mkdir()
            root = extract(download(url, Path(work), sha256), unpacked)
        elif builtin.is_dir():
            root = model_root(builtin)
        else:
            raise FetchError(f"MODEL_URL is empty and the image has no model in {builtin}")
        shutil.copytree(root, staging)
        if dest.exists():  # from an earlier run of this init container in the same pod
            shutil.rmtree(dest)
        staging.rename(dest)


def main() -> None:
    url = os.environ.get("MODEL_URL", "").strip()
    dest = Path(os.environ.get("MODEL_DEST", "/models/current"))
    try:
        fetch(url, os.environ.get("MODEL_SHA256", "").strip(), dest)
    except FetchError as e:
        sys.exit(f"fetch-model: {e}")
    print(f"fetch-model: {url or BUILTIN_MODEL} -> {dest}", flush=True)


if __name__ == "__main__":
    main()
