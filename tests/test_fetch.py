"""model.fetch and NMT_MODELS: models by name, from a local HTTP server that speaks what
huggingface_hub asks the Hugging Face hub (model info, ``resolve/REVISION/FILE`` with ETags, commits
and a redirect of the weights to another host, as the hub sends LFS files to its CDN) and serves an
Argos package index, both with tiny generated models: no internet.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import unquote, urlsplit

import pytest
from pydantic import ValidationError

from app.config import Settings
from app.models.fetched import named_model_dirs
from model.decoding.options import DecodeOptions
from model.fetch import (
    ARGOS_SEARCH,
    OPUS_MT_SEARCH,
    SOURCE_RECORD,
    FetchError,
    _host,
    fetch,
    main,
    parse_name,
    verify,
)
from model.translator import Translator
from tests.marian_models import MarianOptions

SENTENCES = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee."]
GREEDY = DecodeOptions(beam_size=1, max_length_a=0, max_length_b=24, max_output_tokens=24)
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OPUS_CARD = "---\nlanguage: [de, en]\nlicense: cc-by-4.0\n---\n# opus-mt-de-en\n"


@dataclass
class Hub:
    """What the fake hub, CDN and Argos index serve, and what they were asked."""

    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)  # repo -> file -> bytes
    lfs: set[str] = field(default_factory=lambda: {"model.safetensors"})  # sent through the CDN
    static: dict[str, bytes] = field(default_factory=dict)  # path -> bytes (the Argos index, packages)
    cut: set[str] = field(default_factory=set)  # file names or paths whose bodies stop half-way
    requests: list[str] = field(default_factory=list)
    url: str = ""
    cdn: str = ""
    sha: str = COMMIT  # what model_info says a revision's commit is
    declares_sizes: bool = True  # whether model_info gives the files' sizes

    def blob(self, digest: str) -> bytes | None:
        return next((b for files in self.repos.values() for b in files.values() if _sha(b) == digest), None)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _missing(self, code: str) -> None:
            self.send_response(404)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _serve(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append(f"{self.command} {path}")
            if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path):
                return self._info(m.group(1), m.group(2) or "main")
            if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                return self._resolve(m.group(1), m.group(2), m.group(3), body)
            if m := re.fullmatch(r"/cdn/([0-9a-f]{64})", path):
                data = hub.blob(m.group(1))
                if data is None:
                    return self._missing("EntryNotFound")
                name = next(f for files in hub.repos.values() for f, b in files.items() if b == data)
                return self._send(data, body, {"ETag": f'"{m.group(1)}"'}, cut=name in hub.cut)
            if path in hub.static:
                return self._send(hub.static[path], body, {}, cut=path in hub.cut)
            return self._missing("EntryNotFound")

        def _info(self, repo: str, revision: str) -> None:
            if repo not in hub.repos:
                return self._missing("RepoNotFound")
            if revision not in ("main", COMMIT):
                return self._missing("RevisionNotFound")
            siblings = []
            for name, data in hub.repos[repo].items():
                sibling: dict[str, Any] = {"rfilename": name}
                if hub.declares_sizes:
                    sibling["size"] = len(data)
                if name in hub.lfs:
                    sibling["lfs"] = {"size": len(data), "sha256": _sha(data), "pointerSize": 134}
                siblings.append(sibling)
            self._send(json.dumps({"id": repo, "sha": hub.sha, "siblings": siblings}).encode(), True, {})

        def _resolve(self, repo: str, revision: str, name: str, body: bool) -> None:
            if repo not in hub.repos:
                return self._missing("RepoNotFound")
            data = hub.repos[repo].get(name)
            if data is None or revision not in ("main", COMMIT):
                return self._missing("EntryNotFound" if data is None else "RevisionNotFound")
            headers = {"X-Repo-Commit": COMMIT}
            if name in hub.lfs:  # as the hub does: a redirect to another host, the metadata on it
                self.send_response(302)
                for key, value in {
                    **headers,
                    "Location": f"{hub.cdn}/cdn/{_sha(data)}",
                    "X-Linked-Etag": f'"{_sha(data)}"',
                    "X-Linked-Size": str(len(data)),
                    "Content-Length": "0",
                }.items():
                    self.send_header(key, value)
                self.end_headers()
                return None
            etag = hashlib.sha1(data).hexdigest()
            return self._send(data, body, {**headers, "ETag": f'"{etag}"'}, cut=name in hub.cut)

        def _send(self, data: bytes, body: bool, headers: dict[str, str], *, cut: bool = False) -> None:
            start = 0
            if m := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "")):
                start = int(m.group(1))
            self.send_response(206 if start else 200)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            if not body:
                return
            if cut:  # half the bytes (none on a resumed request), then the connection drops
                self.wfile.write(data[: len(data) // 2] if not start else b"")
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.wfile.write(data[start:])

    return Handler


@pytest.fixture(scope="module")
def argos_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny .argosmodel (a briefly trained Marian model through CTranslate2), labelled en -> fr."""
    pytest.importorskip("ctranslate2")
    from tests.test_convert_argos import convert_ct2, make_marian, pack, train_joint_spm

    root = tmp_path_factory.mktemp("argos-package")
    spm_model = train_joint_spm(root, lines=1000)
    hf = make_marian(root / "hf", spm_model, steps=20)
    ct2 = convert_ct2(hf, root / "ct2", "float32")
    return pack(
        ct2, spm_model, root / "en_fr.argosmodel", from_code="en", to_code="fr", package_version="1.1"
    )


@pytest.fixture(scope="module")
def marian(marian_dirs: Any) -> tuple[Path, Path]:
    return marian_dirs(MarianOptions())  # type: ignore[no-any-return]


@pytest.fixture
def hub(
    marian: tuple[Path, Path], argos_package: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Hub]:
    """The fake hub (opus-mt-de-en, a repository that is no Marian model) and Argos index, with
    huggingface_hub's cache and every setting pointed at this test's own folders."""
    hf_dir, _ = marian
    files = {p.name: p.read_bytes() for p in hf_dir.iterdir() if p.is_file()}
    state = Hub(repos={"Helsinki-NLP/opus-mt-de-en": {**files, "README.md": OPUS_CARD.encode()}})
    state.repos["someone/not-marian"] = {"config.json": b'{"model_type": "bert"}'}
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _handler(state)) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    state.url, state.cdn = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
    package = argos_package.read_bytes()
    state.static["/argos/en_fr-1_1.argosmodel"] = package
    index = [
        {"code": "translate-en_fr", "type": "translate", "from_code": "en", "to_code": "fr",
         "package_version": "1.0", "links": [f"{state.url}/argos/missing.argosmodel"]},
        {"code": "translate-en_fr", "type": "translate", "from_code": "en", "to_code": "fr",
         "package_version": "1.1", "links": [f"{state.url}/argos/en_fr-1_1.argosmodel"]},
        {"code": "translate-en_de", "from_code": "en", "to_code": "de", "package_version": "1.0",
         "links": []},
    ]  # fmt: skip
    state.static["/argos/index.json"] = json.dumps(index).encode()
    monkeypatch.setenv("HF_ENDPOINT", state.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("NMT_ARGOS_INDEX", f"{state.url}/argos/index.json")
    monkeypatch.setenv("NMT_MODEL_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("NMT_FETCH_INSECURE", "1")  # (the fake index and its links are http:)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # huggingface_hub waits a second before each retry of a cut download: not here.
    monkeypatch.setattr("huggingface_hub.file_download.time.sleep", lambda s: None)
    yield state
    for server in servers:
        server.shutdown()
        server.server_close()


def translate(model_dir: Path) -> list[str]:
    translator = Translator.load(model_dir, device="cpu", prepack=False, options=GREEDY)
    return [r.hypotheses[0] for r in translator.translate_batch(SENTENCES)]


def leftovers(store: Path) -> list[str]:
    return sorted(p.name for p in store.iterdir()) if store.exists() else []


def test_opus_mt_name_to_translation(hub: Hub, marian: tuple[Path, Path], tmp_path: Path) -> None:
    # What a fetch killed mid-way on this machine left (its process is gone): cleared.
    stale = tmp_path / "store" / f".opus-mt-de-en.{_host()}.999999999.partial"
    stale.mkdir(parents=True)
    model = fetch("opus-mt:de-en", log=lambda m: None)
    assert model == tmp_path / "store" / "opus-mt-de-en"
    # It translates as the same weights converted from a directory do.
    assert translate(model) == translate(marian[1])
    record = json.loads((model / SOURCE_RECORD).read_text())
    assert record["repo"] == "Helsinki-NLP/opus-mt-de-en" and record["commit"] == COMMIT
    served = hub.repos["Helsinki-NLP/opus-mt-de-en"]
    assert record["downloaded"]["model.safetensors"] == _sha(served["model.safetensors"])
    assert set(record["downloaded"]) == {
        "config.json", "source.spm", "target.spm", "vocab.json", "tokenizer_config.json", "README.md",
        "model.safetensors",
    }  # fmt: skip
    assert record["files"]["model.safetensors"] == _sha((model / "model.safetensors").read_bytes())
    card = (model / "README.md").read_text()
    assert "cc-by-4.0" in card and "Tiedemann" in card and COMMIT in card
    # The weights came through the "CDN", the small files from the hub itself.
    assert any(r.startswith("GET /cdn/") for r in hub.requests)
    assert leftovers(tmp_path / "store") == ["opus-mt-de-en"]


def test_a_second_fetch_downloads_nothing(hub: Hub, capsys: pytest.CaptureFixture[str]) -> None:
    first = fetch("opus-mt:de-en", log=lambda m: None)
    hub.requests.clear()
    assert main(["opus-mt:de-en", "hf:Helsinki-NLP/opus-mt-de-en@" + COMMIT]) == 0
    out = capsys.readouterr().out.split()
    assert out[0] == str(first) and out[1].endswith(f"hf-Helsinki-NLP--opus-mt-de-en@{COMMIT}")
    assert any(r.startswith("GET /api/models/") for r in hub.requests)  # the pinned name was new
    hub.requests.clear()
    assert main(["opus-mt:de-en", "hf:Helsinki-NLP/opus-mt-de-en@" + COMMIT]) == 0
    assert hub.requests == []


def test_argos_name_to_translation(hub: Hub, argos_package: Path, tmp_path: Path) -> None:
    from model.convert.argos import convert

    model = fetch("argos:en-fr", log=lambda m: None)
    assert model.name == "argos-en-fr"
    record = json.loads((model / SOURCE_RECORD).read_text())
    # The newest version of the pair, its sha256 recorded.
    assert record["package_version"] == "1.1" and record["url"].endswith("en_fr-1_1.argosmodel")
    assert record["downloaded"] == {"package.argosmodel": _sha(argos_package.read_bytes())}
    direct = convert(argos_package, tmp_path / "direct")
    assert translate(model) == translate(direct)
    hub.requests.clear()
    assert fetch("argos:en-fr", log=lambda m: None) == model
    assert hub.requests == []


def test_offline_serves_what_was_fetched_and_names_what_was_not(
    hub: Hub, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    fetch("opus-mt:de-en", log=lambda m: None)
    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["opus-mt:de-en"]) == 0
    capsys.readouterr()
    assert main(["opus-mt:de-en", "argos:en-fr"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[-1].startswith("error: argos:en-fr: not fetched yet")
    assert "HF_HUB_OFFLINE" in err[-1] and "Traceback" not in err[-1]
    assert hub.requests == []
    # No network at all (nothing listens there): one line too.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", closed)
    with pytest.raises(FetchError, match=r"^opus-mt:en-de: not fetched yet, and .* cannot be reached") as e:
        fetch("opus-mt:en-de", log=lambda m: None)
    assert "\n" not in str(e.value)
    assert leftovers(tmp_path / "store") == ["opus-mt-de-en"]


def test_a_corrupted_file_is_named(hub: Hub) -> None:
    model = fetch("opus-mt:de-en", log=lambda m: None)
    weights = model / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(
        FetchError, match=r"model\.safetensors: sha256 .* recorded when opus-mt:de-en was fetched"
    ):
        fetch("opus-mt:de-en", log=lambda m: None)
    weights.write_bytes(good)
    verify(model)
    (model / "target.spm").unlink()
    with pytest.raises(FetchError, match=r"target\.spm: missing"):
        verify(model)


@pytest.mark.parametrize(
    ("name", "cut", "message"),
    [
        ("opus-mt:de-en", "model.safetensors", "the download from .* broke off .*received"),
        ("argos:en-fr", "/argos/en_fr-1_1.argosmodel", "the download stopped at [0-9]+ of [0-9]+ bytes"),
    ],
)
def test_a_cut_download_leaves_nothing_and_the_next_fetch_succeeds(
    hub: Hub, tmp_path: Path, name: str, cut: str, message: str
) -> None:
    hub.cut.add(cut)
    with pytest.raises(FetchError, match=f"^{name}: .*{message}"):
        fetch(name, log=lambda m: None)
    assert leftovers(tmp_path / "store") == []  # no model directory, no partial one
    hub.cut.clear()
    model = fetch(name, log=lambda m: None)
    assert leftovers(tmp_path / "store") == [model.name]
    verify(model)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("opus-mt:xx-yy", f"no repository Helsinki-NLP/opus-mt-xx-yy on .*{re.escape(OPUS_MT_SEARCH)}"),
        ("hf:Helsinki-NLP/opus-mt-de-en@v9", "has no revision 'v9'"),
        ("hf:someone/not-marian", "not a MarianMTModel repository"),
        ("argos:xx-yy", f"no package from xx to yy in the Argos index .*{re.escape(ARGOS_SEARCH)}"),
        ("argos:en-es", r"no package from en to es .*\(pairs with en: en-de, en-fr, en-fr\)"),
        ("opus:de-en", "not a model name .*opus-mt:SRC-TGT"),
    ],
)
def test_unknown_names_say_how_to_find_names(hub: Hub, tmp_path: Path, name: str, message: str) -> None:
    with pytest.raises(FetchError, match=message) as e:
        fetch(name, log=lambda m: None)
    assert "\n" not in str(e.value)
    assert leftovers(tmp_path / "store") == []


def test_names_and_directories() -> None:
    assert parse_name("opus-mt:de-en").repo == "Helsinki-NLP/opus-mt-de-en"
    assert parse_name("opus-mt:tc-big-en-ko@abc").revision == "abc"
    assert parse_name("argos:pt-en").dirname == "argos-pt-en"
    assert parse_name("hf:a/b@refs/pr/1").dirname == "hf-a--b@refs--pr--1"
    # Distinct names, distinct directories: "/" is written "--", so a name holding "--" gets its
    # own digest, and is never served the other's model.
    names = [
        "hf:org/m@release/v1",
        "hf:org/m@release--v1",
        "hf:org/m@release--v1/x",
        "hf:org/m@release/v1--x",
    ]
    assert len({parse_name(n).dirname for n in names}) == len(names)
    assert parse_name("hf:org/m@release/v1").dirname == "hf-org--m@release--v1"
    for bad in ("hf:nobody", "argos:en", "argos:en-fr@1.0", "opus-mt:de", "", "hf:a/b/c"):
        with pytest.raises(FetchError):
            parse_name(bad)


def test_the_setting(tmp_path: Path) -> None:
    env = {"NMT_MODELS": "opus-mt:de-en, argos:en-fr,", "NMT_MODEL_DIR": ""}
    with mock.patch.dict("os.environ", env):
        settings = Settings()
    assert settings.models == ("opus-mt:de-en", "argos:en-fr") and settings.model_dir == ()
    with (
        mock.patch.dict("os.environ", {"NMT_MODELS": "opus-mt:de-en,opus:fr-en"}),
        pytest.raises(ValidationError, match="'opus:fr-en': not a model name"),
    ):
        Settings()


def test_nmt_models_fetches_in_a_child_process_then_finds_them(hub: Hub, tmp_path: Path) -> None:
    store, index = tmp_path / "store", f"{hub.url}/argos/index.json"
    dirs = named_model_dirs(("opus-mt:de-en", "argos:en-fr"), store, index)  # python -m model.fetch
    assert dirs == [store / "opus-mt-de-en", store / "argos-en-fr"]
    hub.requests.clear()
    assert named_model_dirs(("opus-mt:de-en", "argos:en-fr"), store, index) == dirs
    assert hub.requests == []
    with pytest.raises(FetchError, match=r"^NMT_MODELS: opus-mt:xx-yy: no repository"):
        named_model_dirs(("opus-mt:de-en", "opus-mt:xx-yy"), store, index)


def test_the_app_serves_named_models_and_their_pivot(hub: Hub, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from app.main import create_app

    store = tmp_path / "store"
    for name in ("opus-mt:de-en", "argos:en-fr"):
        fetch(name, store, log=lambda m: None)
    settings = Settings(
        model_dir=(), models=("opus-mt:de-en", "argos:en-fr"), model_store=store, device="cpu",
        compile=False, warmup=False, replicas=1,
    )  # type: ignore[call-arg]  # fmt: skip
    with TestClient(create_app(settings)) as client:
        pairs = {(lang["code"], t) for lang in client.get("/languages").json() for t in lang["targets"]}
        assert {("de", "en"), ("en", "fr"), ("de", "fr")} <= pairs

        def ask(text: str, source: str, target: str) -> str:
            answer = client.post("/translate", json={"q": text, "source": source, "target": target})
            assert answer.status_code == 200, answer.text
            return str(answer.json()["translatedText"])

        english = ask(SENTENCES[0], "de", "en")
        assert english and ask(SENTENCES[0], "de", "fr") == ask(english, "en", "fr")
    assert leftovers(store) == ["argos-en-fr", "opus-mt-de-en"]


def test_a_start_that_cannot_fetch_stops_with_one_line(
    hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from app.main import open_models

    store = tmp_path / "store"
    fetch("opus-mt:de-en", store, log=lambda m: None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    settings = Settings(model_dir=(), models=("opus-mt:de-en", "opus-mt:en-de"), model_store=store)  # type: ignore[call-arg]
    with pytest.raises(SystemExit):
        open_models(settings)
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert line.startswith("NMT_MODELS: opus-mt:en-de: not fetched yet") and "\n" not in line
    # What was fetched serves offline; a file changed since is named at start.
    settings = Settings(model_dir=(), models=("opus-mt:de-en",), model_store=store)  # type: ignore[call-arg]
    assert [spec.path for spec, _, _ in open_models(settings)] == [store / "opus-mt-de-en"]
    (store / "opus-mt-de-en" / "shared_vocabulary.json").write_text("[]")
    caplog.clear()
    with pytest.raises(SystemExit):
        open_models(settings)
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert re.match(r"NMT_MODELS: .*opus-mt-de-en/shared_vocabulary\.json: sha256 ", line), line


# -- sources treated as hostile ---------------------------------------------------------------------


def test_a_commit_that_is_no_commit_id_is_refused_before_it_names_a_cache_path(
    hub: Hub, tmp_path: Path
) -> None:
    hub.sha = "../../../../tmp/elsewhere"
    with pytest.raises(FetchError, match="not a commit id") as e:
        fetch("opus-mt:de-en", log=lambda m: None)
    assert "\n" not in str(e.value)
    assert not list((tmp_path / "hf-cache").rglob("*elsewhere*")) and leftovers(tmp_path / "store") == []


def test_only_https_links_are_followed_unless_allowed(
    hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NMT_FETCH_INSECURE")
    with pytest.raises(FetchError, match="only https") as e:  # the index itself is http: here
        fetch("argos:en-fr", log=lambda m: None)
    assert "NMT_FETCH_INSECURE" in str(e.value) and leftovers(tmp_path / "store") == []
    index = [{"code": "x", "from_code": "en", "to_code": "fr", "links": ["file:///dev/zero"]}]
    monkeypatch.setenv("NMT_FETCH_INSECURE", "1")
    hub.static["/argos/index.json"] = json.dumps(index).encode()
    monkeypatch.setenv("NMT_FETCH_MAX_BYTES", str(1 << 20))  # file:///dev/zero, allowed: capped
    with pytest.raises(FetchError, match="passed 1048576 bytes"):
        fetch("argos:en-fr", log=lambda m: None)


def test_a_download_is_capped_in_bytes_and_in_time(
    hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NMT_FETCH_MAX_BYTES", "1000")  # the package and the hub's weights are larger
    with pytest.raises(FetchError, match="more than 1000"):
        fetch("argos:en-fr", log=lambda m: None)
    with pytest.raises(FetchError, match="more than 1000"):
        fetch("opus-mt:de-en", log=lambda m: None)
    monkeypatch.delenv("NMT_FETCH_MAX_BYTES")
    monkeypatch.setenv("NMT_FETCH_TIMEOUT_S", "0")  # every byte after the first read is late
    with pytest.raises(FetchError, match="took longer than its NMT_FETCH_TIMEOUT_S"):
        fetch("argos:en-fr", log=lambda m: None)
    assert leftovers(tmp_path / "store") == []


def test_a_hub_download_is_capped_in_bytes_and_in_time_whatever_the_hub_declares(
    hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.declares_sizes = False  # no size to refuse beforehand: the bytes themselves are counted
    files = hub.repos["Helsinki-NLP/opus-mt-de-en"]
    limit = len(files["model.safetensors"]) - 1
    assert all(len(data) < limit for name, data in files.items() if name != "model.safetensors")
    monkeypatch.setenv("NMT_FETCH_MAX_BYTES", str(limit))
    with pytest.raises(FetchError, match=f"passed {limit} bytes \\(NMT_FETCH_MAX_BYTES\\)"):
        fetch("opus-mt:de-en", log=lambda m: None)
    monkeypatch.delenv("NMT_FETCH_MAX_BYTES")
    monkeypatch.setenv("NMT_FETCH_TIMEOUT_S", "0")  # every byte is late
    with pytest.raises(FetchError, match="took longer than its NMT_FETCH_TIMEOUT_S"):
        fetch("opus-mt:de-en", log=lambda m: None)
    assert leftovers(tmp_path / "store") == []


def test_strings_from_an_index_cannot_write_lines_of_their_own(hub: Hub) -> None:
    index = [
        {"code": "evil\nERROR forged line", "from_code": "en", "to_code": "fr", "package_version": "9",
         "links": [f"{hub.url}/argos/en_fr-1_1.argosmodel"]},
    ]  # fmt: skip
    hub.static["/argos/index.json"] = json.dumps(index).encode()
    logged: list[str] = []
    fetch("argos:en-fr", log=logged.append)
    assert logged and all("\n" not in line for line in logged)
    assert any("evil\\nERROR forged line" in line for line in logged), logged
