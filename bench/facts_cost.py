"""What the routing facts cost the instance that applies them (``routing.share_index``).

Each instance applies every other instance's facts, so what one spends on them
grows with the requests routed anywhere in the fleet, not with its own. This
routes a generated family's requests through one ``ttft`` instance, drains the
facts it publishes (a block fact per placement, a ``DONE`` per first token),
and times a second instance decoding them as ``gateway.routing_sync`` receives
them (JSON batches of 100) and applying them (``learn_remote``), per fleet
request. Compiled as kvgate runs unless ``KVGATE_INTERPRETED=1``.

    python -m bench.facts_cost
    python -m bench.facts_cost --families layered-8orgs-closed8 --requests 5000
"""

from __future__ import annotations

import argparse
import time

from bench.routing_sim import SimView
from bench.workloads.generated import FAMILIES, build
from routing import RouteFeedback, RouteRequest, RoutingSettings, _native
from routing.gossip import decode, encode
from routing.ttft_affinity import TTFTAffinity

DEFAULT_FAMILIES = ("layered-8orgs-closed8", "heavy4-closed8", "chat-closed32")
BATCH = 100  # facts per stream entry (gateway.routing_sync)


def measure(family: str, seed: int, n: int) -> dict[str, float]:
    fam = next(f for f in FAMILIES if f.name == family)
    w = build(fam, seed, n)
    shared = RoutingSettings(share_index=True)
    sender, receiver = TTFTAffinity(shared), TTFTAffinity(shared)
    # Rates and pool sizes as scraped, so the receiver's pool model runs as it does in service.
    fleet = [SimView(f"r{i}", prefill_rate=20_000.0, kv_tokens=100_000.0) for i in range(fam.replicas)]
    facts = []
    for req in w.requests:
        route = RouteRequest(req.endpoint, req.model, req.namespace, req.body())
        replica = sender.prefer(route, fleet)[0].name
        sender.started(route, replica)
        sender.observe(route, RouteFeedback(replica, req.prompt_tokens, 0, True, ttft_s=0.05))
        assert sender.gossip is not None
        facts.extend(sender.gossip.drain())
    receiver.prefer(RouteRequest("chat", "m", "n", {"messages": [{"role": "user", "content": "x"}]}), fleet)
    wire = [encode(facts[i:i + BATCH]).encode() for i in range(0, len(facts), BATCH)]
    t = time.perf_counter()
    decoded = [f for batch in wire for f in decode(batch)]
    decode_s = time.perf_counter() - t
    apply_us = []
    for f in decoded:
        t = time.perf_counter_ns()
        receiver.learn_remote(f)
        apply_us.append((time.perf_counter_ns() - t) / 1000)
    apply_us.sort()
    return {"facts": len(decoded), "bytes_per_request": sum(map(len, wire)) / len(w.requests),
            "apply_p50_us": apply_us[len(apply_us) // 2], "apply_p99_us": apply_us[int(len(apply_us) * 0.99)],
            "per_request_us": (decode_s * 1e6 + sum(apply_us)) / len(w.requests),
            "decode_per_request_us": decode_s * 1e6 / len(w.requests)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES), choices=[f.name for f in FAMILIES])
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--requests", type=int, default=2000)
    args = p.parse_args(argv)
    print(f"routing {'compiled' if _native.compiled() else 'interpreted'}; {args.requests} requests a family, "
          f"seed {args.seed}")
    print(f"{'family':<24}{'facts':>7}{'bytes/req':>11}{'apply p50':>11}{'apply p99':>11}"
          f"{'decode/req':>12}{'CPU/req':>10}")
    for family in args.families:
        r = measure(family, args.seed, args.requests)
        print(f"{family:<24}{r['facts']:>7.0f}{r['bytes_per_request']:>11.0f}{r['apply_p50_us']:>9.1f}µs"
              f"{r['apply_p99_us']:>9.1f}µs{r['decode_per_request_us']:>10.1f}µs{r['per_request_us']:>8.1f}µs")
    print("CPU/req: decoding and applying one fleet request's facts, on every instance but its sender's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
