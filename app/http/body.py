"""Read and parse a /translate body: JSON, urlencoded or multipart form, as LibreTranslate accepts.

The body is read by hand rather than by FastAPI's parameter machinery because (1) its size must be
capped while it streams in, not after, (2) one endpoint takes three content types, and (3) text
that is not valid UTF-8 must be a 400, not silently decoded as Latin-1 (what Starlette's form
parser falls back to) or replaced by U+FFFD.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from starlette.types import Message

from app.http.schemas import TranslateRequest
from app.http.slow_clients import BODY_TIMEOUT_S
from app.translation.errors import missing_parameter

URLENCODED = "application/x-www-form-urlencoded"
MULTIPART = "multipart/form-data"
# Bodies larger than this are parsed on a thread (``parse_request``). One up to this size costs the
# event loop 7 ms at most (a form of 16,000 bare q fields; as JSON 0.1 ms), and a thread hop ~0.1
# ms: more than an ordinary request's body (up to NMT_MAX_CHARS = 5,000 characters) takes to parse.
INLINE_BYTES = 32 * 1024
LIST_FIELDS = frozenset({"q"})  # form fields that become a list when repeated (q=a&q=b)
# A schema's own such fields, as a class variable of that name (DeepL's ``text``, ``ignore_tags``).
FORM_LISTS = "form_lists"
Body = TypeVar("Body", bound=BaseModel)


def too_large(limit: int) -> HTTPException:
    return HTTPException(413, f"request body is larger than {limit} bytes")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed ``limit`` bytes.

    Content-Length is checked first (no byte is read for an announced oversized body), then the
    bytes actually received, which covers chunked bodies and lying headers.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise HTTPException(400, "invalid Content-Length header")
        if int(declared) > limit:
            raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def decode_utf8(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HTTPException(400, f"request body is not valid UTF-8 (invalid byte at offset {e.start})") from e


def json_error(position: int, reason: str) -> RequestValidationError:
    """The error FastAPI itself raises for a malformed JSON body (type ``json_invalid``)."""
    error = {"type": "json_invalid", "loc": ("body", position), "msg": "JSON decode error"}
    return RequestValidationError([{**error, "ctx": {"error": reason}}])


def parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise json_error(e.pos, e.msg) from e
    except RecursionError as e:  # "[[[[...": legal JSON, but nested beyond what the parser handles
        raise json_error(0, "nested too deeply") from e


def group_fields(pairs: list[tuple[str, str]], repeated: frozenset[str] = LIST_FIELDS) -> dict[str, Any]:
    """Form pairs to a request dict: a field of ``repeated`` (``q``) given again becomes a list;
    other fields keep their first value (as LibreTranslate's ``request.values.get`` does)."""
    data: dict[str, Any] = {}
    lists: dict[str, list[str]] = {}  # the list each repeated field became, appended to in place
    for key, value in pairs:
        if key in lists:
            lists[key].append(value)
        elif key in repeated and key in data:
            data[key] = lists[key] = [data[key], value]
        else:
            data.setdefault(key, value)
    if data.get("api_key") == "":  # HTML forms send empty fields; an empty key means "no key"
        del data["api_key"]
    return data


def parse_urlencoded(text: str, lists: frozenset[str] = LIST_FIELDS) -> dict[str, Any]:
    try:
        pairs = parse_qsl(text, keep_blank_values=True, encoding="utf-8", errors="strict")
    except UnicodeDecodeError as e:  # a %-escape that decodes to invalid UTF-8
        raise HTTPException(400, "form field is not valid UTF-8") from e
    return group_fields(pairs, lists)


def replayed(request: Request, body: bytes) -> Request:
    """``request`` with its body, already read, ready to be read again (by Starlette's parsers)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(request.scope, replay)


async def parse_multipart(
    request: Request, body: bytes, limit: int, lists: frozenset[str] = LIST_FIELDS
) -> dict[str, Any]:
    """Parse with Starlette's multipart parser, replaying the body that was already read.

    The whole body was checked to be UTF-8 before, so every field decodes as UTF-8 (boundaries
    and headers are ASCII). File parts are refused: /translate takes text fields only.
    """
    # Field count is bounded by the body size already; MAX_TEXTS is checked (413) on the result.
    async with replayed(request, body).form(max_files=0, max_fields=limit, max_part_size=limit) as form:
        pairs = [(key, value) for key, value in form.multi_items() if isinstance(value, str)]
    return group_fields(pairs, lists)


def needs_content(field: FieldInfo) -> bool:
    """Whether the field refuses an empty value (``min_length``): "" is then no value at all."""
    return any((getattr(rule, "min_length", None) or 0) > 0 for rule in field.metadata)


def check_present(data: Any, schema: type[BaseModel]) -> None:
    """LibreTranslate's 400 "Invalid request: missing q parameter" for the first required field of
    ``schema`` (in declaration order: q before target, as LibreTranslate checks them) that ``data``
    lacks: absent, null, or empty where the field needs content. (A null or empty value is missing
    to LibreTranslate too, ``if not q``; an empty ``q`` to /translate is not, here: it translates
    to "".) A body that is no object at all is left to validation (422)."""
    if not isinstance(data, dict):
        return
    for name, field in schema.model_fields.items():
        if not field.is_required():
            continue
        value = data.get(name)
        if value is None or (value == "" and needs_content(field)):
            raise missing_parameter(name)


def validate_request(data: Any, schema: type[Body]) -> Body:
    check_present(data, schema)
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        raise RequestValidationError(errors) from e


async def parse_translate_request(request: Request, limit: int) -> TranslateRequest:
    return await parse_request(request, limit, TranslateRequest)


async def read_within(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """``read_body``, or 408 if the body takes over ``timeout_s`` (``BODY_TIMEOUT_S``) to arrive."""
    timeout_s = BODY_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            return await read_body(request, limit)
    except TimeoutError as e:
        raise HTTPException(408, f"request body not received within {timeout_s:g} s") from e


async def parse_request(request: Request, limit: int, schema: type[Body]) -> Body:
    """Read, decode and validate a body as JSON, urlencoded or multipart form (4xx on any problem:
    400 for a required field missing, ``check_present``; 422 for one of the wrong type).

    A body that takes over ``BODY_TIMEOUT_S`` to arrive is a 408 (a /translate body is in memory
    before this, ``app.http.slow_clients``: no place is held while it arrives).

    Parsing costs time linear in the body (up to ~0.25 us a byte: a 1 MiB form of 500,000 ``q``
    fields takes ~0.25 s), so a body over ``INLINE_BYTES`` is parsed on a thread, in an event loop
    of its own (Starlette's multipart parser is a coroutine), and the service's loop answers
    everyone else meanwhile; a smaller one is parsed here, where a thread hop would cost more than
    the parsing."""
    body = await read_within(request, limit)
    if len(body) > INLINE_BYTES:
        return await asyncio.to_thread(parse_body_blocking, request, body, limit, schema)
    return await parse_body(request, body, limit, schema)


def parse_body_blocking(request: Request, body: bytes, limit: int, schema: type[Body]) -> Body:
    """``parse_body`` on a thread that runs no event loop (a loop of its own, for as long as it takes)."""
    return asyncio.run(parse_body(request, body, limit, schema))


async def parse_body(request: Request, body: bytes, limit: int, schema: type[Body]) -> Body:
    """``body``, read already, decoded and validated (``parse_request``)."""
    kind = media_type(request)
    lists: frozenset[str] = getattr(schema, FORM_LISTS, LIST_FIELDS)
    if body and kind == MULTIPART:
        decode_utf8(body)  # (400 unless UTF-8: every field then decodes as such)
        data = await parse_multipart(request, body, limit, lists)
    else:
        data = parse_text(body, kind, lists)
    return validate_request(data, schema)


def parse_text(body: bytes, kind: str, lists: frozenset[str] = LIST_FIELDS) -> Any:
    """A body that is no multipart form, decoded and parsed as ``kind`` says: urlencoded, or JSON
    (also when the client forgot the Content-Type header); ``{}`` for no body at all, whatever the
    type says ("missing q", as LibreTranslate has it). 400 or 422 for a body that is neither."""
    text = decode_utf8(body)
    if not body:
        return {}
    return parse_urlencoded(text, lists) if kind == URLENCODED else parse_json(text)


async def parse_text_body(body: bytes, kind: str) -> Any:
    """``parse_text``, on a thread for a body over ``INLINE_BYTES`` (as ``parse_request``)."""
    if len(body) > INLINE_BYTES:
        return await asyncio.to_thread(parse_text, body, kind)
    return parse_text(body, kind)
