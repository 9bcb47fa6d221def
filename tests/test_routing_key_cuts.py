"""The keyer's per-prefix memo of the cuts inside a first span changes nothing: same cuts, same keys."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from routing import RouteRequest, RoutingSettings
from routing.boundary import candidate_cuts
from routing.hashing import cut_hash
from routing.keys import PrefixKeyer, analyse

words = st.lists(st.sampled_from(["policy", "refund", "order", "café", "λ", "tool", "\n", "  "]),
                 min_size=0, max_size=600)


@settings(max_examples=60, deadline=None)
@given(system=words, user=words, turns=st.integers(1, 3), marker=st.booleans())
def test_memoised_cuts_equal_the_cuts_computed_afresh(system: list[str], user: list[str], turns: int,
                                                        marker: bool) -> None:
    cfg = RoutingSettings()
    keyer = PrefixKeyer(cfg)
    text = " ".join(system)
    if marker:
        text = text[: len(text) // 2] + cfg.boundary_marker + text[len(text) // 2:]
    msgs = [{"role": "system", "content": text}] if text else []
    for k in range(turns):
        msgs += [{"role": "user", "content": f"turn {k}: " + " ".join(user)}, {"role": "assistant", "content": "ok"}]
    for _ in range(2):  # the second pass is served from the memo
        request = RouteRequest("chat", "m", "t", {"model": "m", "messages": msgs[:-1]})
        info = analyse(request, cfg, keyer.chains)
        cuts = candidate_cuts(info.rendered, info.explicit, info.limit, info.block, keyer._positions)
        keys = [info.hashes[c // info.block - 1] if c % info.block == 0
                else cut_hash(info.rendered.data, info.hashes, info.seed, info.block, c) for c in cuts]
        assert keyer._cuts(info) == (cuts, keys)
