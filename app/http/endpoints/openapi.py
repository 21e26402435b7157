"""The request body of an operation whose body ``app.http.body`` parses, as the OpenAPI document states
it: FastAPI does not see such a body, so it is given through ``openapi_extra``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from app.http.body import MULTIPART


def request_body(content: dict[str, Any]) -> dict[str, Any]:
    """The ``openapi_extra`` of a required body in these media types (``{media type: {"schema": ...}}``)."""
    return {"requestBody": {"required": True, "content": content}}


def object_schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """A media type's entry in ``request_body``: an object of these fields."""
    return {"schema": {"type": "object", "properties": properties, "required": required}}


def multipart_body(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """The ``openapi_extra`` of an upload: a multipart form of these fields (a file is
    ``{"type": "string", "format": "binary"}``)."""
    return request_body({MULTIPART: object_schema(properties, required)})


def form_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` as a form can carry it: a field is text or repeated text, never null (an optional
    field is left out instead), and a list has at least one item (an empty one is no field)."""
    properties = {}
    for name, field in schema["properties"].items():
        kinds = [kind for kind in field.get("anyOf", ()) if kind.get("type") != "null"]
        kinds = [{**kind, "minItems": 1} if kind.get("type") == "array" else kind for kind in kinds]
        if len(kinds) == 1:
            field = {**{k: v for k, v in field.items() if k not in ("anyOf", "default")}, **kinds[0]}
        elif kinds:
            field = {**field, "anyOf": kinds}
        properties[name] = field
    return {**schema, "properties": properties}


def inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``$defs`` written in place of their ``$ref``s: a body given through
    ``openapi_extra`` sits inside the OpenAPI document, where "#/$defs/..." would point nowhere."""
    defs = schema.get("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)  # type: ignore[no-any-return]


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """The request body of an operation whose body app.http.body parses (JSON, or a form in either of
    its two content types), declared for /docs since FastAPI does not see it: ``openapi_extra``."""
    schema = inline_refs(model.model_json_schema())
    form = {"schema": form_schema(schema)}
    # A form carries the glossary as JSON text, which no JSON Schema keyword can describe (any
    # other string is a 422): the form's schema leaves it out; its JSON description says how.
    form["schema"]["properties"].pop("glossary", None)
    return request_body(
        {"application/json": {"schema": schema}, "application/x-www-form-urlencoded": form, MULTIPART: form}
    )
