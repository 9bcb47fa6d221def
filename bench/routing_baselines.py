"""Peer routers, implemented from their published descriptions, behind kvgate's RoutingPolicy.

All three see exactly what kvgate sees (the request body and the replica views)
and hash the same canonical byte stream (``routing.hashing``), so differences
come from the decision rules, not from parsing.

* ``SGLangCacheAware`` (sgl-model-gateway ``cache_aware``, defaults
  cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5):
  an approximate radix tree of routed text per worker; if the router's own
  in-flight counts are imbalanced (max - min > abs and max > rel x min), the
  least-loaded worker; else the worker with the longest prefix match if the
  matched fraction exceeds the threshold, else the least-loaded worker; the
  text is then inserted into the chosen worker's tree. The tree is kept at
  64-character granularity (matches are quantised to 64 characters) and its
  size cap (2^26 characters per worker) is never reached in these runs.
* ``LLMDScorers`` (llm-d inference scheduler, approximate prefix mode):
  blocks of 64 characters (16 tokens x 4), chained xxhash seeded by model and
  salt, at most 256 blocks; an LRU index of blocks per pod (31,250 each);
  score = 3 x prefix (matched leading blocks / blocks) + 2 x queue
  ((max - waiting) / (max - min) over pods) + 2 x (1 - KV usage); the pod with
  the highest score (random among ties); the chosen pod's blocks are recorded
  at routing time.
* ``KubeAICHWBL`` (KubeAI ``PrefixHash``): key = adapter (none) + the first 100
  characters of the first user message; a ring of 256 virtual nodes per
  endpoint (xxhash64 of name + index); walk clockwise to the first endpoint
  whose in-flight + 1 <= (total in-flight + 1) / n x 1.25, else the first one.

Precise peers (issue 16), reading the replicas' KV events (``truth``, set by
``bench.routing_sim`` with ``kv_events``): ``LLMDPrecise`` (llm-d's precise
prefix scorer with its queue and KV-utilisation scorers) and
``SGLangEventDriven`` (smg's cache-aware rule over an event-fed tree).
"""

from __future__ import annotations

import bisect
import random
from collections import OrderedDict
from typing import Any, Sequence

import xxhash

from routing.base import ReplicaView, RouteFeedback, RouteRequest
from routing.hashing import chain_hashes, prefix_seed, render
from routing.token_keys import block_keys

__all__ = ["SGLangCacheAware", "LLMDScorers", "KubeAICHWBL", "LLMDPrecise", "SGLangEventDriven"]

_BLOCK = 64


def _blocks(request: RouteRequest, max_blocks: int) -> tuple[list[int], int]:
    data = render(request.endpoint, request.body).data
    return chain_hashes(data, prefix_seed(request.model, request.namespace), _BLOCK, max_blocks), len(data)


class SGLangCacheAware:
    name = "sglang_cache_aware"

    def __init__(self, threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5) -> None:
        self.threshold, self.balance_abs, self.balance_rel = threshold, balance_abs, balance_rel
        self._tree: dict[int, int] = {}  # block hash -> bitmask of workers whose tree holds it
        self._bits: dict[str, int] = {}

    def prefer(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        if not replicas:
            return []
        hashes, length = _blocks(request, 1 << 20)
        by_load = sorted(replicas, key=lambda r: (r.in_flight, r.name))
        lo, hi = by_load[0].in_flight, by_load[-1].in_flight
        chosen = by_load[0]
        bits = {r.name: self._bits.setdefault(r.name, len(self._bits)) for r in replicas}
        if not (hi - lo > self.balance_abs and hi > self.balance_rel * lo):
            alive = sum(1 << b for b in bits.values())
            depth, holders = self._match(hashes, alive)
            if holders and length and depth * _BLOCK / length > self.threshold:
                chosen = min((r for r in replicas if holders >> bits[r.name] & 1),
                             key=lambda r: (r.in_flight, r.name))
        flag = 1 << bits[chosen.name]
        tree = self._tree
        for h in hashes:
            tree[h] = tree.get(h, 0) | flag
        return [chosen, *(r for r in by_load if r is not chosen)]

    def _match(self, hashes: list[int], alive: int) -> tuple[int, int]:
        holders, depth = alive, 0
        tree = self._tree
        for h in hashes:
            inter = holders & tree.get(h, 0)
            if not inter:
                break
            holders, depth = inter, depth + 1
        return depth, (holders if depth else 0)

    def observe(self, request: RouteRequest, feedback: RouteFeedback) -> None:
        return None


class LLMDScorers:
    name = "llm-d"

    def __init__(self, seed: int = 0, per_pod: int = 31_250, max_blocks: int = 256) -> None:
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._per_pod, self._max_blocks = per_pod, max_blocks
        self._rng = random.Random(seed)

    def prefer(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        if not replicas:
            return []
        hashes, _ = _blocks(request, self._max_blocks)
        queues = [r.waiting or 0.0 for r in replicas]
        q_lo, q_hi = min(queues), max(queues)
        scored = []
        for r, q in zip(replicas, queues):
            lru: dict[int, None] = self._lru.get(r.name) or {}
            matched = 0
            for h in hashes:
                if h not in lru:
                    break
                matched += 1
            prefix = matched / len(hashes) if hashes else 0.0
            queue = (q_hi - q) / (q_hi - q_lo) if q_hi > q_lo else 1.0
            kv = 1.0 - (r.kv_usage or 0.0)
            scored.append((3 * prefix + 2 * queue + 2 * kv, self._rng.random(), r))
        scored.sort(key=lambda t: (-t[0], t[1]))
        chosen = scored[0][2]
        lru = self._lru.setdefault(chosen.name, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self._per_pod:
            lru.popitem(last=False)
        return [t[2] for t in scored]

    def observe(self, request: RouteRequest, feedback: RouteFeedback) -> None:
        return None


def _first_user_text(body: dict[str, Any]) -> str:
    for m in body.get("messages") or ():
        if isinstance(m, dict) and m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, str):
                return c
            if isinstance(c, list):
                return "".join(p.get("text", "") for p in c if isinstance(p, dict))
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


class KubeAICHWBL:
    name = "kubeai_chwbl"

    def __init__(self, replication: int = 256, load_factor: float = 1.25, prefix_chars: int = 100) -> None:
        self.replication, self.load_factor, self.prefix_chars = replication, load_factor, prefix_chars
        self._ring: list[tuple[int, str]] = []
        self._members: frozenset[str] = frozenset()

    def _build(self, names: frozenset[str]) -> None:
        self._ring = sorted((xxhash.xxh64_intdigest(f"{n}{i}".encode()), n)
                            for n in names for i in range(self.replication))
        self._members = names

    def prefer(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        if not replicas:
            return []
        names = frozenset(r.name for r in replicas)
        if names != self._members:
            self._build(names)
        by_name = {r.name: r for r in replicas}
        key = xxhash.xxh64_intdigest(_first_user_text(request.body)[: self.prefix_chars].encode("utf-8", "replace"))
        start = bisect.bisect_left(self._ring, (key, ""))
        total = sum(r.in_flight for r in replicas)
        order: list[ReplicaView] = []
        chosen = None
        for j in range(len(self._ring)):
            r = by_name[self._ring[(start + j) % len(self._ring)][1]]
            if r in order:
                continue
            order.append(r)
            ok = total == 0 or r.in_flight + 1 <= (total + 1) / len(replicas) * self.load_factor
            if chosen is None and ok:
                chosen = r
            if len(order) == len(replicas):
                break
        chosen = chosen or order[0]
        return [chosen, *(r for r in order if r is not chosen)]

    def observe(self, request: RouteRequest, feedback: RouteFeedback) -> None:
        return None


def _held_fraction(truth: Any, request: RouteRequest, replicas: Sequence[ReplicaView]) -> tuple[dict[str, float], int]:
    """Per replica, the share of the request's blocks its events say it holds (longest consecutive prefix)."""
    tokens = request.token_ids or []
    salt = request.body.get("cache_salt")
    keys = block_keys(tokens, truth.block_size, salt if isinstance(salt, str) else None)
    held = truth.index.held(keys, [r.name for r in replicas]) if keys else {}
    n = len(keys)
    return {name: blocks / n for name, blocks in held.items()} if n else {}, n


class LLMDPrecise:
    """llm-d's precise prefix-cache scorer: the same three scorers, the prefix one read from KV events.

    prefix = longest consecutive run of the request's blocks the pod's events
    say it holds (tier-weighted), over the request's blocks; then queue and
    KV-utilisation scorers as ``LLMDScorers``, weights 3 / 2 / 2, highest score
    (random among ties). No routing-time guess: only what the events report.
    """

    name = "llm-d precise"

    def __init__(self, seed: int = 0) -> None:
        self.truth: Any = None  # set by the fleet (bench.routing_sim.BenchTruth)
        self._rng = random.Random(seed)

    def prefer(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        if not replicas:
            return []
        share, _ = _held_fraction(self.truth, request, replicas) if self.truth is not None else ({}, 0)
        queues = [r.waiting or 0.0 for r in replicas]
        q_lo, q_hi = min(queues), max(queues)
        scored = []
        for r, q in zip(replicas, queues):
            queue = (q_hi - q) / (q_hi - q_lo) if q_hi > q_lo else 1.0
            scored.append((3 * share.get(r.name, 0.0) + 2 * queue + 2 * (1.0 - (r.kv_usage or 0.0)),
                           self._rng.random(), r))
        scored.sort(key=lambda t: (-t[0], t[1]))
        return [t[2] for t in scored]

    def observe(self, request: RouteRequest, feedback: RouteFeedback) -> None:
        return None


class SGLangEventDriven:
    """sgl-model-gateway's cache-aware rule over an event-driven tree (its KV-event mode).

    As ``SGLangCacheAware`` (balance thresholds on the router's in-flight, then
    the longest match if its rate passes 0.3, else least loaded), with the match
    read from the replicas' KV events instead of the router's own tree.
    """

    name = "sglang event-driven"

    def __init__(self, threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5) -> None:
        self.threshold, self.balance_abs, self.balance_rel = threshold, balance_abs, balance_rel
        self.truth: Any = None

    def prefer(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        if not replicas:
            return []
        by_load = sorted(replicas, key=lambda r: (r.in_flight, r.name))
        lo, hi = by_load[0].in_flight, by_load[-1].in_flight
        chosen = by_load[0]
        if not (hi - lo > self.balance_abs and hi > self.balance_rel * lo) and self.truth is not None:
            share, _ = _held_fraction(self.truth, request, replicas)
            best = max(share.values(), default=0.0)
            if best > self.threshold:
                chosen = min((r for r in replicas if share.get(r.name) == best), key=lambda r: (r.in_flight, r.name))
        return [chosen, *(r for r in by_load if r is not chosen)]

    def observe(self, request: RouteRequest, feedback: RouteFeedback) -> None:
        return None
