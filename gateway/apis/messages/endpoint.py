"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API on the chat hot path.

The request is the chat proxy's (tenants, salt, hygiene, routing, relay,
disconnects); what differs is only the wire: Anthropic's body rules and
``anthropic-version`` header (``validate``), its error shape and ``request-id``
header (``shape``), its stream and whole-message reading (``sse``). The body goes
upstream as the client sent it: vLLM takes ``cache_control`` on /v1/messages,
and its Messages streams always end with usage. ``count_tokens`` is never
streamed and prefills nothing, so routing learns nothing from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.proxy.context import RequestContext
from gateway.proxy.disagg import LegShape
from gateway.proxy.endpoint import ProxyEndpoint
from gateway.proxy.relay import Outcome, WholeObserver
from gateway.proxy.sse import StreamObserver

from .shape import ANTHROPIC_SHAPE
from .sse import MessagesObserver, anthropic_usage, whole_message
from .validate import upstream_headers, validate_messages

if TYPE_CHECKING:
    from gateway.runtime import Runtime

__all__ = ["MESSAGES_PATHS", "MessagesEndpoint", "observe_message"]

MESSAGES_PATHS = {"messages": "/v1/messages", "count_tokens": "/v1/messages/count_tokens"}
# The P/D prefill leg (gateway.proxy.disagg): vLLM 0.33's AnthropicMessagesRequest has no
# max_completion_tokens, and skips its thinking-budget check on a leg with do_remote_decode.
MESSAGES_LEG = LegShape({"stream": False, "max_tokens": 1}, frozenset(),
                        lambda obj: anthropic_usage(obj.get("usage")))


def observe_message(obj: dict[str, Any], outcome: Outcome) -> None:
    """A whole Anthropic ``message``: content blocks, stop_reason, its own usage."""
    msg = whole_message(obj)
    outcome.usage, outcome.text, outcome.finish_reason = msg.usage, msg.text, msg.finish_reason
    outcome.has_tool_calls = msg.has_tool_calls
    outcome.complete = msg.finish_reason is not None


class MessagesEndpoint(ProxyEndpoint):
    paths = MESSAGES_PATHS
    shape = ANTHROPIC_SHAPE
    claims = "/v1/messages"  # even a route that does not exist under it answers in Anthropic's shape
    unary = frozenset({"count_tokens"})
    prefill_legs = {"messages": MESSAGES_LEG}

    def __init__(self, endpoint: str, runtime: "Runtime") -> None:
        super().__init__(endpoint, runtime)
        self.prefills = endpoint != "count_tokens"  # counting leaves no new blocks on the replica

    def _validate(self, body: dict[str, Any], headers: dict[str, str]) -> str:
        return validate_messages(self.endpoint, body, headers, max_tokens=self.rt.settings.limits.max_tokens_ceiling)

    def _upstream_body(self, ctx: RequestContext) -> dict[str, Any]:
        return dict(ctx.body)

    def _upstream_headers(self, ctx: RequestContext) -> dict[str, str]:
        return upstream_headers(ctx.headers)

    def _observer(self, ctx: RequestContext, replica: str) -> StreamObserver:
        return MessagesObserver()

    def _whole_observer(self) -> WholeObserver | None:
        return observe_message if self.endpoint == "messages" else None
