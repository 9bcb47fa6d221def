"""Fault injection: the ways a real replica misbehaves, switchable at start or at run time.

Every gateway failure path (retry, failover, circuit breaking, broken-stream
handling, timeouts) needs a replica that fails on demand. Stall durations are
wall-clock seconds and are NOT multiplied by ``time_scale``: they exist to
trip the gateway's timeouts, which are wall-clock too.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import orjson

from vllm_sim.wire import error_body

__all__ = ["Faults", "Verdict", "decide", "fault_reply"]

_HTML = b"<!doctype html><html><head><title>Welcome</title></head><body><h1>It works!</h1></body></html>\n"

Verdict = Literal["html", "rate_limit", "error"] | None


@dataclass(slots=True)
class Faults:
    # Fraction of generation/embedding requests answered ``error_status`` before any byte.
    error_rate: float = 0.0
    error_status: int = 500
    # Fraction answered 429 with ``retry-after: 1``.
    rate_limit_rate: float = 0.0
    # Sleep after the response headers, before the first token.
    stall_before_first_token_s: float = 0.0
    # Sleep once after ``stall_after_tokens`` tokens have been sent.
    stall_mid_stream_s: float = 0.0
    stall_after_tokens: int = 1
    # Drop the TCP connection after this many tokens (mid-body, no [DONE]).
    die_after_tokens: int | None = None
    # Emit a malformed SSE event after the first token (non-streaming: a malformed JSON body).
    garbage: bool = False
    # Answer 200 text/html, as a misconfigured ingress or captive portal does.
    html_200: bool = False
    # GET /health answers 503.
    unhealthy: bool = False
    # The KV event PUB socket loses every batch (the replay buffer still keeps them).
    kv_events_drop: bool = False
    # Each KV event batch is sent this long after its step ended (in order): events arriving late.
    kv_events_delay_s: float = 0.0

    @classmethod
    def from_json(cls, data: Any) -> Faults:
        """Build from a JSON object; unknown keys or bad values raise ValueError naming the field."""
        if not isinstance(data, dict):
            raise ValueError("faults must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown fault fields: {', '.join(unknown)}")
        faults = cls(**data)
        faults.validate()
        return faults

    def validate(self) -> None:
        for name in ("error_rate", "rate_limit_rate"):
            value = getattr(self, name)
            if not _is_number(value) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a number in [0, 1]")
        if not isinstance(self.error_status, int) or not 400 <= self.error_status <= 599:
            raise ValueError("error_status must be an integer in [400, 599]")
        for name in ("stall_before_first_token_s", "stall_mid_stream_s", "kv_events_delay_s"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0:
                raise ValueError(f"{name} must be a number >= 0")
        if not isinstance(self.stall_after_tokens, int) or self.stall_after_tokens < 0:
            raise ValueError("stall_after_tokens must be an integer >= 0")
        die = self.die_after_tokens
        if die is not None and (not isinstance(die, int) or isinstance(die, bool) or die < 0):
            raise ValueError("die_after_tokens must be null or an integer >= 0")
        for name in ("garbage", "html_200", "unhealthy", "kv_events_drop"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def decide(faults: Faults, rng: random.Random) -> Verdict:
    """Which whole-response fault, if any, this request gets (checked before any work)."""
    if faults.html_200:
        return "html"
    if faults.rate_limit_rate and rng.random() < faults.rate_limit_rate:
        return "rate_limit"
    if faults.error_rate and rng.random() < faults.error_rate:
        return "error"
    return None


def fault_reply(verdict: Verdict, faults: Faults) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Status, headers (content-type first) and body answering a request with ``verdict``."""
    if verdict == "html":
        return 200, [(b"content-type", b"text/html; charset=utf-8")], _HTML
    json_type = (b"content-type", b"application/json")
    if verdict == "rate_limit":
        body = error_body("Rate limit exceeded (simulated).", "RateLimitError", None, 429)
        return 429, [json_type, (b"retry-after", b"1")], orjson.dumps(body)
    status = faults.error_status
    body = error_body("Internal server error (simulated).", "InternalServerError", None, status)
    return status, [json_type], orjson.dumps(body)
