"""Prompt hygiene: volatile content above the cache boundary, found per request. Pure.

vLLM reuses the longest run of leading KV blocks already computed; everything
after the first differing token is recomputed. A timestamp, a request id or a
UUID in the system prompt therefore turns each request into a full prefill of
everything below it. ``analyze`` finds such items in one request body and
estimates the reuse each destroys.

What counts as "above the boundary": the messages before the final user
message, unless the caller passes a message index, or a marker string the
client placed in its prompt. Only system/developer messages are scanned by
default: earlier conversation turns are append-only (turn N+1 repeats turn N
byte for byte), so an id inside a past message costs nothing, and flagging it
would be noise. The final user message is never scanned: it is the volatile
tail by definition.

Detectors are tuned for a low false-positive rate on ordinary prose:
  * a version (1.2.3), a year ("founded in 1998"), opening hours ("9:00-17:00")
    or a bare date are not flagged unless the words just before them say
    "now" (today, current date, time, as of, ...); words like "founded",
    "cutoff", "since" or "effective" say the date is fixed and silence it;
  * a full timestamp, a weekday with a date, a UUID or a labelled request id
    is flagged wherever it appears;
  * hex and base64 runs must look random (mixed character classes that switch
    often), so identifiers like ``HTTPRequestHandler2`` pass.
Only the first item of each kind per message is reported: the earliest one
already destroys everything below it. Cross-request checks (tool order, names
that vary per user, values that turn out to be stable) are in ``hygiene_state``.

Excerpts are short (<= 40 characters), show only the words before an item and
a placeholder for the item itself; they are for the admin API, never for logs.

An application sends the same system prompt with every request, so ``analyze``
takes a memo (``policies.memo.DigestMemo``) of each text's findings and
excerpts: the scan is done once per text, later requests pay a digest. With or
without one, ``analyze`` returns the same warnings; with one it is pure in its
results, not in its cost.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Literal

import xxhash

from .memo import DigestMemo, digest, scope_seed

Kind = Literal["timestamp", "date", "uuid", "hex_id", "base64_id", "request_id", "per_user_name",
               "tool_order", "tool_key_order"]
SCANNED_ROLES = frozenset({"system", "developer"})
EXCERPT_CHARS = 40
CHARS_PER_TOKEN = 4
MAX_SCAN_CHARS = 256_000  # per request: bounds the work on enormous prompts


@dataclass(frozen=True, slots=True)
class PrefixWarning:
    kind: str
    message_index: int | None  # None for tools
    role: str  # the message's role, or "tools"
    offset: int  # characters into the message text
    excerpt: str
    tokens_lost_estimate: int
    # xxh3 of the item's value, for cross-request comparison in memory; never exported.
    fingerprint: int = field(default=0, repr=False, compare=False)

    @property
    def location(self) -> str:
        return "tools" if self.message_index is None else f"messages[{self.message_index}] ({self.role})"


# -- detectors ----------------------------------------------------------------------
_MON = r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sept?(?:ember)?" \
       r"|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
_DAY = r"(?:Mon|Tues?|Wed(?:nes)?|Thu(?:rs?)?|Fri|Sat(?:ur)?|Sun)(?:day)?"
_Y, _MM, _DD = r"(?:19|20)\d\d", r"(?:0[1-9]|1[0-2])", r"(?:0[1-9]|[12]\d|3[01])"
_HH, _MI, _ORD = r"(?:[01]\d|2[0-3])", r"[0-5]\d", r"(?:st|nd|rd|th)?"

# Words (or word pairs) in the ~40 characters before a date that say whether it is "now".
# The nearest strong or fixed word decides; weak words ("date", "time") say "now" only
# when nothing else does, so "Knowledge cutoff date: 2023-10-01" stays fixed.
# Sets of words, not one big regex: this runs for every candidate.
_FIXED_WORDS = frozenset({
    "cutoff", "cut-off", "founded", "born", "since", "established", "released", "copyright", "effective",
    "expire", "expires", "expiry", "deadline", "launch", "launched", "birthday", "anniversary", "valid from",
    "valid until", "open", "opens", "close", "closes", "hours", "updated", "published", "version"})
_NOW_WORDS = frozenset({
    "today", "tonight", "now", "current", "currently", "timestamp", "epoch", "as of", "it is", "it's",
    "generated", "this morning", "this afternoon", "this evening"})
_WEAK_NOW_WORDS = frozenset({"date", "time", "ts", "local", "utc", "gmt", "clock"})
_WORDS = re.compile(r"[a-z]+(?:['-][a-z]+)?")
_CONTEXT_CHARS = 40


def _random_mix(v: str, min_ratio: float) -> bool:
    """True when adjacent characters switch class (upper/lower/digit) often, as random ids do."""
    classes = ["u" if c.isupper() else "l" if c.islower() else "d" for c in v if c.isalnum()]
    if len(classes) < 2:
        return False
    switches = sum(a != b for a, b in pairwise(classes))
    return switches / (len(classes) - 1) >= min_ratio


def _hex_id(v: str) -> bool:
    # Random hex switches digit/letter about 47% of the time; words and numbers do not.
    return any(c.isdigit() for c in v) and any(c.isalpha() for c in v) and _random_mix(v, 0.25)


def _base64_id(v: str) -> bool:
    s = v.rstrip("=")
    return (sum(c.isupper() for c in s) >= 2 and sum(c.islower() for c in s) >= 2
            and any(c.isdigit() for c in s) and _random_mix(s, 0.45))


def _has_digit(v: str) -> bool:
    return any(c.isdigit() for c in v)


@dataclass(frozen=True, slots=True)
class _Detector:
    """One kind of volatile item, found only near literal anchors every match contains.

    Scanning a 20K-character prompt with a dozen regexes costs ~10 ms in CPython;
    finding anchors with ``str.find`` and running each regex in a small window
    around them costs well under 1 ms. ``hint`` is a cheaper test before the regex.
    """

    kind: str
    priority: int  # overlapping matches: the higher priority wins
    context: Literal["always", "now"]  # "now": needs a present-time word just before
    pattern: re.Pattern[str]
    anchors: tuple[str, ...]  # literals every match contains; () = scan long tokens instead
    back: int = 0  # how far before an anchor a match may start
    span: int = 48  # how far after an anchor a match may end
    accept: Callable[[str], bool] | None = None
    group: str | int = 0  # the group holding the volatile value
    hint: Callable[[str, int], bool] | None = None


def _digit_before(text: str, i: int) -> bool:
    return i > 0 and text[i - 1].isdigit()


def _year_before(text: str, i: int) -> bool:  # "2025-" in an ISO date
    return text[max(0, i - 4):i].isdigit()


def _hms(text: str, i: int) -> bool:  # "10:22:01": a second colon three characters on
    return _digit_before(text, i) and text[i + 3:i + 4] == ":"


def _rfc2822(text: str, i: int) -> bool:  # "Mar 2025 10:22"
    return text[i - 3:i - 2] == " " and text[i - 2:i].isdigit() and text[i - 7:i - 3].isdigit()


def _id_label_before(text: str, i: int) -> bool:  # "request_id:", "traceparent="
    before = text[max(0, i - 14):i].rstrip(" \t\"'").lower()
    return before.endswith(("id", "traceparent"))


def _epoch_after(text: str, i: int) -> bool:
    return text[i + 1:i + 4].lstrip(" \"'")[:1] == "1"


_DIGIT = re.compile(r"\d")


def _digit_near(text: str, i: int) -> bool:  # a date written with month or weekday names has digits
    return _DIGIT.search(text, max(0, i - 12), i + 24) is not None


_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_DETECTORS: tuple[_Detector, ...] = (
    _Detector("request_id", 90, "always", re.compile(
        r"(?i)\b(?:(?:x[-_])?(?:request|req|trace|span|session|sess|correlation|corr|conversation|conv|"
        r"message|msg|run|transaction|txn|invocation|interaction|turn)[ _.-]?id|traceparent)\b[\"']?\s*[:=]"
        r"\s*[\"']?(?P<v>[A-Za-z0-9][A-Za-z0-9._:/+-]{3,127})"), (":", "="), 40, 140, _has_digit, "v",
        _id_label_before),
    _Detector("timestamp", 80, "always", re.compile(
        rf"(?<![\d-]){_Y}-{_MM}-{_DD}[T ]{_HH}:{_MI}(?::{_MI}(?:[.,]\d{{1,9}})?)?(?:Z|[+-]{_HH}:?{_MI})?"
        r"(?!\d)"), ("-0", "-1"), 4, 40, hint=_year_before),
    _Detector("timestamp", 80, "always", re.compile(
        rf"\b{_DAY},?\s+\d{{1,2}}\s+{_MON}\s+{_Y}\s+{_HH}:{_MI}(?::{_MI})?(?:\s*(?:[+-]\d{{4}}|GMT|UTC))?"),
        (":",), 34, 20, hint=_rfc2822),
    _Detector("date", 70, "always", re.compile(
        rf"\b{_DAY},?\s+(?:(?:the\s+)?\d{{1,2}}{_ORD}\s+(?:of\s+)?{_MON}|{_MON}\.?\s+\d{{1,2}}{_ORD})\b"
        rf"(?:,?\s+{_Y}\b)?"), _DAYS, 0, 48, hint=_digit_near),
    _Detector("timestamp", 60, "always", re.compile(
        rf"(?<![\d:.])(?:[01]?\d|2[0-3]):{_MI}:{_MI}(?:\.\d{{1,6}})?(?![\d:])"), (":",), 2, 16, hint=_hms),
    _Detector("date", 50, "now", re.compile(
        rf"\b(?:{_MON}\.?\s+\d{{1,2}}{_ORD},?\s+{_Y}|\d{{1,2}}{_ORD}\s+(?:of\s+)?{_MON},?\s+{_Y})\b"),
        _MONTHS, 10, 32, hint=_digit_near),
    _Detector("date", 50, "now", re.compile(rf"(?<![\d-]){_Y}-{_MM}-{_DD}(?![\d-])"), ("-0", "-1"), 4, 8,
              hint=_year_before),
    _Detector("date", 50, "now", re.compile(rf"(?<![\d/])[0-3]?\d/[0-3]?\d/(?:{_Y}|\d\d)(?![\d/])"),
              ("/",), 2, 10, hint=_digit_before),
    _Detector("timestamp", 40, "now", re.compile(r"[:=]\s*[\"']?(?P<v>1[4-9]\d{8}(?:\d{3})?)(?![\d.])"),
              (":", "="), 0, 20, group="v", hint=_epoch_after),
    _Detector("timestamp", 40, "now", re.compile(
        rf"(?<![\d:.])(?:[01]?\d|2[0-3]):{_MI}(?:\s?[AaPp]\.?[Mm]\.?)?(?![\d:])"), (":",), 2, 12,
        hint=_digit_before),
    _Detector("uuid", 30, "always", re.compile(
        r"(?<![0-9A-Za-z-])[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
        r"(?![0-9A-Za-z-])"), ()),
    _Detector("hex_id", 20, "always", re.compile(
        r"(?<![0-9A-Za-z_-])(?:0x)?(?:[0-9a-f]{16,}|[0-9A-F]{16,})(?![0-9A-Za-z_-])"), (), accept=_hex_id),
    _Detector("base64_id", 10, "always", re.compile(
        r"(?<![A-Za-z0-9+/_=-])[A-Za-z0-9+/_-]{20,}={0,2}(?![A-Za-z0-9+/_=-])"), (), accept=_base64_id),
)
_TIME_KINDS = frozenset({"timestamp", "date"})
_MIN_TOKEN = 16  # ids shorter than this are not flagged unless labelled (request_id)
_MAX_MATCHES_PER_DETECTOR = 4  # enough to survive overlap resolution, bounded on hostile input


def _context(text: str, start: int) -> str | None:
    """'now', 'fixed' or None: the last context word in the characters before ``start``."""
    words = _WORDS.findall(text[max(0, start - _CONTEXT_CHARS):start].lower())
    weak = False
    for k in range(len(words) - 1, -1, -1):
        pair = words[k - 1] + " " + words[k] if k else ""
        if words[k] in _FIXED_WORDS or pair in _FIXED_WORDS:
            return "fixed"
        if words[k] in _NOW_WORDS or pair in _NOW_WORDS:
            return "now"
        weak = weak or words[k] in _WEAK_NOW_WORDS
    return "now" if weak else None


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str
    start: int
    end: int
    priority: int
    fingerprint: int


_NAMES = re.compile("|".join(_DAYS + _MONTHS))
# Bytes where every character an id can contain is "a" and all others " ": long
# runs are then found with bytes.find, far faster than a regex or str.split.
_TOKEN_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/_=-")
_TOKEN_TABLE = bytes(0x61 if b in _TOKEN_CHARS else 0x20 for b in range(256))
_TOKEN_RUN = b"a" * _MIN_TOKEN


def _positions(text: str, lit: str, cache: dict[str, list[int]]) -> list[int]:
    if lit not in cache:
        if lit in _DAYS or lit in _MONTHS:
            for name in _DAYS + _MONTHS:
                cache[name] = []
            for m in _NAMES.finditer(text):
                cache[m.group()].append(m.start())
        else:
            found, i = [], text.find(lit)
            while i >= 0:
                found.append(i)
                i = text.find(lit, i + 1)
            cache[lit] = found
    return cache[lit]


def _anchored(text: str, det: _Detector, cache: dict[str, list[int]]) -> Iterator[re.Match[str]]:
    n = len(text)
    for lit in det.anchors:
        done = -1
        for i in _positions(text, lit, cache):
            if i < done or (det.hint is not None and not det.hint(text, i)):
                continue
            m = det.pattern.search(text, max(0, i - det.back), min(n, i + det.span))
            if m is not None:
                done = m.end()
                yield m


def _long_runs(text: str) -> list[tuple[int, int]]:
    """(start, end) of every run of id characters at least _MIN_TOKEN long."""
    # latin-1 with "replace" keeps one byte per character, so offsets stay valid.
    shape = text.encode("latin-1", "replace").translate(_TOKEN_TABLE)
    out, i = [], shape.find(_TOKEN_RUN)
    while i >= 0:
        end = shape.find(b" ", i)
        end = len(shape) if end < 0 else end
        out.append((i, end))
        i = shape.find(_TOKEN_RUN, end)
    return out


def _matches(text: str, det: _Detector, cache: dict[str, list[int]],
             runs: list[tuple[int, int]]) -> Iterator[re.Match[str]]:
    if det.anchors:
        yield from _anchored(text, det, cache)
        return
    for start, end in runs:
        yield from det.pattern.finditer(text, start, end)


def _candidates(text: str) -> Iterator[Finding]:
    cache: dict[str, list[int]] = {}
    runs = _long_runs(text)
    for det in _DETECTORS:
        taken, seen = 0, set()
        for m in _matches(text, det, cache, runs):
            value = m.group(det.group).rstrip(".:")
            start = m.start(det.group)
            if start in seen or (det.accept is not None and not det.accept(value)):
                continue
            if det.kind in _TIME_KINDS:
                ctx = _context(text, m.start())
                if ctx == "fixed" or (det.context == "now" and ctx != "now"):
                    continue
            seen.add(start)
            fingerprint = xxhash.xxh3_64_intdigest(f"{det.kind}\x00{value}".encode("utf-8", "surrogatepass"))
            yield Finding(det.kind, start, start + len(value), det.priority, fingerprint)
            taken += 1
            if taken >= _MAX_MATCHES_PER_DETECTOR:
                break


def scan(text: str) -> list[Finding]:
    """Volatile items in one text: overlaps resolved by priority, first of each kind, in text order."""
    accepted: list[Finding] = []
    for f in sorted(_candidates(text), key=lambda f: (-f.priority, f.start)):
        if all(f.end <= a.start or f.start >= a.end for a in accepted):
            accepted.append(f)
    first: dict[str, Finding] = {}
    for f in sorted(accepted, key=lambda f: f.start):
        first.setdefault(f.kind, f)
    return list(first.values())


# -- request bodies -------------------------------------------------------------------
# A parsed body's messages are dicts: isinstance tries the exact type first and
# reaches the ABC's slower check only for other mappings. Same answers as Mapping alone.
_MAPPING = (dict, Mapping)


def message_text(message: Any) -> str:
    """The text a message contributes to the prompt (text parts joined by newlines)."""
    if not isinstance(message, _MAPPING):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, _MAPPING) and isinstance(p.get("text"), str)]
        return "\n".join(parts)  # type: ignore[arg-type]
    return ""


def _role(message: Any) -> str:
    role = message.get("role") if isinstance(message, _MAPPING) else None
    return role if isinstance(role, str) else ""


def prefix_texts(body: Mapping[str, Any], *, boundary: int | None = None,
                 marker: str | None = None) -> list[tuple[int, str, str]]:
    """``(index, role, text)`` of every message above the boundary, text cut at the marker if any."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    if boundary is None:  # the last user message, looked for from the end: usually the last message
        boundary = max(len(messages) - 1, 0)
        for i in range(len(messages) - 1, -1, -1):
            if _role(messages[i]) == "user":
                boundary = i
                break
    out: list[tuple[int, str, str]] = []
    for i, m in enumerate(messages[:max(boundary, 0)]):
        text = message_text(m)
        cut = text.find(marker) if marker else -1
        out.append((i, _role(m), text[:cut] if cut >= 0 else text))
        if cut >= 0:
            break
    return out


def chars_below(texts: Sequence[tuple[int, str, str]]) -> dict[int, int]:
    """For each message index: characters from its start to the boundary."""
    out: dict[int, int] = {}
    total = 0
    for i, _, text in reversed(texts):
        total += len(text)
        out[i] = total
    return out


def excerpt(text: str, start: int, kind: str) -> str:
    """A few words before ``start`` and a placeholder for the item; at most EXCERPT_CHARS."""
    label = f"\u2039{kind}\u203a"
    room = EXCERPT_CHARS - len(label) - 1
    before = re.sub(r"\s+", " ", text[max(0, start - 2 * room):start])
    if len(before) > room:
        before = "\u2026" + before[-(room - 1):]
    return before + label


# A text's findings with their excerpts: what the memo keeps, and all a warning needs of the text.
Findings = tuple[tuple[Finding, str], ...]


def findings(text: str) -> Findings:
    """``scan(text)``, each finding with its excerpt."""
    return tuple((f, excerpt(text, f.start, f.kind)) for f in scan(text))


def scan_memo(capacity: int = 4096) -> DigestMemo[Findings]:
    """A memo for ``analyze``. 4096 texts hold every distinct system prompt of a busy fleet's
    tenants at well under 1 KB each: a text has at most one finding per kind (six), each a
    few ints and a 40-character excerpt; most have none."""
    return DigestMemo(capacity)


def analyze(body: Mapping[str, Any], *, boundary: int | None = None, marker: str | None = None,
            roles: frozenset[str] = SCANNED_ROLES, memo: DigestMemo[Findings] | None = None,
            scope: str = "") -> list[PrefixWarning]:
    """Volatile items above the boundary of a chat request, earliest first.

    ``tokens_lost_estimate`` is the characters from the item to the boundary / 4:
    the prompt tokens that can no longer be reused from cache because of it.
    ``memo`` keeps each text's ``findings`` for the next request that sends it;
    ``scope`` (the tenant's cache namespace) keys them too: a hit is ~100x faster
    than a scan, so a text's entry is never shared across namespaces, where its
    timing would tell one tenant what prompt another sends.
    """
    texts = prefix_texts(body, boundary=boundary, marker=marker)
    below = chars_below(texts)
    budget = MAX_SCAN_CHARS
    seed = scope_seed(scope) if memo is not None else 0
    warnings: list[PrefixWarning] = []
    for i, role, text in texts:
        if role not in roles or not text:
            continue
        if budget <= 0:
            break
        scanned = text[:budget]  # beyond the budget: unscanned, never slow
        budget -= len(scanned)
        # The excerpt of a finding reads only characters before it: the same in ``scanned`` and ``text``.
        found = findings(scanned) if memo is None else memo.get(digest(scanned, seed), findings, scanned)
        for f, shown in found:
            lost = (below[i] - f.start) // CHARS_PER_TOKEN
            warnings.append(PrefixWarning(f.kind, i, role, f.start, shown, lost, f.fingerprint))
    return warnings


def warning_kinds(warnings: Iterable[PrefixWarning]) -> list[str]:
    """Distinct kinds, sorted: the value of ``x-kvgate-prefix-warning``."""
    return sorted({w.kind for w in warnings})
