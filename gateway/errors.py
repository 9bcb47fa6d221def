"""kvgate's one error hierarchy, mapped to the route's error shape at one point.

    GatewayError                      every error a client may see
    ├── BadRequest          400       malformed JSON, wrong types, limits (param set)
    ├── Unauthorized        401       missing / unknown key
    ├── Forbidden           403       model not allowed, tenant key on admin API
    ├── NotFound            404       unknown model or route
    ├── PayloadTooLarge     413       body over the configured limit
    ├── RateLimited         429       tenant limit or every replica full (retry-after)
    ├── UpstreamError       502       replica failed or answered garbage
    ├── NoReplica           503       no healthy replica serves the model
    └── UpstreamTimeout     504       no first byte in time

Each route spells them in its protocol's shape (``ErrorShape``): OpenAI's
``{"error": {...}}`` everywhere but under /v1/messages, which uses
Anthropic's ``{"type": "error", "error": {"type", "message"}}``.

Only these messages reach clients. Anything else is an internal error: the
client gets a generic 500 with the request id, and the details stay in our
logs. Messages are written here or by the code raising them; they never
embed a key, a prompt or an upstream's raw body.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import orjson


class GatewayError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float, code: str | None = None) -> None:
        seconds = max(1, int(retry_after_s + 0.999))
        super().__init__(
            message,
            code=code,
            headers={"retry-after": str(seconds), "retry-after-ms": str(max(1, int(retry_after_s * 1000)))},
        )


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"
    code = "bad_gateway"


class NoReplica(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "no_healthy_replica"


class UpstreamTimeout(GatewayError):
    status = 504
    type = "timeout"
    code = "upstream_timeout"


def internal_error() -> GatewayError:
    return GatewayError("internal error; quote the x-request-id when reporting it", code="internal_error")


def error_payload(err: GatewayError) -> bytes:
    return orjson.dumps(err.body())


def sse_error_event(err: GatewayError) -> bytes:
    """A mid-stream failure, in the shape the OpenAI SDK raises as APIError."""
    return b"data: " + orjson.dumps(err.body()) + b"\n\n"


class ErrorShape(Protocol):
    """How one route spells kvgate's errors: a whole response body, and an event in a stream
    that already started; and the header, besides x-request-id, where its SDK looks for the
    request id. OpenAI's by default; /v1/messages uses Anthropic's
    (``gateway.apis.messages.shape.ANTHROPIC_SHAPE``)."""

    request_id_header: str | None

    def payload(self, err: GatewayError) -> bytes: ...

    def event(self, err: GatewayError) -> bytes: ...


class OpenAIShape:
    request_id_header: str | None = None

    def payload(self, err: GatewayError) -> bytes:
        return error_payload(err)

    def event(self, err: GatewayError) -> bytes:
        return sse_error_event(err)


OPENAI_SHAPE = OpenAIShape()


class ShapeByPath:
    """The shape of an error answered outside a proxy endpoint (headers too large, an unknown
    route, a wrong method): an API's own under the path prefix it claims, even for routes that
    do not exist there, OpenAI's everywhere else. The app builds it from the endpoints it serves."""

    def __init__(self, claims: Mapping[str, ErrorShape] | None = None) -> None:
        self.claims = dict(claims or {})

    def __call__(self, path: str) -> ErrorShape:
        for prefix, shape in self.claims.items():
            if path == prefix or path.startswith(prefix + "/"):
                return shape
        return OPENAI_SHAPE


def from_policy(err: Any, headers: dict[str, str] | None = None) -> GatewayError:
    """Translate a ``policies`` error or rejection at the boundary. Their messages are
    fixed strings written to be shown (no key, no prompt), so they pass as they are."""
    out = GatewayError(err.message, param=getattr(err, "param", None), code=err.code, headers=headers)
    out.status = err.status
    out.type = err.type
    retry = getattr(err, "retry_after_s", None)
    if retry is not None and "retry-after" not in out.headers:
        out.headers["retry-after"] = str(max(1, int(retry)))
    return out
