"""kvgate's rows in the P/D benchmark (``bench.pd``): kvgate routing the same prefill and decode simulators.

* ``kvgate-always``: every request through a prefill replica (``routing.disaggregation:
  always``), as vLLM's router disaggregates every request; the prefill pick by its own ``ttft``
  policy (``routing.prefill_pick``, the default);
* ``kvgate-always-policy-pick``: the same with ``routing.policy: prefix_affinity`` and the prefill
  pick by it (``routing.prefill_pick: policy``): kvgate's defaults before issues 29 and 26;
* ``kvgate-selective``: remote prefill only when it pays (``routing.disagg.decide``).

Each row runs kvgate as its own process (``bench.chaos_fleet.start_kvgate``) with the fleet's
prefill and decode simulators under their roles. Registered with ``bench.pd.add_row``, so

    python -m bench.pd_kvgate                                    # every row, orgs_layered
    python -m bench.pd_kvgate --rows kvgate-selective vllm-router --workload heavy_orgs

takes ``bench.pd``'s arguments and prints its table with kvgate's rows beside the others.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench import pd
from bench.chaos_fleet import _kill, free_port, kvgate_config, start_kvgate

__all__ = ["kvgate_row", "main"]


def kvgate_row(mode: str, **routing: Any) -> pd.RowStarter:
    def start(fleet: pd.Fleet, workdir: Path, args: argparse.Namespace) -> pd.Route:
        sims = [*fleet.prefill, *fleet.decode]
        config: dict[str, Any] = kvgate_config(free_port(), sims, routing={"disaggregation": mode, **routing},
                                               pool={"metrics_interval_s": 0.5})
        roles = {s.name: "prefill" for s in fleet.prefill} | {s.name: "decode" for s in fleet.decode}
        for replica in config["replicas"]:
            replica["role"] = roles[replica["name"]]
        row_dir = workdir / "-".join(["kvgate", mode, *map(str, routing.values())])
        row_dir.mkdir(parents=True, exist_ok=True)
        gw = start_kvgate(row_dir, config)
        return pd.Route([gw.url], fleet.prefill, fleet.decode, lambda: _kill(gw.proc))

    return start


pd.add_row("kvgate-always", kvgate_row("always"))
pd.add_row("kvgate-always-policy-pick", kvgate_row("always", prefill_pick="policy", policy="prefix_affinity"))
pd.add_row("kvgate-selective", kvgate_row("selective"))


def main(argv: list[str] | None = None) -> int:
    return pd.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
