"""What the routes give the use case of a request (``app.translation``): what may answer before the
model (``RecallDep``), and the request as a ``Caller``: whose memory and cache, its time, and how it
ends (its client going away; its place at the admission gate freed once its sentences are queued)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from starlette.types import Receive

from app.http.deps import MemoryDep, SegmentCacheDep, SettingsDep
from app.http.shedding import passed
from app.translation.sentences import Caller, Recall


async def get_recall(settings: SettingsDep, memory: MemoryDep, cache: SegmentCacheDep) -> Recall:
    return Recall(settings, memory, cache)


RecallDep = Annotated[Recall, Depends(get_recall)]


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client has gone. Called after the body is read, so the server's next ASGI
    message for this request is ``http.disconnect`` (uvicorn sends it when the connection drops, or
    once the response is complete): no polling, nothing runs until then."""
    while (await receive())["type"] != "http.disconnect":
        pass  # a pipelined request's data: not ours to handle, keep waiting


def request_caller(request: Request, owner: str, identity: str, timeout_s: float) -> Caller:
    """An HTTP request as the use case's caller: gone when its client disconnects, admitted (its
    gate's place freed, ``app.http.shedding.passed``) when its sentences are queued."""
    return Caller(
        owner=owner,
        identity=identity,
        timeout_s=timeout_s,
        gone=lambda: wait_for_disconnect(request.receive),
        admitted=lambda: passed(request.scope),
    )
