"""Prompt hygiene across requests: what one request cannot show, and the admin report.

``hygiene.analyze`` sees one request. Three problems only show across requests
of the same tenant, so ``HygieneTracker`` remembers a little about each:

  * tool nondeterminism: the same tool set (canonical fingerprint) sent with
    another key order ("tool_key_order") or tool order ("tool_order");
  * per-user spans: system prompts identical except for a short run of words
    (a user's name, plan or team) near the top ("per_user_name"), which splits
    one shared prefix into one per user;
  * stable values: an id or date that the per-request detectors flag but that
    recurs unchanged request after request is not volatile in practice (an
    agent id, a knowledge-cutoff date); after ``stable_after`` identical
    sightings in a row at the same place it is no longer reported.

Memory is bounded: at most ``max_tenants`` tenants (least recently seen
dropped), and per tenant ``tool_sets`` fingerprints, ``prompts`` system prompts
truncated to ``prompt_chars`` characters, and a small LRU of value slots; for
all tenants, ``tool_memo`` tool-list fingerprints. Prompt text lives only in
this memory; it is never logged nor reported (the report carries only the
short redacted excerpts of ``hygiene``).

What is per prefix costs little per request: a system prompt seen before is
recognised by the digest of its first ``prompt_chars`` characters (not compared
as text again), and a tool list's fingerprints are kept by the digest of its
JSON, per tenant, so a request that repeats its prompt and tools pays one
``orjson.dumps`` and two digests for them.

Not thread-safe: one tracker per event loop, called from the request path.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .hygiene import CHARS_PER_TOKEN, SCANNED_ROLES, PrefixWarning, chars_below, excerpt, prefix_texts
from .memo import DigestMemo, scope_seed
from .normalize import ToolFingerprints, tool_fingerprints

_PROBE = 48  # characters that must agree after a differing span
_MAX_SPAN = 40  # longest span still treated as "a name"
_NAME_CHARS = frozenset(" .-'")


@dataclass(frozen=True)
class KindReport:
    count: int
    tokens_lost_estimate: int
    examples: tuple[str, ...]


@dataclass(frozen=True)
class TenantReport:
    requests: int
    requests_with_warnings: int
    # Sum over requests of the largest loss in each (items below the first add nothing).
    tokens_lost_estimate: int
    kinds: Mapping[str, KindReport]


@dataclass(frozen=True)
class HygieneReport:
    tenants: Mapping[str, TenantReport]

    @property
    def total_tokens_lost(self) -> int:
        return sum(t.tokens_lost_estimate for t in self.tenants.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_tokens_lost_estimate": self.total_tokens_lost,
            "tenants": {
                name: {"requests": t.requests, "requests_with_warnings": t.requests_with_warnings,
                       "tokens_lost_estimate": t.tokens_lost_estimate,
                       "kinds": {k: {"count": r.count, "tokens_lost_estimate": r.tokens_lost_estimate,
                                     "examples": list(r.examples)} for k, r in sorted(t.kinds.items())}}
                for name, t in sorted(self.tenants.items())
            },
        }


@dataclass
class _KindStats:
    count: int = 0
    tokens_lost: int = 0
    examples: list[str] = field(default_factory=list)


@dataclass
class _TenantState:
    seed: int  # keys this tenant's entries in the shared tool memo
    tools: OrderedDict[int, tuple[int, int]] = field(default_factory=OrderedDict)
    prompts: deque[tuple[int, str]] = field(default_factory=deque)
    slots: OrderedDict[tuple[str, int | None], tuple[int, int]] = field(default_factory=OrderedDict)
    kinds: dict[str, _KindStats] = field(default_factory=dict)
    requests: int = 0
    flagged: int = 0
    tokens_lost: int = 0


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix, by binary search over C-speed slice comparisons."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _widen(text: str, start: int, end: int) -> tuple[int, int]:
    """Grow [start, end) to whole words (a shared first letter must not split a name)."""
    if start == end:
        return start, end  # an insertion point: the words around it are shared, not part of it
    if text[start].isalpha():
        while start > 0 and text[start - 1].isalpha():
            start -= 1
    if text[end - 1].isalpha():
        while end < len(text) and text[end].isalpha():
            end += 1
    return start, end


def _name_like(span: str) -> bool:
    span = span.strip()
    return (0 < len(span) <= _MAX_SPAN and any(c.isalpha() for c in span) and len(span.split()) <= 4
            and all(c.isalpha() or c in _NAME_CHARS for c in span))


def differing_span(a: str, b: str) -> tuple[int, int] | None:
    """(start, end) in ``a`` of the one short name-like span where ``a`` and ``b`` differ, else None.

    Both texts must agree on everything before the span and on at least
    ``_PROBE`` characters after it (as far as both texts go).
    """
    if a == b:
        return None
    p = _common_prefix(a, b)
    for i in range(_MAX_SPAN + 1):
        probe = a[p + i:p + i + _PROBE]
        if len(probe) < _PROBE:
            return None
        j = b.find(probe, p, p + _MAX_SPAN + _PROBE)
        if j < 0:
            continue
        tail = min(len(a) - (p + i), len(b) - j)
        if a[p + i:p + i + tail] != b[j:j + tail]:
            return None
        sa, ea = _widen(a, p, p + i)
        sb, eb = _widen(b, p, j)
        if _name_like(a[sa:ea]) or (sa == ea and _name_like(b[sb:eb])):
            return sa, ea
        return None
    return None


class HygieneTracker:
    def __init__(self, *, max_tenants: int = 1024, tool_sets: int = 32, prompts: int = 4,
                 prompt_chars: int = 4096, slots: int = 64, stable_after: int = 3, examples: int = 3,
                 tool_memo: int = 4096) -> None:
        self._max_tenants = max_tenants
        self._tool_sets = tool_sets
        self._prompts = prompts
        self._prompt_chars = prompt_chars
        self._slots = slots
        self._stable_after = stable_after
        self._examples = examples
        self._tenants: OrderedDict[str, _TenantState] = OrderedDict()
        # tool_memo=0: no memo (the same results, each tool list fingerprinted in full).
        self._tool_memo: DigestMemo[ToolFingerprints] | None = DigestMemo(tool_memo) if tool_memo else None

    def _state(self, tenant: str) -> _TenantState:
        st = self._tenants.get(tenant)
        if st is None:
            st = self._tenants[tenant] = _TenantState(scope_seed(tenant), prompts=deque(maxlen=self._prompts))
            if len(self._tenants) > self._max_tenants:
                self._tenants.popitem(last=False)
        else:
            self._tenants.move_to_end(tenant)
        return st

    def observe(self, tenant: str, body: Mapping[str, Any], warnings: Sequence[PrefixWarning], *,
                boundary: int | None = None, marker: str | None = None) -> list[PrefixWarning]:
        """Filter ``warnings`` (from ``hygiene.analyze`` of the same body), add cross-request ones,
        record them for the report, and return the final list (tools first, then text order)."""
        st = self._state(tenant)
        texts = prefix_texts(body, boundary=boundary, marker=marker)
        below = chars_below(texts)
        above_total = below[texts[0][0]] if texts else 0
        out = [w for w in warnings if not self._stable(st, w)]
        tools = body.get("tools")
        if isinstance(tools, list) and tools:
            out.extend(self._tool_warnings(st, tools, above_total))
        name = self._name_warning(st, texts, below)
        if name is not None:
            out.append(name)
        out.sort(key=lambda w: (w.message_index is not None, w.message_index or 0, w.offset))
        self._record(st, out)
        return out

    def _stable(self, st: _TenantState, w: PrefixWarning) -> bool:
        """Count identical sightings in a row at one place; True once the value looks fixed."""
        slot = (w.kind, w.message_index)
        last, streak = st.slots.get(slot, (None, 0))
        streak = streak + 1 if last == w.fingerprint else 1
        st.slots[slot] = (w.fingerprint, streak)
        st.slots.move_to_end(slot)
        if len(st.slots) > self._slots:
            st.slots.popitem(last=False)
        return streak > self._stable_after

    def _tool_warnings(self, st: _TenantState, tools: list[Any], above: int) -> list[PrefixWarning]:
        fp = tool_fingerprints(tools, self._tool_memo, st.seed)
        previous = st.tools.get(fp.canonical)
        st.tools[fp.canonical] = (fp.ordered, fp.raw)
        st.tools.move_to_end(fp.canonical)
        if len(st.tools) > self._tool_sets:
            st.tools.popitem(last=False)
        if previous is None:
            return []
        lost = (fp.chars + above) // CHARS_PER_TOKEN
        if previous[0] != fp.ordered:
            return [PrefixWarning("tool_order", None, "tools", 0, "tools reordered between requests", lost)]
        if previous[1] != fp.raw:
            return [PrefixWarning("tool_key_order", None, "tools", 0, "tool JSON keys reordered", lost)]
        return []

    def _name_warning(self, st: _TenantState, texts: list[tuple[int, str, str]],
                      below: dict[int, int]) -> PrefixWarning | None:
        first = next(((i, role, t) for i, role, t in texts if role in SCANNED_ROLES and t), None)
        if first is None:
            return None
        index, role, full = first
        text = full[:self._prompt_chars]
        digest = xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))
        found = None
        if all(h != digest for h, _ in st.prompts):
            for _, other in reversed(st.prompts):
                span = differing_span(text, other)
                if span is not None:
                    start, end = span
                    value_fp = xxhash.xxh3_64_intdigest(text[start:end].encode("utf-8", "surrogatepass"))
                    found = PrefixWarning("per_user_name", index, role, start,
                                          excerpt(text, start, "per_user_name"),
                                          (below[index] - start) // CHARS_PER_TOKEN, value_fp)
                    break
            st.prompts.append((digest, text))
        return found

    def _record(self, st: _TenantState, warnings: list[PrefixWarning]) -> None:
        st.requests += 1
        if not warnings:
            return
        st.flagged += 1
        st.tokens_lost += max(w.tokens_lost_estimate for w in warnings)
        for w in warnings:
            ks = st.kinds.setdefault(w.kind, _KindStats())
            ks.count += 1
            ks.tokens_lost += w.tokens_lost_estimate
            if len(ks.examples) < self._examples and w.excerpt not in ks.examples:
                ks.examples.append(w.excerpt)

    def report(self, tenant: str | None = None) -> HygieneReport:
        """Counts by tenant and kind, a few redacted examples, estimated tokens of reuse lost."""
        names = [tenant] if tenant is not None else list(self._tenants)
        out = {}
        for name in names:
            st = self._tenants.get(name)
            if st is None:
                continue
            kinds = {k: KindReport(s.count, s.tokens_lost, tuple(s.examples)) for k, s in st.kinds.items()}
            out[name] = TenantReport(st.requests, st.flagged, st.tokens_lost, kinds)
        return HygieneReport(out)

    def reset(self, tenant: str | None = None) -> None:
        if tenant is None:
            self._tenants.clear()
        else:
            self._tenants.pop(tenant, None)
