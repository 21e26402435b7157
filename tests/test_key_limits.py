"""API keys with limits over HTTP (app/keys/limits.py): what clients get from the real app with a
model worker and the tiny random model. The usage store's clock is replaced by one the tests
move: Retry-After values are exact."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.keys.usage import KeyLimits, UsageStore
from app.main import create_app, lifespan
from tests.test_api import assert_error, make_settings, serve
from tests.test_keys import write_keys

T0 = 1_700_000_000.25

KEYS_FILE = """
[[keys]]
name = "tight"
key = "tight-secret"
requests_per_minute = 2

[[keys]]
name = "free"
sha256 = "{free_sha256}"

[[keys]]
name = "batch"
key = "batch-secret"
requests_per_minute = 3

[[keys]]
name = "short"
key = "short-secret"
char_limit = 10

[[keys]]
name = "detect"
key = "detect-secret"
requests_per_minute = 1

[[keys]]
name = "files"
key = "files-secret"
chars_per_minute = 30

[[keys]]
name = "solo"
key = "solo-secret"
max_concurrent = 1
"""


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# --- start ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("keys", "invalid configuration: NMT_API_KEYS_FILE"),
        ("data", "invalid configuration: NMT_DATA_DIR"),
    ],
)
def test_bad_keys_or_data_dir_stop_the_start_with_one_line(
    tmp_path: Path, model_dir: Path, caplog: pytest.LogCaptureFixture, where: str, message: str
) -> None:
    keys = write_keys(tmp_path, "[[keys]]\nname = 'a'\nkey = 'k'\nmax_concurrent = 1\n")
    if where == "keys":
        keys.write_text("[[keys]]\nname = 'a'\n")
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    settings = make_settings(model_dir, api_keys_file=keys, data_dir=not_a_directory / "data")

    async def start() -> None:
        async with lifespan(create_app(settings)):
            pass

    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit):
        asyncio.run(start())  # (the keys are read before any model worker starts)
    assert any(r.getMessage().startswith(message) for r in caplog.records), caplog.text


# --- over HTTP -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def clock() -> Clock:
    return Clock()


@pytest.fixture(scope="module")
def client(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, data_dir: Path, clock: Clock
) -> Iterator[TestClient]:
    free = hashlib.sha256(b"free-secret").hexdigest()
    keys = write_keys(tmp_path_factory.mktemp("keys"), KEYS_FILE.format(free_sha256=free))
    settings = make_settings(
        model_dir,
        api_keys="env-secret",
        api_keys_file=keys,
        data_dir=data_dir,
        warmup=False,
        key_metrics=True,  # the tests below read the per-key series
    )
    with serve(settings) as c:
        store(c).clock = clock
        yield c


def store(client: TestClient) -> UsageStore:
    used: UsageStore = client.app.state.services.keys.store  # type: ignore[attr-defined]
    return used


def translate(client: TestClient, key: str | None, q: Any = "Hallo.", **body: Any) -> Any:
    fields = {"q": q, "source": "de", "target": "en", **body}
    return client.post("/translate", json=fields if key is None else {**fields, "api_key": key})


def test_a_key_over_its_limit_gets_429_with_retry_after_while_others_are_served(
    client: TestClient, clock: Clock
) -> None:
    assert translate(client, "tight-secret").status_code == 200
    assert translate(client, "tight-secret").status_code == 200
    limited = translate(client, "tight-secret")
    assert limited.status_code == 429
    assert limited.json() == {"error": "Slowdown: 2 requests per 1 minute (requests_per_minute)"}
    # The first request's second leaves the window 60 s after its end.
    assert limited.headers["Retry-After"] == str(math.ceil(math.floor(clock.now) + 61 - clock.now))
    for other in ("free-secret", "env-secret", "batch-secret"):
        assert translate(client, other).status_code == 200, other
    assert_error(translate(client, "nope-secret"), 403, "invalid api_key")
    assert_error(translate(client, None), 403, "api_key is required")
    clock.now += int(limited.headers["Retry-After"]) - 1
    assert translate(client, "tight-secret").status_code == 429
    clock.now += 1
    assert translate(client, "tight-secret").status_code == 200


def test_a_list_q_counts_one_request_per_text(client: TestClient) -> None:
    assert translate(client, "batch-secret", q=["Eins.", "Zwei."]).status_code == 200
    assert_error(translate(client, "batch-secret", q=["Eins.", "Zwei."]), 429, "Slowdown: 3 requests")
    assert translate(client, "batch-secret", q=["Eins."]).status_code == 200
    too_many = translate(client, "batch-secret", q=["a", "b", "c", "d"])
    assert_error(too_many, 413, "3 requests per 1 minute (requests_per_minute)")
    assert "Retry-After" not in too_many.headers  # waiting would not help


def test_char_limit_is_libretranslates_400_for_each_text(client: TestClient) -> None:
    assert translate(client, "short-secret", q="Ein Hund.").status_code == 200
    over = "Ein Mann läuft."
    expected = f"Invalid request: request ({len(over)}) exceeds text limit (10)"
    assert translate(client, "short-secret", q=over).json() == {"error": expected}
    assert_error(translate(client, "short-secret", q=["Ja.", over]), 400, expected)
    assert_error(client.post("/detect", json={"q": over, "api_key": "short-secret"}), 400, expected)


def test_detect_spends_the_same_budget(client: TestClient) -> None:
    assert client.post("/detect", json={"q": "Hallo", "api_key": "detect-secret"}).status_code == 200
    assert_error(client.post("/detect", json={"q": "Hallo", "api_key": "detect-secret"}), 429, "Slowdown")
    assert_error(translate(client, "detect-secret"), 429, "Slowdown: 1 request per 1 minute")


def upload(client: TestClient, key: str, text: str) -> Any:
    form = {"source": "de", "target": "en", "api_key": key}
    return client.post("/translate_file", data=form, files={"file": ("a.txt", text.encode())})


def test_a_file_spends_its_characters_once_read(client: TestClient, clock: Clock) -> None:
    assert upload(client, "files-secret", "Ein Hund läuft im Park.").status_code == 200  # 23 characters
    limited = upload(client, "files-secret", "Ein Mann.")
    assert_error(limited, 429, "Slowdown: 30 characters per 1 minute (chars_per_minute)")
    assert limited.headers["Retry-After"] == str(math.ceil(math.floor(clock.now) + 61 - clock.now))
    assert_error(upload(client, "files-secret", "x" * 31), 413, "30 characters per 1 minute")
    assert upload(client, "files-secret", "Ja.").status_code == 200  # 26 of 30
    assert_error(translate(client, "files-secret", q="Ein Mann."), 429, "chars_per_minute")


def test_the_concurrency_cap_holds_across_processes(client: TestClient, data_dir: Path) -> None:
    other_process = UsageStore(data_dir)  # another front-end process, holding solo's one slot
    assert other_process.admit("solo", KeyLimits(max_concurrent=1)) is None
    limited = translate(client, "solo-secret")
    assert limited.json() == {"error": "Slowdown: 1 concurrent request (max_concurrent)"}
    assert limited.status_code == 429 and limited.headers["Retry-After"] == "1"
    other_process.release("solo")
    assert translate(client, "solo-secret").status_code == 200
    other_process.close()


def test_the_slot_is_given_back_however_the_request_ends(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics = client.app.state.services.metrics  # type: ignore[attr-defined]

    def free() -> bool:
        in_flight = metrics.sample("nmt_key_requests_in_flight", {"key": "solo"})
        return store(client).in_flight("solo") == 0 and in_flight == 0

    assert translate(client, "solo-secret").status_code == 200 and free()
    assert translate(client, "solo-secret", source="xx").status_code == 400 and free()  # after admission
    form = {"source": "de", "target": "en", "api_key": "solo-secret"}
    unsupported = client.post("/translate_file", data=form, files={"file": ("a.exe", b"MZ")})
    assert unsupported.status_code == 400 and free()
    lenient = TestClient(client.app, raise_server_exceptions=False)  # the same app, already started

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    with monkeypatch.context() as patch:
        patch.setattr(client.app.state.services.scheduler, "submit", broken)  # type: ignore[attr-defined]
        client.app.state.services.segment_cache.clear()  # type: ignore[attr-defined]  # (answers decoded before)
        body = {"q": "Hallo", "target": "en", "api_key": "solo-secret"}
        assert lenient.post("/translate", json=body).status_code == 500
    assert free()

    async def gone(*args: Any, **kwargs: Any) -> tuple[bool, None]:
        for awaitable in args:
            awaitable.close()  # never awaited: the client went away first
        return False, None

    with monkeypatch.context() as patch:
        patch.setattr("app.translation.sentences.run_until_disconnect", gone)
        assert translate(client, "solo-secret").status_code == 499
    assert free()
    assert translate(client, "solo-secret").status_code == 200


def test_metrics_are_per_key_name_never_the_key(client: TestClient) -> None:
    assert translate(client, "free-secret").status_code == 200
    assert translate(client, "nope-secret").status_code == 403
    # Limited requests of its own (the clock stands still: 3 in its minute cross tight's 2).
    assert 429 in {translate(client, "tight-secret").status_code for _ in range(3)}
    assert translate(client, "short-secret", q="Ein Hund läuft.").status_code == 400
    text = client.get("/metrics").text
    assert 'nmt_key_requests_total{key="free"}' in text
    assert 'nmt_key_characters_total{key="free"}' in text
    assert 'nmt_key_requests_in_flight{key="free"} 0.0' in text
    assert 'nmt_key_limited_requests_total{key="tight",limit="requests_per_minute"}' in text
    assert 'nmt_key_limited_requests_total{key="short",limit="char_limit"}' in text
    assert "secret" not in text
    # One series per configured key (other tests' apps in this process add theirs): an unknown key
    # gets none, so its guesses cannot grow the labels.
    keys = {line.split('key="')[1].split('"')[0] for line in text.splitlines() if 'key="' in line}
    assert {"free", "tight", "short"} <= keys
    assert not any(key.startswith("nope") for key in keys)
    metrics = client.app.state.services.metrics  # type: ignore[attr-defined]
    before = metrics.sample("nmt_key_characters_total", {"key": "free"})
    assert translate(client, "free-secret", q=["Ein Hund.", "Ja."]).status_code == 200
    assert metrics.sample("nmt_key_characters_total", {"key": "free"}) == before + 12


def test_keys_without_counted_limits_never_open_the_store(model_dir: Path, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    settings = make_settings(model_dir, api_keys="k1", key_char_limit=100, data_dir=data_dir, warmup=False)
    with serve(settings) as keyed:
        assert keyed.app.state.services.keys.store is None  # type: ignore[attr-defined]
        assert translate(keyed, "k1").status_code == 200
        assert_error(translate(keyed, "k1", q="x" * 101), 400, "exceeds text limit (100)")
        assert keyed.get("/frontend/settings").json()["keyRequired"] is True
    assert not data_dir.exists()


def test_without_key_metrics_no_series_names_a_key(model_dir: Path, tmp_path: Path) -> None:
    keys = write_keys(
        tmp_path,
        '[[keys]]\nname = "unmetered-team"\nkey = "unmetered-secret"\nrequests_per_minute = 1\n',
    )
    settings = make_settings(model_dir, api_keys_file=keys, data_dir=tmp_path / "data", warmup=False)
    assert settings.key_metrics is False  # the default
    with serve(settings) as quiet:
        assert translate(quiet, "unmetered-secret").status_code == 200
        assert translate(quiet, "unmetered-secret").status_code == 429  # limited: no series either
        assert translate(quiet, "nope-secret").status_code == 403
        text = quiet.get("/metrics").text
    assert text.count("nmt_requests_total") > 0  # the service's own metrics are there
    # (This process's other apps, with NMT_KEY_METRICS on, add series of their own keys' names.)
    assert "unmetered" not in text
