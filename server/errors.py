"""Every way a request can fail, as OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`.

`error_response` is the one mapping from an exception to a response, used by the routes and inside
SSE streams alike: nothing a client sends yields a 500 or a trace, and a bug is logged, never shown.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec
from starlette.responses import Response

from engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("kiln.server")

_encoder = msgspec.json.Encoder()


def json_response(body: msgspec.Struct, status: int = 200) -> Response:
    return Response(_encoder.encode(body), status_code=status, media_type="application/json")


def encode(body: msgspec.Struct) -> bytes:
    return _encoder.encode(body)


class APIError(Exception):
    """An error the client gets in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def response(self) -> Response:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        response = json_response(ErrorResponse(error=info), self.status)
        response.headers.update(self.headers or {})
        return response


def as_api_error(e: Exception, context: str) -> APIError:
    """The client's view of `e`; `context` says where an unexpected one happened, for the log."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), e.param)
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine core died: {e}")
    if isinstance(e, EngineOverloadedError):
        return APIError(
            429, str(e), type="rate_limit_error", code="too_many_requests", headers={"Retry-After": "1"}
        )
    logger.error("unhandled error %s", context, exc_info=e)
    return APIError(500, "internal server error")


def short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_PATH = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"^Object missing required field `([^`]*)`")


def validation_error(e: msgspec.ValidationError) -> APIError:
    """msgspec's 'Expected `int`, got `str` - at `$.messages[0].role`' -> a 400 naming the field."""
    text = str(e)
    m = _PATH.search(text)
    path = m.group(1) if m else ""
    detail = text[: m.start()] if m else text
    missing = _MISSING.match(detail)
    if missing:
        param = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return APIError(400, f"missing required field '{param}'", param)
    if not path:
        return APIError(400, f"invalid request body: {detail}")
    return APIError(400, f"invalid value for '{path}': {detail}", path)


def bad_param(e: ValueError) -> APIError:
    """SamplingParams' ValueErrors start with the field's name."""
    message = str(e)
    return APIError(400, message, getattr(e, "param", None) or (message.split(" ", 1)[0] or None))
