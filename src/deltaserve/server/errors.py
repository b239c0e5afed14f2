"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause leaves the server as one of these, so the official ``openai``
client raises its typed exception (``BadRequestError``, ``NotFoundError``, ...)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltaserve.core.errors import InputError

log = logging.getLogger("deltaserve.server")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def not_found(kind: str, ident: str, param: str | None = None) -> APIError:
    return APIError(404, f"No such {kind}: '{ident}'", param=param,
                    code=f"{kind.replace(' ', '_')}_not_found")


def from_input_error(e: InputError, *, param_prefix: str | None = None) -> APIError:
    """A validation error of the project's loaders: ``message`` keeps the line, ``param`` names
    the field (prefixed by the request parameter it came through, if given)."""
    param = f"{param_prefix}.{e.field}" if param_prefix else e.field
    return APIError(400, str(e), param=param, code="invalid_value")


def error_body(status: int, message: str, param: str | None, code: str | None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(InputError)
    async def _input(_: Request, e: InputError) -> JSONResponse:
        err = from_input_error(e)
        return error_response(err.status, err.message, err.param, err.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        return error_response(400, f"{param or 'request'}: {first.get('msg', 'invalid')}",
                              param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail), None, None)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("internal error")
        return error_response(500, f"internal error: {type(e).__name__}", None, "internal_error")
