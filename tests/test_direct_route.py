"""POST /translate served by ``app.http.direct.DirectRoute`` answers exactly as FastAPI's own route.

The reference is the same started app with the direct route switched off (``app.direct = None``):
every request then goes through FastAPI's routing, dependencies, middleware and exception handlers,
which is what the direct route must reproduce, status, body, headers and metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import pytest
from fastapi import Depends, Request
from fastapi.dependencies.utils import get_dependant
from fastapi.testclient import TestClient

from app.http.direct import DirectRoute, check_plain, solve
from app.main import TranslationApp, create_app
from tests.test_api import make_settings

CASES: list[tuple[str, dict[str, Any]]] = [
    ("one text", {"json": {"q": "Ein Hund läuft.", "source": "de", "target": "en"}}),
    (
        "a list, beam 2",
        {"json": {"q": ["Ein Mann.", "Zwei Frauen."], "source": "de", "target": "en", "beam_size": 2}},
    ),
    ("alternatives", {"json": {"q": "Ein Hund.", "source": "de", "target": "en", "alternatives": 2}}),
    ("form", {"data": {"q": "Ein Hund.", "source": "de", "target": "en"}}),
    ("missing q: 400", {"json": {"source": "de", "target": "en"}}),
    ("unsupported language: 400", {"json": {"q": "x", "source": "zz", "target": "en"}}),
    ("wrong type: 422", {"json": {"q": 3, "source": "de", "target": "en"}}),
    ("malformed JSON: 422", {"content": b'{"q": "x",', "headers": {"content-type": "application/json"}}),
    ("too long: 413", {"json": {"q": "a" * 5001, "source": "de", "target": "en"}}),
    ("beam too large: 400", {"json": {"q": "x", "source": "de", "target": "en", "beam_size": 99}}),
]


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[TestClient]:
    with TestClient(create_app(make_settings(model_dir)), raise_server_exceptions=False) as c:
        yield c


def answer(client: TestClient, direct: bool, request: dict[str, Any]) -> tuple[int, str, str, str | None]:
    app = client.app
    assert isinstance(app, TranslationApp)
    kept = app.direct
    app.direct = kept if direct else None
    try:
        r = client.post("/translate", **request)
    finally:
        app.direct = kept
    return r.status_code, r.text, r.headers.get("content-type", ""), r.headers.get("retry-after")


def requests_counted(client: TestClient, status: int) -> float:
    metrics = client.app.state.services.metrics  # type: ignore[attr-defined]
    return float(metrics.sample("nmt_requests_total", {"endpoint": "/translate", "status": str(status)}) or 0)


def test_the_app_serves_post_translate_directly(client: TestClient) -> None:
    app = client.app
    assert isinstance(app, TranslationApp) and app.direct is not None
    assert DirectRoute.matches({"type": "http", "path": "/translate", "method": "POST"})
    for path, method in [("/translate/", "POST"), ("/translate", "GET"), ("/detect", "POST")]:
        assert not DirectRoute.matches({"type": "http", "path": path, "method": method})


@pytest.mark.parametrize("request_", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_the_direct_route_answers_as_fastapis_route(client: TestClient, request_: dict[str, Any]) -> None:
    via_fastapi = answer(client, False, request_)
    status = via_fastapi[0]
    before = requests_counted(client, status)
    assert answer(client, True, request_) == via_fastapi
    assert requests_counted(client, status) == before + 1  # counted under the same labels


def test_a_bug_is_the_same_500_both_ways(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr("app.http.endpoints.translate.check_limits", boom)
    request = {"json": {"q": "x", "source": "de", "target": "en"}}
    via_fastapi = answer(client, False, request)
    assert via_fastapi[0] == 500
    assert answer(client, True, request) == via_fastapi


def test_not_ready_is_the_same_503_both_ways(client: TestClient) -> None:
    state = client.app.state.services  # type: ignore[attr-defined]
    state.ready = False
    try:
        request = {"json": {"q": "x", "source": "de", "target": "en"}}
        via_fastapi = answer(client, False, request)
        assert via_fastapi[0] == 503
        assert answer(client, True, request) == via_fastapi
    finally:
        state.ready = True


# (At module level: the annotations are strings, resolved in the module's names.)
async def by_query(q: str) -> str:
    return q


async def needs_a_query(request: Request, value: Annotated[str, Depends(by_query)]) -> None:
    return None


CALLS: list[str] = []


async def shared(request: Request) -> int:
    CALLS.append(request.url.path)
    return 7


async def built_on_it(value: Annotated[int, Depends(shared)]) -> int:
    return value + 1


async def endpoint(
    request: Request, x: Annotated[int, Depends(shared)], y: Annotated[int, Depends(built_on_it)]
) -> None:
    return None


def test_a_dependency_that_needs_fastapis_own_parsing_is_refused_when_the_app_starts() -> None:
    with pytest.raises(RuntimeError, match="by_query needs more than the request"):
        check_plain(get_dependant(path="/translate", call=needs_a_query))


def test_the_endpoints_dependencies_are_found_in_its_signature_each_called_once() -> None:
    dependant = get_dependant(path="/translate", call=endpoint)
    check_plain(dependant)
    request = Request({"type": "http", "method": "POST", "path": "/translate", "headers": []})
    CALLS.clear()
    values = asyncio.run(solve(dependant, request, {}))
    assert values == {"request": request, "x": 7, "y": 8}
    assert CALLS == ["/translate"]  # once, though two parameters need it
