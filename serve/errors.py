"""OpenAI-style errors for the HTTP API: the exception, the FastAPI handlers, the API-key check.

Every error leaves the server as OpenAI's body with the matching status:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

    app = FastAPI()
    install_error_handlers(app)
    app.get("/v1/models", dependencies=[Depends(api_key_dependency("sk-..."))])(...)

FastAPI's own answers change with it: a body that fails validation is a 400 (not 422) naming
the field in `param` (an unknown field: "not supported"), malformed JSON a 400, an unknown route
a 404, and an unexpected exception a 500 `server_error` with a generic message and a request id
(the traceback goes to the log under that id, never to the client).
"""
from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# pydantic names the member of a union that failed in the error's location ("str",
# "list[int]", "function-after[...]"); those labels are not fields and stay out of `param`.
_TYPE_LABELS = {"str", "int", "float", "bool", "none", "list", "dict"}


class ErrorInfo(BaseModel):
    """The `error` object of an OpenAI error body."""

    message: str = Field(description="What went wrong, for a person to read.")
    type: str = Field(description="Error class: invalid_request_error, authentication_error, "
                                  "not_found_error, server_error.")
    param: str | None = Field(None, description="The request field at fault, when one is.")
    code: str | None = Field(None, description="Machine-readable code, e.g. model_not_found.")


class ErrorResponse(BaseModel):
    """An OpenAI error body."""

    error: ErrorInfo = Field(description="The error.")


class OpenAIError(Exception):
    """An error the API reports to the client as OpenAI's JSON body with `status`.

    Raise it from route code (or code routes call); `install_error_handlers` turns it into the
    response. The named constructors below give the statuses and codes OpenAI uses.
    """

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        if not 400 <= status <= 599:
            raise ValueError(f"status must be an HTTP error status (400..599), got {status}")
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """OpenAI's error body as a dict (also what a stream sends as its last event)."""
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    @classmethod
    def model_not_found(cls, model: str, served: Sequence[str] = ()) -> OpenAIError:
        known = f"; this server has {', '.join(served)}" if served else ""
        return cls(f"The model `{model}` does not exist{known}.", status=404,
                   type="invalid_request_error", param="model", code="model_not_found")

    @classmethod
    def invalid_api_key(cls, missing: bool = False) -> OpenAIError:
        msg = ("No API key provided: pass it as `Authorization: Bearer <key>`." if missing
               else "Incorrect API key provided.")
        return cls(msg, status=401, type="authentication_error", code="invalid_api_key")

    @classmethod
    def context_length_exceeded(cls, max_model_len: int, prompt_len: int, max_tokens: int | None = None,
                                param: str = "messages") -> OpenAIError:
        if max_tokens is None:
            asked = f"your prompt has {prompt_len} tokens"
        else:
            asked = (f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                     f"{max_tokens} for the completion)")
        return cls(f"This model's maximum context length is {max_model_len} tokens; however, {asked}. "
                   "Shorten the prompt or lower max_tokens.", status=400, param=param,
                   code="context_length_exceeded")

    @classmethod
    def internal(cls, request_id: str) -> OpenAIError:
        """A server fault: what a client may see of it is that it happened, and under which id the
        log holds it (log it under `request_id`)."""
        return cls(f"The server had an error while processing your request (request id {request_id}); "
                   "the details are in the server's log.", status=500, type="server_error", code="internal_error")


def log_fault(exc: BaseException, what: str) -> OpenAIError:
    """Log an unexpected exception with its traceback under a new request id; the 500 to send."""
    request_id = f"req-{secrets.token_hex(8)}"
    logger.error("%s failed (request id %s)", what, request_id, exc_info=exc)
    return OpenAIError.internal(request_id)


def require_model(model: str, served: Sequence[str]) -> None:
    """404 `model_not_found` unless `model` is one of the served names."""
    if model not in served:
        raise OpenAIError.model_not_found(model, served)


_PART_TAGS = ("text", "image_url", "video_url")  # the `type` tags of a chat message's content parts


def param_from_loc(loc: Sequence[str | int]) -> str | None:
    """A pydantic error location as an OpenAI `param`: ("body", "messages", 0, "content") ->
    "messages[0].content". Union-member labels pydantic inserts are dropped, and so is a tagged
    union's tag (it repeats the field that follows: ("image_url", "image_url", "url"))."""
    parts: list[str | int] = []
    for i, item in enumerate(loc):
        if i == 0 and item in ("body", "query", "path", "header"):
            continue
        if isinstance(item, str) and (item in _TYPE_LABELS or not item.isidentifier()):
            continue
        if parts and item == parts[-1] and isinstance(item, str):
            continue
        if item in _PART_TAGS and isinstance(loc[i - 1], int) and parts[-2:-1] == ["content"]:
            continue  # a content part's tag: ("content", 0, "text", "foo") is content[0].foo
        parts.append(item)
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or None


def _validation_error(errors: Sequence[dict]) -> OpenAIError:
    # A union reports one error per member; the one with the deepest location is the member
    # the client meant (a list with one bad part, not "should be a valid string").
    first = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        why = first.get("ctx", {}).get("error", first.get("msg", ""))
        return OpenAIError(f"We could not parse the JSON body of your request ({why}).", status=400)
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "missing" and loc in ((), ("body",)):
        return OpenAIError("The request has no JSON body.", status=400)
    param = param_from_loc(loc)
    msg = first["msg"].removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        msg = "this field is not supported by this server"
    more = f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return OpenAIError(f"{param}: {msg}{more}" if param else msg + more, status=400, param=param)


async def _on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return exc.response()


async def _on_request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    return _validation_error(exc.errors()).response()


async def _on_pydantic_validation(request: Request, exc: ValidationError) -> JSONResponse:
    # A model built inside a route (e.g. SamplingParams from a request) rejected the values:
    # the client's input, so a 400 like any other validation error.
    return _validation_error(exc.errors()).response()


async def _on_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(
        exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
    err = OpenAIError(str(exc.detail), status=exc.status_code, type=kind)
    resp = err.response()
    for k, v in (exc.headers or {}).items():
        resp.headers[k] = v
    return resp


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    return log_fault(exc, f"{request.method} {request.url.path}").response()


def install_error_handlers(app: FastAPI) -> None:
    """Make every error `app` returns an OpenAI body with the right status (see the module doc)."""
    app.add_exception_handler(OpenAIError, _on_openai_error)
    app.add_exception_handler(RequestValidationError, _on_request_validation)
    app.add_exception_handler(ValidationError, _on_pydantic_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(Exception, _on_unexpected)


def api_key_dependency(api_key: str | None) -> Callable[..., Any]:
    """A FastAPI dependency that admits only `Authorization: Bearer <api_key>`; with `api_key`
    None it admits everyone. A missing or wrong key is a 401 `invalid_api_key`.

    Declared through HTTPBearer so the OpenAPI document shows the scheme."""
    if api_key is not None and not api_key:
        raise ValueError("api_key must be a non-empty string or None")
    bearer = HTTPBearer(auto_error=False, description="The server's API key, when it has one.")

    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if api_key is None:
            return
        if credentials is None or credentials.scheme.lower() != "bearer":
            raise OpenAIError.invalid_api_key(missing=True)
        # constant-time comparison: the time to reject a key says nothing about its prefix
        if not secrets.compare_digest(credentials.credentials.encode(), api_key.encode()):
            raise OpenAIError.invalid_api_key()

    return check
