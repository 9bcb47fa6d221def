"""Tables and the plot for ``bench/routing.py`` (formatting only; no simulation here).

Columns: ``hit`` is the fleet's prefix-cache hit ratio (tokens), absolute;
``%ideal`` that over one infinite cache's; ``%ref`` over the run-level bounded
omniscient reference's (``bench.routing_reference``, ``run_bounded_reference``:
greedy longest cached prefix, each replica within ceil(1.3 x mean) of the
requests placed over the run); ``max/mean`` is time-averaged replica
load; ``req m/m`` max/mean per-replica request counts over the run;
``if/bound`` the max over decisions of the chosen replica's in-flight over
the bounded-loads cap (above 1: the cap was broken at least once).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .routing_stats import RunStats

__all__ = ["Row", "WorkloadReport", "format_table", "write_json", "plot"]


@dataclass
class Row:
    label: str
    stats: RunStats
    ideal: float
    reference: float | None = None  # the run-level bounded reference's hit ratio on the same replay

    @property
    def of_reference(self) -> float:
        return self.stats.hit_ratio / self.reference if self.reference else float("nan")

    def cells(self) -> list[str]:
        s = self.stats
        pct = s.hit_ratio / self.ideal if self.ideal else float("nan")
        return [
            self.label, str(s.instances), f"{s.hit_ratio:.3f}", _pct(pct), _pct(self.of_reference),
            _secs(s.ttft(0.5)), _secs(s.ttft(0.95)), f"{s.throughput:,.0f}",
            _num(s.max_over_mean_load), _num(s.max_over_mean_requests), _num(s.max_bound_ratio),
            _pct(s.warm_share), _pct(s.agreement), _pct(s.belief_gap), _num(s.route_us, 0),
        ]


@dataclass
class WorkloadReport:
    name: str
    description: str
    ideal: float
    rate: float
    rows: list[Row] = field(default_factory=list)
    reference: float | None = None
    notes: list[str] = field(default_factory=list)
    pool: str = ""  # how each replica's KV pool was sized (bench.pools.PoolSize.describe)
    pool_tokens: int | None = None
    working_set: int | None = None


HEADER = ["policy", "inst", "hit", "%ideal", "%ref", "TTFT p50", "TTFT p95", "out tok/s", "max/mean",
          "req m/m", "if/bound", "warm f/u", "agree", "belief", "route us"]


def _pct(x: float) -> str:
    return "-" if x != x else f"{x:.0%}"


def _num(x: float, digits: int = 2) -> str:
    return "-" if x != x else f"{x:.{digits}f}"


def _secs(x: float) -> str:
    if x != x:
        return "-"
    return f"{x * 1000:.0f}ms" if x < 1 else f"{x:.2f}s"


def format_table(reports: list[WorkloadReport]) -> str:
    lines: list[str] = []
    for rep in reports:
        lines.append(f"\n## {rep.name}: {rep.description}")
        ref = f"; run-bounded reference {rep.reference:.3f}" if rep.reference is not None else ""
        lines.append(f"ideal hit ratio (one infinite cache) {rep.ideal:.3f}{ref}; arrival rate {rep.rate:.2f} req/s")
        if rep.pool:
            lines.append(rep.pool)
        table = [HEADER] + [row.cells() for row in rep.rows]
        widths = [max(len(r[i]) for r in table) for i in range(len(HEADER))]
        for k, r in enumerate(table):
            lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.extend(f"  {n}" for n in rep.notes)
    return "\n".join(lines)


def write_json(reports: list[WorkloadReport], path: Path) -> None:
    out = []
    for rep in reports:
        rows = []
        for row in rep.rows:
            s = row.stats
            rows.append({
                "label": row.label, "instances": s.instances, "hit_ratio": s.hit_ratio,
                "fraction_of_ideal": s.hit_ratio / rep.ideal if rep.ideal else None,
                "fraction_of_reference": _nan_none(row.of_reference),
                "ttft_p50_s": s.ttft(0.5), "ttft_p95_s": s.ttft(0.95), "throughput_tok_s": s.throughput,
                "max_over_mean_load": s.max_over_mean_load, "warm_follow_up_share": _nan_none(s.warm_share),
                "agreement": _nan_none(s.agreement), "belief_gap": _nan_none(s.belief_gap),
                "route_us": _nan_none(s.route_us),
                "requests_per_replica": s.requests_per_replica,
                "max_over_mean_requests": _nan_none(s.max_over_mean_requests),
                "max_in_flight_over_bound": s.max_bound_ratio, "decisions_over_bound": s.over_bound,
                "dropped": s.dropped, "wall_s": s.wall_s,
            })
        out.append({"workload": rep.name, "description": rep.description, "ideal": rep.ideal,
                    "reference": rep.reference, "pool_tokens": rep.pool_tokens, "working_set_tokens": rep.working_set,
                    "pool": rep.pool, "rate": rep.rate, "rows": rows, "notes": rep.notes})
    path.write_text(json.dumps(out, indent=1))


def _nan_none(x: float) -> float | None:
    return None if x != x else x


def plot(reports: list[WorkloadReport], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({row.label for rep in reports for row in rep.rows}, key=_label_order(reports))
    fig, axes = plt.subplots(1, 2, figsize=(15, 6))
    width = 0.8 / max(1, len(labels))
    colours = [plt.get_cmap("tab20")(i) for i in range(20)]
    for j, label in enumerate(labels):
        xs, hits, p95 = [], [], []
        for i, rep in enumerate(reports):
            row = next((r for r in rep.rows if r.label == label), None)
            if row is None:
                continue
            xs.append(i + (j - len(labels) / 2) * width + width / 2)
            hits.append(row.stats.hit_ratio / rep.ideal if rep.ideal else 0.0)
            p95.append(max(row.stats.ttft(0.95), 1e-3))
        colour = colours[(2 * j) % 20 if j < 10 else (2 * j + 1) % 20]
        axes[0].bar(xs, hits, width, label=label, color=colour)
        axes[1].bar(xs, p95, width, color=colour)
    for ax, title in ((axes[0], "fleet prefix-cache hit ratio / ideal"), (axes[1], "TTFT p95 (s, log)")):
        ax.set_xticks(range(len(reports)), [rep.name for rep in reports])
        ax.set_title(title)
    axes[1].set_yscale("log")
    axes[0].set_ylim(0, 1.05)
    fig.legend(loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label_order(reports: list[WorkloadReport]):
    order: dict[str, int] = {}
    for rep in reports:
        for row in rep.rows:
            order.setdefault(row.label, len(order))
    return lambda label: order.get(label, math.inf)
