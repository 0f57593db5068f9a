"""The API's OpenAPI 3.1 document, built from the contract's pydantic models, and a self-contained page showing it.

The request and response schemas come from `clef_engine.protocol` (the one owner of the contract); what is only
HTTP — the error bodies, /health and /v1/models — is modelled here. The docs page is plain HTML with the document
rendered into it: no script or stylesheet from a CDN, since the server often runs on a machine without internet.
"""

from __future__ import annotations

import functools
import json
from html import escape
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from .. import protocol

_REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")

    error_type: Literal[
        "authentication_error", "request_timeout", "request_too_large", "token_budget_exceeded",
        "unsupported_media_type", "unsupported_encoding", "overloaded", "not_ready", "deadline_exceeded",
        "shutting_down", "misdirected_request", "not_found", "method_not_allowed", "internal_error"]
    message: str


class ErrorBody(BaseModel):
    """Every error that is not a validation error."""

    detail: ErrorDetail


class Health(BaseModel):
    ready: bool
    state: str
    model: str | None
    models: list[str]
    revision: str | None
    device: str | None


_MODELS = {
    "title": "Models",
    "type": "object",
    "properties": {"models": {"type": "array", "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                       "release_date": {"type": "string", "format": "date"},
                       "random_weights": {"type": "boolean",
                                          "description": "The model's weights are random: its answers mean nothing"}},
    }}},
}


# Only HTTP bodies carry the TypeSafe SDK's assets: the server turns them into images before the contract's model
# reads the request (bodies.assets_to_images).
_ASSETS = {
    "type": "object", "minProperties": 1,
    "description": "The TypeSafe SDK's assets, placeholder → image: each becomes one image after `images`, and its "
                   "placeholder `[image N]` in the request's text (never in keys, ids or types)",
    "additionalProperties": {"type": "object", "properties": {
        "type": {"const": "image"},
        "format": {"type": "string", "description": "ignored: the bytes say what the image is"},
        "data_base64": {"type": "string"},
        "part": {"type": "string", "description": "the name of the multipart part holding the bytes"}}},
}


def _json(schema: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": _REF.format(
        model=schema)}}}}


def _errors(*statuses: int) -> dict:
    words = {
        401: "No or a wrong API key (with a WWW-Authenticate challenge)",
        408: "The body did not arrive in time",
        413: "The body is too large, or the record is over its token budget",
        415: "Not application/json or multipart/form-data, or an unsupported Content-Encoding",
        421: "The Host header names another server (only with an allowed-hosts list: DNS rebinding)",
        429: "The model's queue is full; retry after Retry-After seconds",
        503: "No model loaded yet, or no answer within the server's deadline",
    }
    return {str(status): _json("ErrorBody", words[status]) for status in statuses}


@functools.cache
def document() -> dict:
    """The OpenAPI document (built once; the models do not change while the process runs)."""
    _, top = models_json_schema(
        [(protocol.SystemOneRequest, "validation"), (protocol.SystemOneResponse, "serialization"),
         (protocol.ValidationErrorBody, "serialization"), (ErrorBody, "serialization"), (Health, "serialization")],
        ref_template=_REF,
    )
    schemas = dict(top.get("$defs", {}))
    schemas["Models"] = _MODELS
    schemas["SystemOneRequest"]["properties"]["assets"] = _ASSETS
    bearer: list[dict[str, list]] = [{"bearer": []}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "Clef System One API", "version": "1",
                 "description": "Jev / System One–compatible decisions from a resident Clef model."},
        "paths": {
            "/v1/systemone": {"post": {
                "summary": "Answer the questions about one record",
                "description": "A JSON body (application/json), or multipart/form-data with a `request` part "
                               "holding it and one part per asset. TypeSafe `assets` become images; their "
                               "placeholders are replaced in text only. gzip or zstd Content-Encoding.",
                "security": bearer,
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model="SystemOneRequest")}},
                    "multipart/form-data": {"schema": {"type": "object", "required": ["request"], "properties": {
                        "request": {"$ref": _REF.format(model="SystemOneRequest")}}}},
                }},
                "responses": {"200": _json("SystemOneResponse", "The answers"),
                              "422": _json("ValidationErrorBody", "Every problem of the request, with its location"),
                              **_errors(401, 408, 413, 415, 421, 429, 503)},
            }},
            "/v1/models": {"get": {"summary": "The resident model and its alias", "security": bearer,
                                   "responses": {"200": _json("Models", "The models"), **_errors(401, 421, 503)}}},
            "/health": {"get": {"summary": "Whether a model is loaded (no key needed)", "security": [],
                                "responses": {"200": _json("Health", "Ready"), "503": _json("Health", "Loading"),
                                              **_errors(421)}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "security": bearer, "responses": {
                "200": {"description": "Prometheus text exposition", "content": {"text/plain": {}}},
                **_errors(401, 421)}}},
        },
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "Only when the server has an API key"}}},
    }


def docs_page(doc: dict) -> str:
    """The document as one HTML page: routes with their answers, then every schema."""
    parts = [f"<h1>{escape(doc['info']['title'])}</h1><p>{escape(doc['info']['description'])} "
             "The machine-readable document is at <a href='/openapi.json'>/openapi.json</a>.</p>"]
    for path, methods in doc["paths"].items():
        for method, operation in methods.items():
            parts.append(f"<h2><code>{method.upper()} {escape(path)}</code></h2><p>{escape(operation['summary'])}</p>")
            if operation.get("description"):
                parts.append(f"<p>{escape(operation['description'])}</p>")
            body = operation.get("requestBody", {}).get("content", {})
            if body:
                parts.append("<p>Body: " + ", ".join(f"<code>{escape(kind)}</code>" for kind in body) + "</p>")
            rows = "".join(f"<tr><td>{status}</td><td>{escape(answer['description'])}</td><td>{_schema_link(answer)}"
                           "</td></tr>" for status, answer in operation["responses"].items())
            parts.append(f"<table><tr><th>Status</th><th>Meaning</th><th>Body</th></tr>{rows}</table>")
    parts.append("<h2>Schemas</h2>")
    for name, schema in doc["components"]["schemas"].items():
        parts.append(f"<h3 id='{escape(name)}'>{escape(name)}</h3><pre>{escape(json.dumps(schema, indent=2))}</pre>")
    style = ("body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}"
             "pre{background:#f5f5f5;padding:.5rem;overflow:auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:.2rem .5rem;text-align:left}")
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{escape(doc['info']['title'])}</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>")


def _schema_link(answer: dict[str, Any]) -> str:
    names = [c["schema"]["$ref"].rsplit("/", 1)[-1] for c in answer.get("content", {}).values() if "schema" in c]
    return f"<a href='#{escape(names[0])}'>{escape(names[0])}</a>" if names else ""
