"""vLLM's token endpoints on the REST shim: POST /tokenize, POST /detokenize, GET /version.

    POST /tokenize    {"prompt": str, "add_special_tokens": true}                       completion style
                      {"messages": [...], "add_generation_prompt": true}                 chat style
                      -> {"count", "max_model_len", "tokens", "token_strs"}  (token_strs with return_token_strs)
    POST /detokenize  {"tokens": [int]} -> {"prompt": str}
    GET  /version     {"version": splitserve's version}

Both POST endpoints count against the caller's request rate limit, and long inputs are worked on a
thread (GatewayService.tokenize_*), never on the event loop.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request

from splitserve.gateway.auth import ANONYMOUS
from splitserve.gateway.errors import GatewayError, invalid
from splitserve.gateway.rest_guard import CLIENT_ID_KEY, error_response
from splitserve.gateway.rest_models import ChatMessages, validate
from splitserve.gateway.service import GatewayService

TOKENIZE_FIELDS = frozenset(
    {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs"}
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def _version() -> str:
    try:
        return metadata.version("splitserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def _object(body: Any, fields: frozenset[str], what: str) -> dict:
    if not isinstance(body, dict):
        raise invalid(f"the {what} body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise invalid(f"unknown field {unknown[0]!r}; {what} takes {', '.join(sorted(fields))}", unknown[0])
    return body


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false, got {value!r}", name)
    return value


async def tokenize(service: GatewayService, body: Any) -> dict:
    body = _object(body, TOKENIZE_FIELDS, "/tokenize")
    service.check_model(body.get("model") or "")
    if "messages" in body:
        if "prompt" in body:
            raise invalid("give prompt or messages, not both", "messages")
        if not _flag(body, "add_generation_prompt", True):
            raise invalid(
                "add_generation_prompt=false is not supported; the template adds the prompt", "add_generation_prompt"
            )
        ids = await service.tokens.tokenize_chat(validate(ChatMessages, {"messages": body["messages"]}).turns)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise invalid(f"prompt must be a string, got {type(prompt).__name__}", "prompt")
        ids = await service.tokens.tokenize_text(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
    answer = {"count": len(ids), "max_model_len": service.registry.max_model_len, "tokens": ids, "token_strs": None}
    if _flag(body, "return_token_strs", False):
        answer["token_strs"] = [service.tokenizer.id_to_token(i) for i in ids]
    return answer


async def detokenize(service: GatewayService, body: Any) -> dict:
    body = _object(body, DETOKENIZE_FIELDS, "/detokenize")
    service.check_model(body.get("model") or "")
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise invalid("tokens must be a list of token ids", "tokens")
    return {"prompt": await service.tokens.detokenize(tokens, skip_special_tokens=False)}


def add_token_routes(app: FastAPI, service: GatewayService, read_json) -> None:
    """Register /tokenize, /detokenize and /version; `read_json(request)` reads a bounded JSON body."""

    async def run(request: Request, handler) -> Any:
        try:
            service.limiter.take_request(request.scope.get(CLIENT_ID_KEY, ANONYMOUS))
            return await handler(service, await read_json(request))
        except GatewayError as exc:
            return error_response(exc)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await run(request, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await run(request, detokenize)

    @app.get("/version")
    async def version():
        return {"version": _version()}
