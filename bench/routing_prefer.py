"""What a routing decision costs in process: ``prefer`` + ``observe`` per policy, on one chat request shape.

    .venv/bin/python -m bench.routing_prefer                     # round_robin, prefix_affinity, ttft; 4K tokens
    .venv/bin/python -m bench.routing_prefer --prompt-tokens 282 --requests 5000
    .venv/bin/python -m bench.routing_prefer --evict-mb 8       # caches evicted between decisions

The request is ``bench.overhead``'s: a support assistant's system prompt of
about ``--prompt-tokens`` tokens and one of 256 short user turns, over 4
replica views that report nothing (so no policy waits on a scrape). Each
request is a fresh ``RouteRequest`` (parsed once, as the gateway builds it), so
rendering, hashing and the chain cache are paid as a request pays them; the
policies are measured interleaved, request by request, so a busy machine slows
them alike. The first ``--warmup`` requests are left out (the chain cache and
the index fill). ``bench.overhead`` measures the same through a real kvgate.

Inside kvgate a decision costs more than here (about 1.6x: ``bench.overhead``
prints what it costs inside each kvgate): between two decisions the gateway's other work (parsing,
tenant policy, the transport) evicts the policy's code and data from the caches. ``--evict-mb N`` writes
N MiB between requests (untimed) to show that cold figure in process. Routing runs
compiled where it was built (``routing._native``); ``KVGATE_INTERPRETED=1`` measures the source.
"""

from __future__ import annotations

import argparse
import statistics
import time

from routing import RouteFeedback, RouteRequest, RoutingSettings
from routing.prefix_affinity import PrefixAffinity
from routing.round_robin import RoundRobin
from routing.ttft_affinity import TTFTAffinity

from .overhead import _TOKENS_PER_WORD, _TURNS, system_prompt
from .routing_sim import SimView

POLICIES = {
    "round_robin": lambda: RoundRobin(),
    "prefix_affinity": lambda: PrefixAffinity(RoutingSettings()),
    "ttft": lambda: TTFTAffinity(RoutingSettings()),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.routing_prefer", description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--evict-mb", type=float, default=0.0, help="MiB written between requests (untimed)")
    args = p.parse_args(argv)
    evict = bytearray(int(args.evict_mb * (1 << 20)))
    lines = len(evict[::64])
    system = system_prompt(round(args.prompt_tokens / _TOKENS_PER_WORD))
    turns = [f"Question {i}: how do I change the billing address on order {1000 + i}?" for i in range(_TURNS)]
    policies = {name: POLICIES[name]() for name in args.policies}
    views = {name: [SimView(f"r{i}") for i in range(4)] for name in args.policies}
    took: dict[str, list[float]] = {name: [] for name in args.policies}
    for i in range(args.requests):
        body = {"model": "m", "messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": turns[i % _TURNS]}]}
        for name, policy in policies.items():
            if evict:
                evict[::64] = bytes(lines)  # one write a cache line
            request = RouteRequest("chat", "m", "", dict(body))
            started = time.perf_counter()
            chosen = policy.prefer(request, views[name])[0]
            policy.observe(request, RouteFeedback(chosen.name, None, None, True))
            if i >= args.warmup:
                took[name].append(time.perf_counter() - started)
    print(f"prefer + observe, {len(system)}-character system prompt (~{args.prompt_tokens} tokens), "
          f"{args.requests - args.warmup} requests each, interleaved"
          + (f", {args.evict_mb:g} MiB evicted between requests" if evict else ""))
    base = statistics.median(took[args.policies[0]])
    for name, xs in took.items():
        xs.sort()
        p50, p99 = statistics.median(xs), xs[int(0.99 * (len(xs) - 1))]
        print(f"  {name:16s} p50 {p50 * 1e6:7.1f} us  p99 {p99 * 1e6:7.1f} us  "
              f"(p50 over {args.policies[0]}: {(p50 - base) * 1e6:+.1f} us)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
