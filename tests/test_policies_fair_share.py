"""policies.fair_share: what a full fleet holds back for a tenant below its share, and for how long."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.fair_share import Shares

W = {"quiet": 1.0, "noisy": 1.0}


def test_a_tenant_keeps_the_slots_it_showed_it_uses_for_one_of_its_requests_times() -> None:
    s = Shares()
    s.hold("quiet", 0.0)
    s.hold("quiet", 0.0)
    s.release("quiet", 1.0, held_s=1.0)  # one request took a second: its demand stays 2 for a second
    assert s.held_back("noisy", 8, W, {}, 1.5) == (1.0, 2.0)
    assert s.held_back("noisy", 8, W, {}, 2.01) == (0.0, None)  # it paused longer than a request takes
    assert s.held_back("quiet", 8, W, {}, 1.5) == (0.0, None)  # nothing is held back from itself


def test_users_out_of_step_keep_each_slot_for_one_of_their_requests_times() -> None:
    """Two users of one tenant never hold their two slots at one moment once one has paused: each
    slot is kept while its own user comes back within a request's time."""
    s = Shares()
    s.hold("quiet", 0.0)
    s.hold("quiet", 0.0)
    s.release("quiet", 1.0, held_s=1.0)  # user A's answer ends; A pauses
    s.release("quiet", 1.6, held_s=1.0)  # user B's ends while A is still away
    s.hold("quiet", 1.7)  # A is back, 0.7 s after its slot went
    # B's slot went 0.6 s ago, within one request's time: still its. (Timed from the last moment both
    # slots were held, 1.0 s, the demand lapsed at 2.0 s and the other tenant took B's slot.)
    assert s.held_back("noisy", 8, W, {}, 2.2) == (1.0, 2.6)
    s.hold("quiet", 2.3)
    assert s.held_back("noisy", 8, W, {}, 2.4) == (0.0, None)  # both held: nothing to keep for it
    assert s.held_back("noisy", 8, W, {}, 2.7) == (0.0, None)


def test_nothing_is_held_back_before_a_request_has_ended_or_beyond_the_share() -> None:
    s = Shares()
    for _ in range(6):
        s.hold("quiet", 0.0)
    assert s.held_back("noisy", 8, W, {}, 0.0) == (0.0, None)  # demand is what it holds: 6
    for t in range(6):
        s.release("quiet", 1.0 + t / 100, held_s=1.0)
    # Demand 6 within the window, but its share of 8 slots beside one other tenant is 4.
    assert s.held_back("noisy", 8, W, {}, 1.2)[0] == 4.0


def test_a_tenant_with_requests_waiting_is_not_held_for_it_competes_in_the_queue() -> None:
    s = Shares()
    s.hold("quiet", 0.0)
    s.hold("quiet", 0.0)
    s.release("quiet", 1.0, held_s=1.0)
    assert s.held_back("noisy", 8, W, {"quiet": 1}, 1.5)[0] == 0.0


def test_within_share_follows_the_active_tenants_weights() -> None:
    s = Shares()
    for _ in range(3):
        s.hold("noisy", 0.0)
    s.hold("quiet", 0.0)
    weights = {"quiet": 1.0, "noisy": 3.0}
    assert s.share("quiet", 8, weights, {}, 0.0) == 2.0 and s.within_share("quiet", 8, weights, {}, 0.0)
    assert s.share("noisy", 8, weights, {}, 0.0) == 6.0 and s.within_share("noisy", 8, weights, {}, 0.0)
    s.hold("quiet", 0.0)
    assert not s.within_share("quiet", 8, weights, {}, 0.0)  # a third would pass its 2


def test_slots_are_promised_to_a_tenant_with_demand_and_nothing_waiting() -> None:
    s = Shares()
    assert not s.promised({}, 0.0)
    s.hold("noisy", 0.0)
    assert s.promised({}, 0.0)
    assert not s.promised({"noisy": 3}, 0.0)  # it waits: it competes in the queue instead
    s.hold("quiet", 0.0)
    s.release("quiet", 1.0, held_s=1.0)
    assert s.promised({"noisy": 3}, 1.5)  # quiet's demand lasts one of its requests' times
    assert not s.promised({"noisy": 3}, 2.5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.booleans(), st.floats(0.01, 2.0)), max_size=60),
       st.integers(1, 16), st.floats(0, 5))
def test_what_is_held_back_is_never_negative_nor_more_than_the_slots(events, slots, later) -> None:
    s = Shares()
    now = 0.0
    weights = {"a": 1.0, "b": 2.0, "c": 0.5}
    for tenant, take, dt in events:
        now += dt
        if take:
            s.hold(tenant, now)
        else:
            s.release(tenant, now, held_s=dt)
        assert s.held(tenant) >= 0
    for who in (None, "a", "b", "c"):
        back, lapse = s.held_back(who, slots, weights, {}, now + later)
        assert 0.0 <= back <= slots
        assert lapse is None or back > 0
