"""Scheduling classes: a tenant's class, a request's own, and the value vLLM is sent. Pure.

vLLM's ``--scheduling-policy priority`` runs lower ``priority`` values first (ties
first-come). Under its default ``fcfs`` the field does nothing: vLLM's protocol
says any value but 0 is an error there (engines that enforce it answer 400;
0.33 accepts and ignores it), so kvgate sends it only to replicas configured as
``priority``. ``standard`` is 0, so a tenant of the default class never needs
the field: what a first-come replica receives is what it received before
classes existed. ``interactive`` is
below it and ``batch`` above, one step each: the scheduler compares values only,
so the size of a step means nothing.

A request may lower its class with ``x-kvgate-priority`` (a tenant's nightly job
sent as ``batch``), never raise it: the class is the operator's decision about
the tenant, and a header the client controls must not undo it. Asking for more,
or for a class that does not exist, is refused, never silently clamped, so a
client learns at once that its header does nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

from .errors import InvalidPriority

__all__ = ["CLASSES", "PRIORITY_HEADER", "TAKES_PRIORITY", "VLLM_PRIORITY", "band", "request_class"]

PRIORITY_HEADER = "x-kvgate-priority"
# Most urgent first: a class's index is its band in kvgate's queue (policies.fair_queue).
CLASSES: tuple[str, ...] = ("interactive", "standard", "batch")
VLLM_PRIORITY: Mapping[str, int] = {"interactive": -1, "standard": 0, "batch": 1}
# The routes whose vLLM request model has a ``priority`` field (chat, completions and responses
# requests; PoolingBasicRequestMixin for embeddings and the pooling routes). Not /v1/messages
# (vLLM's Anthropic request has none), tokenize or audio: there the class orders kvgate's queue only.
TAKES_PRIORITY: frozenset[str] = frozenset({"chat", "completions", "responses", "embeddings", "rerank", "score",
                                            "pooling", "classify"})


def band(cls: str) -> int:
    """The queue band of a class: 0 is served first."""
    return CLASSES.index(cls)


def request_class(tenant_class: str, header: str | None) -> str:
    """The class one request runs at: the tenant's, or the lower one its header asks for.

    Raises ``InvalidPriority`` (400) for an unknown class or one above the tenant's."""
    if header is None:
        return tenant_class
    asked = header.strip().lower()
    if asked not in VLLM_PRIORITY:
        raise InvalidPriority(f"{PRIORITY_HEADER} must be one of {', '.join(CLASSES)}.")
    if band(asked) < band(tenant_class):
        raise InvalidPriority(f"{PRIORITY_HEADER}: {asked} is above this key's class ({tenant_class}); "
                              "a request may only lower its priority.")
    return asked
