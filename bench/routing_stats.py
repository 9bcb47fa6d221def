"""What one simulated run measured (``bench.routing_sim``): hit ratio, TTFT, loads, agreement, belief."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RunStats", "belief_gap"]


@dataclass
class RunStats:
    policy: str
    workload: str
    instances: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    # Per request, in the order of ``ttfts``: how much of its wait was for KV blocks.
    kv_waits: list[float] = field(default_factory=list)
    makespan: float = 0.0
    loads: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    follow_ups: int = 0
    follow_ups_warm: int = 0
    agreement_checked: int = 0
    agreement_same: int = 0
    route_s: float = 0.0
    routed: int = 0
    dropped: int = 0
    wall_s: float = 0.0
    # Requests each replica took over the run.
    requests_per_replica: list[int] = field(default_factory=list)
    # Max over decisions of the chosen replica's in-flight / load_bound, and how many decisions exceeded 1.
    max_bound_ratio: float = 0.0
    over_bound: int = 0
    # Most requests in flight fleet-wide at once (a closed loop never passes its client count).
    max_in_flight: int = 0
    # Each replica's prefill rate as a scrape at the end of the run reads it (routing.rates).
    prefill_rates: list[float | None] = field(default_factory=list)
    # Prompt tokens each replica computed (prefix-cache hits excluded) over the run.
    computed_per_replica: list[int] = field(default_factory=list)
    # How far the policy's belief of what the chosen replica held missed the cached tokens it
    # reported, as a share of the prompt (its ``stats()["belief"]``, over every instance); nan
    # for a policy that keeps no belief.
    belief_gap: float = float("nan")

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def ttft(self, q: float) -> float:
        if not self.ttfts:
            return float("nan")
        xs = sorted(self.ttfts)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    def kv_wait_tail(self, q: float = 0.9) -> float:
        """The mean KV-memory wait of the requests whose TTFT is at or past the ``q`` quantile."""
        if not self.ttfts:
            return float("nan")
        pairs = sorted(zip(self.ttfts, self.kv_waits))
        tail = pairs[min(len(pairs) - 1, int(q * len(pairs))):]
        return sum(w for _, w in tail) / len(tail)

    @property
    def max_over_mean_load(self) -> float:
        mean = sum(self.loads) / len(self.loads) if self.loads else 0.0
        return max(self.loads) / mean if mean else float("nan")

    @property
    def max_over_mean_requests(self) -> float:
        counts = self.requests_per_replica
        mean = sum(counts) / len(counts) if counts else 0.0
        return max(counts) / mean if mean else float("nan")

    @property
    def idle_replicas(self) -> int:
        """Replicas that served no request over the whole run: capacity left unused, which the
        max/mean of the request counts does not show."""
        return sum(1 for c in self.requests_per_replica if c == 0)

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.makespan if self.makespan else 0.0

    @property
    def warm_share(self) -> float:
        return self.follow_ups_warm / self.follow_ups if self.follow_ups else float("nan")

    @property
    def agreement(self) -> float:
        return self.agreement_same / self.agreement_checked if self.agreement_checked else float("nan")

    @property
    def route_us(self) -> float:
        return self.route_s / self.routed * 1e6 if self.routed else float("nan")


def belief_gap(policies: list) -> float:
    """The policies' belief gaps (``stats()["belief"]``), weighted by the requests each checked."""
    gaps = []
    for policy in policies:
        stats = getattr(policy, "stats", None)
        belief = stats().get("belief") if callable(stats) else None
        if belief and belief.get("gap_share") is not None:
            gaps.append((belief["requests"], belief["gap_share"]))
    n = sum(k for k, _ in gaps)
    return sum(k * g for k, g in gaps) / n if n else float("nan")
