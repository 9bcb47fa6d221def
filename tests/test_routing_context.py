"""Request contexts below a routing key: one digital twin under its organisation's key."""

from __future__ import annotations

from bench.routing_sim import SimView as View
from routing import RouteFeedback, RouteRequest, RoutingSettings
from routing.keys import PrefixKeyer
from routing.prefix_affinity import PrefixAffinity
from tests.support.chats import conversation
from tests.support.clock import Clock

ORG = "Policies of Example Corp: refunds within 30 days, escalate legal threats. " * 60  # ~4.4K chars


def twin(t: int, q: int) -> RouteRequest:
    system = ORG + f"You are twin {t}, " + f"profile line {t}. " * 12  # a short tail of its own
    return RouteRequest("chat", "m", "org", {"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"question {q}: " + "details " * 30}]})


def test_twins_share_their_organisations_key_and_a_conversation_keeps_one() -> None:
    keyer = PrefixKeyer(RoutingSettings())
    a, b, a_again = (keyer.key_for(r, 8) for r in (twin(1, 1), twin(2, 2), twin(1, 3)))
    assert a.key == b.key == a_again.key  # the organisation keys them all
    c1, c3 = keyer.key_for(conversation(7, 1), 8), keyer.key_for(conversation(7, 3), 8)
    assert c1.key == c3.key


def test_a_twin_served_elsewhere_is_followed_there_while_its_siblings_stay() -> None:
    policy = PrefixAffinity(RoutingSettings(), Clock())
    replicas = [View(f"r{i}", running=4.0, waiting=0.0, in_flight_at_scrape=4) for i in range(8)]  # alone
    first = twin(1, 1)
    home = policy.prefer(first, replicas)[0].name
    policy.observe(first, RouteFeedback(home, None, None, True))  # served: its prefill is done
    other = next(r.name for r in replicas if r.name != home)
    # Twin 2 was served on another replica (a spill): its own prefix is warm there.
    policy.observe(twin(2, 1), RouteFeedback(other, None, None, True))
    assert policy.prefer(twin(2, 2), replicas)[0].name == other
    assert policy.prefer(twin(1, 2), replicas)[0].name == home
    # A twin never served goes where its organisation's policies are warm.
    assert policy.prefer(twin(3, 1), replicas)[0].name in (home, other)


def test_a_conversations_later_turns_follow_its_first() -> None:
    # One tenant's application: its system prompt keys all its conversations.
    policy = PrefixAffinity(RoutingSettings(), Clock())
    replicas = [View(f"r{i}", running=4.0, waiting=0.0) for i in range(8)]
    home = policy.prefer(conversation(1, 1, ORG), replicas)[0].name
    for c in range(1, 4):
        policy.observe(conversation(c, 1, ORG), RouteFeedback(home, None, None, True))
    served = next(r.name for r in replicas if r.name != home)  # a retry landed elsewhere
    policy.observe(conversation(9, 1, ORG), RouteFeedback(served, None, None, True))
    # Its next turns follow it there; its siblings stay home; a new conversation goes
    # where the system prompt is warm.
    assert policy.prefer(conversation(9, 2, ORG), replicas)[0].name == served
    assert policy.prefer(conversation(9, 5, ORG), replicas)[0].name == served
    assert policy.prefer(conversation(2, 2, ORG), replicas)[0].name == home
    assert policy.prefer(conversation(10, 1, ORG), replicas)[0].name in (home, served)


def test_a_prefix_is_wide_at_the_95th_percentile_of_its_count_and_credited_everywhere_once_spread() -> None:
    # Wide (keyed past) once its count is past a replica's share at the 95th percentile
    # (routing.hotness): from the 14th request on 2 replicas, the 7th on 4, the 5th on 8 and
    # 16. Credited to every replica only once the requests past it could have reached them
    # all: the coupon collector's n·H_n, 3 for 2 replicas, 9 for 4, 22 for 8 and 55 for 16.
    for replicas, wide_at, spread in ((2, 14, 3), (4, 7, 9), (8, 5, 22), (16, 5, 55)):
        keyer = PrefixKeyer(RoutingSettings())
        keys = [keyer.key_for(twin(t, t), replicas) for t in range(1, wide_at + spread + 4)]
        first_wide = next(i for i, k in enumerate(keys) if k.key != keys[0].key)
        assert first_wide == wide_at - 1, (replicas, first_wide)
        assert len({k.key for k in keys[first_wide:]}) == len(keys) - first_wide  # then each twin's
        first_credited = next(i for i, k in enumerate(keys) if k.shared)
        assert first_credited == first_wide + spread - 1, (replicas, first_credited)
        assert all(k.shared == keys[first_credited].shared for k in keys[first_credited:])
