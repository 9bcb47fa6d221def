"""Chat requests for routing tests: a conversation at any turn, optionally behind a system prompt."""

from __future__ import annotations

from routing import RouteRequest


def conversation(c: int, turns: int = 1, system: str | None = None, filler: str = "hello ",
                 namespace: str = "t") -> RouteRequest:
    """Conversation ``c`` at turn ``turns``: the same first user turn, then short answers and questions."""
    msgs = [{"role": "system", "content": system}] if system else []
    msgs += [{"role": "user", "content": f"conversation {c}: " + filler * 30}]
    for i in range(1, turns):
        msgs += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"more {i}"}]
    return RouteRequest("chat", "m", namespace, {"model": "m", "messages": msgs})
