"""kvgate's own errors in Anthropic's shape, so the ``anthropic`` SDK raises its usual classes.

``{"type": "error", "error": {"type", "message"}}``, the type chosen by the status
exactly as Anthropic (and vLLM's own translation) does. Mid-stream failures become
an ``event: error`` SSE event, which the SDK raises from its stream iterator. The
request id also goes out as ``request-id``, where the SDK looks for it.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import GatewayError

__all__ = ["ANTHROPIC_SHAPE", "AnthropicShape", "error_type"]

# Anthropic's error types by status (docs.anthropic.com "Errors"; vLLM 0.33's
# anthropic/protocol.py translates its own errors with the same table).
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    known = _TYPES.get(status)
    if known is not None:
        return known
    return "api_error" if status >= 500 else "invalid_request_error"


class AnthropicShape:
    """kvgate's errors in Anthropic's shape: the response body and the mid-stream SSE event."""

    request_id_header: str | None = "request-id"  # where the anthropic SDK looks for the request id

    @staticmethod
    def body(err: GatewayError) -> dict[str, Any]:
        # No ``param`` field here: like Anthropic's own errors, the message names the location.
        message = err.message if not err.param or err.param in err.message else f"{err.param}: {err.message}"
        return {"type": "error", "error": {"type": error_type(err.status), "message": message}}

    def payload(self, err: GatewayError) -> bytes:
        return orjson.dumps(self.body(err))

    def event(self, err: GatewayError) -> bytes:
        return b"event: error\ndata: " + orjson.dumps(self.body(err)) + b"\n\n"


ANTHROPIC_SHAPE = AnthropicShape()
