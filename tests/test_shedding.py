"""Load shedding in the front end (app.http.shedding): the gate, turns to be parsed, and the body time-out.

Raw ASGI calls with a fake scheduler: what is checked is who waits, who is refused and what is given
back, not the model."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fastapi import HTTPException, Request
from starlette.datastructures import State

import app.http.body as body_module
from app.http.body import parse_translate_request
from app.http.shedding import GATE_KEY, passed, refused, take_turn


class Gate:
    """The part of the scheduler the gate uses: ``places`` requests at a time."""

    def __init__(self, places: int) -> None:
        self.places = places
        self.inside = 0

    def enter(self) -> bool:
        if self.inside >= self.places:
            return False
        self.inside += 1
        return True

    def leave(self) -> None:
        self.inside -= 1


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def labels(self, **_: str) -> Counter:
        return self

    def inc(self) -> None:
        self.count += 1


def state(places: int, turns: int) -> State:
    s = State()
    s.scheduler = Gate(places)
    s.turns = asyncio.Semaphore(turns)
    s.metrics = State({"requests": Counter()})
    return s


def scope(path: str = "/translate") -> dict[str, Any]:
    return {"type": "http", "path": path, "method": "POST", "headers": []}


async def no_send(message: Any) -> None:
    raise AssertionError(f"nothing should be sent: {message}")


def test_requests_beyond_the_gate_are_refused_with_retry_after() -> None:
    async def main() -> None:
        s = state(places=1, turns=4)
        first = scope()
        assert not await refused(s, first, no_send)
        sent: list[Any] = []

        async def send(message: Any) -> None:
            sent.append(message)

        assert await refused(s, scope(), send)
        assert sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
        assert s.metrics.requests.count == 1
        assert not await refused(s, scope("/health"), no_send)  # only translations are shed
        passed(first)
        assert not await refused(s, scope(), no_send)  # its place was given back

    asyncio.run(main())


def test_deepls_translate_is_shed_at_the_gate_with_deepls_error_body() -> None:
    async def main() -> None:
        s = state(places=1, turns=4)
        assert not await refused(s, scope("/v2/translate"), no_send)
        sent: list[Any] = []

        async def send(message: Any) -> None:
            sent.append(message)

        assert await refused(s, scope("/v2/translate"), send)
        assert await refused(s, scope("/translate"), send)  # the two APIs share the places
        assert [m["status"] for m in sent[::2]] == [503, 503]
        deepl, libre = json.loads(sent[1]["body"]), json.loads(sent[3]["body"])
        assert list(deepl) == ["message"] and list(libre) == ["error"]
        assert deepl["message"] == libre["error"]

    asyncio.run(main())


def test_at_most_turns_requests_are_parsed_at_a_time() -> None:
    async def main() -> None:
        s = state(places=10, turns=2)
        scopes = [scope() for _ in range(3)]
        for sc in scopes:
            assert not await refused(s, sc, no_send)
        await take_turn(s, scopes[0])
        await take_turn(s, scopes[1])
        third = asyncio.ensure_future(take_turn(s, scopes[2]))
        await asyncio.sleep(0.01)
        assert not third.done()  # two are being parsed
        passed(scopes[0])  # admitted: its turn goes to the next
        await asyncio.wait_for(third, 1)
        other = scope("/health")  # not let in by the gate: never waits for a turn
        await asyncio.wait_for(take_turn(s, other), 1)
        for sc in scopes:
            passed(sc)
            passed(sc)  # a second call gives nothing back twice
        assert s.scheduler.inside == 0 and GATE_KEY not in scopes[1]
        for _ in range(2):  # both turns are free again, and no more
            await asyncio.wait_for(s.turns.acquire(), 1)
        assert s.turns.locked()

    asyncio.run(main())


def test_a_body_that_does_not_arrive_is_a_408(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(body_module, "BODY_TIMEOUT_S", 0.05)

    async def main() -> None:
        async def receive() -> dict[str, Any]:
            await asyncio.sleep(3600)  # a client that announced a body and sends nothing
            raise AssertionError

        request = Request({**scope(), "headers": [(b"content-type", b"application/json")]}, receive)
        with pytest.raises(HTTPException) as error:
            await asyncio.wait_for(parse_translate_request(request, 1000), 2)
        assert error.value.status_code == 408

    asyncio.run(main())
