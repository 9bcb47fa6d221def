"""Prefix affinity: kvgate's default policy.

Three layers, each with one job:

1. **Key** (``routing.keys``): the shallowest prefix of the request that one
   replica can own (not carried by more than a replica's share of traffic).
   Requests that share it share a key: a conversation's turns, a tenant's
   or an organisation's requests behind a global system prompt.
2. **Order** (``routing.rendezvous``): the key's rendezvous order over the
   eligible replicas (a heavy key's packed home first, ``routing.placement``),
   with bounded load. A replica sheds (moves to the back) a hash-chosen
   fraction of the request contexts (``RouteKey.context``: one twin of an
   organisation, not the whole organisation at once) when its time-averaged
   *shared* load (scraped running + waiting) is past (1 + epsilon) x mean, and
   is skipped when its load right now (with this instance's in-flight) is past
   (1 + burst_epsilon) x mean. The averaged view is the
   same on every gateway instance, so they move a key off an overloaded
   replica together; the instantaneous check only stops a pile-up.
   A key no replica holds yet, while this instance carries all the traffic
   (``SharedLoad.alone``), is instead placed where the least prompt work is
   queued or was placed lately (``routing.backlog``), within a tighter
   ``new_key_epsilon``; its next
   requests follow it there before the index learns of it. With
   ``share_index``, instances tell each other where they placed new keys and
   which replicas hold which keys (``routing.gossip``, through Redis), so
   several instances place new keys too.
3. **Follow** (``routing.block_index``): while this instance carries all the
   traffic, a request context goes back to the replica it last sent it to,
   which loses it only past looser bounds than a newcomer (hysteresis: load
   wobbling around the bound must not move twins back and forth, each move
   paying their whole prefix). Otherwise a context served before (a twin)
   follows the replica that served it; else its key. If the
   first choice is not known to hold that prefix but another replica within
   the bound is (it spilled there under load, or membership changed), that
   replica goes first;
   if the first choice holds it, only a *clearly* deeper prefix elsewhere (at
   least ``index_min_gain_chars`` and half again deeper: a conversation that
   spilled on its last turn) moves the request. A shallower shared prefix
   elsewhere never overrides the key. This instance learned all that from its
   own traffic, so it only ever *adds* stickiness on top of the order every
   instance computes alike.

``observe`` teaches the index (the replica now holds the prompt and its key)
and tracks, per replica, how well the index predicted the replica's reported
``cached_tokens``: a replica that keeps evicting what the index believes it
holds is not followed.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from .backlog import CHARS_PER_TOKEN, Backlog, Committed, LastSent
from .base import ReplicaView, RouteFeedback, RouteRequest, load_of
from .block_index import BlockIndex
from .gossip import HELD, PLACED, Fact, Gossip
from .keys import PrefixInfo, PrefixKeyer, analyse
from .load import SharedLoad
from .placement import Placement
from .rendezvous import rendezvous_order, shed_fractions, sheds, within_bound
from .settings import RoutingSettings

__all__ = ["PrefixAffinity", "ReplicaBits"]

# A deeper match must also be this many times the first choice's depth.
_GAIN_RATIO = 1.5
# Index trust per replica: an EWMA of reported / predicted cached tokens.
_TRUST_ALPHA = 0.1
_MIN_TRUST = 0.5
MAX_REPLICA_IDS = 4096
# Contexts whose last replica is remembered (about 1 MB): a fleet's active twins and chats.
_MAX_CONTEXTS = 65_536
# Endpoints whose requests come back as longer conversations (a completions prompt does not).
_TURNS = ("chat", "responses")
# Below these many requests over the mean, a replica is never skipped: at a few
# requests per replica, such differences are Poisson noise, not imbalance.
_STEADY_FLOOR = 2.0
_BURST_FLOOR = 4.0
_NEW_KEY_FLOOR = 1.0
# A context stays where it went last until that replica is past these multiples of
# epsilon (averaged load) and burst_epsilon (load right now).
_STAY_STEADY = 2.0
_STAY_BURST = 1.5
# Past them, a replica sheds its stayers gently (10% past: about a fifth of them, where a
# newcomer's gain of 10 sheds nearly all): each one moved pays its whole prefix again.
# Twins, 8 seeds: hit .664 -> .667, TTFT p95 5.88 -> 5.57 s, max/mean at most 1.24.
_STAY_GAIN = 2.0
# Heavy keys are packed to half the load bound: room for estimate noise and bursts.
PACK_FACTOR = 0.5


def _find(items: Sequence[ReplicaView], name: str | None) -> int | None:
    """Position of the replica called ``name`` in ``items`` (None: not there)."""
    return next((i for i, r in enumerate(items) if r.name == name), None)


def _to_front(items: list[ReplicaView], i: int) -> list[ReplicaView]:
    """``items`` with the ``i``-th first; the rest keep their order."""
    return items if i == 0 else [items[i], *items[:i], *items[i + 1:]]


class ReplicaBits:
    """Small integer ids for replica names (bit positions in the block index)."""

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, name: str) -> int | None:
        return self._ids.get(name)

    def bit_for(self, name: str, index: BlockIndex) -> int:
        """``name``'s id, made on first sight. Past the id space (DNS pods coming and
        going) every id and ``index``, which is written in them, start afresh rather
        than grow without bound."""
        b = self._ids.get(name)
        if b is None:
            if len(self._ids) >= MAX_REPLICA_IDS:
                self._ids.clear()
                index.clear()
            b = self._ids[name] = len(self._ids)
        return b


class PrefixAffinity:
    name = "prefix_affinity"

    def __init__(self, settings: RoutingSettings | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings or RoutingSettings()
        self.keyer = PrefixKeyer(self.settings)
        self.index = BlockIndex(self.settings.index_capacity, self.settings.max_blocks)
        self.bits = ReplicaBits()
        self.load = SharedLoad(self.settings.load_average_s, clock)
        self.placement = Placement(self.settings.heavy_share, self.settings.epsilon * PACK_FACTOR)
        self.young = LastSent()
        self.recent = LastSent(_MAX_CONTEXTS)
        self.backlog = Backlog(self.settings.prefill_tokens_per_s, clock)
        self.committed = Committed(self.settings.placement_memory_s, clock)
        # Facts for other instances, when they share what they learn (routing.gossip).
        self.gossip = Gossip() if self.settings.share_index else None
        self._salts: dict[str, int] = {}
        self._trust: dict[str, float] = {}
        # For metrics and the benchmark: decisions, and how many the index changed.
        self.decisions = 0
        self.follows = 0

    # -- RoutingPolicy -----------------------------------------------------------------
    def prefer(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        return self._rank(request, replicas, learn=True)

    def peek(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        """``prefer`` without learning anything: what this instance would do."""
        return self._rank(request, replicas, learn=False)

    def observe(self, request: RouteRequest, feedback: RouteFeedback) -> None:
        if not feedback.ok:
            return
        info = analyse(request, self.settings, self.keyer.chains)
        if not info.hashes:
            return
        bit = self.bits.bit_for(feedback.replica, self.index)
        # The key this instance routed on (a peek if the request came another way),
        # the request's context, and for conversations their first turn (the context of its
        # next turns; a completions prompt has no turns to come back to).
        route = self.keyer.key_for(request, max(1, len(self.bits)), learn=False)
        keys = dict.fromkeys((route.key, route.context) + ((route.capped,) if request.endpoint in _TURNS else ()))
        for key in keys:
            if self.gossip is not None and not self.index.holders(key) >> bit & 1:
                self.gossip.note(HELD, key, feedback.replica)  # news to this instance, so to others
        self._learn_trust(info, feedback, bit)
        self.recent.put(route.context, feedback.replica)  # a retry may have served it elsewhere
        self.index.add(info.hashes, bit)
        for key in keys:
            self.index.add_key(key, bit)

    def learn_remote(self, fact: Fact) -> None:
        """Apply what another instance learned (``routing.gossip``)."""
        _, key, replica = fact
        if self.gossip is not None:
            self.gossip.applied += 1
        # Either kind: a key another instance placed is, for this one, held there (its
        # prefill is under way; the next turn may come here before the answer is back).
        self.index.add_key(key, self.bits.bit_for(replica, self.index))

    def stats(self) -> dict[str, object]:
        """For ``GET /admin/routing``: what the policy decided on its own."""
        out: dict[str, object] = {"heavy_keys_packed": len(self.placement), "alone": self.load.alone(),
                                  "young_keys": len(self.young), "recent_contexts": len(self.recent)}
        if self.gossip is not None:
            out["shared_facts"] = {"published": self.gossip.published, "applied": self.gossip.applied,
                                   "pending": len(self.gossip)}
        return out

    # -- internals ---------------------------------------------------------------------
    def _rank(self, request: RouteRequest, replicas: Sequence[ReplicaView], learn: bool) -> list[ReplicaView]:
        if len(replicas) < 2:
            return list(replicas)
        if len(self._salts) > MAX_REPLICA_IDS:
            self._salts.clear()
        route = self.keyer.key_for(request, len(replicas), learn=learn)
        key, context = route.key, route.context
        order = rendezvous_order(key, replicas, self._salts)
        if learn:
            self.placement.record(key, len(replicas))
        packed = self.placement.home(key, replicas, self._salts, refresh=learn)
        if packed:
            order = _to_front(order, _find(order, packed) or 0)
        if learn:
            self.load.update(replicas)
            self.decisions += 1
        # A key may go where the load is lowest rather than where it hashes only
        # while this instance carries the replicas' traffic alone, or tells the
        # other instances where it went (``routing.gossip``): otherwise they would
        # send its next turns to the first choice. And only a key nobody is known to
        # hold yet (a new conversation, a one-off prompt): placing it elsewhere costs
        # nothing now. A heavy key is left to its packed home, which accounts for load.
        placing = self.settings.new_key_epsilon is not None and (self.load.alone() or self.gossip is not None)
        placed = placing and packed is None and not self.index.holders(key)
        # Where this instance last sent the context, while it carries all the traffic:
        # with other instances about, its own memory would make it disagree with them.
        last = self.recent.get(context) if self.load.alone() else None
        inside, over = self._bound(context, order, placed, last, self.young.get(key) if placed else None)
        info = analyse(request, self.settings, self.keyer.chains)
        again = _find(inside, last)
        if again is not None:
            inside = _to_front(inside, again)  # its answer may not be back: the index can't know
        elif placed and len(inside) > 1:
            inside = self._place(key, info, inside)
        elif len(inside) > 1:
            # A context served before (one twin of an organisation) follows where it
            # was served; a new one follows its key (where its siblings are).
            pick = self._follow(info, context if context != key and self.index.holders(context) else key, inside)
            if pick and learn:
                self.follows += 1
            inside = _to_front(inside, pick)
        ranked = inside + over
        if learn:
            # Tracked on every decision, not only while alone: the instance drifts in
            # and out of that state, and a backlog missing those requests misplaces
            # the next new key (twin workload: hit .627 -> .616, p95 7.4 -> 9.1 s).
            work = self._uncached_tokens(info, ranked[0].name)
            self.backlog.add(ranked[0].name, work)
            self.recent.put(context, ranked[0].name)
            if placed:
                if self.young.get(key) != ranked[0].name:  # placed, not following its siblings
                    self.committed.add(ranked[0].name, work)
                self.young.put(key, ranked[0].name)
                if self.gossip is not None:
                    self.gossip.note(PLACED, key, ranked[0].name)
        return ranked

    def _place(self, key: int, info: PrefixInfo, inside: list[ReplicaView]) -> list[ReplicaView]:
        """A new key's order: where its earlier requests went, else the least work coming.

        A new conversation often sends several requests before the first answer
        comes back (and teaches the index): they go together. Otherwise the
        replica with the least prompt work from this instance goes first: still
        queued, plus what the new keys placed there lately will bring
        (``routing.backlog``); ties keep the rendezvous order.
        """
        home = self.young.get(key)
        at = _find(inside, home)
        if at is None:
            # The work placed lately counts only while this instance places all of it:
            # sharing facts, each instance would spread a quarter of the new keys
            # evenly, not the fleet's (4 instances, Mooncake: hit .257 -> .246).
            lately = self.load.alone()
            queues = [self.backlog.get(r.name) + (self.committed.get(r.name) if lately else 0.0) for r in inside]
            at = min(range(len(inside)), key=queues.__getitem__)  # the first of equals
        return _to_front(inside, at)

    def _uncached_tokens(self, info: PrefixInfo, name: str) -> float:
        """The prompt tokens ``name`` must prefill, as far as the index knows."""
        bit = self.bits.get(name)
        held = self.index.depth_of(info.hashes, bit) * info.block if bit is not None and info.hashes else 0
        return max(0, len(info.rendered.data) - held) / CHARS_PER_TOKEN

    def _bound(self, context: int, order: list[ReplicaView], placed: bool, last: str | None = None,
               young: str | None = None) -> tuple[list[ReplicaView], list[ReplicaView]]:
        """(replicas that may take the request, in ``order``; the rest, least loaded now first).

        An overloaded replica sheds a hash-chosen fraction of request *contexts*:
        every instance sheds the same ones, and a heavy key (an organisation)
        overflows a few twins at a time, each always to the same next replica.
        ``last`` (where this instance last sent the context) is held to looser
        bounds; ``young`` (where a new key's first requests went) to the usual
        burst bound rather than the new-key one.
        """
        weights = [r.weight for r in order]
        now = [load_of(r) for r in order]
        averaged = [self.load.get(r) for r in order]
        shed = shed_fractions(averaged, weights, self.settings.epsilon, _STEADY_FLOOR)
        eps, floor = self.settings.burst_epsilon, _BURST_FLOOR
        new_eps = self.settings.new_key_epsilon
        if placed and new_eps is not None and new_eps < eps:
            eps, floor = new_eps, _NEW_KEY_FLOOR
        burst = within_bound(now, weights, eps, floor)
        fits = [b and not sheds(context, r.name, f, self._salts) for r, f, b in zip(order, shed, burst)]
        # Replicas held to other bounds than a newcomer's: index -> (shed fractions, burst epsilon).
        held: dict[int, tuple[list[float], float]] = {}
        went = _find(order, young)
        if went is not None and eps != self.settings.burst_epsilon:
            # The tight bound chooses where a new key goes. Once its first requests went
            # somewhere (answers not back yet), the next ones follow them there unless
            # that replica is swamped: placing each anew spreads one organisation over
            # the fleet while it starts (twins, mean of 8 seeds: hit .663 -> .665).
            held[went] = (shed, self.settings.burst_epsilon)
        stay = _find(order, last)
        if stay is not None:
            # Hysteresis: a context leaves the replica it went to last only when that
            # replica is further past the bounds than a newcomer may be. Otherwise load
            # wobbling around the bound moves twins back and forth, each move paying
            # their whole prefix (one instance, 1,200 twin requests: hit .622 -> .640 with
            # the follow above; Mooncake .252 -> .254; shared prefix .905 -> .910).
            held[stay] = (shed_fractions(averaged, weights, _STAY_STEADY * self.settings.epsilon, _STEADY_FLOOR,
                                         _STAY_GAIN),
                          _STAY_BURST * self.settings.burst_epsilon)
        for i, (fractions, burst_eps) in held.items():
            ok_now = within_bound(now, weights, burst_eps, _BURST_FLOOR)[i]
            fits[i] = ok_now and not sheds(context, order[i].name, fractions[i], self._salts)
        inside = [r for r, ok in zip(order, fits) if ok]
        over = sorted((i for i, ok in enumerate(fits) if not ok), key=lambda i: (now[i], i))
        return inside, [order[i] for i in over]

    def _follow(self, info: PrefixInfo, key: int, inside: list[ReplicaView]) -> int:
        """Index of the replica in ``inside`` to move first (0: keep the order)."""
        bits = [self.bits.get(r.name) for r in inside]
        among = 0
        for b in bits:
            if b is not None:
                among |= 1 << b
        holders = self.index.holders(key) & among
        if not holders:
            return 0  # nobody known to hold the key: the rendezvous order decides
        first = bits[0]
        trusted = [b is not None and self._trust.get(r.name, 1.0) >= _MIN_TRUST for r, b in zip(inside, bits)]
        if first is None or not holders >> first & 1:
            # The key's prefix went elsewhere (a spill, a membership change): follow it.
            return next((i for i, b in enumerate(bits) if trusted[i] and holders >> b & 1), 0)  # type: ignore[operator]
        depth, deep = self.index.deepest(info.hashes, holders)
        if deep >> first & 1:
            return 0
        first_depth = self.index.depth_of(info.hashes, first)
        gain = (depth - first_depth) * info.block
        if gain < self.settings.index_min_gain_chars or depth < _GAIN_RATIO * first_depth:
            return 0
        return next((i for i, b in enumerate(bits) if trusted[i] and deep >> b & 1), 0)  # type: ignore[operator]

    def _learn_trust(self, info: PrefixInfo, feedback: RouteFeedback, bit: int) -> None:
        if feedback.cached_tokens is None or not feedback.prompt_tokens:
            return
        predicted_blocks = self.index.depth_of(info.hashes, bit)
        if predicted_blocks < 4:
            return
        chars_per_token = len(info.rendered.data) / feedback.prompt_tokens
        reported_blocks = feedback.cached_tokens * chars_per_token / info.block
        ratio = min(1.0, reported_blocks / predicted_blocks)
        old = self._trust.get(feedback.replica, 1.0)
        self._trust[feedback.replica] = old + _TRUST_ALPHA * (ratio - old)
