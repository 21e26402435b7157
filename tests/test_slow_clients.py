"""Slow clients cost only themselves (app/http/slow_clients.py), against ``uvicorn app.main:app`` as
deployed: connections that send a request's headers and never its body hold no parsing turn and no
place in the queue, and are answered 408 and closed at their deadline; one address past
NMT_MAX_CONNECTIONS_PER_CLIENT gets 429 and a closed connection, and no one else notices; health
probes are answered whatever one address holds."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.http.connections import HEADER_TIMEOUT_S
from app.http.slow_clients import (
    BODY_TIMEOUT_S,
    EXCESS_HOLD_S,
    UPLOAD_GRACE_S,
    BodyError,
    ClientLimit,
    form_fields_before_file,
    receive_body,
    replayed,
)
from tests.test_server import Server, running_server

HEADERS_ONLY = (
    b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
)
BODY = {"q": "Ein Hund läuft über die Wiese.", "source": "de", "target": "en"}


def header_only(server: Server, source: str = "127.0.0.2") -> socket.socket:
    """A connection that sends a /translate request's headers and never its body."""
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), source_address=(source, 0))
    s.sendall(HEADERS_ONLY)
    return s


def answered(s: socket.socket, timeout_s: float) -> bytes:
    """What the server sent within ``timeout_s``, or until it closed the connection."""
    s.settimeout(timeout_s)
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except TimeoutError:
        pass
    return data


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("slow")
    with running_server(
        directory / "server.log",
        NMT_MODEL_DIR=str(model_dir),
        NMT_DATA_DIR=str(directory / "data"),  # (its jobs this test's own)
        NMT_MAX_CONNECTIONS_PER_CLIENT="400",
        NMT_SEGMENT_CACHE_MB="0",
    ) as s:
        yield s


def test_requests_without_their_body_or_head_hold_nothing_and_are_closed_at_their_deadline(
    server: Server,
) -> None:
    # 300 of them: more than the 32 parsing turns, and than the scheduler's places would be spared;
    # and 200 that never end their head (half of them send nothing at all: uvicorn alone would
    # hold those for good, app/http/connections.py).
    slow = [header_only(server) for _ in range(300)]
    headless = [head_begun(server, b"" if i % 2 else b"POST /translate HTTP/1.1\r\nHo") for i in range(200)]
    try:
        time.sleep(0.5)  # every one of them reached the app
        with httpx.Client(base_url=server.url, timeout=30) as client:
            started = time.monotonic()
            answer = client.post("/translate", json=BODY)
            took = time.monotonic() - started
            assert answer.status_code == 200 and took < 2.0, (answer.text, took)
            started = time.monotonic()
            assert client.get("/health").status_code == 200
            assert time.monotonic() - started < 0.5
        started = time.monotonic()
        first = answered(slow[0], BODY_TIMEOUT_S + 5)
        assert first.startswith(b"HTTP/1.1 408") and b"connection: close" in first.lower(), first[:200]
        assert all(answered(s, 2.0).startswith(b"HTTP/1.1 408") for s in slow[1:])
        assert all(answered(s, 2.0).startswith(b"HTTP/1.1 408") for s in headless)
        assert time.monotonic() - started < max(BODY_TIMEOUT_S, HEADER_TIMEOUT_S) + 5
    finally:
        for s in slow + headless:
            s.close()


def head_begun(server: Server, start: bytes, source: str = "127.0.0.3") -> socket.socket:
    """A connection that sends ``start`` (a head's first bytes, or nothing), then nothing."""
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), source_address=(source, 0))
    s.sendall(start)
    return s


def trickling_upload(server: Server, path: str, source: str = "127.0.0.2") -> socket.socket:
    """An upload that announces 100 kB and sends its first bytes, then nothing."""
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), source_address=(source, 0))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        "Content-Length: 100000\r\n\r\n--b\r\n"
    )
    s.sendall(head.encode())
    return s


def test_uploads_that_trickle_in_from_one_address_hold_a_quarter_of_the_places_for_seconds(
    server: Server,
) -> None:
    started = time.monotonic()
    slow = [trickling_upload(server, "/translate_file" if i % 2 else "/jobs") for i in range(16)]
    try:
        replies = [answered(s, 0.2) for s in slow]  # the ones past their address's share: at once
        refused = [r for r in replies if r]
        assert len(refused) == 16 - 4 and all(r.startswith(b"HTTP/1.1 429") for r in refused), refused[:1]
        # Everyone else still has the other places.
        with httpx.Client(base_url=server.url, timeout=30) as client:
            form = {"source": "de", "target": "en"}
            done = client.post("/translate_file", data=form, files={"file": ("a.txt", b"Ein Hund.")})
            assert done.status_code == 200, done.text
        held = [s for s, r in zip(slow, replies, strict=True) if not r]
        timed_out = [answered(s, UPLOAD_GRACE_S + 3) for s in held]
        assert all(r.startswith(b"HTTP/1.1 408") for r in timed_out), timed_out
        # The rate's check (a few bytes in UPLOAD_GRACE_S), long before the size's deadline (~11 s).
        assert time.monotonic() - started < UPLOAD_GRACE_S + 5
    finally:
        for s in slow:
            s.close()


def test_an_address_past_its_bound_gets_429_and_a_closed_connection_and_others_do_not_notice(
    model_dir: Path, tmp_path: Path
) -> None:
    with running_server(
        tmp_path / "server.log",
        NMT_MODEL_DIR=str(model_dir),
        NMT_DATA_DIR=str(tmp_path / "data"),
        NMT_MAX_CONNECTIONS_PER_CLIENT="5",
    ) as server:
        held = [header_only(server) for _ in range(5)]
        time.sleep(0.3)
        excess = header_only(server)
        started = time.monotonic()
        reply = answered(excess, EXCESS_HOLD_S * 1.5 + 2)
        assert reply.startswith(b"HTTP/1.1 429") and b"connection: close" in reply.lower(), reply[:200]
        assert b"retry-after: 1" in reply.lower()
        assert EXCESS_HOLD_S / 2 - 0.1 <= time.monotonic() - started < EXCESS_HOLD_S * 1.5 + 2
        # Its probes are answered (never counted), and every other address is served.
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(base_url=server.url, transport=transport, timeout=10) as same:
            assert same.get("/health/live").status_code == 200
        with httpx.Client(base_url=server.url, timeout=30) as other:
            assert other.post("/translate", json=BODY).status_code == 200
        for s in held:
            s.close()


# --- the pieces --------------------------------------------------------------------------------------


def test_receive_body_reads_the_whole_body_or_refuses_it_by_its_deadline_and_size() -> None:
    async def run() -> None:
        parts = [b"ab", b"cd", b"e"]

        async def chunks() -> dict[str, object]:
            part = parts.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(parts)}

        assert await receive_body(chunks, 10, time.monotonic() + 1) == b"abcde"
        parts[:] = [b"abc", b"def"]
        with pytest.raises(BodyError) as large:
            await receive_body(chunks, 5, time.monotonic() + 1)
        assert large.value.status == 413

        async def never() -> dict[str, object]:
            await asyncio.sleep(3600)
            return {}

        started = time.monotonic()
        with pytest.raises(BodyError) as slow:
            await receive_body(never, 5, time.monotonic() + 0.2)
        assert slow.value.status == 408 and time.monotonic() - started < 1

        async def drip() -> dict[str, object]:  # 100 bytes a second, for ever
            await asyncio.sleep(0.1)
            return {"type": "http.request", "body": b"x" * 10, "more_body": True}

        started = time.monotonic()
        with pytest.raises(BodyError) as behind:  # 1,000 bytes a second past 0.3 s, or 408
            await receive_body(drip, 10**6, time.monotonic() + 60, min_rate=1000, grace_s=0.3)
        assert behind.value.status == 408 and 0.3 < time.monotonic() - started < 1.0

        async def gone() -> dict[str, object]:
            return {"type": "http.disconnect"}

        replay = replayed(b"whole", gone)
        assert await replay() == {"type": "http.request", "body": b"whole", "more_body": False}
        assert await replay() == {"type": "http.disconnect"}

    asyncio.run(run())


def test_a_client_limit_counts_each_address_apart_and_forgets_those_with_nothing_open() -> None:
    limit = ClientLimit.of(2)
    assert limit.take("a") and limit.take("a") and not limit.take("a")
    assert limit.take("b")
    limit.give("a")
    assert limit.take("a")
    for address in ("a", "a", "b"):
        limit.give(address)
    assert limit.open == {}
    unbounded = ClientLimit.of(0)
    assert all(unbounded.take("a") for _ in range(1000))


def test_strangers_jobs_are_counted_per_client_address(server: Server) -> None:
    """Without keys, one client's jobs fill its own share (NMT_MAX_JOBS_PER_KEY), not everyone's."""
    form = {"source": "de", "target": "en"}
    one = httpx.Client(base_url=server.url, transport=httpx.HTTPTransport(local_address="127.0.0.3"))
    with one, httpx.Client(base_url=server.url) as other:
        made = [one.post("/jobs", data=form, files={"file": ("a.txt", b"Hallo.")}) for _ in range(21)]
        assert [m.status_code for m in made] == [202] * 20 + [429], made[-1].text
        assert "you hold 20 jobs" in made[-1].json()["error"]
        assert other.post("/jobs", data=form, files={"file": ("b.txt", b"Hallo.")}).status_code == 202


def test_the_fields_before_a_forms_file_are_found_in_its_first_bytes() -> None:
    part = 'Content-Disposition: form-data; name="{}"\r\n\r\n{}\r\n'
    head = "--b\r\n" + part.format("source", "de") + "--b\r\n" + part.format("api_key", "k1")
    file = '--b\r\nContent-Disposition: form-data; name="file"; filename="a.txt"\r\n\r\nEin Hund'
    assert form_fields_before_file((head + file).encode(), b"b") == ({"source": "de", "api_key": "k1"}, True)
    assert form_fields_before_file(head.encode()[:-10], b"b") == ({"source": "de"}, False)  # more may come
    after = file + "\r\n--b\r\n" + part.format("api_key", "k2") + "--b--\r\n"
    assert form_fields_before_file(after.encode(), b"b") == ({}, True)  # the key after the file: too late
    assert form_fields_before_file((head + "--b--\r\n").encode(), b"b") == (
        {"source": "de", "api_key": "k1"},
        True,
    )
