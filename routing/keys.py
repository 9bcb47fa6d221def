"""From a request to its routing key: the shallowest prefix that one replica can own.

The prefix is a tree: every request shares the global instructions, an
organisation shares its policies, a digital twin its profile, a conversation
its first turn. Keying deep (the whole stable prefix) spreads well but loses
what siblings share; keying shallow shares more but a prefix carried by more
traffic than one replica serves cannot live on one replica. So the key is the
hash of the prefix ending at the *shallowest* candidate cut
(``routing.boundary``: message ends, explicit boundaries, sampled block
positions, up to the first user turn) that is *not wide*, where wide means
carrying more than ``hot_fraction / replicas`` of the requests:

* a system prompt in every request (the Mooncake trace's first 512 tokens, an
  application's global instructions) is wide: the key goes past it, to the
  conversation's first user turn, which stays constant for all its turns (a
  flat prompt, the Mooncake trace's, has no turns: it is cut at sampled
  positions, and its key is where its conversation starts);
* an organisation with a twelfth of the traffic is not wide: its twins share
  a home and meet its 16K tokens of policies, agent and tool schemas warm;
* if every cut up to the cap is wide, the deepest one keys the request.

Nothing here is set by hand. A share is judged at the 95th percentile of its
count (``routing.hotness``): a handful of requests for a prefix in all of them,
and never by chance for one near a replica's share. A wide prefix is credited
as warm on every replica (``RouteKey.shared``), but only once it can be: until
it turned wide its requests shared its key and went to one home; past it they
go to their own keys' homes, drawn like a fair die, which reaches all n faces
in n·H_n throws on average. Crediting it at once made a cold replica look as
warm as the warm one (docs/benchmarks/routing-ttft.md, thirteenth stop).

Shares are learned per instance (``routing.hotness``); a prefix in every
request or in one conversation is classified the same way everywhere, which is
all instances need to agree. The threshold is a whole replica's share of
traffic by default, far from what conversations and typical tenants carry.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import NamedTuple

import xxhash

from .base import RouteRequest
from .block_index import sampled_positions
from .boundary import candidate_cuts, explicit_cuts
from .chains import ChainCache
from .hashing import Rendered, chain_hashes, cut_hash, prefix_seed, render
from .hotness import Popularity
from .settings import RoutingSettings

__all__ = ["PrefixInfo", "RouteKey", "analyse", "PrefixKeyer"]

_SCRATCH_INFO = "kvgate.prefix"
_SCRATCH_KEY = "kvgate.key"
# A first span this many blocks long has its sampled cuts kept (shorter: cheaper to redo),
# for this many distinct first spans (then forgotten at once: they are recomputed cheaply).
_INNER_MIN_BLOCKS = 16
_INNER_CAPACITY = 4096
_xxh = xxhash.xxh3_64_intdigest
_SPREAD: dict[int, int] = {}


def _spread(n: int) -> int:
    """Throws of a fair n-sided die until every face has come up, on average: n·H_n, rounded up."""
    got = _SPREAD.get(n)
    if got is None:
        harmonic = 0.0
        for k in range(1, n + 1):
            harmonic += 1.0 / k
        got = _SPREAD[n] = math.ceil(n * harmonic - 1e-9)
    return got


# Named tuples rather than frozen dataclasses: both are made for every request, and a
# frozen dataclass costs three times as much to build.
class PrefixInfo(NamedTuple):
    rendered: Rendered
    seed: int
    hashes: list[int]
    explicit: list[int]
    limit: int  # bytes a key may cover (hashed blocks, plus a partial last block)
    block: int


class RouteKey(NamedTuple):
    key: int  # hash of the exact prefix data[:cut]
    cut: int  # bytes of prefix the key covers
    # The deepest wide cut whose traffic has spread (0 if none): a prefix carried by
    # more than a replica's share of the traffic is on every replica that serves any of
    # it, so every replica is credited with it (a system prompt in every request is warm
    # everywhere), once the requests past it could have reached them all (module doc).
    shared: int = 0


def analyse(request: RouteRequest, settings: RoutingSettings, chains: ChainCache | None = None) -> PrefixInfo:
    """Render and hash ``request`` once; later calls with the same settings reuse the result.

    With ``chains``, a prefix hashed for an earlier request is not hashed again.
    """
    tag = (settings.block_chars, settings.max_blocks, settings.boundary_marker)
    cached = request.scratch.get(_SCRATCH_INFO)
    if cached is not None and cached[0] == tag:
        return cached[1]
    rendered = render(request.endpoint, request.body)
    seed = prefix_seed(request.model, request.namespace)
    block = settings.block_chars
    if chains is None:
        hashes = chain_hashes(rendered.data, seed, block, settings.max_blocks)
        ends = None
    else:
        marker = settings.boundary_marker.encode("utf-8", "surrogatepass")
        hashes, ends = chains.analyse(rendered.data, seed, block, settings.max_blocks, rendered.spans, marker)
    limit = len(rendered.data) if len(rendered.data) // block <= len(hashes) else len(hashes) * block
    explicit = explicit_cuts(rendered, settings.boundary_marker, request.boundary_hint, ends)
    info = PrefixInfo(rendered, seed, hashes, explicit, limit, block)
    request.scratch[_SCRATCH_INFO] = (tag, info)
    return info


class PrefixKeyer:
    """Chooses routing keys; owns the per-instance popularity estimate."""

    def __init__(self, settings: RoutingSettings, layers_inside_messages: bool = True,
                 chains: ChainCache | None = None) -> None:
        """``layers_inside_messages``: also cut at sampled block positions, to find layers
        nobody declared inside one message (an organisation's policies inside a long
        system prompt). A policy that finds shared blocks through its index needs only
        message ends and explicit boundaries; a flat prompt, which has no message end
        short of its own end, is cut at sampled positions either way (``_cuts``)."""
        self.settings = settings
        self.popularity = Popularity(max(1000, settings.index_capacity // 4))
        self.chains = chains if chains is not None else ChainCache()
        self._sampled = sampled_positions(settings.max_blocks)
        self._positions = self._sampled if layers_inside_messages else ()
        # Two keyers may key one request (``ttft``'s key and its home's anchor): each keeps its own.
        self._slot = _SCRATCH_KEY + (".layers" if layers_inside_messages else "")
        # First spans' sampled cuts and keys, by the chain hash that names the span (``_cuts``).
        self._inner: dict[int, tuple[list[int], list[int]]] = {}

    def _cuts(self, info: PrefixInfo) -> tuple[list[int], list[int]]:
        """The candidate cuts and their keys. The sampled cuts inside the first span (the
        system prompt or tools an application repeats) are the same for every request
        that starts with it: found once per such prefix, named by its chain hash."""
        data, hashes, seed, block = info.rendered.data, info.hashes, info.seed, info.block
        spans, positions = info.rendered.spans, self._positions
        # A flat prompt (a completions prompt: no turns) has no message end before its own
        # end: cut at message ends alone, its key would be all of it, so a new key and a new
        # home at every turn of a conversation that grows by appending. Its sampled cuts find
        # where the conversation starts (past a wide system prompt). Its first span is all
        # of it, new every time, so its cuts are not kept.
        flat = not any(s.role == "user" for s in spans)
        if flat:
            positions = self._sampled
        inner = min(spans[0].end, info.limit) // block if positions and spans and not flat else 0
        if inner < _INNER_MIN_BLOCKS or any(c <= inner * block for c in info.explicit):
            cuts = candidate_cuts(info.rendered, info.explicit, info.limit, block, positions)
            return cuts, [hashes[c // block - 1] if c % block == 0 else cut_hash(data, hashes, seed, block, c)
                          for c in cuts]
        got = self._inner.get(hashes[inner - 1])
        if got is None:
            if len(self._inner) >= _INNER_CAPACITY:
                self._inner.clear()
            sampled = positions[: bisect_right(positions, inner - 1)]
            got = self._inner[hashes[inner - 1]] = ([(p + 1) * block for p in sampled], [hashes[p] for p in sampled])
        inner_cuts, inner_keys = got
        rest = candidate_cuts(info.rendered, info.explicit, info.limit, block, positions, after=inner_cuts[-1])
        return inner_cuts + rest, inner_keys + [
            hashes[c // block - 1] if c % block == 0 else cut_hash(data, hashes, seed, block, c) for c in rest]

    def key_for(self, request: RouteRequest, replicas: int, learn: bool = True) -> RouteKey:
        """The request's routing key in a fleet of ``replicas``.

        With ``learn`` (the default) the request counts towards popularity, once
        per request however often it is asked; ``learn=False`` is a side-effect
        free peek (what this instance would do, used to measure agreement).
        """
        cached = request.scratch.get(self._slot)
        if cached is not None and cached[0] is self:
            return cached[1]
        info = analyse(request, self.settings, self.chains)
        n = max(replicas, 1)
        wide_share = self.settings.hot_fraction / n
        cuts, keys = self._cuts(info)
        popularity = self.popularity
        if learn:
            # Every cut is counted, not only the walked ones: a deeper prefix's share
            # must be known from the start, or it would lag behind its parent's.
            i = popularity.first_narrow(keys, wide_share, record=True)
            popularity.tick()
        else:
            i = popularity.first_narrow(keys, wide_share, record=False)
        # Credited everywhere only once spread (module doc): until it turned wide, its requests
        # shared its key and went to one home; past it, they go to their own keys' homes, which
        # rendezvous hashing draws like a fair die, and a die reaches all n faces in n·H_n
        # throws on average (the coupon collector). This instance's throws alone are counted.
        j, spread = i - 1, _spread(n)
        while j >= 0 and popularity.since_wide(keys[j]) < spread:
            j -= 1
        chosen = RouteKey(keys[i], cuts[i], cuts[j] if j >= 0 else 0) if keys else RouteKey(info.seed, 0)
        if learn:
            request.scratch[self._slot] = (self, chosen)
        return chosen
