"""Request bodies (``app.http.body``): repeated fields grouped as LibreTranslate does, and a large body
parsed on a thread into the very request a small one parsed on the event loop gives."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from fastapi import HTTPException
from starlette.requests import Request

from app.http import body as request_body
from app.http.body import INLINE_BYTES, group_fields, parse_request
from app.http.schemas import TranslateRequest
from tests.test_api import multipart


def test_repeated_q_becomes_a_list_in_order_and_other_fields_keep_their_first_value() -> None:
    pairs = [("q", "a"), ("source", "de"), ("q", "b"), ("source", "fr"), ("q", "c"), ("api_key", "")]
    assert group_fields(pairs) == {"q": ["a", "b", "c"], "source": "de"}
    assert group_fields([("q", "a"), ("target", "en")]) == {"q": "a", "target": "en"}
    assert group_fields([("q", "")] * 3) == {"q": ["", "", ""]}


def request_of(content: bytes, content_type: str) -> Request:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": content, "more_body": False}

    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(content)).encode())]
    return Request(
        {"type": "http", "method": "POST", "path": "/", "headers": headers, "query_string": b""}, receive
    )


def bodies(texts: list[str]) -> dict[str, tuple[bytes, str]]:
    """The same request as urlencoded, multipart and JSON bodies."""
    fields = [("source", "de"), ("target", "en"), *[("q", text) for text in texts]]
    form = "&".join(f"{k}={v}" for k, v in fields).encode()
    return {
        "urlencoded": (form, "application/x-www-form-urlencoded"),
        "multipart": multipart(fields),
        "json": (json.dumps({"source": "de", "target": "en", "q": texts}).encode(), "application/json"),
    }


@pytest.mark.parametrize("kind", ["urlencoded", "multipart", "json"])
def test_a_large_body_is_parsed_on_a_thread_into_the_same_request(kind: str) -> None:
    small = [f"Satz{i}" for i in range(3)]
    large = [f"Satz{i}" for i in range(INLINE_BYTES // 4)]
    threads: list[str] = []
    original = request_body.validate_request

    def recording(data: Any, schema: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(data, schema)

    async def parse(texts: list[str]) -> TranslateRequest:
        content, content_type = bodies(texts)[kind]
        return await parse_request(request_of(content, content_type), 16 * 1024 * 1024, TranslateRequest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(request_body, "validate_request", recording)
        parsed_small = asyncio.run(parse(small))
        parsed_large = asyncio.run(parse(large))
    assert len(bodies(small)[kind][0]) <= INLINE_BYTES < len(bodies(large)[kind][0])
    assert parsed_small.q == small and parsed_large.q == large
    assert threads[0] == threading.current_thread().name  # small: where the event loop runs
    assert threads[1] != threading.current_thread().name  # large: on a thread


def test_a_large_bodys_refusal_is_the_same_as_a_small_ones() -> None:
    """Errors raised on the thread reach the caller as they are (invalid UTF-8: 400)."""
    for size in (10, 2 * INLINE_BYTES):
        content = b"q=" + b"a" * size + b"%ff&source=de&target=en"
        with pytest.raises(HTTPException) as raised:
            asyncio.run(
                parse_request(
                    request_of(content, "application/x-www-form-urlencoded"), 1 << 24, TranslateRequest
                )
            )
        assert raised.value.status_code == 400 and "UTF-8" in str(raised.value.detail)
