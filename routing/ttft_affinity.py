"""``ttft``: the time to first token each replica would give, learned from the replicas, and one rail.

Issue 26's policy and the default (``routing.policy: ttft``); ``prefix_affinity``
was the default before it (docs/benchmarks/routing-ttft.md: where each wins
and where it still loses). For every request it asks each eligible replica
one question, in seconds (NVIDIA Dynamo's KV router asks it in blocks):

    ttft(r) = ahead(r) + uncached(r) / rate(r)
    cost(r) = ttft(r) + astray(r) + excess(r) + refill(r)

* ``rate(r)``: the prompt tokens ``r`` computes per second of prefill, learned
  from what it reports (``routing.rates``), scaled by what the replies show:
  the times to first token observed over those predicted at the reported
  rates (a request prefilled in a batch is charged the batch's time, so the
  reported figure is below the rate a queue drains at; the scale is the
  same for every replica, so it changes no ranking, only the seconds).
  Replicas that have not said are given the mean of those that have; before
  any has, every figure stays in tokens. A replica at half speed reports half
  the rate.
* ``held(r)``: how much of the prompt ``r`` holds, the largest of the named
  estimates: its KV events (precise mode, ``routing.kv_events``; there the
  estimates below count only with block facts, which add the others' placements
  the events cannot show until they are prefilled), this
  instance's index of what it sent there (``routing.block_index``, kept to
  what the replica's pool can still hold by ``routing.pool_model``: its size,
  less the output its running requests pin, in blocks of characters at the
  characters per token the replies teach, ``routing.ttft_learned``), the
  routing key known to be there, a wide prefix (one carrying more than a
  replica's share of the traffic, ``routing.keys``: warm wherever any of it
  went, other instances' traffic included) and the presumed home (below).
  ``uncached(r)`` is the prompt minus it.
* ``ahead(r)``: the wait ahead of it: the larger of what this instance sent
  ``r`` that has not started (``routing.backlog``: drained at ``rate(r)``,
  and a first token proves its request and all sent before it started) and
  the requests ``r`` reported waiting (every client's), each weighing the mean
  uncached prompt the replies report (before any reply, what this request
  would compute there). Each figure counts this instance's own requests, so
  they are not added. Where ``r``'s seats are known (its ``max_in_flight``,
  vLLM's --max-num-seqs), at least the wait for a seat: past them a request
  waits for one to end, however short its prefill (``seat_wait``). Not learned
  from the queues: a queue beside a full pool, or beside a prefill step in
  progress, shows fewer running than the seats, and a wait priced from that
  made homes look busy and collapsed shared prefixes (the benchmark page).
* ``astray(r)``: only for a key no replica is known to hold, placed away from
  its home: the others' share of the traffic times the prompt's prefill. Other
  instances will send its next request home, which then prefills it all again.
* ``excess(r)``: the tokens ``r`` would compute beyond the fewest any replica
  would, at ``rate(r)``, times ``busy``, the share of replicas with a wait
  ahead. Those tokens delay whoever queues behind them, and ``busy`` is the
  chance that someone does: nothing on an idle fleet, all of it on a full one.
  Without it the least ``ttft`` sends a warm request to an idle cold replica
  as soon as its home has one cold prefill queued; each such move adds a whole
  prefill to a fleet with little to spare, and queues grow behind it (the
  benchmark page: ``shared_prefix`` .875 and 610 ms p95 without it, .909 and
  30 ms with it; twins 4.0 s against 2.8 s).
* ``refill(r)``: the blocks ``r``'s pool must evict for this request's new
  ones, times the share of evicted blocks that requests bring back
  (``routing.pool_model``'s ghosts): the prefill its evictions cost the fleet
  later. Zero where pools do not evict, or what they evict never returns.
  Each instance models its own part of every pool: the pool's size times the
  part of the replicas' queues that is its own (``1 - share``), since the
  other instances' requests take the rest of the same LRU (in precise mode,
  whose belief is the events, and with block facts, which bring the others'
  requests into the model, the whole pool: ``_hold``). Modelled at the
  whole size, an instance of four believed warm what the others' traffic had
  evicted: its belief missed the replicas' ``cached_tokens`` by 0.39 of the
  prompt on ``shared_prefix``, against 0.21 with its share.

**The pick.** The least cost; of replicas within the prediction's error of it
(the mean gap between predicted and observed time to first token over the
last ``ttft_inputs._ERROR_WINDOW`` requests, learned like the rate), the one that computes
the fewest tokens: the fleet spends fewer GPU-seconds for the same wait. Then
the one with the fewest requests now (``load_now``: every one decodes beside
this one, and past the seats waits for one), then the key's rendezvous order.

**The rail** refuses a replica whatever its cost (it goes to the back, so
retries still have somewhere to go): *wait*, a replica whose wait ahead
exceeds the least wait ahead in the fleet by more than ``(1 + busy)`` times
this request's whole prefill there, plus the prediction's error. No warm
prefix can save more than its whole prefill and the excess it spares the
fleet, so a queue past that is a hot spot, not affinity. The least cost
never breaks it, nor does the error band: it binds where figures are stale or
other instances' requests arrive between scrapes. What each instance
guarantees is over its own view (``Terms.bound``). The bound of one whole
prefill, from before ``excess``, refused warm replicas the cost preferred
(``shared_prefix`` p95 60 against 30 ms). A second
rail, refusing replicas whose free KV (``kv_cache_usage_perc``) could not
take the request, was built and measured: it moved cold work into full pools
under pressure and collapsed a KV-bound fleet (the benchmark page), so it is
not kept.

**The home.** The request's key (``routing.keys``) orders the replicas by
rendezvous hashing, the same order on every instance, and orders ties. When
this instance knows of no replica holding the key, one replica is presumed to
hold the request's context with the chance that another instance sent it there
(the others' share of the queues the replicas report): the first in the
rendezvous order of the request's *anchor*, the shallowest prefix that is not
wide, cut inside messages too. An organisation's policies inside one system
message, before each person's profile, are such a prefix, so every instance
presumes an organisation's new people at the replica its layers live on. (With
the key's own first choice as the home, each person had one of their own, every
replica came to hold every organisation's layers, and four instances kept 0.72
of one instance's reuse on ``orgs_layered``.) Alone there is no one to agree
with: nothing is presumed, and the anchor decides nothing.

**Block facts** (``routing.share_index``, with a ``redis_url``). Each
instance publishes every placement as a block fact (``routing.gossip``): the
routing key, the replica, and the prompt's block hashes at the positions the
index records. Another instance records them as it records its own sends: in
its index, and in the replica's pool model at the pool's *whole* size (every
instance's placements now pass through every model; the sizes are those of
the last scrape, and where none is known yet, the index only). Nothing is
presumed then: the others' share is taken as 0 for the home, ``astray`` and
the modelled part of the pool, since the index already holds where they sent
their prompts, a flush (about 50 ms) late. Presuming on top of the facts would
credit the anchor's replica with contexts the facts place elsewhere. The seats
keep the real share (``seat_wait``): the facts say where the others' requests
went, not how many run now. Four instances sharing nothing kept 0.95 of one
instance's hit ratio in 7 of ``bench.routing_homes``'s 15 runs, and key facts
alone (``HELD``, ``PLACED``) did little better; with block facts, 14 (the
benchmark page, seventh stop).
Each block fact also carries the tokens the sender expects the replica to
compute, and the receiver queues them in its backlog of that replica; the
sender's ``DONE`` fact (the request's first token, or its end) clears that
backlog up to it, first come first served, as this instance's own replies
clear its own sends. That is the other instances' sends since the last
scrape, which the sixth stop's oracle found behind the several instances'
tail: with it the suite's median p95 was at most 1.11x one instance's on 9
of 12 families (``heavy8-poisson-5s`` 1.68 s -> 391 ms, one instance 352).

``observe`` records that the serving replica now holds the whole prompt,
learns the mean uncached prompt, the prediction's error and the rate's scale,
and checks the index's belief against the ``cached_tokens`` the replica
reports (``belief`` in ``stats``). ``explain`` returns every term of a
decision, per replica, without learning anything (``POST
/admin/routing/explain``).
"""

from __future__ import annotations

import secrets
import time
from typing import Callable, Sequence

from .backlog import CHARS_PER_TOKEN, Backlog
from .base import ReplicaView, RouteFeedback, RouteRequest, load_now, others_reported
from .block_index import MAX_REPLICA_IDS, BlockIndex, ReplicaBits
from .gossip import DONE, MAX_HASHES, PLACED, BlockFact, Fact, Gossip
from .hotness import P95_Z
from .keys import PrefixInfo, PrefixKeyer, RouteKey, analyse
from .kv_events import KVEvents
from .pool_model import PoolModel
from .rendezvous import Rendezvous
from .settings import RoutingSettings
from .ttft_inputs import Terms, home_index, known_rates, seat_wait, waiting_and_share
from .ttft_learned import Learned

__all__ = ["TTFTAffinity", "Terms"]

# Where a request was sent, in its scratch: a retry elsewhere is news for ``observe``.
_SENT = "kvgate.sent"
# Its entry among the requests in flight (precise mode).
_PENDING = "kvgate.pending"
# Its mark in the chosen replica's prefill backlog, and what was predicted there.
_MARK = "kvgate.backlog_mark"
_PREDICTED = "kvgate.predicted"
# The number its block fact named it by (``share_index``), for its DONE fact.
_TOKEN = "kvgate.gossip_token"
# The others' requests this instance keeps queued by token, awaiting their DONE: each is cleared
# by its own DONE or, first come first served, by any later one at its replica; only lost facts
# leave entries behind. About a minute of a busy fleet's requests.
_MAX_QUEUED_REMOTE = 1 << 16
# When its first token came (``started``): the rest of its time is a seat's.
_FIRST = "kvgate.first_token_at"


class TTFTAffinity:
    name = "ttft"

    def __init__(self, settings: RoutingSettings | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings or RoutingSettings()
        # The key orders ties and is what the index says is held. Cut at message ends and
        # explicit boundaries only (a flat prompt, which has none, at sampled positions:
        # routing.keys): the index finds layers inside a message anyway. (Ordered by keys cut
        # inside messages too, an organisation's cold requests crowd the replicas its hash
        # favours: one instance lost its tail on the generated suite, and precise mode 0.04 of
        # reuse on orgs_layered: docs/benchmarks/routing-ttft.md.)
        self.keyer = PrefixKeyer(self.settings, layers_inside_messages=False)
        # The home, where other instances presumably sent the request's context, is named by
        # the shallowest prefix that is not wide, cut inside messages too (the module doc).
        self.anchors = PrefixKeyer(self.settings, layers_inside_messages=True, chains=self.keyer.chains)
        self.index = BlockIndex(self.settings.index_capacity, self.settings.max_blocks, tails=True)
        self.pools = PoolModel()
        self.bits = ReplicaBits()
        self.backlog = Backlog(clock)
        self.gossip = Gossip() if self.settings.share_index else None
        # Each replica's room for cached prompts (``_room``) as this instance last read it: another
        # instance's block fact moves the pool model of a replica this one may not have sent to yet.
        self._rooms: dict[str, float] = {}
        # ... and its rate as this instance last priced it: the others' queued prompt tokens
        # (their block facts) drain at it, until their first token says they are done.
        self._rates: dict[str, float | None] = {}
        # The others' requests queued in ``backlog`` (by their fact's token): where, and the mark
        # their DONE fact clears up to. Numbers this instance's own requests: a random start, so
        # instances name theirs apart.
        self._queued_remote: dict[int, tuple[str, float]] = {}
        self._next_token = secrets.randbits(64) | 1
        self._orders = Rendezvous()
        # What the replies teach (``routing.ttft_learned``): the uncached prompt of a request, how
        # far predictions missed, a seat's hold, the output, characters per token, the belief's gap.
        self.learned = Learned()
        self._others_share = 0.0
        self._clock = clock
        # Decisions, how many left the key's home, and how many a rail decided: the replica
        # the formula preferred was refused.
        self.decisions = 0
        self.moved = 0
        self.bound_overrides = 0
        # Precise mode's source (set by the gateway when replicas publish KV events).
        self.truth: KVEvents | None = None
        self.precise_decisions = 0

    # -- RoutingPolicy -----------------------------------------------------------------
    def prefer(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        return self._rank(request, replicas, learn=True)[0]

    def peek(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        """``prefer`` without learning anything: what this instance would do."""
        return self._rank(request, replicas, learn=False)[0]

    def explain(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[Terms]:
        """Every replica's terms, in the order ``prefer`` would give, without learning anything."""
        order, terms = self._rank(request, replicas, learn=False, explain=True)
        by_name = {t.replica: t for t in terms}
        return [by_name[r.name] for r in order]

    def home(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> str:
        """The replica this instance would presume holds the request's context where no replica is
        known to (the anchor's first choice), without learning anything. Instances that name
        different homes for the same request split its context (``bench.routing_homes``)."""
        anchor = self.anchors.key_for(request, len(replicas), learn=False)
        return self._orders.order(anchor.key, replicas)[0].name

    def observe(self, request: RouteRequest, feedback: RouteFeedback) -> None:
        if self.truth is not None:
            self.truth.done(request.scratch.pop(_PENDING, None), served=feedback.ok, replica=feedback.replica)
        mark = request.scratch.pop(_MARK, None)
        if mark is not None:
            self._done(request, mark)
        predicted = request.scratch.pop(_PREDICTED, None)
        first = request.scratch.pop(_FIRST, None)
        if not feedback.ok:
            return  # nothing learned
        info = analyse(request, self.settings, self.keyer.chains)  # rendered once a request (cached)
        # Characters per token from the reply, where routing had no token ids to count them by.
        chars = len(info.rendered.data) if feedback.prompt_tokens and not request.token_ids else 0
        self.learned.reply(feedback, predicted, chars, None if first is None else self._clock() - first)
        if request.scratch.get(_SENT) == feedback.replica or not info.hashes:
            return  # recorded when it was sent there, or nothing to record
        route = self.keyer.key_for(request, max(1, len(self.bits)), learn=False)
        bit = self.bits.bit_for(feedback.replica, self.index)
        if self._sharing():  # served elsewhere than sent (a retry): a placement too
            self._publish(info, route, feedback.replica)
        self._hold(info, route, bit, None)

    def started(self, request: RouteRequest, replica: str) -> None:
        """The request's first token came from ``replica``: its prefill is done, and (first come,
        first served) so is every prefill sent there before it."""
        request.scratch[_FIRST] = self._clock()
        mark = request.scratch.pop(_MARK, None)
        if mark is not None:
            self._done(request, mark)

    def _done(self, request: RouteRequest, mark: tuple[str, float, float | None]) -> None:
        """This instance's request at ``mark`` is prefilled (or given up): clear the backlog to
        it, and tell the others (``DONE``), whose backlogs hold it and what was queued before."""
        self.backlog.done(mark[0], mark[1], mark[2])
        token = request.scratch.pop(_TOKEN, None)
        if token is not None and self.gossip is not None:
            self.gossip.note(DONE, token, mark[0])

    def learn_remote(self, fact: Fact) -> None:
        """Apply what another instance learned (``routing.gossip``): the key is held there, and with
        a block fact the prompt's blocks too, recorded as this instance's own placements are: in the
        index, and in the replica's pool model at the pool's whole size (every instance's
        placements now pass through it), forgetting what the model evicts. Where the pool's size
        is not known yet, the index only."""
        if self.gossip is not None:
            self.gossip.applied += 1
        if fact.kind == DONE:
            queued = self._queued_remote.pop(fact.key, None)
            if queued is not None:  # prefilled there: so is all that was queued before it
                self.backlog.done(queued[0], queued[1], self._rates.get(queued[0]))
            return
        bit = self.bits.bit_for(fact.replica, self.index)
        if isinstance(fact, BlockFact):
            if self.index.add_recorded(fact.blocks, fact.hashes, bit):
                room = self._rooms.get(fact.replica)
                if room:
                    self._touch(bit, fact.key, self.index.positions(fact.blocks), fact.hashes, room)
            if fact.token and fact.uncached > 0:
                # Queued at the replica ahead of what this instance sends next, as its own would be.
                mark = self.backlog.add(fact.replica, float(fact.uncached), self._rates.get(fact.replica))
                waiting = self._queued_remote
                if len(waiting) >= _MAX_QUEUED_REMOTE:  # DONE facts lost (a Redis outage): oldest first
                    del waiting[next(iter(waiting))]
                waiting[fact.token] = (fact.replica, mark)
        self.index.add_key(fact.key, bit)

    def stats(self) -> dict[str, object]:
        """For ``GET /admin/routing``: what the policy decided and learned on its own."""
        out: dict[str, object] = {
            "decisions": self.decisions, "left_home": self.moved, "bound_overrides": self.bound_overrides,
            "index_entries": len(self.index), "precise_decisions": self.precise_decisions,
            **self.learned.stats()}
        if self.gossip is not None:
            out["shared_facts"] = {"published": self.gossip.published, "applied": self.gossip.applied,
                                   "pending": len(self.gossip)}
        return out

    # -- internals ---------------------------------------------------------------------
    def _hold(self, info: PrefixInfo, route: RouteKey, bit: int, replica: ReplicaView | None,
              known: int = 0) -> None:
        """Record that replica ``bit`` holds (or is about to hold) the request's prompt, and
        what its pool evicts for it (where its size is known)."""
        self.index.add(info.hashes, bit, known)
        self.index.add_key(route.key, bit)
        size = self._room(replica) if replica is not None else None
        if size:
            at = self.index.positions(len(info.hashes))
            # Other instances' requests take their share of the same LRU: this instance's
            # blocks live in what is left of it. That share keeps the index's belief near
            # what the pool still holds; in precise mode the belief is the replicas' events,
            # and the model only prices evictions (``refill``): at an eighth of the pool, an
            # instance of eight charged a busy home's evictions as if its own requests filled
            # it, kept sending there, and shared_prefix collapsed (the benchmark page).
            # With block facts (share_index) every instance's placements pass through the
            # model, so it is the whole pool: ``_others_share`` is 0 then (``_rank``).
            own = 1.0 if self.truth is not None else 1.0 - self._others_share
            self._touch(bit, route.key, at, [info.hashes[p] for p in at], size * own)

    def _touch(self, bit: int, key: int, at: Sequence[int], recorded: Sequence[int], room: float) -> None:
        """The pool model's part of recording a prompt: its key and the blocks recorded at
        positions ``at`` (``recorded``) just used at ``bit``, whose pool has ``room`` tokens for it
        (counted in blocks of characters, at the characters per token learned); what the model
        evicts, the index forgets."""
        weights = [0] + [p - (at[i - 1] if i else -1) for i, p in enumerate(at)]
        capacity = int(room * self.learned.chars_per_token() / self.settings.block_chars)
        evicted = self.pools.touch(bit, [key, *recorded], weights, capacity)
        if evicted:
            self.index.forget(evicted, bit)

    def _rank(self, request: RouteRequest, replicas: Sequence[ReplicaView], learn: bool,
              explain: bool = False) -> tuple[list[ReplicaView], list[Terms]]:
        if len(replicas) < 2 and not explain:
            return list(replicas), []
        info = analyse(request, self.settings, self.keyer.chains)
        route = self.keyer.key_for(request, len(replicas), learn=learn)
        order = self._orders.order(route.key, replicas)
        n = len(order)
        waiting, others = waiting_and_share(order)
        # With block facts (share_index) this index holds where the other instances sent each
        # prompt, about a flush late: nothing is presumed of them (no home, no astray, the whole
        # pool modelled). Presumed on top of the facts, every replica an instance's anchor named
        # would be credited twice over (the sixth and seventh stops of the benchmark page).
        share = 0.0 if self._sharing() else others
        home = 0
        if share > 0.0:
            # Only where another instance has a share: alone, nothing is presumed, and an
            # instance pays nothing for its anchor (20 µs or more a request at 4K tokens).
            anchor = self.anchors.key_for(request, n, learn=learn)
            if anchor.key != route.key:
                home = home_index(self._orders.order(anchor.key, replicas)[0], order)
        if learn:
            self._others_share = share
            if request.token_ids:
                self.learned.learn_chars(len(info.rendered.data), len(request.token_ids))
        hold = self.learned.hold.get(0.0)
        scale = self.learned.scale()
        rates = [x / scale if x is not None else None for x in known_rates(order)]
        if learn and self.gossip is not None:
            self._remember(order, rates)
        keys = self._keys(request)
        precise = self.truth.held(keys, [r.name for r in order]) if keys and self.truth is not None else {}
        held, sources, prompt_tokens, depths = self._held(info, route, order, home, precise, request, share)
        uncached = [max(0.0, prompt_tokens - h) for h in held]
        # Another client's waiting request weighs what a request of ours was reported to
        # compute; before any report, what this one would compute there.
        learned = self.learned.work.get(-1.0)
        each = [learned if learned >= 0 else u for u in uncached]
        queued = self.backlog.queued([r.name for r in order], rates)
        ahead, ttft, refill, seated = [], [], [], []
        # Before any replica has reported a rate every figure is in tokens (a rate of 1).
        speed = [x or 1.0 for x in rates]
        astray = prompt_tokens * share if share and not self.index.holders(route.key) and not any(
            precise.values()) else 0.0
        # Evicting a block costs the fleet the share of evicted blocks that come back
        # (routing.pool_model): a replica whose pool must evict for this request's new blocks
        # is charged their refill.
        back = self.pools.refill()
        per_block = info.block * (len(request.token_ids) / len(info.rendered.data)
                                  if request.token_ids and info.rendered.data else 1.0 / CHARS_PER_TOKEN)
        for i, r in enumerate(order):
            rate = speed[i]
            # The queue is at least what this instance sent and was not done, and at least what
            # the replica reported waiting: each figure counts this instance's own requests.
            # And at least the wait for a seat, where a replica's seats are known: a request that
            # waits for one is not waiting for prefill (seconds, so only once rates are known).
            # The seats get the real share, facts or none: block facts say where the others'
            # requests went, not how many are running now, and the seats a scrape left free are
            # taken by their requests sent since it all the same (``seat_wait``). With the seats
            # known (the suite's --seats), orgs-poisson-0.85 x4 with block facts: p95 72 / 726 ms /
            # 1.07 s (min / median / max over seeds) with the real share, 165 ms / 726 ms / 1.07 s
            # with 0; the same hit ratios.
            seated.append(seat_wait(r, hold, others) if rates[i] is not None else 0.0)
            ahead.append(max(max(queued[i], waiting[i] * each[i]) / rate, seated[-1]))
            ttft.append(ahead[-1] + uncached[i] / rate)
            bit = self.bits.get(r.name)
            evicts = self.pools.overflow(bit, uncached[i] / per_block) if back and bit is not None else 0.0
            refill.append(evicts * per_block * back / rate)
        # Tokens computed beyond the fewest delay whoever queues behind them (module doc).
        busy = sum(1 for a in ahead if a > 0) / n
        least_uncached = min(uncached)
        excess = [(u - least_uncached) / speed[i] * busy for i, u in enumerate(uncached)]
        strays = [astray / speed[i] if i != home else 0.0 for i in range(n)]
        cost = [ttft[i] + strays[i] + excess[i] + refill[i] for i in range(n)]
        # The pick: least cost; within the prediction's error of it, fewest tokens computed.
        band = self.learned.error.get(0.0) if rates[0] is not None else 0.0
        # The rail (module doc): a queue past the least by more than this whole prefill and the
        # excess it would spare, beyond the prediction's error.
        least_ahead = min(ahead)
        bounds = [least_ahead + (1.0 + busy) * prompt_tokens / speed[i] + band for i in range(n)]
        rails: list[str | None] = ["wait" if ahead[i] > bounds[i] else None for i in range(n)]
        fits = [i for i in range(n) if rails[i] is None]
        if fits:
            best = min(cost[i] for i in fits)
            # Of those computing the fewest tokens, the fewest requests now (ours, the others' as
            # reported) for its speed: each decodes beside this one. Without it cold prompts split by
            # key hash; the fairness benchmark's quiet tenant: p95 123 ms at its share, 28 ms with it.
            first = min((i for i in fits if cost[i] <= best + band),
                        key=lambda i: (uncached[i], load_now(order[i]) / speed[i], cost[i], i))
            rest = sorted((i for i in fits if i != first), key=lambda i: (cost[i], uncached[i], i))
            picks = [first] + rest
        else:
            picks = []
        picks += sorted((i for i in range(n) if rails[i] is not None), key=lambda i: (cost[i], i))
        terms: list[Terms] = []
        if explain:
            terms = [Terms(r.name, rates[i], held[i], sources[i], uncached[i], ahead[i], seated[i], strays[i],
                           excess[i], refill[i], ttft[i], cost[i], bounds[i], rails[i])
                     for i, r in enumerate(order)]
        if learn:
            if any(rails) and rails[min(range(n), key=lambda i: (cost[i], i))] is not None:
                self.bound_overrides += 1  # the formula's choice was refused by a rail
            c = picks[0]
            chosen = order[c]
            mark = self.backlog.add(chosen.name, uncached[c], rates[c])
            request.scratch[_MARK] = (chosen.name, mark, rates[c])
            request.scratch[_PREDICTED] = (chosen.name, ttft[c] if rates[c] is not None else None,
                                           held[c] / prompt_tokens if prompt_tokens else 0.0, scale)
            self._commit(request, info, route, chosen, order[home], depths, uncached[c])
            if keys and self.truth is not None:
                if chosen.name in precise:
                    self.precise_decisions += 1
                new = precise.get(chosen.name, 0.0) < len(keys)
                request.scratch[_PENDING] = self.truth.sent(chosen.name, keys, new)
        return [order[i] for i in picks], terms

    def _room(self, r: ReplicaView) -> float | None:
        """The tokens ``r``'s pool has for cached prompts: its size less what its running requests
        pin for their output, which no prompt recorded here accounts for. Their number comes and
        goes: each runs for a while and new ones arrive independently, so it is about Poisson
        around the ``n`` there now, and the room is kept for its 95th percentile,
        ``n + 1.645 sqrt(n)``: the percentile users judge a time to first token by. (At ``n``
        alone, a burst outgrew a crowded pool and waited for blocks: the benchmark page, tenth
        stop.)"""
        if not r.kv_tokens:
            return None
        n = others_reported(r) + r.in_flight
        return max(0.0, r.kv_tokens - (n + P95_Z * n ** 0.5) * self.learned.output.get(0.0))

    def _sharing(self) -> bool:  # block facts go out and come in: another instance listens
        return self.gossip is not None and self.gossip.listening

    def _held(self, info: PrefixInfo, route: RouteKey, order: list[ReplicaView], home: int,
              precise: dict[str, float], request: RouteRequest,
              share: float) -> tuple[list[float], list[str], float, dict[int, int]]:
        """``held(r)`` for every replica, in prompt tokens, with its source; the prompt in tokens;
        and the index's depths (blocks, by replica bit) they were read from."""
        prompt = len(info.rendered.data)
        tokens = request.token_ids
        # With the token ids known every figure is in real tokens: the index's share of the
        # prompt is scaled to them.
        scale = len(tokens) / prompt if tokens and prompt else 1.0 / CHARS_PER_TOKEN
        prompt_tokens = float(len(tokens)) if tokens and prompt else prompt * scale
        block = self.truth.block_size if self.truth is not None else 0
        holders = self.index.holders(route.key)
        # The context, what its client sent before: everything but the last message; a
        # single span marks no turns, and a prompt grows by appending, so all of it.
        spans = info.rendered.spans
        context = max(route.cut, spans[-1].start if len(spans) > 1 else info.limit)
        presumed = context * (0.0 if holders else share) * scale
        wide = route.shared * scale
        fleet_holds = any(precise.values())
        sharing = self._sharing()
        depths = self.index.depths(info.hashes, (1 << len(self.bits)) - 1) if info.hashes else {}
        # Knows nothing of the request past its key: only then can another instance's fact
        # (share_index) say more than this instance's own blocks.
        blind = self.gossip is not None and max(depths.values(), default=0) * info.block <= route.cut
        held, sources = [], []
        for i, r in enumerate(order):
            best, source = 0.0, "none"
            if r.name in precise and tokens:
                best, source = precise[r.name] * block, "events"
                if i == home and not fleet_holds and presumed > best:
                    best, source = presumed, "home"
                if not sharing:
                    held.append(min(best, prompt_tokens))
                    sources.append(source if best else "none")
                    continue
                # With block facts the index holds what every instance placed, a flush late; the
                # events, only what was stored, a prefill late. The others' prompts still being
                # prefilled are the index's alone: read on events only, eight precise instances
                # saw an organisation's prompts nowhere, sent its people to every replica, and
                # orgs-poisson-0.85 kept 0.83 of one instance's reuse (0.99 with the estimates
                # below; without the wide prefix's, MT-bench's p95 92 ms against 22).
            bit = self.bits.get(r.name)
            if bit is not None:
                indexed = depths.get(bit, 0) * info.block * scale
                if indexed > best:
                    best, source = indexed, "index"
                if holders >> bit & 1:
                    # Known to hold the key; known by its key alone (no blocks recorded, or
                    # another instance's fact where this instance knows nothing past the key),
                    # it is presumed to hold the context, as a home is.
                    keyed = (context if blind or not indexed else route.cut) * scale
                    if keyed > best:
                        best, source = keyed, "key"
            if i == home and presumed > best:
                best, source = presumed, "home"
            # A wide prefix (``RouteKey.shared``: more than a replica's share of the traffic)
            # is warm wherever any of its traffic went, other instances' included: without
            # this, the replicas this instance happened not to send it to look cold for it.
            if wide > best:
                best, source = wide, "wide"
            held.append(min(best, prompt_tokens))
            sources.append(source)
        return held, sources, prompt_tokens, depths

    def _keys(self, request: RouteRequest) -> list[int]:
        """The request's token-block keys, once per request; empty without token ids or truth."""
        return self.truth.request_keys(request) if self.truth is not None else []

    def _commit(self, request: RouteRequest, info: PrefixInfo, route: RouteKey, chosen: ReplicaView,
                home: ReplicaView, depths: dict[int, int], uncached: float) -> None:
        """What a decision teaches: the chosen replica will hold the prompt."""
        self.decisions += 1
        bit = self.bits.bit_for(chosen.name, self.index)
        if chosen is not home:
            self.moved += 1
        if self._sharing():
            token = self._next_token = (self._next_token + 2) & 0xFFFFFFFFFFFFFFFF  # odd: never 0
            request.scratch[_TOKEN] = token
            self._publish(info, route, chosen.name, uncached, token)
        if info.hashes:
            self._hold(info, route, bit, chosen, depths.get(bit, 0))
            request.scratch[_SENT] = chosen.name


    def _publish(self, info: PrefixInfo, route: RouteKey, replica: str, uncached: float = 0.0,
                 token: int = 0) -> None:
        """Tell the other instances where this prompt went (``share_index``), before ``_hold``
        records it here. Every placement, not only news: each one moves the receivers' pool
        models as it moves this instance's. A prompt without blocks is a key fact, and only
        news: a key nobody was known to hold (another instance's home for it may differ)."""
        assert self.gossip is not None
        if info.hashes:
            blocks, recorded = self.index.recorded(info.hashes, MAX_HASHES)
            self.gossip.note_blocks(route.key, replica, blocks, recorded, round(uncached), token)
        elif not self.index.holders(route.key):
            self.gossip.note(PLACED, route.key, replica)

    def _remember(self, replicas: Sequence[ReplicaView], rates: Sequence[float | None]) -> None:
        """Each replica's room for cached prompts and its rate as priced now, for the facts about it
        (``learn_remote``)."""
        rooms, known = self._rooms, self._rates
        if len(known) > MAX_REPLICA_IDS:  # names come and go (DNS pods): start afresh, as ``bits`` does
            rooms.clear()
            known.clear()
        for r, rate in zip(replicas, rates):
            room = self._room(r)
            if room:
                rooms[r.name] = room
            known[r.name] = rate
