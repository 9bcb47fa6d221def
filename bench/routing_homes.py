"""Do independent gateway instances agree on a request's home? The diagnosis of ``ttft``'s scale-out.

    KVGATE_INTERPRETED=1 .venv/bin/python -m bench.routing_homes      # 5 suite families, seed 2, 4 instances
    KVGATE_INTERPRETED=1 .venv/bin/python -m bench.routing_homes --families layered-4orgs-closed8 --seeds 1 2 3
    KVGATE_INTERPRETED=1 .venv/bin/python -m bench.routing_homes --seeds 1 2 3 --rows none --longer 4
                                          # runs 4x the family's length: what is the instances' start

With several instances, ``ttft`` presumes a request's context at its *home*:
the first choice of its anchor, the shallowest prefix that is not wide
(``routing.keys``). Whether a prefix is wide is learned per instance from the
requests it routes (``routing.hotness``), so each instance judges from its own
random 1/N of the traffic. A prefix near the threshold (an organisation with
about one replica's share) is judged wide by some instances and narrow by
others, and they name different homes for the same request.

For each family and seed, rows over the same requests and fleet (pools sized
as in the suite):

* ``ttft``: one instance (nothing is presumed alone);
* ``ttft xN``: N instances sharing nothing, as in ``bench.routing_suite``;
  ``homes agree`` is the share of decisions where all N name the same home;
The other rows are oracles, not deployable modes: each gives the N instances
one piece of knowledge in common, to find which missing piece costs what.

* ``one popularity``: they read and write one estimate of the anchors'
  popularity, so they judge every prefix alike (from all the traffic);
* ``one index``: they read and write one index and pool model, so each knows
  where every instance sent every prompt; nothing is presumed (the others'
  share is taken as 0: the index already holds their requests);
* ``one index and backlog``: also one record of the requests sent and not
  started (``routing.backlog``): every instance knows everything one instance
  would, and the row equals one instance's.

And one deployable row (``--rows shared``):

* ``shared index``: ``routing.share_index`` on: each instance publishes every
  placement as a block fact (``routing.gossip``), delivered to the others
  ``bench.routing.SHARE_DELAY_S`` later; nothing is presumed.

After the table: per row, its hit ratio over one instance's per run (``x1
share``), and in how many runs it keeps at least 0.95 of it; per family, the
medians over seeds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable, Iterator, Sequence

import routing.ttft_affinity as ttft_module
from routing._native import compiled
from routing.base import ReplicaView, RouteRequest
from routing.settings import RoutingSettings
from routing.ttft_affinity import TTFTAffinity

from .pools import DEFAULT_RATIO, pool_size
from .routing import SHARE_DELAY_S, ideal_hit_ratio, calibrate
from .routing_sim import SimSettings, simulate
from .routing_stats import RunStats
from .routing_suite import _PROBE, requests_for
from .workloads.generated import FAMILIES, build

FAMILY_NAMES = ("layered-4orgs-closed8", "layered-8orgs-closed8", "heavy4-closed8", "heavy8-poisson-5s",
                "orgs-poisson-0.5")


# What each row's instances have in common (besides the scrape every instance reads).
ROWS = (("", ()), (", one popularity", ("popularity",)), (", one index", ("index",)),
        (", one index and backlog", ("index", "backlog")), (", shared index", ("share",)))
# ``--rows`` names them (one instance's row always runs: the others are compared with it).
ROW_NAMES = dict(zip(("none", "popularity", "index", "backlog", "shared"), ROWS))
# A row keeps one instance's reuse where its hit ratio is at least this share of it.
KEEPS = 0.95


class _Instances:
    """Makes the N policies of one run, and counts whether they name the same home at each decision."""

    def __init__(self, common: tuple[str, ...]) -> None:
        self.common = common
        self.policies: list[TTFTAffinity] = []
        self.decisions = 0
        self.agreed = 0

    def make(self, clock: Callable[[], float]) -> TTFTAffinity:
        policy = TTFTAffinity(RoutingSettings(share_index="share" in self.common), clock)
        if self.policies:
            first = self.policies[0]
            if "popularity" in self.common:
                policy.anchors.popularity = first.anchors.popularity
            if "index" in self.common:
                policy.index, policy.pools, policy.bits = first.index, first.pools, first.bits
            if "backlog" in self.common:
                policy.backlog = first.backlog
        decide = policy.prefer

        def prefer(request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
            if len(self.policies) > 1:
                self.decisions += 1
                self.agreed += len({p.home(request, replicas) for p in self.policies}) == 1
            return decide(request, replicas)

        policy.prefer = prefer  # type: ignore[method-assign]
        self.policies.append(policy)
        return policy


@contextmanager
def _nothing_presumed(on: bool) -> Iterator[None]:
    """With one index, the others' share of the queues is taken as 0: what they sent is in it."""
    others = ttft_module.waiting_and_share
    if on:
        ttft_module.waiting_and_share = lambda replicas: (others(replicas)[0], 0.0)  # type: ignore[assignment]
    try:
        yield
    finally:
        ttft_module.waiting_and_share = others  # type: ignore[assignment]


def run(family_name: str, seed: int, instances: int,
        which: Sequence[tuple[str, tuple[str, ...]]] = ROWS,
        longer: float = 1.0) -> list[tuple[str, RunStats, float | None]]:
    family = next(f for f in FAMILIES if f.name == family_name)
    settings = SimSettings(replicas=family.replicas, seed=seed)
    w = build(family, seed, requests_for(build(family, seed, _PROBE), family, settings, family.seconds * longer))
    pool = pool_size(w, family.replicas, DEFAULT_RATIO, clients=family.clients, block_size=settings.block_size)
    settings = replace(settings, kv_tokens=pool.kv_tokens)
    if family.closed_loop is None:
        calibrate(w, ideal_hit_ratio(w), settings, family.load)
    rows: list[tuple[str, RunStats, float | None]] = []
    for label, n, common in [("ttft", 1, ())] + [(f"ttft x{instances}{suffix}", instances, common)
                                                   for suffix, common in which]:
        made = _Instances(common)
        # Block facts reach the other instances as through Redis (bench.routing's shared rows).
        share_s = SHARE_DELAY_S if "share" in common else None
        with _nothing_presumed("index" in common):
            stats = simulate(w, made.make, replace(settings, instances=n, share_s=share_s))
        # With one index or block facts nothing is presumed (the anchors learn nothing): no home to agree on.
        agreed = made.agreed / made.decisions if made.decisions and not {"index", "share"} & set(common) else None
        rows.append((label, stats, agreed))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.routing_homes", description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=list(FAMILY_NAMES), choices=[f.name for f in FAMILIES])
    p.add_argument("--seeds", type=int, nargs="+", default=[2])
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--rows", nargs="+", default=list(ROW_NAMES), choices=list(ROW_NAMES),
                   help="rows beside one instance's: none (sharing nothing), the oracles popularity, index, "
                        "backlog (one index and backlog), and shared (routing.share_index's block facts)")
    p.add_argument("--longer", type=float, default=1.0,
                   help="runs this many times the family's length (how much of a loss is the instances' start)")
    args = p.parse_args(argv)
    rows = [ROW_NAMES[r] for r in args.rows]
    if compiled():
        # The oracle rows replace a module function, which compiled callers would not see.
        p.error("run interpreted: KVGATE_INTERPRETED=1 python -m bench.routing_homes")
    print("| family | seed | row | hit | TTFT p50 | TTFT p95 | homes agree |")
    print("|---|---|---|---|---|---|---|")
    agree: dict[str, list[float]] = {}
    # Per row label: per family, the (hit, p95 s, share of one instance's hit) of each seed.
    runs: dict[str, dict[str, list[tuple[float, float, float]]]] = {}
    for family in args.families:
        for seed in args.seeds:
            got = run(family, seed, args.instances, rows, args.longer)
            single = got[0][1].hit_ratio
            for label, s, agreed in got:
                cell = "" if agreed is None else f"{agreed:.0%}"
                if agreed is not None:
                    agree.setdefault(label, []).append(agreed)
                share = s.hit_ratio / single if single else 1.0
                runs.setdefault(label, {}).setdefault(family, []).append((s.hit_ratio, s.ttft(0.95), share))
                print(f"| {family} | {seed} | {label} | {s.hit_ratio:.3f} | {s.ttft(0.5) * 1e3:.0f} ms "
                      f"| {s.ttft(0.95) * 1e3:.0f} ms | {cell} |", flush=True)
    for label, xs in agree.items():
        print(f"\n{label}: homes agree on {statistics.median(xs):.0%} of decisions (median over runs)")
    print("\n| row | family | hit (median) | TTFT p95 (median) | x1 share (median) |")
    print("|---|---|---|---|---|")
    for label, families in runs.items():
        for family, seeded in families.items():
            print(f"| {label} | {family} | {statistics.median(x[0] for x in seeded):.3f} "
                  f"| {statistics.median(x[1] for x in seeded) * 1e3:.0f} ms "
                  f"| {statistics.median(x[2] for x in seeded):.3f} |")
    for label, families in list(runs.items())[1:]:
        shares = [x[2] for seeded in families.values() for x in seeded]
        kept = sum(x >= KEEPS for x in shares)
        print(f"\n{label}: keeps >= {KEEPS} of one instance's hit ratio in {kept} of {len(shares)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
