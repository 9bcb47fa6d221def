"""Prefix affinity, kvgate's default policy: one cost, one bound and one tie-break.

For every request the policy asks each eligible replica one question: how many
prompt tokens would this request wait behind there, and add? (NVIDIA Dynamo's
KV router asks the same.)

    cost(r) = queued(r) + uncached(r) + in_flight(r) x (uncached(r) - min uncached + typical)
                                                  in prompt tokens

* ``uncached(r)``: the request's prompt minus what ``r`` is believed to hold of
  it (``routing.block_index``: what this instance sent there, or saw served
  there, or was told of). Prefill is linear in these tokens, so this is the
  work the replica must do before the first token.
* ``queued(r)``: prompt work ahead of it: what this instance sent ``r`` and
  ``r`` has not prefilled yet (``routing.backlog``: drained at the fleet's
  prefill rate, and a reply proves its own prefill and all queued before it
  done), plus the requests ``r``
  reports waiting for other clients, each weighed as an average request of
  ours (their prompts are not known here; their traffic is assumed alike).
* the last term has two parts, both per request in flight at ``r``. The first
  prices the prefill a replica does only because the request did not go where
  it is warmest: every request in flight there waits for, or decodes around,
  that extra prefill (Little's law: they are the requests the extra work
  delays). The second is the decode load (Dynamo's ``decode_blocks``): each
  request in flight there is one the new one decodes beside, weighed as
  ``typical``, the prefill work of an average request of ours, the same unit
  that weighs other clients' waiting requests (one unit of load, whatever
  phase it is in). Queued prefill alone cannot see it: a replica whose
  prefills are done looks empty while it decodes for a dozen conversations,
  and new conversations filled exactly those replicas, whose follow-ups the
  bound then refused. With it a new conversation goes where fewer are
  decoding, keeping room at busy replicas for the turns of the conversations
  they hold. Where most of each prompt is warm (organisations' shared
  layers), ``typical`` is small and the term barely moves anything.
  A P/D prefill leg (``RouteRequest.prefill_only``) has no second part: its
  replica decodes nothing, and the legs in flight there are prefill work that
  ``queued`` already counts, token for token (Dynamo's prefill workers carry
  no ``decode_blocks`` either). Counted again as decode load, a typical
  request each, they sent legs to a cold replica beside a warm one with a few
  legs in flight (docs/disaggregation.md, "The prefill pick").

**The bound** (consistent hashing with bounded loads, Mirrokni, Thorup and
Zadimoghaddam): a replica takes the request only if its in-flight count stays
within ``ceil((1 + epsilon) x mean)``, the mean of what is in flight right now
with this request included: this instance's own in-flight at each replica,
exact, plus the requests of other clients (other kvgate instances included) that
the replicas last reported, spread evenly over them (``_load_view``: their
number is known, where they are by now is not). It is checked at every
decision, from the first; nothing is averaged. With one instance it holds
exactly; with several, each holds it over its own view, and the fleet can pass
it by what the others sent since the last scrape. Replicas past it go to the
back of the order (least loaded first) so that retries still have somewhere to
go. The same view prices the in-flight terms of the cost.

**The tie-break and the home.** The request's key (``routing.keys``: the
shallowest prefix that one replica can own, cut at a message end or an explicit
boundary, such as a conversation's first turn) orders the replicas by
rendezvous hashing, the same order on every instance. Of equal
costs, the replica where the request adds less prefill goes first (the fleet
does less work for the same wait), then that order.

The key's *home* (the first of that order) is how instances that share nothing
agree, so two rules make it hold:

* *presumed there*: when this instance knows of no replica holding the key, the
  home is presumed to hold the request's context (everything before its last
  message; all of a flat prompt, which marks no turns) with the chance that
  another instance sent it there: the others' share of the queues the replicas
  report, none for a lone instance; a holder known only from another
  instance's fact is presumed to hold it too;
* *leaving it costs*: a key with no known holder placed anywhere else costs, on
  top, its whole prompt times that same share: the other instances will send
  its next request home, which then prefills it all again. One next request is
  the least a key brings; the cost counts only that one.

What the cost replaced (the layers of the policy before it, deleted with their
settings; README, "Routing"): hysteresis, because a context stays where its
prefix is warm by exactly that prefix's prefill; packed homes for heavy keys and
shedding on an averaged load, because a heavy key spills exactly as far as queues
and the bound make it; the new-key placement and its fading memory, because a new
key's cost is its queue and its decode load; the index-trust EWMA and the
"clearly deeper" rule, because a deeper match elsewhere simply costs less.
What it keeps, one line each: the rendezvous order (instances that see the same
facts must pick the same replica); the home presumption (instances that share
nothing must guess alike where a conversation went); the bound (the cost prices
waiting, but only a cap guarantees no replica takes a pile-up); the optional
shared facts (``share_index``: several instances that share a Redis learn what
one learned).

``observe`` records that the serving replica now holds the whole prompt. With
``share_index``, the facts this instance learns are also told to the others
(``routing.gossip``); they enter the index like its own.

**Precise mode** (issue 16): when the request carries the token ids vLLM will
prefill (``RouteRequest.token_ids``) and a replica's KV-event stream is live
(``truth``, a ``routing.kv_events.KVEvents``), that replica's ``uncached`` is
read from the truth: prompt tokens minus the longest consecutive prefix of the
request's blocks it holds (``routing.token_keys`` over the token ids, salted
like vLLM's first block) times the block size. Every instance subscribes to
every replica, so they see the same blocks without talking; neither the
approximate index nor the home presumption is consulted for such a replica.
Replicas without a live stream keep the approximate figure, scaled to the
same token count.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from .backlog import CHARS_PER_TOKEN, Backlog
from .base import ReplicaView, RouteFeedback, RouteRequest, reported
from .block_index import BlockIndex, ReplicaBits
from .gossip import DONE, HELD, PLACED, Fact, Gossip
from .keys import PrefixInfo, PrefixKeyer, RouteKey, analyse
from .kv_events import KVEvents
from .rendezvous import Rendezvous, within_bound
from .settings import RoutingSettings

__all__ = ["PrefixAffinity"]

# Where a request was sent, in its scratch: a retry elsewhere is news for ``observe``.
_SENT = "kvgate.sent"
# Its entry among the requests in flight (precise mode).
_PENDING = "kvgate.pending"
# Its mark in the chosen replica's prefill backlog.
_MARK = "kvgate.backlog_mark"


class PrefixAffinity:
    name = "prefix_affinity"

    def __init__(self, settings: RoutingSettings | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings or RoutingSettings()
        # The key orders ties and names the home that instances sharing nothing agree on. Cut
        # at message ends and explicit boundaries only (a flat prompt, which has none, at
        # sampled positions: routing.keys): cuts inside messages too found shared layers
        # inside one message at about 80 us a request with a 4K-token system prompt, most
        # of issue 15's 100 us budget, and the index finds those blocks anyway.
        self.keyer = PrefixKeyer(self.settings, layers_inside_messages=False)
        self.index = BlockIndex(self.settings.index_capacity, self.settings.max_blocks, tails=True)
        self.bits = ReplicaBits()
        self.backlog = Backlog(clock)
        self._rate = self.settings.prefill_tokens_per_s
        self.gossip = Gossip() if self.settings.share_index else None
        self._orders = Rendezvous()
        # The mean prompt work of this instance's requests: what another client's
        # waiting request is taken to weigh.
        self._work_sum = 0.0
        # Decisions, how many left the key's home, and how many the bound decided: the
        # replica the cost preferred was past it (for metrics: how often balance overrode
        # affinity, the trade ``epsilon`` sets).
        self.decisions = 0
        self.moved = 0
        self.bound_overrides = 0
        # Precise mode's source (set by the gateway when replicas publish KV events).
        self.truth: KVEvents | None = None
        self.precise_decisions = 0

    # -- RoutingPolicy -----------------------------------------------------------------
    def prefer(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        return self._rank(request, replicas, learn=True)

    def peek(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        """``prefer`` without learning anything: what this instance would do."""
        return self._rank(request, replicas, learn=False)

    def observe(self, request: RouteRequest, feedback: RouteFeedback) -> None:
        if self.truth is not None:
            self.truth.done(request.scratch.pop(_PENDING, None), served=feedback.ok, replica=feedback.replica)
        mark = request.scratch.pop(_MARK, None)
        if mark is not None:
            self.backlog.done(mark[0], mark[1], self._rate)
        if not feedback.ok or request.scratch.get(_SENT) == feedback.replica:
            return  # nothing learned, or recorded when it was sent there
        info = analyse(request, self.settings, self.keyer.chains)
        if not info.hashes:
            return
        route = self.keyer.key_for(request, max(1, len(self.bits)), learn=False)
        bit = self.bits.bit_for(feedback.replica, self.index)
        if self.gossip is not None and not self.index.holders(route.key) >> bit & 1:
            self.gossip.note(HELD, route.key, feedback.replica)  # news to this instance, so to others
        self._hold(info, route, bit)

    def learn_remote(self, fact: Fact) -> None:
        """Apply what another instance learned (``routing.gossip``): the key is held there."""
        if fact[0] == DONE:  # ttft's: about a request's prefill, not where a key lives
            return
        key, replica = fact[1], fact[2]  # a block fact (``ttft``'s) names its key and replica too
        if self.gossip is not None:
            self.gossip.applied += 1
        self.index.add_key(key, self.bits.bit_for(replica, self.index))

    def stats(self) -> dict[str, object]:
        """For ``GET /admin/routing``: what the policy decided on its own."""
        out: dict[str, object] = {"decisions": self.decisions, "left_home": self.moved,
                                  "bound_overrides": self.bound_overrides,
                                  "index_entries": len(self.index), "precise_decisions": self.precise_decisions}
        if self.gossip is not None:
            out["shared_facts"] = {"published": self.gossip.published, "applied": self.gossip.applied,
                                   "pending": len(self.gossip)}
        return out

    # -- internals ---------------------------------------------------------------------
    def _hold(self, info: PrefixInfo, route: RouteKey, bit: int, known: int = 0) -> None:
        """Record that replica ``bit`` holds (or is about to hold) the request's prompt.

        ``known``: the blocks of it the index was just found to hold there."""
        self.index.add(info.hashes, bit, known)
        self.index.add_key(route.key, bit)

    def explain(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[dict[str, Any]]:
        """Every replica's terms, in the order ``prefer`` would give, without learning anything
        (``POST /admin/routing/explain``): the cost and its parts, in prompt tokens."""
        rows: list[dict[str, Any]] = []
        self._rank(request, replicas, learn=False, rows=rows)
        return rows

    def _rank(self, request: RouteRequest, replicas: Sequence[ReplicaView], learn: bool,
              rows: list[dict[str, Any]] | None = None) -> list[ReplicaView]:
        if len(replicas) < 2 and rows is None:
            return list(replicas)
        info = analyse(request, self.settings, self.keyer.chains)
        route = self.keyer.key_for(request, len(replicas), learn=learn)
        order = self._orders.order(route.key, replicas)
        now, waiting, share = _load_view(order)
        fits = within_bound(now, [r.weight for r in order], self.settings.epsilon)
        keys = self._keys(request)
        precise = self.truth.held(keys, [r.name for r in order]) if keys and self.truth is not None else {}
        # Decode load: every request in flight weighs a typical request of ours (module doc);
        # none beside a P/D prefill leg, which its replica does not decode.
        typical = self._typical(info, request)
        decoding = 0.0 if request.prefill_only else typical
        cost, uncached, depths = self._work(info, route, order, precise, request, now, waiting, share, typical,
                                            decoding)
        # Of equal waits, the one adding less work to the fleet; then the rendezvous order.
        ranked = sorted([(cost[i], uncached[i], i) for i in range(len(order)) if fits[i]])
        picks = [t[2] for t in ranked]
        refused = len(picks) < len(order)
        if refused:
            picks += sorted((i for i in range(len(order)) if not fits[i]), key=lambda i: (now[i], i))
        if rows is not None:
            prompt = max(uncached) if uncached else 0.0
            rows.extend({"replica": order[i].name, "cost": cost[i], "uncached": uncached[i],
                         "held": prompt - uncached[i] if prompt else 0.0, "in_flight": now[i],
                         "typical": typical, "decode_weight": decoding, "home": i == 0,
                         "rail": None if fits[i] else "bound"}
                        for i in picks)
        if learn:
            if refused and not fits[min(range(len(order)), key=lambda i: (cost[i], uncached[i], i))]:
                self.bound_overrides += 1  # the cost's choice was past the bound
            chosen = order[picks[0]]
            self._commit(request, info, route, chosen, uncached[picks[0]], order[0], depths)
            if keys and self.truth is not None:
                if chosen.name in precise:
                    self.precise_decisions += 1
                new = precise.get(chosen.name, 0.0) < len(keys)
                request.scratch[_PENDING] = self.truth.sent(chosen.name, keys, new)
        return [order[i] for i in picks]

    def _typical(self, info: PrefixInfo, request: RouteRequest) -> float:
        """The prefill a request of this instance brings, on average (before any: this one's prompt)."""
        if self.decisions:
            return self._work_sum / self.decisions
        prompt, tokens = len(info.rendered.data), request.token_ids
        return float(len(tokens)) if tokens and prompt else prompt / CHARS_PER_TOKEN

    def _keys(self, request: RouteRequest) -> list[int]:
        """The request's token-block keys, once per request; empty without token ids or truth."""
        return self.truth.request_keys(request) if self.truth is not None else []

    def _work(self, info: PrefixInfo, route: RouteKey, order: list[ReplicaView], precise: dict[str, float],
              request: RouteRequest, now: list[float], waiting: list[float], others: float,
              typical: float, decoding: float) -> tuple[list[float], list[float], dict[int, int]]:
        """Per replica, in prompt tokens: the cost, and the request's own prefill there; and the
        index's depths (blocks held, by replica bit) they were read from."""
        prompt = len(info.rendered.data)
        tokens = request.token_ids
        # With the token ids known, every figure is in real tokens: the approximate
        # index's share of the prompt is scaled to them.
        scale = len(tokens) / prompt if tokens and prompt else 1.0 / CHARS_PER_TOKEN
        block = self.truth.block_size if self.truth is not None else 0
        # Replicas known to hold the key hold its prefix (another instance may have said
        # so, without the blocks); if none is, the home is presumed to (module doc).
        holders = self.index.holders(route.key)
        # The context, what its client sent before: everything but the last message; a
        # single span marks no turns, and a prompt grows by appending, so all of it.
        spans = info.rendered.spans
        context = max(route.cut, spans[-1].start if len(spans) > 1 else info.limit)
        share = 0.0 if holders else others
        presumed = context * share
        fleet_holds = any(precise.values())
        # A key placed away from its home: the other instances send its next requests
        # home (the presumption above), where they prefill its whole prompt again; with
        # their share of the traffic, that is what leaving home costs (module doc).
        astray = prompt * scale * share if not fleet_holds else 0.0
        ahead, uncached = [], []
        depths = self.index.depths(info.hashes, (1 << len(self.bits)) - 1) if info.hashes else {}
        # Knows nothing of the request past its key: only then can another instance's fact
        # (share_index) say more than this instance's own blocks.
        blind = self.gossip is not None and max(depths.values(), default=0) * info.block <= route.cut
        queued = self.backlog.queued([r.name for r in order], [self._rate] * len(order))
        bit_of, shared, block_chars = self.bits.get, float(route.shared), info.block
        for i, r in enumerate(order):
            ahead.append(queued[i] + waiting[i] * typical + (astray if i else 0.0))
            if r.name in precise and tokens:
                # The truth: what the replica's own events say it holds of this prompt. A
                # prefix no replica holds yet is presumed at its home as in approximate mode
                # (module doc), so instances that place it before any event agree on where.
                held_tokens = precise[r.name] * block
                if i == 0 and not fleet_holds:
                    held_tokens = max(held_tokens, presumed * scale)
                uncached.append(max(0.0, len(tokens) - held_tokens))
                continue
            bit = bit_of(r.name)
            held = float(depths.get(bit, 0) * block_chars) if bit is not None else 0.0
            if bit is not None and holders >> bit & 1:
                # Known to hold the key; known by its key alone (no blocks recorded, or
                # another instance's fact where this instance knows nothing past the key:
                # a shared system prompt is no knowledge), it is presumed to hold the
                # context, as a home is.
                held = max(held, float(context) if blind or not held else float(route.cut))
            elif i == 0:
                held = max(held, presumed)
            # A wide prefix is warm wherever any of its traffic went (``RouteKey.shared``):
            # without this, the replicas this instance happened not to send it to looked
            # cold for it, and a conversation's new turns crowded the ones it did.
            held = max(held, shared)
            # Queued prefill: ours, and others' waiting requests weighed as average ones of ours (above).
            uncached.append(max(0.0, prompt - held) * scale)
        # Prefill that the best-placed replica would not need is paid once by this request
        # and once more by every request in flight where it lands: each waits for, or
        # decodes around, that extra prefill step.
        least = min(uncached)
        # Then its own prefill, and the decode load (module doc): the cost.
        cost = [a + load * (u - least) + u + load * decoding for a, u, load in zip(ahead, uncached, now)]
        return cost, uncached, depths

    def _commit(self, request: RouteRequest, info: PrefixInfo, route: RouteKey, chosen: ReplicaView,
                uncached: float, home: ReplicaView, depths: dict[int, int]) -> None:
        """What a decision teaches: the chosen replica's queue grows, and it will hold the prompt."""
        request.scratch[_MARK] = (chosen.name, self.backlog.add(chosen.name, uncached, self._rate))
        self._work_sum += uncached
        self.decisions += 1
        bit = self.bits.bit_for(chosen.name, self.index)
        if chosen is not home:
            self.moved += 1
        if self.gossip is not None and not self.index.holders(route.key):
            # A key nobody was known to hold: where it went is news even if it went home,
            # since another instance's eligible replicas (its home) may differ.
            self.gossip.note(PLACED, route.key, chosen.name)
        if info.hashes:
            self._hold(info, route, bit, depths.get(bit, 0))
            request.scratch[_SENT] = chosen.name


def _load_view(replicas: Sequence[ReplicaView]) -> tuple[list[float], list[float], float]:
    """(in flight now, others' waiting requests), per replica and unit weight, and the others' share.

    *In flight now*: this instance's own requests at each replica it knows
    exactly. The others' it knows only as the replicas last reported them, up to
    a scrape interval ago. Those waiting then are still there (queued, or started
    since). Those running then have mostly finished and been followed by others
    that no scrape has counted, so of them their number is known, not where they
    are: each replica is given the fleet's mean of them. (Read per replica, a
    stale running figure sent every instance away from the replicas that were
    busy a second ago, each to its own choice of the others: four instances
    sharing nothing kept 62-78% of one instance's hit ratio on conversations,
    90-94% with this.)

    *Others' waiting*: the replica reports running and waiting together with
    every client's; of its queue at the last scrape, this instance's share was
    ``in_flight_at_scrape``. The rest, in the proportion the replica reports
    waiting, is others' work still ahead of a new request.

    *The others' share*: of the replicas' reported queues, the part that is not
    this instance's (0 before any report).

    One pass over the replicas, each report read once: this runs for every request.
    """
    own, waiting = [], []
    total = mine = others_all = 0.0
    for r in replicas:
        queue = reported(r)
        own.append(r.in_flight / r.weight)
        if queue is None:
            waiting.append(0.0)
            continue
        others = max(0.0, queue - r.in_flight_at_scrape)  # ``others_reported``, inline: this loop is hot
        waiting.append(r.waiting * others / queue / r.weight if queue and r.waiting else 0.0)
        others_all += others / r.weight
        total += queue
        mine += min(queue, r.in_flight_at_scrape)
    running = others_all - sum(waiting)
    mean = max(0.0, running) / len(replicas) if replicas else 0.0
    share = (total - mine) / total if total > 0 else 0.0
    return [o + w + mean for o, w in zip(own, waiting)], waiting, share
