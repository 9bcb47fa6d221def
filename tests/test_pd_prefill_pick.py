"""The prefill pick on a P/D fleet, over simulated replicas that speak vLLM's NixlConnector protocol
(vllm_sim.pd), on loopback: by default its own ``ttft`` policy (routing.prefill_pick), or the
fleet's policy (routing.prefix_affinity) choosing among the prefill replicas for a request's
prefill leg (``RouteRequest.leg``).

A prefill replica decodes nothing: the legs in flight there are prefill work, which the policy
already counts as queued prefill. Counted once more as decode load, a typical request each, they
sent a leg to a cold prefill replica beside the warm one (docs/disaggregation.md, "Benchmark").
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import openai

from tests.support.pd_stack import PDStack
from tests.support.stack import MODEL

PREFILLS = ("p1", "p2")


def _ask(stack: PDStack, system: str, question: str) -> None:
    with openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as client:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[  # type: ignore[arg-type]
            {"role": "system", "content": system}, {"role": "user", "content": question}])


def _eventually(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_the_prefill_pick_is_its_own_ttft_policy_by_default() -> None:
    """Its own policy, over the prefill replicas only: it learns each leg's answer (the leg's time
    to first token), sends the next leg of a context where it was prefilled, and explains itself."""
    # The fleet's own policy is set apart from ttft, so the prefill pick is seen to be its own.
    stack = PDStack({"p1": "prefill", "p2": "prefill", "d1": "decode"},
                    routing={"disaggregation": "always", "policy": "prefix_affinity"})
    try:
        system = "You are the support desk of a router maker; the manuals follow. " * 60
        requests = {n: stack.requests(n) for n in PREFILLS}
        _ask(stack, system, "first question")
        warm = next(n for n in PREFILLS if stack.requests(n) > requests[n])
        cold = next(n for n in PREFILLS if n != warm)
        cached = stack.runtime.disagg.prefill_cached
        for question in ("second question", "third question"):
            _ask(stack, system, question)
        assert stack.requests(cold) == requests[cold]
        assert stack.runtime.disagg.prefill_cached - cached >= 2 * 700  # the system prompt, reused twice
        out = stack.admin_post("/admin/routing/explain", {"body": {"model": MODEL, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": "why?"}]}}).json()
        assert out["policy"] == "prefix_affinity" and out["prefill_policy"] == "ttft"
        rows = {r["replica"]: r for r in out["prefill_replicas"]}
        assert set(rows) == set(PREFILLS) and rows[warm]["pick"]
        assert rows[warm]["source"] in ("index", "key") and rows[cold]["source"] == "none"
        assert rows[warm]["uncached"] < rows[cold]["uncached"]
        pick = stack.admin_get("/admin/routing")["prefill_pick"]
        assert pick["policy"] == "ttft" and pick["decisions"] == 3
    finally:
        stack.close()


def test_a_prefill_leg_goes_to_the_warm_replica_beside_a_leg_in_flight_there() -> None:
    stack = PDStack({"p1": "prefill", "p2": "prefill", "d1": "decode"},
                    routing={"disaggregation": "always", "prefill_pick": "policy", "policy": "prefix_affinity"})
    held: list[Any] = []
    try:
        # Three long cold prompts: this instance's typical request is large, about twice the one below.
        for i in range(3):
            _ask(stack, f"Archive {i} of the maintenance logs. " * 300, "summarise")
        system = "You are the support desk of a router maker; the manuals follow. " * 60
        requests = {n: stack.requests(n) for n in PREFILLS}
        _ask(stack, system, "first question")
        warm = next(n for n in PREFILLS if stack.requests(n) > requests[n])
        cold = next(n for n in PREFILLS if n != warm)
        # A second question's leg held at the warm replica before its prefill (a small one: its
        # prefix is warm there). Only that leg is held: the fault is read when a request arrives.
        stack.faults(warm, stall_before_first_token_s=2.0)
        waiting = threading.Thread(target=lambda: held.append(_ask(stack, system, "second question")))
        waiting.start()
        assert _eventually(lambda: stack.requests(warm) == requests[warm] + 2)
        stack.faults(warm, stall_before_first_token_s=0.0)
        assert stack.runtime.pool.replicas[warm].in_flight == 1
        cached = stack.runtime.disagg.prefill_cached
        before = {n: stack.requests(n) for n in PREFILLS}
        _ask(stack, system, "third question")
        # Warm: the held leg's prefill is small and queued there, and nothing decodes beside it.
        assert stack.requests(warm) == before[warm] + 1 and stack.requests(cold) == before[cold]
        assert stack.runtime.disagg.prefill_cached - cached >= 700  # the system prompt, reused
        # What /admin/routing/explain shows: no decode load on the prefill replicas, some on the decode side.
        out = stack.admin_post("/admin/routing/explain", {"body": {"model": MODEL, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": "why?"}]}}).json()
        assert [r["decode_weight"] for r in out["prefill_replicas"]] == [0.0, 0.0]
        assert all(r["decode_weight"] > 0 for r in out["replicas"])
        waiting.join(10)
        assert held == [None]
    finally:
        stack.close()
