"""The cost model: prefix affinity as one cost, one bound and one tie-break (experimental).

The candidate replacement for ``prefix_affinity``'s layers (issue 15), selected with
``routing.policy: cost`` while it is measured; the README's routing section says
where it stands.

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
  ``r`` has not prefilled yet (``routing.backlog``), plus the requests ``r``
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

**The bound** (consistent hashing with bounded loads, Mirrokni, Thorup and
Zadimoghaddam): a replica takes the request only if its in-flight count stays
within ``ceil((1 + epsilon) x mean)``, the mean of what is in flight right now
with this request included: this instance's own in-flight, exact, plus the
others' as the replica last reported them (``routing.base.load_now``). It is
checked at every decision, from the first; nothing is averaged. Replicas past it
go to the back of the order (least loaded first) so that retries still have
somewhere to go.

**The tie-break and the home.** The request's key (``routing.keys``: the
shallowest cut at a message end or an explicit boundary that one replica can
own, such as a conversation's first turn) orders the replicas by rendezvous
hashing, the same order on every instance. Of equal costs, the replica where the
request adds less prefill goes first (the fleet does less work for the same
wait), then that order. When this instance knows of no replica holding the key,
the key's *home* (the first of that order) is presumed to hold the request's
context (everything before its last message) with the chance that another
instance sent it there: the others' share of the queues the replicas report,
none for a lone instance. Every instance sends a key home unless the cost says
otherwise, so that is where a conversation this instance has not seen most
likely lives; that presumption is what lets instances that share nothing agree.

What the cost replaces: a context stays where its prefix is warm because that
replica's cost is lower by the prefix's prefill (hysteresis with a reason); a
heavy key spills exactly as far as queues and the bound make it; a new key's
second request, sent before the first answer, follows the first because the
index learns at decision time, not only when the answer returns.

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
from typing import Callable, Sequence

from .backlog import CHARS_PER_TOKEN, Backlog
from .base import ReplicaView, RouteFeedback, RouteRequest, load_now, reported
from .block_index import BlockIndex
from .gossip import HELD, PLACED, Fact, Gossip
from .keys import PrefixInfo, PrefixKeyer, RouteKey, analyse
from .kv_events import KVEvents
from .token_keys import block_keys
from .prefix_affinity import MAX_REPLICA_IDS, ReplicaBits
from .rendezvous import rendezvous_order, within_bound
from .settings import RoutingSettings

__all__ = ["CostModel"]

# Where a request was sent, in its scratch: a retry elsewhere is news for ``observe``.
_SENT = "kvgate.sent"
# Its token-block keys (precise mode), and its entry among the requests in flight.
_KEYS = "kvgate.block_keys"
_PENDING = "kvgate.pending"


class CostModel:
    name = "cost"

    def __init__(self, settings: RoutingSettings | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings or RoutingSettings()
        # The key only orders ties and names a home: shared blocks inside a message are
        # found by the index, so message ends and explicit boundaries are cuts enough.
        self.keyer = PrefixKeyer(self.settings, layers_inside_messages=False)
        self.index = BlockIndex(self.settings.index_capacity, self.settings.max_blocks, tails=True)
        self.bits = ReplicaBits()
        self.backlog = Backlog(self.settings.prefill_tokens_per_s, clock)
        self.gossip = Gossip() if self.settings.share_index else None
        self._salts: dict[str, int] = {}
        # The mean prompt work of this instance's requests: what another client's
        # waiting request is taken to weigh.
        self._work_sum = 0.0
        # Decisions, and how many left the key's home (for metrics and the benchmark).
        self.decisions = 0
        self.moved = 0
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
            self.truth.done(request.scratch.pop(_PENDING, None), served=feedback.ok)
        if not feedback.ok:
            return
        info = analyse(request, self.settings, self.keyer.chains)
        if not info.hashes:
            return
        if request.scratch.get(_SENT) == feedback.replica:
            return  # recorded when it was sent there
        route = self.keyer.key_for(request, max(1, len(self.bits)), learn=False)
        bit = self.bits.bit_for(feedback.replica, self.index)
        if self.gossip is not None and not self.index.holders(route.key) >> bit & 1:
            self.gossip.note(HELD, route.key, feedback.replica)  # news to this instance, so to others
        self._hold(info, route, bit)

    def learn_remote(self, fact: Fact) -> None:
        """Apply what another instance learned (``routing.gossip``): the key is held there."""
        _, key, replica = fact
        if self.gossip is not None:
            self.gossip.applied += 1
        self.index.add_key(key, self.bits.bit_for(replica, self.index))

    def stats(self) -> dict[str, object]:
        """For ``GET /admin/routing``: what the policy decided on its own."""
        out: dict[str, object] = {"decisions": self.decisions, "left_home": self.moved,
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

    def _rank(self, request: RouteRequest, replicas: Sequence[ReplicaView], learn: bool) -> list[ReplicaView]:
        if len(replicas) < 2:
            return list(replicas)
        if len(self._salts) > MAX_REPLICA_IDS:
            self._salts.clear()
        info = analyse(request, self.settings, self.keyer.chains)
        route = self.keyer.key_for(request, len(replicas), learn=learn)
        order = rendezvous_order(route.key, replicas, self._salts)
        now = [load_now(r) for r in order]
        fits = within_bound(now, [r.weight for r in order], self.settings.epsilon)
        keys = self._keys(request)
        precise = self.truth.held(keys, [r.name for r in order]) if keys and self.truth is not None else {}
        work = self._work(info, route, order, precise, request)
        # Decode load: every request in flight weighs a typical request of ours (module doc).
        typical = self._typical(info, request)
        costs = [ahead + uncached + load * typical for (ahead, uncached), load in zip(work, now)]
        # Of equal waits, the one adding less work to the fleet; then the rendezvous order.
        inside = sorted((i for i in range(len(order)) if fits[i]), key=lambda i: (costs[i], work[i][1], i))
        over = sorted((i for i in range(len(order)) if not fits[i]), key=lambda i: (now[i], i))
        picks = inside + over
        if learn:
            chosen = order[picks[0]]
            self._commit(request, info, route, chosen, work[picks[0]][1], order[0])
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
        if self.truth is None:
            return []
        keys = request.scratch.get(_KEYS)
        if keys is None:
            tokens = request.token_ids
            salt = request.body.get("cache_salt")
            keys = block_keys(tokens, self.truth.block_size, salt if isinstance(salt, str) else None) \
                if tokens else []
            request.scratch[_KEYS] = keys
        return keys  # type: ignore[no-any-return]

    def _work(self, info: PrefixInfo, route: RouteKey, order: list[ReplicaView], precise: dict[str, float],
              request: RouteRequest) -> list[tuple[float, float]]:
        """Per replica, in prompt tokens: (the work ahead of this request there, its own prefill there)."""
        prompt = len(info.rendered.data)
        tokens = request.token_ids
        # With the token ids known, every figure is in real tokens: the approximate
        # index's share of the prompt is scaled to them.
        scale = len(tokens) / prompt if tokens and prompt else 1.0 / CHARS_PER_TOKEN
        block = self.truth.block_size if self.truth is not None else 0
        typical = self._typical(info, request)
        # Replicas known to hold the key hold its prefix (another instance may have said
        # so, without the blocks); if none is, the home is presumed to (module doc).
        holders = self.index.holders(route.key)
        spans = info.rendered.spans
        context = max(route.cut, spans[-1].start if len(spans) > 1 else 0)
        presumed = 0.0 if holders else context * _others_share(order)
        fleet_holds = any(precise.values())
        ahead, uncached = [], []
        depths = self.index.depths(info.hashes, (1 << len(self.bits)) - 1) if info.hashes else {}
        for i, r in enumerate(order):
            ahead.append(self.backlog.get(r.name) + _others_waiting(r) * typical)
            if r.name in precise and tokens:
                # The truth: what the replica's own events say it holds of this prompt. A
                # prefix no replica holds yet is presumed at its home as in approximate mode
                # (module doc), so instances that place it before any event agree on where.
                held_tokens = precise[r.name] * block
                if i == 0 and not fleet_holds:
                    held_tokens = max(held_tokens, presumed * scale)
                uncached.append(max(0.0, len(tokens) - held_tokens))
                continue
            bit = self.bits.get(r.name)
            held = float(depths.get(bit, 0) * info.block) if bit is not None else 0.0
            if bit is not None and holders >> bit & 1:
                held = max(held, float(route.cut))
            elif i == 0:
                held = max(held, presumed)
            # Queued prefill: ours, and others' waiting requests weighed as average ones of ours (above).
            uncached.append(max(0.0, prompt - held) * scale)
        # Prefill that the best-placed replica would not need is paid once by this request
        # and once more by every request in flight where it lands: each waits for, or
        # decodes around, that extra prefill step.
        least = min(uncached)
        return [(a + load_now(r) * (u - least), u) for a, u, r in zip(ahead, uncached, order)]

    def _commit(self, request: RouteRequest, info: PrefixInfo, route: RouteKey, chosen: ReplicaView,
                uncached: float, home: ReplicaView) -> None:
        """What a decision teaches: the chosen replica's queue grows, and it will hold the prompt."""
        self.backlog.add(chosen.name, uncached)
        self._work_sum += uncached
        self.decisions += 1
        bit = self.bits.bit_for(chosen.name, self.index)
        if chosen is not home:
            self.moved += 1
            if self.gossip is not None and not self.index.holders(route.key):
                self.gossip.note(PLACED, route.key, chosen.name)  # the others presume it is home
        if info.hashes:
            self._hold(info, route, bit, self.index.depth_of(info.hashes, bit))
            request.scratch[_SENT] = chosen.name


def _others_share(replicas: Sequence[ReplicaView]) -> float:
    """The share of the replicas' reported queues that is not this instance's (0 before any report)."""
    total = mine = 0.0
    for r in replicas:
        queue = reported(r)
        if queue is not None:
            total += queue
            mine += min(queue, r.in_flight_at_scrape)
    return (total - mine) / total if total > 0 else 0.0


def _others_waiting(replica: ReplicaView) -> float:
    """Requests the replica reports waiting that are not this instance's (per unit weight).

    The replica reports running and waiting together with every client's; of its
    queue at the last scrape, this instance's share was ``in_flight_at_scrape``.
    The rest, in the proportion the replica reports waiting, is others' work
    still ahead of a new request.
    """
    queue = reported(replica)
    if not queue or not replica.waiting:
        return 0.0
    others = max(0.0, queue - replica.in_flight_at_scrape)
    return replica.waiting * others / queue / replica.weight
