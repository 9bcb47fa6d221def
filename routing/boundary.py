"""Where a request's stable prefix ends, and which cut points routing may key on.

A routing key must be (a) identical for every request that should share a
replica, and (b) fine enough that keys spread over the fleet. A conversation
grows by appending turns, so its first user turn (with everything before it)
is the deepest prefix that stays constant for its whole life: that is the
default *cap*. Clients can say more precisely where their stable layers end:

* a literal marker in the text (``RoutingSettings.boundary_marker``);
* Anthropic-style ``cache_control`` breakpoints on content parts, messages or
  tools (vLLM rejects the unknown key, so the gateway forwards the body through
  ``strip_cache_control``, and routes on the original);
* the ``x-kvgate-cache-boundary: <n>`` header: the first *n* messages are stable.

``candidate_cuts`` lists the offsets, up to the cap, where a level of the
prefix tree may end: message ends, explicit cuts and sampled block positions.
The policy (``routing.keys``) walks them shallowest first and measures how
much traffic shares each prefix, so a global system prompt in every request
spreads over every replica while a conversation, an organisation or a digital
twin still keys on something it keeps for all its requests.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any, Sequence

from .hashing import Rendered, Span

__all__ = ["explicit_cuts", "marker_ends", "default_cap", "stable_cap", "candidate_cuts", "strip_cache_control",
           "parse_boundary_hint"]

# Anthropic allows four breakpoints; a few more leave room for markers and the header.
_MAX_EXPLICIT = 8


def parse_boundary_hint(hint: str | None) -> int | None:
    """``x-kvgate-cache-boundary`` as a message count; anything else is ignored, never an error."""
    if hint is None:
        return None
    text = hint.strip()
    if not text.isdigit() or len(text) > 6:
        return None
    return int(text)


def _message_spans(rendered: Rendered) -> list[Span]:
    return [s for s in rendered.spans if s.role != "tools"]


def marker_ends(data: bytes, needle: bytes, start: int = 0) -> list[int]:
    """Offsets just past each occurrence of ``needle`` in ``data`` from ``start`` (at most a few)."""
    out: list[int] = []
    if not needle:
        return out
    at = data.find(needle, start)
    while at >= 0 and len(out) < _MAX_EXPLICIT * 2:
        out.append(at + len(needle))
        at = data.find(needle, at + len(needle))
    return out


def explicit_cuts(rendered: Rendered, marker: str, hint: str | None, ends: Sequence[int] | None = None) -> list[int]:
    """Client-declared boundaries (marker ends, breakpoints, header), sorted, deduplicated.

    ``ends``: the marker's ends in the stream when already known (``marker_ends``)."""
    found: Sequence[int] = ()
    if marker:
        found = marker_ends(rendered.data, marker.encode("utf-8", "surrogatepass")) if ends is None else ends
    if not found and not rendered.breakpoints and hint is None:
        return []  # most requests declare nothing
    cuts: set[int] = set(rendered.breakpoints)
    cuts.update(found)
    n = parse_boundary_hint(hint)
    if n is not None:
        messages = _message_spans(rendered)
        if 0 < n <= len(messages):
            cuts.add(messages[n - 1].end)
        elif n == 0 and rendered.spans and rendered.spans[0].role == "tools":
            cuts.add(rendered.spans[0].end)
    return sorted(c for c in cuts if c > 0)[:_MAX_EXPLICIT]


def default_cap(rendered: Rendered) -> tuple[int, int]:
    """(start, end) of the span holding the cap: the first user turn, else the whole stream.

    Everything before the first user message (tools, system and developer
    messages) plus that message stays constant as a conversation grows.
    """
    for span in rendered.spans:
        if span.role == "user":
            return span.start, span.end
    if rendered.spans:
        last = rendered.spans[-1]
        return last.start, last.end
    return 0, len(rendered.data)


def stable_cap(rendered: Rendered, explicit: list[int]) -> int:
    """Where the prefix a request keeps for life ends: the first user turn, or a deeper explicit cut.

    A breakpoint deeper than the first user turn (the common Anthropic pattern
    marks the newest message) extends the cap; levels there are only reached
    when everything shallower is hot.
    """
    _, cap = default_cap(rendered)
    return max(cap, explicit[-1]) if explicit else cap


def candidate_cuts(
    rendered: Rendered, explicit: list[int], limit: int, block: int, positions: Sequence[int], after: int = 0
) -> list[int]:
    """Offsets a routing level may end at, ascending, up to the cap.

    Message ends and explicit cuts are exact layer boundaries; the sampled
    block positions (dense near the root, eight per doubling of depth, as the
    block index samples them) find boundaries nobody declared, such as where
    one organisation's policies end inside a long system prompt. ``limit`` is
    the number of bytes covered by hashes (``max_blocks``). Only cuts past ``after``.
    """
    cap = min(stable_cap(rendered, explicit), limit)
    cuts = {s.end for s in rendered.spans if after < s.end <= cap}
    cuts.update(c for c in explicit if after < c <= cap)
    for p in positions[bisect_right(positions, after // block - 1): bisect_right(positions, cap // block - 1)]:
        cuts.add((p + 1) * block)
    if cap > after:
        cuts.add(cap)
    cuts.discard(0)
    return sorted(cuts)


def _strip_parts(content: Any) -> tuple[Any, bool]:
    if not isinstance(content, list):
        return content, False
    changed = False
    out = []
    for part in content:
        if isinstance(part, dict) and "cache_control" in part:
            part = {k: v for k, v in part.items() if k != "cache_control"}
            changed = True
        out.append(part)
    return (out, True) if changed else (content, False)


def _strip_list(items: Any, inner: bool) -> tuple[Any, bool]:
    if not isinstance(items, list):
        return items, False
    changed = False
    out = []
    for item in items:
        if isinstance(item, dict):
            new = item
            if "cache_control" in item:
                new = {k: v for k, v in item.items() if k != "cache_control"}
            if inner:
                content, parts_changed = _strip_parts(new.get("content"))
                if parts_changed:
                    new = {**new, "content": content}
            if new is not item:
                changed = True
            item = new
        out.append(item)
    return (out, True) if changed else (items, False)


def strip_cache_control(body: dict[str, Any]) -> dict[str, Any]:
    """The body without ``cache_control`` keys (on content parts, messages and tools).

    vLLM's request schema forbids unknown keys on content parts, so the gateway
    forwards this and routes on the original body. Pure: the input is never
    mutated; when there is nothing to strip the same object is returned.
    """
    messages, m_changed = _strip_list(body.get("messages"), inner=True)
    tools, t_changed = _strip_list(body.get("tools"), inner=False)
    if not (m_changed or t_changed):
        return body
    out = dict(body)
    if m_changed:
        out["messages"] = messages
    if t_changed:
        out["tools"] = tools
    return out
