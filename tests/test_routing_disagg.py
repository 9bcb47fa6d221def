"""The P/D decision (routing.disagg.decide): remote prefill or local, from its named terms."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from routing.disagg import Terms, decide


def terms(**kw: float | None) -> Terms:
    base: dict[str, float | None] = dict(uncached_decode=4000.0, uncached_prefill=4000.0, rate_decode=10_000.0,
                                         rate_prefill=10_000.0, decoding=8.0, prefill_wait_s=0.0,
                                         transfer_s_per_token=1e-5, leg_s=0.005)
    base.update(kw)
    return Terms(**base)  # type: ignore[arg-type]


def test_a_long_uncached_prompt_beside_running_decodes_goes_remote() -> None:
    d = decide(terms())
    assert d.remote and d.reason == "remote"
    # 4000 tokens at 10k/s: 0.4 s here, and each of the 8 decodes running there waits through it.
    assert math.isclose(d.local_s, 0.4) and math.isclose(d.stall_s, 3.2)
    assert math.isclose(d.transfer_s, 0.04) and math.isclose(d.prefill_s, 0.4)
    assert math.isclose(d.remote_s, 0.4 + 0.04 + 0.005)


def test_a_follow_up_turn_whose_prompt_the_decode_replica_holds_stays_local() -> None:
    # 20 uncached tokens: 2 ms of local prefill (18 ms with the stall) against a 5 ms leg plus a
    # cold prefill replica's 4000 tokens.
    d = decide(terms(uncached_decode=20.0))
    assert not d.remote and d.reason in ("below_threshold", "prefill_colder")
    # Its threshold is the leg over what each moved token saves on a cold, idle prefill side.
    assert math.isclose(d.saved_per_token, 9 / 10_000 - 1e-5 - 1 / 10_000)
    assert math.isclose(d.threshold, 0.005 / d.saved_per_token)


def test_the_threshold_splits_remote_from_local_on_an_idle_cold_prefill_side() -> None:
    t = decide(terms()).threshold
    assert not decide(terms(uncached_decode=t * 0.99, uncached_prefill=t * 0.99)).remote
    assert decide(terms(uncached_decode=t * 1.01, uncached_prefill=t * 1.01)).remote


def test_a_prefill_queue_deeper_than_the_transfer_saves_keeps_it_local() -> None:
    d = decide(terms())
    assert not decide(terms(prefill_wait_s=d.headroom_s * 1.01)).remote
    deep = decide(terms(prefill_wait_s=d.headroom_s * 1.01))
    assert deep.reason == "prefill_queue"
    assert decide(terms(prefill_wait_s=d.headroom_s * 0.99)).remote


def test_a_transfer_dearer_than_the_prefill_it_saves_never_disaggregates() -> None:
    d = decide(terms(transfer_s_per_token=1.0))
    assert not d.remote and d.threshold == math.inf and d.as_dict()["threshold"] is None


def test_nothing_uncached_stays_local() -> None:
    assert decide(terms(uncached_decode=0.0)).reason == "nothing_uncached"


def test_without_rates_the_figures_are_tokens_and_the_learned_seconds_are_not_mixed_in() -> None:
    d = decide(terms(rate_decode=None, transfer_s_per_token=5.0, leg_s=9.0))
    assert d.transfer_s == 0.0 and math.isclose(d.local_s, 4000.0)
    assert d.remote


finite = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False)
rate = st.one_of(st.none(), st.floats(min_value=1.0, max_value=1e6))
small = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
terms_st = st.builds(Terms, uncached_decode=finite, uncached_prefill=finite, rate_decode=rate, rate_prefill=rate,
                     decoding=st.floats(min_value=0.0, max_value=512.0), prefill_wait_s=finite,
                     transfer_s_per_token=small, leg_s=small)


@settings(max_examples=300, deadline=None)
@given(terms_st)
def test_remote_exactly_when_it_costs_less_than_local_prefill_and_its_stall(t: Terms) -> None:
    d = decide(t)
    local = d.local_s + d.stall_s
    slack = 1e-9 * max(local, d.remote_s) + 1e-300
    if t.uncached_decode <= 0:
        assert not d.remote
    elif d.remote:
        assert d.remote_s < local + slack
    else:
        assert d.remote_s > local - slack
    assert d.remote == (d.reason == "remote")


@settings(max_examples=300, deadline=None)
@given(terms_st, st.floats(min_value=0.0, max_value=1e6))
def test_a_deeper_prefill_queue_never_turns_local_into_remote(t: Terms, more: float) -> None:
    deeper = Terms(**{**{k: getattr(t, k) for k in t.__slots__}, "prefill_wait_s": t.prefill_wait_s + more})
    if not decide(t).remote:
        assert not decide(deeper).remote


@settings(max_examples=300, deadline=None)
@given(terms_st, st.floats(min_value=0.0, max_value=1.0))
def test_a_dearer_transfer_never_turns_local_into_remote(t: Terms, more: float) -> None:
    dearer = Terms(**{**{k: getattr(t, k) for k in t.__slots__},
                      "transfer_s_per_token": t.transfer_s_per_token + more})
    if not decide(t).remote:
        assert not decide(dearer).remote


def test_an_exact_break_even_stays_local_whatever_the_rounding() -> None:
    # saved_per_token is exactly 0 here (1 + d - t - 1 with t = d), the sums' rounding is not.
    d = 0.8560496453132092
    t = Terms(uncached_decode=0.8125, uncached_prefill=0.8125, rate_decode=1.0, rate_prefill=1.0, decoding=d,
              prefill_wait_s=0.0, transfer_s_per_token=d, leg_s=0.0)
    assert not decide(t).remote


@settings(max_examples=300, deadline=None)
@given(terms_st)
def test_below_the_threshold_an_idle_cold_prefill_side_never_pays(t: Terms) -> None:
    cold_idle = Terms(**{**{k: getattr(t, k) for k in t.__slots__}, "prefill_wait_s": 0.0,
                         "uncached_prefill": t.uncached_decode})
    d = decide(cold_idle)
    if d.remote:
        assert t.uncached_decode > d.threshold * (1 - 1e-9)


def test_a_legs_placement_marks_are_its_own_and_its_analysis_is_shared() -> None:
    from routing import prefix_affinity, ttft_affinity
    from routing.base import PLACEMENT_KEYS, RouteRequest

    # The names the policies keep a placement under: a leg must not inherit another leg's.
    named = {prefix_affinity._SENT, prefix_affinity._PENDING, prefix_affinity._MARK, ttft_affinity._SENT,
             ttft_affinity._PENDING, ttft_affinity._MARK, ttft_affinity._PREDICTED, ttft_affinity._TOKEN}
    assert named == PLACEMENT_KEYS
    route = RouteRequest("chat", "m", "ns", {"messages": []}, token_ids=[1, 2])
    route.scratch.update({"kvgate.prefix": "analysis", "kvgate.sent": "r1", "kvgate.backlog_mark": ("r1", 3)})
    leg = route.leg()
    assert leg.scratch == {"kvgate.prefix": "analysis"} and leg.token_ids is route.token_ids
    leg.scratch.update({"kvgate.key": "key", "kvgate.sent": "p1"})
    route.adopt(leg)
    assert route.scratch["kvgate.key"] == "key" and route.scratch["kvgate.sent"] == "r1"
