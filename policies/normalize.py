"""Deterministic tool schemas, so equal tool sets render to equal prompt bytes. Pure.

Chat templates render tools with ``tojson``, which keeps the key order of the
parsed request. Two clients (or one client across two runs of a dict-ordering
code path) sending the same schema with keys in another order produce different
prompt text and lose all prefix-cache reuse from the tools onwards.

What ``normalize_tools`` changes, and why it is safe:
  * object keys are sorted at every depth of each tool: JSON objects are
    unordered by specification, so no schema validator can tell the difference;
  * integral floats (``1.0``) become integers (``1``): equal JSON numbers that
    ``tojson`` would render differently;
  * list order is kept everywhere (``enum`` and ``required`` order may carry
    meaning for the model, and lists are ordered by specification);
  * the order of the tools themselves is kept unless ``sort_tools`` is set.
    Some models weigh earlier tools more, and some clients order tools on
    purpose, so reordering is an explicit per-tenant opt-in (by function name,
    stable for equal names).
Property order inside ``parameters.properties`` does change when keys are
sorted; models may see arguments in another order. That is the trade the
tenant opts into with ``normalize_tools``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from .memo import DigestMemo

_MAX_EXACT_INT = 2**53  # beyond this a float is not an exact integer in JSON consumers
_TOOL_FIELDS = ("tools", "functions")  # "functions" is the legacy OpenAI field


def canonical(value: Any) -> Any:
    """``value`` with object keys sorted at every depth and integral floats as ints."""
    if isinstance(value, dict):
        return {k: canonical(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [canonical(v) for v in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < _MAX_EXACT_INT:
        return int(value)
    return value


def tool_name(tool: Any) -> str:
    if not isinstance(tool, Mapping):
        return ""
    fn = tool.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else tool.get("name")
    return name if isinstance(name, str) else ""


def sort_by_name(tools: Sequence[Any]) -> list[Any]:
    return sorted(tools, key=tool_name)


def normalize_tools(body: Mapping[str, Any], *, sort_tools: bool = False) -> dict[str, Any]:
    """A shallow copy of ``body`` with canonical ``tools`` / ``functions``; the input is untouched.

    Idempotent, and insensitive to key order (and to tool order with ``sort_tools``).
    Non-list values are left for request validation to reject.
    """
    out = dict(body)
    for field in _TOOL_FIELDS:
        tools = out.get(field)
        if not isinstance(tools, list):
            continue
        normalized = [canonical(t) for t in tools]
        out[field] = sort_by_name(normalized) if sort_tools else normalized
    return out


@dataclass(frozen=True, slots=True)
class ToolFingerprints:
    """Three hashes of one tool list, to tell which kind of nondeterminism changed it.

    raw:       as sent (after JSON parsing: whitespace outside strings never matters)
    ordered:   keys sorted, tools in the order sent
    canonical: keys sorted, tools sorted by name
    Same canonical but different ordered: the tools were reordered.
    Same ordered but different raw: the key order changed.
    (Number formatting, 1.0 vs 1, makes a different canonical: not classified.)
    """

    raw: int
    ordered: int
    canonical: int
    chars: int  # length of the rendered JSON, for loss estimates


def _dumps(value: Any, sort_keys: bool = False) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else 0)
    except TypeError:  # integers beyond 64 bits: valid JSON orjson will not write
        return json.dumps(value, sort_keys=sort_keys, separators=(",", ":"), default=str).encode()


def _fingerprints(args: tuple[Sequence[Any], bytes]) -> ToolFingerprints:
    tools, raw = args
    ordered = xxhash.xxh3_64_intdigest(_dumps(tools, sort_keys=True))
    full = xxhash.xxh3_64_intdigest(_dumps(sort_by_name(tools), sort_keys=True))
    return ToolFingerprints(xxhash.xxh3_64_intdigest(raw), ordered, full, len(raw))


def tool_fingerprints(tools: Sequence[Any], memo: DigestMemo[ToolFingerprints] | None = None,
                      seed: int = 0) -> ToolFingerprints:
    """Fingerprints of a tool list; C-speed (orjson), as this runs on every request with tools.

    All three are functions of the raw JSON (the bytes of a parsed document determine
    it), so with ``memo`` a tool list sent again costs one ``orjson.dumps`` and a
    digest, not three dumps and a sort; ``seed`` keeps one tenant's entries apart
    from another's. The result is the same with or without a memo.
    """
    raw = _dumps(tools)
    if memo is None:
        return _fingerprints((tools, raw))
    return memo.get(xxhash.xxh3_128_intdigest(raw, seed), _fingerprints, (tools, raw))
