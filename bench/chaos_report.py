"""The chaos run's report: one table row per scenario (P/D fleets add their decisions and
fallbacks, ``kvgate_pd_*`` on /metrics), then each scenario's errors, notes and repros."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tallies' type only: bench.chaos, which runs the scenarios, imports this
    from bench.chaos import Tally

__all__ = ["format_table", "format_details"]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


# The P/D fallbacks a run counts (kvgate_pd_fallbacks_total's leg and fallback), and their column.
_PD_FALLBACKS = (("prefill", "retry"), ("prefill", "local"), ("decode", "retry"), ("decode", "local"))
_PD_HEAD = ("P/D remote/local", "P/D fallbacks " + "/".join(f"{leg[0].upper()} {to}" for leg, to in _PD_FALLBACKS))


def _pd_columns(t: Tally) -> tuple[str, str]:
    """P/D decisions (remote/local) and fallbacks (``_PD_FALLBACKS``)."""
    def n(name: str, **labels: str) -> str:
        return f"{t.delta(name, **labels):.0f}"
    decisions = "/".join(n("kvgate_pd_decisions_total", decision=d) for d in ("remote", "local"))
    return decisions, "/".join(n("kvgate_pd_fallbacks_total", leg=leg, fallback=to) for leg, to in _PD_FALLBACKS)


def format_table(tallies: list[Tally]) -> str:
    # A P/D fleet's run adds its decisions and fallbacks (kvgate_pd_* on /metrics).
    pd = any(t.delta("kvgate_pd_decisions_total") for t in tallies)
    head = ("scenario", "sent", "ok", "clean errors", "lost", "wrong", "p50/p99 ms (ok)", "cache hits",
            "retries", "ejections", *(_PD_HEAD if pd else ()), "fault exercised")
    rows = [head]
    for t in tallies:
        why = t.unexercised
        rows.append((t.scenario, str(t.sent), str(t.ok), str(t.clean), str(t.lost), str(t.wrong),
                     f"{_ms(t.latency_ms(0.5))}/{_ms(t.latency_ms(0.99))}", str(t.cache_hits),
                     f"{t.retries:.0f}", f"{t.ejections:.0f}", *(_pd_columns(t) if pd else ()),
                     "yes" if why is None else f"NO: {why}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def format_details(tallies: list[Tally]) -> str:
    out = []
    for t in tallies:
        lines = [f"  {n:5d}  {d}" for d, n in sorted(t.details().items())]
        lines += [f"  note: {n}" for n in t.notes]
        lines += [f"  REPRO: {r}" for r in t.repros()]
        if lines:
            out.append(f"{t.scenario} (settled in {t.settle_s:.1f} s):\n" + "\n".join(lines))
    return "\n".join(out)
