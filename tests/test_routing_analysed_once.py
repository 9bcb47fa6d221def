"""A request is rendered and hashed once, however many stages read its analysis; a repeated prefix is not re-hashed."""

from __future__ import annotations

import openai
import pytest

from routing.boundary import marker_ends
from routing.chains import ChainCache
from routing.hashing import chain_hashes, render
from tests.support.stack import start_stack

SYSTEM = "You are the support assistant of Example Corp. Follow the handbook. " * 60  # ~1K tokens


@pytest.mark.parametrize("policy", ["prefix_affinity", "consistent_hash"])
def test_each_request_is_analysed_once_and_its_shared_prefix_hashed_once(policy: str) -> None:
    stack = start_stack(3, routing={"policy": policy})
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0)
        chains = stack.runtime.policy.keyer.chains  # type: ignore[attr-defined]
        for i in range(12):
            stream = client.chat.completions.create(
                model="sim-model", max_tokens=4, stream=i % 2 == 0,
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}])
            if i % 2 == 0:
                for _ in stream:  # type: ignore[union-attr]
                    pass
        # prefer, observe and the admin counters all read one analysis per request ...
        assert chains.calls == 12
        # ... and the system prompt's blocks were chained for the first request only.
        assert chains.misses == 1 and chains.hits == 11
    finally:
        stack.close()


def test_a_stored_prefix_gives_the_same_chain_as_hashing_afresh() -> None:
    cache = ChainCache(capacity=10_000)
    for turn in range(1, 6):
        msgs = [{"role": "system", "content": SYSTEM}]
        for k in range(turn):
            msgs += [{"role": "user", "content": f"q{k} " * 50}, {"role": "assistant", "content": f"a{k} " * 40}]
        msgs.append({"role": "user", "content": "and now?"})
        r = render("chat", {"messages": msgs})
        for seed in (1, 2):  # another tenant's seed never reuses the first's chain
            assert cache.chain(r.data, seed, 64, 2048, r.spans) == chain_hashes(r.data, seed, 64, 2048)
    assert cache.hits > 0


def test_markers_inside_a_stored_prefix_are_found_as_if_searched_afresh() -> None:
    marker = "<!-- kvgate:cache-boundary -->"
    cache = ChainCache(capacity=10_000)
    system = f"Org policies. {marker} " + "Handbook text. " * 80
    for turn in range(1, 5):
        msgs = [{"role": "system", "content": system}]
        for k in range(turn):
            # A marker at the very end of a message: it ends where the stored context does.
            msgs += [{"role": "user", "content": f"q{k} " * 30 + marker},
                     {"role": "assistant", "content": f"a{k} " * 30}]
        msgs.append({"role": "user", "content": f"now {marker} what?"})
        r = render("chat", {"messages": msgs})
        hashes, ends = cache.analyse(r.data, 1, 64, 2048, r.spans, marker.encode())
        assert hashes == chain_hashes(r.data, 1, 64, 2048)
        assert ends == marker_ends(r.data, marker.encode()) and len(ends) == turn + 2
    assert cache.hits == 3
