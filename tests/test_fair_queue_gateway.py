"""Priority classes and the fair queue end to end: a real kvgate, real clients, replicas at the outside edge.

The replica is ``tests.support.capture.Capture``: it records the exact bytes it
receives (which ``priority`` reached it) and holds a request whose prompt says
HOLD until told, so a test decides when the one slot of a replica frees.
"""

from __future__ import annotations

import random
import signal
import socket
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import openai
import orjson
import pytest

from gateway.app import build_app
from gateway.settings import load_settings
from tests.support.capture import Capture
from tests.support.procs import start_kvgate
from tests.support.servers import ServerThread, free_port

MODEL = "cap-model"
POOL = {"health_interval_s": 60, "metrics_interval_s": 60}


class Fleet:
    """A kvgate in front of Capture replicas, in this process."""

    def __init__(self, replicas: dict[str, dict[str, Any]], tenants: list[dict[str, Any]], **settings: Any) -> None:
        self.captures = {name: Capture(spec.pop("model", MODEL), refuse_priority=spec.pop("refuse_priority", False))
                         for name, spec in replicas.items()}
        self.upstreams = {name: ServerThread(c.app(), lifespan="off").start() for name, c in self.captures.items()}
        config = {"replicas": [{"name": n, "url": self.upstreams[n].url, "models": [self.captures[n].model], **spec}
                               for n, spec in replicas.items()],
                  "pool": POOL, "tenants": tenants, **settings}
        self.app = build_app(load_settings(environ={}, overrides=config))
        self.gateway = ServerThread(self.app).start()
        self.url = self.gateway.url

    @property
    def admission(self) -> Any:
        return self.app.state.runtime.admission

    def release(self, name: str = "r1") -> None:
        Capture.release_at(self.upstreams[name].url)

    def wait_for(self, predicate: Any, what: str, timeout: float = 30.0) -> None:
        done = threading.Event()
        for _ in range(int(timeout / 0.02)):
            if predicate():
                return
            done.wait(0.02)
        raise AssertionError(f"never happened: {what}")

    def close(self) -> None:
        for name in self.upstreams:
            self.release(name)  # nothing may still hold a slot, or the gateway's stop waits for it
        self.gateway.stop()
        for s in self.upstreams.values():
            s.stop()


def _chat(url: str, key: str, text: str, *, headers: dict[str, str] | None = None, model: str = MODEL,
          timeout: float = 30) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=timeout,
                      headers={"authorization": f"Bearer {key}", **(headers or {})},
                      json={"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]})


def _background(fn: Any, *args: Any, **kw: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn(*args, **kw)
        except Exception as e:  # the test asserts on it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


# -- part 1: the class reaches only the replicas that accept it --------------------------------
@pytest.fixture
def two_policies() -> Iterator[Fleet]:
    # The first-come replica refuses a non-zero priority, as vLLM does.
    fleet = Fleet({"prio": {"model": "m-prio", "scheduling_policy": "priority"},
                   "fifo": {"model": "m-fifo", "refuse_priority": True}},
                  [{"name": "live", "api_keys": ["sk-live"], "priority": "interactive"},
                   {"name": "plain", "api_keys": ["sk-plain"]},
                   {"name": "night", "api_keys": ["sk-night"], "priority": "batch"}])
    try:
        yield fleet
    finally:
        fleet.close()


def test_priority_is_sent_from_the_tenants_class_only_to_replicas_that_schedule_by_it(two_policies: Fleet) -> None:
    fleet = two_policies
    cases = [("sk-live", None, -1), ("sk-plain", None, None), ("sk-night", None, 1),
             ("sk-live", "batch", 1), ("sk-live", "standard", None), ("sk-plain", "batch", 1)]
    for key, header, expected in cases:
        for model, name in (("m-prio", "prio"), ("m-fifo", "fifo")):
            r = httpx.post(fleet.url + "/v1/chat/completions", timeout=10,
                           headers={"authorization": f"Bearer {key}", "x-vllm-priority": "-100",
                                    **({"x-kvgate-priority": header} if header else {})},
                           # The client's own priority is never the one sent.
                           json={"model": model, "max_tokens": 1, "priority": -100,
                                 "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            got = fleet.captures[name].received[-1]
            sent = got.body
            want = expected if name == "prio" else None  # fcfs: never a priority, 0 included
            assert sent.get("priority") == want, (key, header, name, sent)
            # vLLM's own priority header (it wins over the body there) never passes through.
            assert "x-vllm-priority" not in got.headers and "x-kvgate-priority" not in got.headers
    # The text completions route takes it too; /v1/messages has no such field in vLLM.
    openai.OpenAI(base_url=fleet.url + "/v1", api_key="sk-live", max_retries=0).completions.create(
        model="m-prio", prompt="hi", max_tokens=1)
    assert fleet.captures["prio"].received[-1].body["priority"] == -1
    anthropic.Anthropic(base_url=fleet.url, api_key="sk-live", max_retries=0).messages.create(
        model="m-prio", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    got = fleet.captures["prio"].received[-1]
    assert got.path == "/v1/messages" and "priority" not in got.body


def test_a_header_above_the_tenants_class_gets_a_400_in_the_routes_own_shape(two_policies: Fleet) -> None:
    fleet = two_policies
    before = sum(len(c.received) for c in fleet.captures.values())
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="sk-plain", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m-prio", max_tokens=1, messages=[{"role": "user", "content": "hi"}],
                                       extra_headers={"x-kvgate-priority": "interactive"})
    assert err.value.code == "invalid_priority" and "standard" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m-prio", max_tokens=1, messages=[{"role": "user", "content": "hi"}],
                                       extra_headers={"x-kvgate-priority": "urgent"})
    assert err.value.code == "invalid_priority"
    claude = anthropic.Anthropic(base_url=fleet.url, api_key="sk-night", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as aerr:
        claude.messages.create(model="m-prio", max_tokens=1, messages=[{"role": "user", "content": "hi"}],
                               extra_headers={"x-kvgate-priority": "standard"})
    body = aerr.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "batch" in body["error"]["message"]
    assert sum(len(c.received) for c in fleet.captures.values()) == before  # none reached a replica


# -- part 2: the fair queue --------------------------------------------------------------------
def _one_slot(tenants: list[dict[str, Any]], **settings: Any) -> Fleet:
    return Fleet({"r1": {"max_in_flight": 1}}, tenants, **settings)


def _hold(fleet: Fleet, key: str) -> tuple[threading.Thread, dict[str, Any]]:
    """A request that takes the replica's one slot until ``fleet.release()``."""
    t, out = _background(_chat, fleet.url, key, "HOLD")
    fleet.wait_for(lambda: any("HOLD" in r.text for r in fleet.captures["r1"].received), "the held request arrived")
    return t, out


@pytest.mark.parametrize("seed", [7, 2028])
def test_queued_work_is_served_in_weighted_shares_and_bands_in_order(seed: int) -> None:
    rng = random.Random(seed)
    fleet = _one_slot([{"name": "heavy", "api_keys": ["sk-h"], "weight": 3},
                       {"name": "light", "api_keys": ["sk-l"], "weight": 1},
                       {"name": "urgent", "api_keys": ["sk-u"], "priority": "interactive", "weight": 0.1}])
    try:
        held, _ = _hold(fleet, "sk-h")
        # Prompts of seeded lengths, sent in a seeded order, all at once.
        plan = [(key, f"{key}-{i} " + "x" * rng.randrange(20, 2000)) for key in ("sk-h", "sk-l") for i in range(24)]
        plan += [("sk-u", f"sk-u-{i} " + "y" * rng.randrange(20, 2000)) for i in range(4)]
        plan += [("sk-h", f"sk-h-late-{i} " + "z" * 50) for i in range(2)]  # lowered to batch by header
        rng.shuffle(plan)
        threads = []
        for key, text in plan:
            headers = {"x-kvgate-priority": "batch"} if "late" in text else None
            threads.append(_background(_chat, fleet.url, key, text, headers=headers)[0])
        fleet.wait_for(lambda: fleet.admission.queue_len == len(plan), "every request queued")
        fleet.release()
        for t in [held, *threads]:
            t.join(60)
        served = [r for r in fleet.captures["r1"].received if "HOLD" not in r.text]
        assert len(served) == len(plan)
        tenants = [r.text.split("-")[1] for r in served]  # h, l, u
        late = ["late" in r.text for r in served]
        # Bands: every interactive request first, the batch ones last, whatever their weight.
        assert tenants[:4] == ["u"] * 4 and late[-2:] == [True, True] and not any(late[:-2])
        # Within the standard band, the work served (prompt tokens as kvgate counts them: the
        # forwarded body's bytes / 4) stays within SCFQ's bound of the 3:1 weights while both wait.
        middle = served[4:-2]
        cost = [len(r.raw) / 4 for r in middle]
        who = [r.text.split("-")[1] for r in middle]
        weight = {"h": 3.0, "l": 1.0}
        lmax = {t: max(c for c, w in zip(cost, who) if w == t) for t in weight}
        last = min(max(k for k, w in enumerate(who) if w == t) for t in weight)
        work: dict[str, float] = defaultdict(float)
        for k in range(last):
            work[who[k]] += cost[k]
            assert abs(work["h"] / 3 - work["l"] / 1) <= lmax["h"] / 3 + lmax["l"] / 1, (k, dict(work))
        # And the shares are visible per tenant on /metrics.
        metrics = httpx.get(fleet.url + "/metrics", timeout=5).text
        assert 'kvgate_queue_exits_total{outcome="served",tenant="light"} 24.0' in metrics
        assert 'kvgate_queue_wait_seconds_count{tenant="urgent"} 4.0' in metrics
    finally:
        fleet.close()


def test_a_request_past_its_queue_deadline_gets_a_429_with_retry_after_in_its_routes_shape() -> None:
    fleet = _one_slot([{"name": "a", "api_keys": ["sk-a"], "queue_timeout_s": 0.3}])
    try:
        held, out = _hold(fleet, "sk-a")
        client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="sk-a", max_retries=0)
        with pytest.raises(openai.RateLimitError) as err:
            client.chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hi"}])
        assert err.value.code == "queue_timeout" and err.value.response.headers["retry-after"] == "1"
        claude = anthropic.Anthropic(base_url=fleet.url, api_key="sk-a", max_retries=0)
        with pytest.raises(anthropic.RateLimitError) as aerr:
            claude.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hi"}])
        body = aerr.value.response.json()
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
        assert "retry-after" in aerr.value.response.headers
        assert len(fleet.captures["r1"].received) == 1  # neither reached the replica
        fleet.release()
        held.join(30)
        assert out["result"].status_code == 200
        status = fleet.admission.stats()["tenants"]["a"]
        assert status["timeout"] == 2 and status["waiting"] == 0
    finally:
        fleet.close()


def test_a_client_that_disconnects_leaves_the_queue_at_once() -> None:
    fleet = _one_slot([{"name": "a", "api_keys": ["sk-a"], "queue_timeout_s": 600},
                       {"name": "b", "api_keys": ["sk-b"]}])
    try:
        held, _ = _hold(fleet, "sk-a")
        body = orjson.dumps({"model": MODEL, "max_tokens": 1,
                             "messages": [{"role": "user", "content": "I will not wait"}]})
        gone = socket.create_connection(("127.0.0.1", fleet.gateway.port), timeout=10)
        gone.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: kvgate\r\nauthorization: Bearer sk-a\r\n"
                     b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        stays, stays_out = _background(_chat, fleet.url, "sk-b", "I will wait")
        fleet.wait_for(lambda: fleet.admission.queue.depths() == {"a": 1, "b": 1}, "both queued")
        gone.close()  # the client gives up
        # Gone from the queue while the slot is still held: it did not wait for its deadline.
        fleet.wait_for(lambda: fleet.admission.queue.depth("a") == 0, "the disconnected request left")
        assert fleet.admission.queue.depth("b") == 1
        metrics = httpx.get(fleet.url + "/metrics", timeout=5).text
        assert 'kvgate_queue_exits_total{outcome="disconnect",tenant="a"} 1.0' in metrics
        assert 'kvgate_queue_depth{tenant="b"} 1.0' in metrics
        fleet.release()
        for t in (held, stays):
            t.join(30)
        assert stays_out["result"].status_code == 200
        texts = [r.text for r in fleet.captures["r1"].received]
        assert "I will not wait" not in texts and "I will wait" in texts
    finally:
        fleet.close()


def _stream(url: str, key: str, text: str, max_tokens: int | None) -> list[str]:
    """A streamed chat's chunks of text, read to the end."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    extra = {} if max_tokens is None else {"max_tokens": max_tokens}
    chunks = client.chat.completions.create(model=MODEL, stream=True, messages=[{"role": "user", "content": text}],
                                            **extra)
    return [c.choices[0].delta.content or "" for c in chunks if c.choices]


@pytest.mark.parametrize("max_tokens", [3, None])
def test_a_slot_is_handed_on_at_the_last_step_of_an_answer_its_max_tokens_bounds(max_tokens: int | None) -> None:
    fleet = Fleet({"r1": {"max_in_flight": 1}}, [{"name": "a", "api_keys": ["sk-a"]}],
                  pool={**POOL, "hand_on_at_last_step": True})
    received = fleet.captures["r1"].received
    try:
        # The replica streams all of the held answer's tokens but its last, then waits.
        first, first_out = _background(_stream, fleet.url, "sk-a", "HOLD", max_tokens)
        fleet.wait_for(lambda: any("HOLD" in r.text for r in received), "the held request arrived")
        second, second_out = _background(_chat, fleet.url, "sk-a", "next")
        if max_tokens is not None:
            # One token left: the next request is sent now, to wait its turn inside the replica.
            fleet.wait_for(lambda: any(r.text == "next" for r in received), "the next request reached the replica")
            assert first.is_alive() and sum(r.ending for r in fleet.app.state.runtime.pool.replicas.values()) == 1
        else:
            # Nothing says when the answer ends: the next request waits in kvgate until it has.
            fleet.wait_for(lambda: fleet.admission.queue.depth("a") == 1, "the next request queued")
            assert [r.text for r in received] == ["HOLD"]
        fleet.release()
        for t in (first, second):
            t.join(30)
        assert first_out["result"] == ["t", "t", "t"] and second_out["result"].status_code == 200
        assert [r.text for r in received] == ["HOLD", "next"]
        fleet.wait_for(lambda: fleet.app.state.runtime.pool.active_requests == 0, "both leases ended")
        adm = fleet.admission
        assert not any(r.ending for r in fleet.app.state.runtime.pool.replicas.values())
        assert adm.reserved == {} and adm.queue_len == 0 and adm.shares.held("a") == 0
    finally:
        fleet.close()


def test_without_tenants_nothing_queues() -> None:
    fleet = _one_slot([])
    try:
        held, _ = _hold(fleet, "any")
        r = _chat(fleet.url, "any", "not queued")  # over the limit, yet sent: there is no one to be fair between
        assert r.status_code == 200 and fleet.admission.stats()["active"] is False
        fleet.release()
        held.join(30)
    finally:
        fleet.close()


def test_a_shutdown_answers_every_queued_request_with_a_503_and_lets_the_one_in_flight_finish(
        tmp_path: Path) -> None:
    capture = Capture(MODEL)
    upstream = ServerThread(capture.app(), lifespan="off").start()
    port = free_port()
    config = {"listen": {"host": "127.0.0.1", "port": port}, "admin": {"enabled": False}, "log_level": "warning",
              "replicas": [{"name": "r1", "url": upstream.url, "models": [MODEL], "max_in_flight": 1}],
              "pool": POOL, "tenants": [{"name": "a", "api_keys": ["sk-a"], "queue_timeout_s": 600},
                                        {"name": "b", "api_keys": ["sk-b"], "priority": "batch"}],
              "shutdown_delay_s": 0.2, "shutdown_grace_s": 10}
    proc = start_kvgate(tmp_path, config)
    url = f"http://127.0.0.1:{port}"
    try:
        held, held_out = _background(_chat, url, "sk-a", "HOLD")
        for _ in range(500):  # the held request has the slot before the others queue for it
            if capture.received:
                break
            threading.Event().wait(0.02)
        assert [r.text for r in capture.received] == ["HOLD"]
        waiting = [_background(_chat, url, key, f"queued {i}") for i, key in enumerate(["sk-a", "sk-b"] * 3)]

        def depth() -> float:
            text = httpx.get(url + "/metrics", timeout=5).text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("kvgate_queue_depth{"))

        for _ in range(500):
            if depth() == len(waiting):
                break
            threading.Event().wait(0.02)
        assert depth() == len(waiting)
        proc.send_signal(signal.SIGTERM)
        for t, _ in waiting:
            t.join(30)
        for _, out in waiting:
            r = out["result"]
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        Capture.release_at(upstream.url)  # the request in flight finishes within the grace
        held.join(30)
        assert held_out["result"].status_code == 200
        assert proc.wait(30) == 0
        assert [r.text for r in capture.received] == ["HOLD"]  # no queued request reached the replica
    finally:
        if proc.poll() is None:
            proc.kill()
        upstream.stop()


def test_seats_are_learned_only_beside_a_batch_that_is_not_prefilling() -> None:
    """vLLM spends a step's token budget on its running requests first, a long prompt's next chunk
    among them, so a request waits with seats free. The gateway learns no seats from that queue
    while its own streams there lack their first event, and learns them once the batch decodes."""
    fleet = Fleet({"r1": {}}, [{"name": "a", "api_keys": ["sk-a"]}], pool={**POOL, "metrics_interval_s": 0.05})
    capture, r1 = fleet.captures["r1"], fleet.app.state.runtime.pool.replicas["r1"]

    def stream(text: str) -> httpx.Response:
        return httpx.post(fleet.url + "/v1/chat/completions", timeout=30, headers={"authorization": "Bearer sk-a"},
                          json={"model": MODEL, "max_tokens": 2, "stream": True,
                                "messages": [{"role": "user", "content": text}]})

    try:
        # The long prompt's answer then stays open (HOLD: its last token waits), so it is its first
        # event, not its end, that tells the gateway the batch no longer prefills.
        answers = [_background(stream, text) for text in ("FIRST:long HOLD", "FIRST:kept")]
        fleet.wait_for(lambda: len(capture.received) == 2, "both requests at the replica")
        # The long prompt is being chunked, the other kept waiting: vLLM's gauges then.
        capture.metrics = ('vllm:num_requests_running{model_name="m"} 1.0\n'
                           'vllm:num_requests_waiting{model_name="m"} 1.0\n')
        fleet.wait_for(lambda: r1.running == 1.0, "a scrape of that queue")
        assert r1.capacity is None and fleet.admission.limit(r1) is None  # no seat count from it
        Capture.release_at(fleet.upstreams["r1"].url, "long")  # its first token: it decodes now
        fleet.wait_for(lambda: r1.capacity == 1.0, "the seats learned beside a batch that decodes")
        assert r1.in_flight == 2
        Capture.release_at(fleet.upstreams["r1"].url, "kept")
        fleet.release()
        for thread, out in answers:
            thread.join(30)
            assert out["result"].status_code == 200 and out["result"].text.endswith("data: [DONE]\n\n")
        assert r1.in_flight == r1.unstarted == 0
    finally:
        for name in ("long", "kept"):
            Capture.release_at(fleet.upstreams["r1"].url, name)
        fleet.close()


def test_a_replica_chunking_a_long_prompt_teaches_no_seats_and_a_full_batch_teaches_them() -> None:
    """The same rule against the simulator's own scheduler, which chunks prompts as vLLM's does
    (its parity with vLLM's is tests/test_sim_vllm_scheduler_parity.py): with 64 tokens a step, a
    3,000-token prompt holds the budget for 47 steps while a short request waits beside three free
    seats. The gateway must read that queue and learn nothing from it; then six long answers on
    four seats show the seats (four running, two waiting, every first token of ours back)."""
    from tests.support.stack import MODEL as SIM_MODEL
    from tests.support.stack import start_stack
    from vllm_sim.timing import TimingModel

    timing = TimingModel(time_scale=1.0, max_num_seqs=4, max_num_batched_tokens=64, prefill_base_s=0.0,
                         prefill_s_per_token=1 / 2000, decode_base_s=0.01)
    stack = start_stack(1, sim={"timing": timing}, pool={"metrics_interval_s": 0.05})
    r1 = stack.runtime.pool.replicas["r1"]

    def stream(text: str, max_tokens: int) -> httpx.Response:
        return httpx.post(stack.url + "/v1/chat/completions", timeout=60,
                          json={"model": SIM_MODEL,
                                "max_tokens": max_tokens, "stream": True,
                                "messages": [{"role": "user", "content": text}]})

    try:
        long = _background(stream, "lorem ipsum " * 1500, 2)
        assert stack.wait_for(lambda: r1.running == 1.0, timeout=10), "the long prompt admitted"
        short = _background(stream, "a short question", 2)
        assert stack.wait_for(lambda: r1.waiting == 1.0 and r1.running == 1.0, timeout=10), \
            "a scrape of the short request waiting beside the prompt being chunked"
        assert r1.capacity is None  # learned from that scrape, it would be 1
        answers = [long, short]
        assert stack.wait_for(lambda: r1.in_flight == 0, timeout=30)
        answers += [_background(stream, f"question {i}", 150) for i in range(6)]
        assert stack.wait_for(lambda: r1.capacity == 4.0, timeout=30), (r1.capacity, r1.running, r1.waiting)
        for thread, out in answers:
            thread.join(60)
            assert out["result"].status_code == 200 and out["result"].text.endswith("data: [DONE]\n\n")
    finally:
        stack.close()


def test_a_runtime_tenants_class_set_through_the_admin_api_reaches_the_replica() -> None:
    from gateway.admin.api import build_admin_app

    fleet = Fleet({"prio": {"scheduling_policy": "priority"}}, [{"name": "file", "api_keys": ["sk-file"]}],
                  admin={"token": "adm"})
    admin = fleet.gateway.beside(build_admin_app(fleet.app.state.runtime))
    try:
        auth = {"authorization": "Bearer adm"}
        made = httpx.post(admin.url + "/admin/tenants", headers=auth, timeout=10,
                          json={"name": "nightly", "priority": "batch", "weight": 0.5})
        assert made.status_code == 201, made.text
        assert made.json()["priority"] == "batch" and made.json()["weight"] == 0.5
        assert _chat(fleet.url, made.json()["api_key"], "hi").status_code == 200
        assert fleet.captures["prio"].received[-1].body["priority"] == 1
        bad = httpx.patch(admin.url + "/admin/tenants/nightly", headers=auth, timeout=10, json={"priority": "vip"})
        assert bad.status_code == 400
    finally:
        admin.stop()
        fleet.close()


def test_a_config_reload_changes_what_a_replica_is_sent(tmp_path: Path) -> None:
    import yaml

    from gateway.admin.api import build_admin_app

    capture = Capture(MODEL)
    upstream = ServerThread(capture.app(), lifespan="off").start()
    path = tmp_path / "kvgate.yaml"

    def write(policy: str) -> None:
        path.write_text(yaml.safe_dump({
            "replicas": [{"name": "r1", "url": upstream.url, "models": [MODEL], "scheduling_policy": policy}],
            "pool": POOL, "admin": {"token": "adm"},
            "tenants": [{"name": "a", "api_keys": ["sk-a"], "priority": "interactive"}]}))

    write("fcfs")
    app = build_app(load_settings(path, environ={}), config_path=path)
    gateway = ServerThread(app).start()
    admin = gateway.beside(build_admin_app(app.state.runtime))
    try:
        assert _chat(gateway.url, "sk-a", "hi").status_code == 200
        assert "priority" not in capture.received[-1].body
        write("priority")  # the replica was restarted with --scheduling-policy priority
        assert httpx.post(admin.url + "/admin/config/reload", headers={"authorization": "Bearer adm"},
                          timeout=10).status_code == 200
        assert _chat(gateway.url, "sk-a", "hi").status_code == 200
        assert capture.received[-1].body["priority"] == -1
    finally:
        admin.stop()
        gateway.stop()
        upstream.stop()
