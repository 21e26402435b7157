"""deploy/kubernetes/base/fetch_model.py, the init container's script: it fetches model names with
the service's own fetcher (model.fetch) and unpacks archives of any model directory, requiring what
the model directory format requires; run here against the fake hub of tests/test_fetch.py, and
what it leaves in the volume is what the translator serves offline."""

from __future__ import annotations

import ast
import hashlib
import http.server
import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from app.config import Settings
from app.main import open_models
from model.directory import CONFIG_FILE, SPM_FILE, WEIGHTS_FILE, read_info_and_tokenizer
from model.fetch import verify
from tests.test_fetch import COMMIT, Hub, argos_package, hub, marian, translate  # noqa: F401 - fixtures

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "deploy" / "kubernetes" / "base" / "fetch_model.py"  # the init container's command


# -- the init container's script -------------------------------------------------------------------


@pytest.fixture(scope="module")
def fetcher() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fetch_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tarball(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def model_archive(model_dir: Path, folder: str = "tiny-de-en/", drop: str = "") -> bytes:
    return tarball({folder + p.name: p.read_bytes() for p in model_dir.iterdir() if p.name != drop})


@pytest.fixture
def serve_bytes() -> Iterator[dict[str, bytes]]:
    """A loopback HTTP server of the returned dict's contents (path -> bytes); its URL at "url"."""
    files: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    files["url"] = f"http://127.0.0.1:{server.server_address[1]}".encode()
    try:
        yield files
    finally:
        server.shutdown()
        server.server_close()


def test_fetcher_requires_what_the_model_format_requires(fetcher: ModuleType) -> None:
    """Its required files are the format's (model/directory.py), its tokenizer checked by the
    format's own reader: no list of file names of its own that could drift from what loads."""
    assert fetcher.REQUIRED == (CONFIG_FILE, WEIGHTS_FILE)
    assert fetcher.read_info_and_tokenizer is read_info_and_tokenizer
    names = {
        node.value
        for node in ast.walk(ast.parse(SCRIPT.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    assert not {n for n in names if n.endswith((".json", ".spm", ".model", ".safetensors"))}


def test_fetcher_downloads_checks_and_unpacks_a_model(
    fetcher: ModuleType, model_dir: Path, serve_bytes: dict[str, bytes], tmp_path: Path
) -> None:
    archive = model_archive(model_dir)
    serve_bytes["/models/tiny.tar.gz"] = archive
    url = serve_bytes["url"].decode() + "/models/tiny.tar.gz"
    store = tmp_path / "models"
    (dest,) = fetcher.fill([], url, hashlib.sha256(archive).hexdigest(), store)
    assert dest == store / "tiny-de-en"  # the archive's folder names it
    info, _ = read_info_and_tokenizer(dest)  # what the service will load
    assert (info.source_lang, info.target_lang) == ("de", "en")
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in model_dir.iterdir())
    # Run again (the init container restarted, after a run killed mid-download): replaced,
    # nothing left over beside it.
    (store / ".fetch-killed" / "unpacked").mkdir(parents=True)
    fetcher.fill([], url, "", store)
    assert sorted(p.name for p in store.iterdir()) == ["tiny-de-en"]


def test_fetcher_refuses_bad_archives(
    fetcher: ModuleType, model_dir: Path, serve_bytes: dict[str, bytes], tmp_path: Path
) -> None:
    base = serve_bytes["url"].decode()
    serve_bytes["/ok.tgz"] = model_archive(model_dir)
    serve_bytes["/flat.tar.gz"] = model_archive(model_dir, folder="")  # files at the top: fine
    serve_bytes["/no-spm.tgz"] = model_archive(model_dir, drop=SPM_FILE)
    serve_bytes["/no-weights.tgz"] = model_archive(model_dir, drop=WEIGHTS_FILE)
    serve_bytes["/escape.tgz"] = tarball({"../outside": b"x", "m/config.json": b"{}"})
    serve_bytes["/junk.tgz"] = b"not an archive"
    store = tmp_path / "models"
    (dest,) = fetcher.fill([], f"{base}/flat.tar.gz", "", store)
    assert dest == store / "flat" and (dest / CONFIG_FILE).is_file()  # named after the file
    cases = {
        f"{base}/ok.tgz#sha": ("0" * 64, "SHA-256"),
        f"{base}/no-spm.tgz": ("", SPM_FILE),
        f"{base}/no-weights.tgz": ("", f"lacks {WEIGHTS_FILE}"),
        f"{base}/escape.tgz": ("", "cannot unpack"),
        f"{base}/junk.tgz": ("", "cannot unpack"),
        f"{base}/missing.tgz": ("", "404"),
        "ftp://example.org/m.tgz": ("", "http://, https:// or file://"),
    }
    for url, (sha, message) in cases.items():
        with pytest.raises(fetcher.FetchError, match=message):
            fetcher.fill([], url, sha, store)
        assert (dest / CONFIG_FILE).is_file()  # the model there before is untouched
    assert not (tmp_path / "outside").exists()
    assert sorted(p.name for p in store.iterdir()) == ["flat"]  # no temporary folder left


def test_fetcher_copies_the_builtin_model_and_reports_failures(fetcher: ModuleType, tmp_path: Path) -> None:
    builtin = REPO / "artifacts" / "multi30k-de-en"
    (dest,) = fetcher.fill([], "", "", tmp_path / "models", builtin=builtin)
    assert dest == tmp_path / "models" / builtin.name
    read_info_and_tokenizer(dest)
    with pytest.raises(fetcher.FetchError, match="MODEL_URL are empty"):
        fetcher.fill([], "", "", tmp_path / "other", builtin=tmp_path / "absent")
    # As the init container runs it: a failure is one line and a non-zero exit.
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)],
        env={"MODEL_URL": f"file://{tmp_path}/absent.tgz", "NMT_MODEL_STORE": str(tmp_path / "m")},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("fetch-model: cannot download") and proc.stderr.count("\n") == 1
    assert json.loads((dest / CONFIG_FILE).read_text())


def run_script(environment: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """fetch_model.py as the init container runs it: its own process, its directory elsewhere."""
    return subprocess.run(
        [sys.executable, str(SCRIPT)], env=environment, cwd=cwd, capture_output=True, text=True, timeout=600
    )


def cpu_note(line: str) -> bool:
    """One of ``model.reproducible.ensure_strict``'s warnings (what MKL can do on this CPU)."""
    return line.startswith(("MKL's strict mode could not be set:", "float32 products may depend on"))


def test_the_init_container_fetches_a_name_and_a_converted_archive_that_the_translator_serves(
    hub: Hub,  # noqa: F811
    marian: tuple[Path, Path],  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The script against the local hub of tests/test_fetch.py: an OPUS-MT name (downloaded,
    converted and recorded by model.fetch) and the archive of a converted OPUS-MT directory
    (source.spm, target.spm and their vocabulary: no sentencepiece.model), into the store; then the
    translator's start, offline, finds both and each translates."""
    converted = marian[1]
    assert (converted / "source.spm").is_file() and not (converted / SPM_FILE).is_file()
    archive = model_archive(converted, folder="converted-de-en/")
    hub.static["/archives/converted.tar.gz"] = archive
    store = tmp_path / "models"
    environment = {
        **os.environ,  # the hub fixture's HF_ENDPOINT and NMT_ARGOS_INDEX, PATH, ...
        "NMT_MODELS": "opus-mt:de-en",
        "MODEL_URL": f"{hub.url}/archives/converted.tar.gz",
        "MODEL_SHA256": hashlib.sha256(archive).hexdigest(),
        "NMT_MODEL_STORE": str(store),
        # As deployment.yaml sets them: the hub's cache in a hidden folder of the volume.
        "HF_HOME": str(store / ".huggingface"),
        "HF_HUB_CACHE": str(store / ".huggingface" / "hub"),
    }
    proc = run_script(environment, tmp_path)
    assert proc.returncode == 0, proc.stderr
    # Nothing on stderr but, on a CPU where MKL cannot be made strict (an AMD EPYC: "unsupported
    # branch"), model.reproducible's two lines saying so: a CPU's note, not the script's.
    assert [line for line in proc.stderr.splitlines() if not cpu_note(line)] == []
    # The converted directories only: the hub's cache removed, no temporary folder left.
    assert sorted(p.name for p in store.iterdir()) == ["converted-de-en", "opus-mt-de-en"]
    assert verify(store / "opus-mt-de-en")["commit"] == COMMIT
    # The translator's start, as deployment.yaml configures it: offline, the store read-only to it.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.requests.clear()
    settings = Settings.model_validate(
        {"model_dir": (store,), "models": ("opus-mt:de-en",), "model_store": store, "device": "cpu"}
    )
    opened = open_models(settings)
    assert sorted(spec.name for spec, _, _ in opened) == ["converted-de-en", "opus-mt-de-en"]
    assert hub.requests == []  # nothing asked of the network
    expected = translate(converted)
    assert expected and all(expected)
    for spec, _, _ in opened:
        assert translate(spec.path) == expected, spec.name
    # Run again (the init container restarted): the name is verified, not downloaded again.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    proc = run_script(environment, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not any(r.startswith("GET /cdn/") or "/resolve/" in r for r in hub.requests)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("wrong-sha256", "SHA-256 is "),
        ("no-source-spm", "source.spm"),
        ("no-weights", f"lacks {WEIGHTS_FILE}"),
        ("no-config", f"no single folder with {CONFIG_FILE}"),
        ("bad-name", "not a model name"),
    ],
)
def test_the_init_container_stops_with_one_line(
    marian: tuple[Path, Path],  # noqa: F811
    serve_bytes: dict[str, bytes],
    tmp_path: Path,
    case: str,
    message: str,
) -> None:
    """A wrong checksum, a converted directory that lacks a file the format requires, or a name
    that is none: exit 1 with one line naming it, nothing left in the volume."""
    converted = marian[1]
    drop = {"no-source-spm": "source.spm", "no-weights": WEIGHTS_FILE, "no-config": CONFIG_FILE}.get(case, "")
    archive = model_archive(converted, folder="converted-de-en/", drop=drop)
    serve_bytes["/m.tar.gz"] = archive
    store = tmp_path / "models"
    environment = {
        "PATH": os.environ.get("PATH", ""),
        "MODEL_URL": serve_bytes["url"].decode() + "/m.tar.gz",
        "MODEL_SHA256": "0" * 64 if case == "wrong-sha256" else hashlib.sha256(archive).hexdigest(),
        "NMT_MODEL_STORE": str(store),
        "NMT_MODELS": "opus:de-en" if case == "bad-name" else "",
        "HF_HUB_OFFLINE": "1",  # a name is never fetched here
    }
    proc = run_script(environment, tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.startswith("fetch-model: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr
    assert not store.exists() or list(store.iterdir()) == []
